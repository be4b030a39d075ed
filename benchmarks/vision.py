"""Records/s and real tokens/s of the vision demo's model (examples/vision_demo.yaml: a tiny LLaVA built from its
config) trained through ``AutoModelParallelStrategy`` against the same Hugging Face model under Lightning's stock
``ModelParallelStrategy`` (what a user writes without us: FSDP2 by ``fully_shard`` on each block of the vision tower
and of the decoder, then the root; one record a row, padded), side by side in one run, as ratios ours / peer.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/vision.py              # about 2 minutes on 2 shared CPU cores
    PYTHONPATH=$PWD .venv/bin/python benchmarks/vision.py --world 4 --tp   # adds ours at tp=2 + sp x dp_shard=2

Rows (gloo, fp32, ``--world`` processes, each rank ``--batch-size`` rows of ``--seq-len`` tokens a step):

- ours, padded: ``AutoModelParallelStrategy()`` (dp_shard = world), one record a row: the strategy's overhead;
- ours, packed: the same with ``VisionChatDataModule(pack=True)`` (as many records a row as fit): packing's gain;
- ours, tp=2 + sp (``--tp``): on CPU it only shows that the layout trains, not what it gains;
- the peer: ``CausalLMModule`` (the same step, loss and optimizer) with ``configure_model`` building the model from
  the same config and sharding it as above, under Lightning's ``ModelParallelStrategy(data_parallel_size=world)``;
- the peer with ours' FSDP2 units: the same, the tower's embeddings and norms and the projector sharded apart too,
  as ours does (9 units to 5): what the strategy costs beyond its choice of units.

Every Trainer fits ``--steps`` steps, the first ``--warmup`` untimed; the variants take turns for ``--rounds`` rounds
in the same fresh processes (the machine's load falls on all alike). A round's throughput is its records (or real
tokens) a step over its median step time, each step the slowest rank's (the median leaves out the steps a burst of
another process's load fell on); each variant's best round is reported, and each ratio with its range over the
rounds (the noise a difference must exceed). A record is one picture and its question (one image each: counted as
the batch's images); real tokens are the rows' tokens less their padding. The demo's records are about 70 tokens: at
the demo's seq_len=80 a row holds one either way, so the default ``--seq-len 256`` is where packing has records to
put together (and where padding one a row wastes most).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "vision_demo.yaml"
VARIANTS = {  # name: (strategy, pack)
    "peer": ("stock", False),
    "peer_our_units": ("stock_our_units", False),
    "ours": ("ours", False),
    "ours_packed": ("ours", True),
    "ours_tp2": ("ours_tp2", False),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="processes (gloo)")
    parser.add_argument("--tp", action="store_true", help="add ours at tp=2 + sp x dp_shard=world/2")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4, help="rows a step on each data-parallel rank")
    parser.add_argument("--threads", type=int, default=1, help="torch threads a rank")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------ one rank's fits


def model_config(seq_len: int) -> dict[str, Any]:
    """The demo's config, its positions raised to ``seq_len`` where that is longer (RoPE: no weights change)."""
    import yaml

    config = yaml.safe_load(EXAMPLE.read_text())["model"]["config"]
    text = config["text_config"]
    text["max_position_embeddings"] = max(text["max_position_embeddings"], seq_len)
    return config


OUR_UNITS = (
    "vision_tower.embeddings",
    "vision_tower.pre_layrnorm",
    "vision_tower.post_layernorm",
    "multi_modal_projector",
)


