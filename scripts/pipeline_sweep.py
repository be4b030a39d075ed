"""Pipeline parallel at every layout the tests know, through the Trainer against one process, and the largest one
the suite leaves out: pp=2 x tp=2 x dp_shard=2 on 8 processes.

Llama, Qwen3 and Gemma 3 (tied embeddings) with 4 decoder layers, 3 AdamW steps each: GPipe and 1F1B at pp=2 (world
2) and pp=4 (world 4, one layer a stage); pp=2 x tp=2 with sp and pp=2 x dp_shard=2 with activation checkpointing
(world 4); pp=2 x tp=2 x dp_shard=2 with sp (world 8). Each row: the relative error of the first loss, of this
stage's gradients at the first and later steps (worst stage) and of the weights after the last step, and of
validate's loss (tests/pipeline_checks.py, which also asserts the tolerances). About 8 minutes on 2 cores.

    PYTHONPATH=$PWD .venv/bin/python scripts/pipeline_sweep.py
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from harness import check_name, run_checks  # noqa: E402
from pipeline_checks import check_pipeline_trainer_parity  # noqa: E402

FAMILIES = ("llama", "qwen3", "gemma3")
# (name, world size, pp, schedule, options)
LAYOUTS = (
    ("pp=2, GPipe", 2, 2, "GPipe", {}),
    ("pp=2, 1F1B, 4 micro-batches", 2, 2, "1F1B", dict(microbatches=4)),
    ("pp=4, GPipe", 4, 4, "GPipe", {}),
    ("pp=4, 1F1B, 8 micro-batches", 4, 4, "1F1B", dict(microbatches=8)),
    ("pp=2 x tp=2 + sp, 1F1B", 4, 2, "1F1B", dict(tp=2, sp=True)),
    ("pp=2 x dp_shard=2, checkpointing", 4, 2, "1F1B", dict(activation_checkpointing=True)),
    ("pp=2 x tp=2 x dp_shard=2 + sp", 8, 2, "1F1B", dict(tp=2, sp=True)),
)
KEYS = ("first_loss", "first_grads", "later_grads", "weights_after_3_steps", "validation_loss")


def main() -> None:
    print("| family | layout | first loss | gradients (first / later steps) | weights after 3 steps | validate |")
    print("|---|---|---|---|---|---|")
    for name, world, pp, schedule, options in LAYOUTS:
        checks = [partial(check_pipeline_trainer_parity, pp, schedule, family, **options) for family in FAMILIES]
        results = run_checks(world, checks, timeout=900)
        for family, check in zip(FAMILIES, checks, strict=True):
            worst = {key: f"{max(rank[key] for rank in results[check_name(check)]):.1e}" for key in KEYS}
            first_loss, first_grads, later_grads, weights, validation = worst.values()
            row = f"| {family} | {name} | {first_loss} | {first_grads} / {later_grads} | {weights} | {validation} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
