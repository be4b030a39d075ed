"""torchtitan's own trainer beside ours, in the same processes: the same Llama, weights, rows, layout and optimizer.

    scripts/torchtitan_setup.sh    # once: torchtitan 0.3.0 into .torchtitan (or $1), the venv's torch untouched
    PYTHONPATH=$PWD:$PWD/.torchtitan .venv/bin/python benchmarks/torchtitan_peer.py    # every layout, a table each
    PYTHONPATH=$PWD:$PWD/.torchtitan .venv/bin/torchrun --nproc_per_node 4 -m benchmarks.torchtitan_peer --tp 2  # one

The layouts, model, batch and step of ours are peers.py's (lightning_automodel/testing/peer_setup.py: dp_shard=2 x tp=2
with sequence parallel, dp_shard=2, tp=2 with sequence parallel; gloo, fp32, AdamW at lr 1e-3 and torch's defaults).
torchtitan's trainer, set as ours: benchmarks/torchtitan_trainer.py; its CPU workarounds:
benchmarks/torchtitan_cpu.py.

Ours runs twice, on two copies: with peers.py's step (the logits whole) and with the loss 8 sequence chunks at a time as
torchtitan's (``chunked_step``: ``CausalLMModule(loss_chunks=8)``'s loss). Each rank builds all three and alternates
their steps, each going first in turn after a barrier, on the same rows (the dp rank's share of peers.py's batch;
torchtitan's labels are the next tokens, the last position ignored, so all average the same 255 predictions a row). Per
layout: each one's first loss against one process on the whole batch (else its time is void); the step time over ours
(the logits whole), the median over steps of each step's ratio (a step's time is its slowest rank's), with the quartiles
of the ratios: the noise a difference must exceed; the bytes of each collective kind in one step on rank 0
(lightning_automodel/testing/collectives.py, around one more step after the timed ones); the peak memory of one more
step, the worst rank's (lightning_automodel/testing/peak_memory.py: every tensor alive at the step's highest point,
weights, gradients and AdamW state included; torch's MemTracker less its statistics by module, which refuse a loss
calling lm_head once a chunk).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks.torchtitan_trainer import logged_losses, torchtitan_step, torchtitan_trainer
from lightning_automodel.testing.collectives import CollectiveBytes
from lightning_automodel.testing.peak_memory import peak_bytes
from lightning_automodel.testing.peer_setup import (
    LAYOUTS,
    STEPS,
    WARMUP,
    global_batch,
    one_process_loss,
    our_model,
    over_ours,
    seeded_model,
    step,
)

CHUNKED = "ours, loss_chunks=8"
PEERS = ("ours", CHUNKED, "torchtitan")
TOLERANCE = 1e-5  # relative: fp32 losses of the same weights and rows, summed in another order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="under torchrun: tp; dp_shard is the rest of the world")
    args = parser.parse_args()
    if importlib.util.find_spec("torchtitan") is None:
        sys.exit("torchtitan is not importable: run scripts/torchtitan_setup.sh and put its target on PYTHONPATH")
    if "LOCAL_RANK" in os.environ:
        compare(tp=args.tp)
    else:
        launch()


def launch() -> None:
    """Each layout in a torchrun of its own, one after another (they share the cores); rank 0 prints its table."""
    for dp, tp in LAYOUTS:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={dp * tp}"]
        subprocess.run([*command, "-m", "benchmarks.torchtitan_peer", f"--tp={tp}"], check=True)


def compare(*, tp: int) -> None:
    """On this rank: build torchtitan's trainer and ours, alternate their steps, report on rank 0."""
    dp = int(os.environ["WORLD_SIZE"]) // tp
    # the same path on every rank of this launch: no other launch on this host holds its port
    directory = os.path.join(tempfile.gettempdir(), f"torchtitan_peer_{os.environ['MASTER_PORT']}")
    trainer = torchtitan_trainer(dp=dp, tp=tp, directory=directory)  # initializes the default (gloo) process group
    save_seeded_weights(directory)
    trainer.checkpointer.load()
    losses = logged_losses(trainer)
    data = trainer.batch_generator(trainer.dataloader)
    ours, chunked = our_model((dp, tp)), our_model((dp, tp))
    rows = global_batch().chunk(dp)[dist.get_rank() // tp]
    steps = {
        "ours": lambda: step(*ours, rows),
        CHUNKED: lambda: chunked_step(*chunked, rows, chunks=8),
        "torchtitan": lambda: torchtitan_step(trainer, data),
    }
    seconds, first = alternate(steps)
    first = {"ours": mean_over_ranks(first["ours"]), CHUNKED: mean_over_ranks(first[CHUNKED]), "torchtitan": losses[0]}
    counted = {name: collective_bytes(run) for name, run in steps.items()}
    held = {"ours": ours, CHUNKED: chunked, "torchtitan": (*trainer.model_parts, *trainer.optimizers.optimizers)}
    peaks = {name: peak_bytes(run, *held[name]) for name, run in steps.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (seconds, counted, peaks))
    if dist.get_rank() == 0:
        report(everyone, first, dp=dp, tp=tp)
        shutil.rmtree(directory)
    trainer.close()
    dist.destroy_process_group()


def alternate(steps: dict) -> tuple[dict[str, list[float]], dict]:
    """Every step of each peer after a barrier, each going first in turn; the seconds of the timed ones, the first
    step's result."""
    seconds = {name: [] for name in steps}
    first = {}
    for index in range(WARMUP + STEPS):
        for name in PEERS[index % len(PEERS) :] + PEERS[: index % len(PEERS)]:
            dist.barrier()
            start = time.perf_counter()
            result = steps[name]()
            elapsed = time.perf_counter() - start
            first.setdefault(name, result)
            if index >= WARMUP:
                seconds[name].append(elapsed)
    return seconds, first


def collective_bytes(run) -> dict[str, int]:
    dist.barrier()
    with CollectiveBytes() as sent:
        run()
    return dict(sent.bytes)


def mean_over_ranks(loss: torch.Tensor) -> float:
    from torch.distributed.tensor import DTensor

    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss.clone()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def report(ranks: list[tuple[dict, dict, dict]], first: dict[str, float], *, dp: int, tp: int) -> None:
    """One layout's table: times and peak memory the worst rank's, collectives rank 0's."""
    reference, parameters = one_process_loss()
    slowest = {name: [max(seconds[name][i] for seconds, _, _ in ranks) for i in range(STEPS)] for name in PEERS}
    peak = {name: max(peaks[name] for _, _, peaks in ranks) for name in PEERS}
    sent = ranks[0][1]
    kinds = sorted(set().union(*sent.values()))
    print(f"\n**dp_shard={dp}{f' x tp={tp} + sp' if tp > 1 else ''}** (world {dp * tp}), {parameters:,} parameters,")
    print(f"{torch.get_num_threads()} threads a rank; one process's first loss {reference:.6f}\n")
    print("| peer | first loss vs one process | median step (s) | step time over ours (quartiles) |", end="")
    print("".join(f" {kind} (MiB) |" for kind in kinds), "peak memory (MiB) |")
    print("|---|---|---|---|" + "---|" * (len(kinds) + 1))
    for name in PEERS:
        error = abs(first[name] - reference) / reference
        over = over_ours(slowest[name], slowest["ours"])
        timing = f"{statistics.median(slowest[name]):.3f} | {over}" if error < TOLERANCE else "void | void"
        print(f"| {name} | {error:.1e} | {timing} |", end="")
        print("".join(f" {sent[name].get(kind, 0) / 2**20:.2f} |" for kind in kinds), f"{peak[name] / 2**20:.1f} |")


def save_seeded_weights(directory: str) -> None:
    """The model every peer starts from, as safetensors where torchtitan's checkpointer looks (rank 0 writes)."""
    if dist.get_rank() == 0:
        seeded_model().save_pretrained(directory)
    dist.barrier()


def chunked_step(model, optimizer, tokens: torch.Tensor, *, chunks: int) -> torch.Tensor:
    """peers.step with the loss ``chunks`` sequence chunks at a time, as ``CausalLMModule(loss_chunks=chunks)`` and
    torchtitan's chunked loss compute it: the same mean over every row's predicted tokens."""
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_automodel.parallel.chunked_loss import chunked_causal_lm_loss_sum

    optimizer.zero_grad(set_to_none=True)
    with loss_parallel():
        loss_sum, tokens_scored, _ = chunked_causal_lm_loss_sum(model, input_ids=tokens, labels=tokens, chunks=chunks)
        loss = loss_sum / tokens_scored
        loss.backward()
    optimizer.step()
    return loss.detach()


if __name__ == "__main__":
    main()
