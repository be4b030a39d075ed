"""Training throughput of ``CausalLMModule`` under ``AutoModelParallelStrategy`` and Lightning's default strategy.

    PYTHONPATH=. python benchmarks/throughput.py                 # on one GPU: variants a, b, c, d and a CSV-logged a
    PYTHONPATH=. python benchmarks/throughput.py --tiny          # a CPU smoke test: a tiny model, a, b and a_csv

The same Llama (built from a config, seeded the same) trains on random token batches, one fresh process per
variant, so that no memory or compiled state leaks from one into the next:

    a  AutoModelParallelStrategy(): FSDP2 over one rank, the model built on the meta device and initialised there
    b  Lightning's default single-device strategy: the module builds the model with real weights itself
    c  a with activation_checkpointing=True
    d  a with cpu_offload=True (few steps: it checks that the offloaded path trains, not how fast it is)

For each: tokens/s over the steps after the warm-up (timed with ``torch.cuda.synchronize`` in a callback), MFU
(``flops_per_token`` x tokens/s over the chip's peak bf16 FLOP/s from Lightning's table), the peak allocated GPU
memory and the first steps' losses (the same seed and the same batches in the same order: one rank needs no
``DistributedSampler``, which Lightning would make shuffle under a and not under b). a, c and d start from the same
weights and their losses agree within bf16 noise; b's weights come from transformers' own initialisation, another
draw of the same distribution, so its losses agree only as closely as two such draws do. The ratios a/b, c/a and
d/a are what this project quotes; absolute numbers only from a GPU. One more run of a (a_csv) logs to CSV, to check
that the module's own metrics and Lightning's ``ThroughputMonitor`` (which the module adds) work, and that the
monitor's MFU matches ours.

Why: a world of one is where FSDP2's wrapping and the meta-device initialisation buy nothing, so a/b is what a
single-GPU user pays (or gains) for writing the script once for many GPUs.

Measured on one H100 80GB HBM3 (torch 2.11.0+cu130, lightning 2.6.6, transformers 5.17.0), defaults (8 layers,
hidden 2048, 16 heads, batch 8 x 2048 tokens), two runs: a/b tokens/s 1.030 and 1.037 (MFU of a 0.30-0.31), peak
memory 0.89; c/a tokens/s 0.82 and 0.85, peak memory 0.56; d/a tokens/s 0.19 and 0.18, peak memory 0.72.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VARIANTS = {
    "a": "AutoModelParallelStrategy()",
    "b": "default single-device strategy",
    "c": "a + activation_checkpointing=True",
    "d": "a + cpu_offload=True",
    "a_csv": "a + CSVLogger (metrics check)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=VARIANTS, help="run this one variant in this process (internal)")
    parser.add_argument("--result", type=Path, help="where --variant writes its JSON result (internal)")
    parser.add_argument(
        "--variants", default="a,b,c,a_csv,d", help="comma-separated variants to run (d last: it is the untried one)"
    )
    parser.add_argument("--variant-timeout", type=float, default=180, help="seconds before a variant is killed")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: a tiny model, variants a and b")
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--intermediate-size", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    parser.add_argument("--offload-steps", type=int, default=6, help="steps of variant d")
    parser.add_argument("--offload-warmup", type=int, default=2)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--csv-dir", type=Path, help="where a_csv's CSVLogger writes (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.hidden_size, args.intermediate_size, args.layers, args.heads, args.kv_heads = 64, 128, 2, 4, 2
        args.vocab_size, args.batch_size, args.seq_len = 256, 2, 64
        args.steps, args.warmup, args.offload_steps, args.offload_warmup = 12, 2, 4, 1
        if args.variants == parser.get_default("variants"):
            args.variants = "a,b,a_csv"
    return args


# ------------------------------------------------------------------------------------------ one variant's process


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.seq_len,
    }


def random_tokens(samples: int, seq_len: int, vocab_size: int):
    """A dataset of ``samples`` random sequences, each a pure function of its index (the same in every variant)."""
    import torch
    from torch.utils.data import Dataset

    class RandomTokens(Dataset):
        def __len__(self) -> int:
            return samples

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            generator = torch.Generator().manual_seed(index)
            tokens = torch.randint(0, vocab_size, (seq_len,), generator=generator)
            return {"input_ids": tokens, "labels": tokens.clone()}

    return RandomTokens()


def step_timer(cuda: bool):
    """A callback that records the time at the end of every training step (after the optimizer) and its loss."""
    import torch
    from lightning.pytorch.callbacks import Callback

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.start = 0.0
            self.ends: list[float] = []
            self.losses: list[float] = []

        def _now(self) -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_start(self, trainer, pl_module) -> None:
            self.start = self._now()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.ends.append(self._now())
            self.losses.append(float(outputs["loss"].detach().float()))

    return StepTimer()


def strategy_for(variant: str):
    from lightning_automodel import AutoModelParallelStrategy

    if variant == "b":
        return "auto"
    return AutoModelParallelStrategy(activation_checkpointing=variant == "c", cpu_offload=variant == "d")


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.fabric.utilities.throughput import get_available_flops
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    from lightning_automodel.lm import CausalLMModule
    from lightning_automodel.planning.flops import flops_per_token

    variant = args.variant
    cuda = not args.tiny
    steps, warmup = (args.offload_steps, args.offload_warmup) if variant == "d" else (args.steps, args.warmup)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    L.seed_everything(0, verbose=False)
    module = CausalLMModule(config=model_config(args), schedule="constant")
    data = DataLoader(random_tokens(steps * args.batch_size, args.seq_len, args.vocab_size), batch_size=args.batch_size)
    timer = step_timer(cuda)
    logger: Any = False
    csv_dir = None
    if variant == "a_csv":
        csv_dir = args.csv_dir or Path(tempfile.mkdtemp(prefix="throughput_csv_"))
        logger = CSVLogger(csv_dir, name="a_csv", version=0)
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        strategy=strategy_for(variant),
        precision=args.precision,
        max_steps=steps,
        logger=logger,
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # else Lightning shuffles under a and not under b: batches would differ
        callbacks=[timer],
    )
    trainer.fit(module, data)

    timed = len(timer.ends) - warmup
    seconds = timer.ends[-1] - timer.ends[warmup - 1]
    tokens_per_s = timed * args.batch_size * args.seq_len / seconds
    per_token = flops_per_token(module.model, args.seq_len)
    peak = get_available_flops(torch.device("cuda"), torch.bfloat16) if cuda else None
    metrics = trainer.callback_metrics
    result = {
        "variant": variant,
        "steps": len(timer.ends),
        "timed_steps": timed,
        "tokens_per_s": tokens_per_s,
        "step_s": seconds / timed,
        "flops_per_token": per_token,
        "peak_flops": peak,
        "mfu": per_token * tokens_per_s / peak if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "losses": timer.losses,
        "callback_metrics": {name: float(value) for name, value in metrics.items() if value.numel() == 1},
        "strategy": type(trainer.strategy).__name__,
    }
    if csv_dir is not None:
        result["csv"] = read_throughput_columns(Path(logger.log_dir) / "metrics.csv")
    return result


def read_throughput_columns(path: Path) -> dict[str, Any]:
    """The step and every throughput/MFU/loss column of a CSVLogger's metrics.csv, rows with any of them."""
    with open(path, newline="") as file:
        rows = list(csv.DictReader(file))
    wanted = [
        name
        for name in (rows[0].keys() if rows else ())
        if any(key in name for key in ("mfu", "per_sec", "train_loss", "train_accuracy"))
    ]
    kept = [{"step": row.get("step", "")} | {name: row[name] for name in wanted} for row in rows]
    return {"path": str(path), "columns": wanted, "rows": [row for row in kept if any(row[n] for n in wanted)]}