def peer_module(config: dict[str, Any], *, units: tuple[str, ...] = ()):
    """What a user writes for Lightning's stock ModelParallelStrategy: the model built in configure_model (as ours,
    from the config and the processor), each block of the tower and of the decoder FSDP2-sharded, then ``units``
    (of ``model.model``), then the root."""
    from torch.distributed.fsdp import fully_shard

    from lightning_automodel.lm import CausalLMModule

    class PeerModule(CausalLMModule):
        def configure_model(self) -> None:
            if self.model is not None:
                return
            super().configure_model()
            mesh = self.device_mesh["data_parallel"]
            blocks = [b for m in self.model.modules() if isinstance(m, torch.nn.ModuleList) for b in m]
            for unit in [*blocks, *(self.model.model.get_submodule(name) for name in units)]:
                fully_shard(unit, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    return PeerModule(config=config, schedule="constant")


def strategy(kind: str, world: int):
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_automodel import AutoModelParallelStrategy

    if kind.startswith("stock"):
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    if kind == "ours_tp2":
        return AutoModelParallelStrategy(tp=2, sp=True)
    return AutoModelParallelStrategy(dp_shard=world)


def real_tokens(batch: dict[str, torch.Tensor], pad_id: int) -> int:
    """The batch's tokens less padding: an attention mask's ones, or (packed rows) the rows less each one's padding
    tail, the last span of restarted positions when it is padding only."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    ids, positions = batch["input_ids"], batch["position_ids"]
    total = 0
    for row_ids, row_positions in zip(ids, positions, strict=True):
        tail = int(torch.nonzero(row_positions == 0)[-1])
        total += tail if bool((row_ids[tail:] == pad_id).all()) else len(row_ids)
    return total


def counter(warmup: int, pad_id: int):
    """A callback: each step's seconds (end to end, its batch's loading included) after the warm-up, and the records
    and real tokens of those steps."""
    from lightning.pytorch.callbacks import Callback

    class Counter(Callback):
        def __init__(self) -> None:
            self.records = self.tokens = 0
            self.seconds: list[float] = []
            self.last = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx >= warmup:
                self.records += len(batch["pixel_values"])  # one picture a record
                self.tokens += real_tokens(batch, pad_id)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = time.perf_counter()
            if batch_idx >= warmup:
                self.seconds.append(now - self.last)
            self.last = now

    return Counter()


def data_module(files: str, *, pack: bool, args: argparse.Namespace):
    from lightning_automodel.data.vision import VisionChatDataModule
    from lightning_automodel.data.vision.byte_processors import llava_processor
    from lightning_automodel.data.vision.demo import PATCH, SIDE

    processor = llava_processor(side=SIDE, patch=PATCH)
    options = dict(seq_len=args.seq_len, batch_size=args.batch_size, seed=0)
    return VisionChatDataModule(train_files=files, processor=processor, pack=pack, **options)


def fit(variant: str, files: str, args: argparse.Namespace, world: int) -> dict[str, Any]:
    """One variant's Trainer on this rank: each timed step's seconds, and the records and real tokens of those steps."""
    import lightning as L

    from lightning_automodel.lm import CausalLMModule

    torch.set_num_threads(args.threads)
    kind, pack = VARIANTS[variant]
    L.seed_everything(0, verbose=False)
    data = data_module(files, pack=pack, args=args)
    config = model_config(args.seq_len)
    if kind.startswith("stock"):
        module = peer_module(config, units=OUR_UNITS if kind == "stock_our_units" else ())
    else:
        module = CausalLMModule(config=config, schedule="constant")
    count = counter(args.warmup, data.tokenizer.pad_token_id)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy(kind, world),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[count],
    )
    trainer.fit(module, data)
    tp = 2 if kind == "ours_tp2" else 1
    return {"seconds": count.seconds, "records": count.records / tp, "tokens": count.tokens / tp}


def rounds(variants: list[str], files: str, args: argparse.Namespace) -> list[dict[str, dict]]:
    """On this rank (of a gloo launch): every round, each variant's fit, the variants in turn."""
    import torch.distributed as dist

    world = dist.get_world_size()
    done = []
    for index in range(args.rounds):
        order = variants[index % len(variants) :] + variants[: index % len(variants)]  # each goes first in turn
        done.append({variant: fit(variant, files, args, world) for variant in order})
    return done


# ---------------------------------------------------------------------------------------------------- the parent


def prepare(directory: Path, args: argparse.Namespace, world: int) -> str:
    """The demo's records, enough for every variant's steps packed, written and cached once."""
    from lightning_automodel.data import cache
    from lightning_automodel.data.vision.demo import write_demo_records

    cache.DEFAULT_ROOT = directory / "tokens"
    records = args.steps * args.batch_size * world * max(args.seq_len // 60, 1)
    write_demo_records(directory, num_records=records, val_records=0, seed=0)
    files = str(directory / "train.parquet")
    for pack in (False, True):
        data_module(files, pack=pack, args=args).prepare_data()
    return files


def throughput(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """Records/s and real tokens/s over all ranks: their records and tokens a step over the median step time (each
    step the slowest rank's: the median leaves out the steps another process's burst of load fell on)."""
    steps = [max(times) for times in zip(*(rank["seconds"] for rank in per_rank), strict=True)]
    median = sorted(steps)[len(steps) // 2]
    return {key: sum(rank[key] for rank in per_rank) / len(steps) / median for key in ("records", "tokens")}


def table(measured: list[list[dict[str, dict]]], variants: list[str]) -> list[str]:
    """Markdown rows: each variant's best round, and its ratio to the peer's with the range over rounds."""
    by_round = [
        {v: throughput([rank[index][v] for rank in measured]) for v in variants} for index in range(len(measured[0]))
    ]
    best = {v: {k: max(r[v][k] for r in by_round) for k in ("records", "tokens")} for v in variants}
    lines = [
        "| variant | records/s | real tokens/s | records/s over the peer's (range over rounds)"
        " | tokens/s over the peer's |",
        "|---|---|---|---|---|",
    ]
    for variant in variants:
        cells = [f"{best[variant]['records']:,.1f}", f"{best[variant]['tokens']:,.0f}"]
        for key in ("records", "tokens"):
            if variant == "peer":
                cells.append("1.00")
                continue
            ratios = sorted(r[variant][key] / r["peer"][key] for r in by_round)
            spread = f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if key == "records" else ""
            cells.append(f"{best[variant][key] / best['peer'][key]:.2f}{spread}")
        lines.append(f"| {variant} | {' | '.join(cells)} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    from lightning_automodel.testing.harness import run_checks

    args = parse_args(argv)
    variants = ["peer", "peer_our_units", "ours", "ours_packed"] + (["ours_tp2"] if args.tp else [])
    with tempfile.TemporaryDirectory() as temporary:
        os.environ["XDG_CACHE_HOME"] = temporary  # the ranks' token cache: lightning-automodel/tokens beneath
        files = prepare(Path(temporary) / "lightning-automodel", args, args.world)
        launched = time.perf_counter()
        measured = run_checks(args.world, [partial(rounds, variants, files, args)], timeout=1800)
        print(f"{args.world} gloo processes, {args.steps} steps ({args.warmup} untimed) x {args.rounds} rounds;")
        seconds = time.perf_counter() - launched
        print(f"{args.batch_size} rows of {args.seq_len} tokens a data-parallel rank a step; {seconds:.0f} s\n")
        print("\n".join(table(next(iter(measured.values())), variants)))


if __name__ == "__main__":
    main()