# ----------------------------------------------------------------------------------------------- the parent


def spawn(variant: str, argv: list[str], timeout: float) -> dict[str, Any]:
    """Run one variant in a fresh Python process, killed after ``timeout`` seconds; its output goes straight to
    ours."""
    with tempfile.TemporaryDirectory() as directory:
        result = Path(directory) / "result.json"
        command = [sys.executable, __file__, *argv, "--variant", variant, "--result", str(result)]
        print(f"\n=== variant {variant}: {VARIANTS[variant]} ===", flush=True)
        started = time.perf_counter()
        try:
            returncode = subprocess.run(command, env=os.environ | {"PYTHONUNBUFFERED": "1"}, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            returncode = f"killed after {timeout:.0f} s"
        print(f"=== variant {variant}: exit {returncode}, {time.perf_counter() - started:.0f} s ===", flush=True)
        if returncode != 0 or not result.exists():
            return {"variant": variant, "failed": f"exit {returncode}"}
        return json.loads(result.read_text())


def _format(value: float | None, spec: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def print_table(results: dict[str, dict[str, Any]]) -> None:
    print(
        f"\n{'variant':<8}{'strategy':<34}{'steps':>6}{'tokens/s':>12}{'step s':>9}{'MFU':>8}{'peak GiB':>10}"
        f"{'loss 1':>10}{'loss 2':>10}"
    )
    for name, result in results.items():
        if "failed" in result:
            print(f"{name:<8}{VARIANTS[name]:<34} FAILED ({result['failed']})")
            continue
        losses = result["losses"] + [math.nan, math.nan]
        print(
            f"{name:<8}{VARIANTS[name]:<34}{result['timed_steps']:>6}{_format(result['tokens_per_s'], ',.0f'):>12}"
            f"{_format(result['step_s'], '.3f'):>9}{_format(result['mfu'], '.3f'):>8}"
            f"{_format(result['peak_memory_gib'], '.2f'):>10}{_format(losses[0], '.4f'):>10}"
            f"{_format(losses[1], '.4f'):>10}"
        )


def print_ratios(results: dict[str, dict[str, Any]]) -> None:
    def ratio(top: str, bottom: str, key: str) -> str:
        if any(name not in results or "failed" in results[name] for name in (top, bottom)):
            return "n/a"
        a, b = results[top][key], results[bottom][key]
        return "n/a" if a is None or not b else f"{a / b:.3f}"

    done = [result for result in results.values() if "failed" not in result]
    if done:
        peak = done[0]["peak_flops"]
        print(f"\nflops_per_token {done[0]['flops_per_token']:.4g}; peak bf16 FLOP/s {_format(peak, '.4g')}")
    print(f"\n{'ratio':<8}{'tokens/s':>10}{'peak memory':>13}")
    for top, bottom in (("a", "b"), ("c", "a"), ("d", "a")):
        print(f"{top}/{bottom:<6}{ratio(top, bottom, 'tokens_per_s'):>10}{ratio(top, bottom, 'peak_memory_gib'):>13}")


def print_losses(results: dict[str, dict[str, Any]]) -> None:
    print("\nlosses of the first steps (same seed, same data):")
    for name, result in results.items():
        if "failed" not in result:
            print(f"  {name:<6}" + " ".join(f"{loss:.4f}" for loss in result["losses"][:6]))
    if all(name in results and "failed" not in results[name] for name in ("a", "d")):
        shared = min(len(results["a"]["losses"]), len(results["d"]["losses"]))
        gap = max(
            abs(x - y) for x, y in zip(results["a"]["losses"][:shared], results["d"]["losses"][:shared], strict=True)
        )
        print(f"  d vs a: largest loss difference over the first {shared} steps {gap:.2e}")


def print_metrics_check(results: dict[str, dict[str, Any]]) -> None:
    print("\nCausalLMModule's own metrics in trainer.callback_metrics:")
    for name, result in results.items():
        if "failed" not in result:
            shown = {k: round(v, 4) for k, v in result["callback_metrics"].items() if k.startswith("train_")}
            missing = [k for k in ("train_loss", "train_accuracy") if k not in shown]
            print(f"  {name:<6}{shown}" + (f"  MISSING {missing}" if missing else ""))
    logged = results.get("a_csv", {})
    if "csv" not in logged:
        return
    table = logged["csv"]
    print(f"\nThroughputMonitor columns of {table['path']} (a, log_every_n_steps=5):")
    columns = ["step", *table["columns"]]
    print("  " + "  ".join(f"{c:>24}" for c in columns))
    for row in table["rows"]:
        print("  " + "  ".join(f"{row[c]:>24}" for c in columns))
    mfu_columns = [c for c in table["columns"] if c.endswith("mfu")]
    values = [float(row[c]) for row in table["rows"] for c in mfu_columns if row[c]]
    if values:
        print(f"  ThroughputMonitor's last MFU {values[-1]:.3f}; ours for a_csv {_format(logged['mfu'], '.3f')}")
    else:
        print("  ThroughputMonitor logged no MFU column")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.variant is not None:
        result = run_variant(args)
        args.result.write_text(json.dumps(result))
        return
    import lightning
    import torch
    import transformers

    print(
        f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}),"
        f" lightning {lightning.__version__}, transformers {transformers.__version__}"
    )
    if not args.tiny:
        print(f"device: {torch.cuda.get_device_name()}")
    print(f"model: {json.dumps(model_config(args))}; batch {args.batch_size} x {args.seq_len} tokens")
    results = {variant: spawn(variant, argv, args.variant_timeout) for variant in args.variants.split(",")}
    print_table(results)
    print_ratios(results)
    print_losses(results)
    print_metrics_check(results)
    if any("failed" in result for result in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
