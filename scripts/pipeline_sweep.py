"""Pipeline parallel at every layout the tests know, through the Trainer against one process, and those the suite
leaves out: pp=2 x tp=2 x dp_shard=2 on 8 processes, the virtual-stage schedules at every layout.

Llama, Qwen3 and Gemma 3 (tied embeddings) with 4 decoder layers, 3 AdamW steps each: GPipe and 1F1B at pp=2 (world 2)
and pp=4 (world 4, one layer a stage); Interleaved1F1B, LoopedBFS and InterleavedZeroBubble with two stages per rank at
pp=2 (one layer a stage), also with tp=2 + sp, with dp_shard=2, and with activation checkpointing; pp=2 x tp=2 with sp
and pp=2 x dp_shard=2 with activation checkpointing (world 4); pp=2 x tp=2 x dp_shard=2 with sp (world 8). Each row: the
relative error of the first loss, of this rank's gradients at the first and later steps (worst rank) and of the weights
after the last step, and of validate's loss (lightning_automodel/testing/trainer_checks.py, which also asserts the
tolerances). About 14 minutes on 2 cores.

    PYTHONPATH=$PWD .venv/bin/python scripts/pipeline_sweep.py ["2 stages"]   # only the layouts naming it
"""

from __future__ import annotations

import sys
from functools import partial

from lightning_automodel.testing.harness import check_name, run_checks
from lightning_automodel.testing.trainer_checks import check_pipeline_trainer_parity
from lightning_automodel.testing.trainer_parity import parity_row

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
    ("pp=2 x 2 stages, Interleaved1F1B", 2, 2, "Interleaved1F1B", dict(microbatches=4, stages_per_rank=2)),
    ("pp=2 x 2 stages, LoopedBFS", 2, 2, "LoopedBFS", dict(stages_per_rank=2)),
    ("pp=2 x 2 stages, InterleavedZeroBubble", 2, 2, "InterleavedZeroBubble", dict(stages_per_rank=2)),
    ("pp=2 x 2 stages x tp=2 + sp, Interleaved1F1B", 4, 2, "Interleaved1F1B", dict(tp=2, sp=True, stages_per_rank=2)),
    ("pp=2 x 2 stages x dp_shard=2, InterleavedZeroBubble", 4, 2, "InterleavedZeroBubble", dict(stages_per_rank=2)),
    (
        "pp=2 x 2 stages x dp_shard=2, Interleaved1F1B, checkpointing",
        4,
        2,
        "Interleaved1F1B",
        dict(activation_checkpointing=True, stages_per_rank=2),
    ),
)


def main() -> None:
    print("| family | layout | first loss | gradients (first / later steps) | weights after 3 steps | validate |")
    print("|---|---|---|---|---|---|")
    chosen = sys.argv[1] if len(sys.argv) > 1 else ""
    for name, world, pp, schedule, options in (layout for layout in LAYOUTS if chosen in layout[0]):
        checks = [partial(check_pipeline_trainer_parity, pp, schedule, family, **options) for family in FAMILIES]
        results = run_checks(world, checks, timeout=900)
        for family, check in zip(FAMILIES, checks, strict=True):
            print(parity_row(family, name, results[check_name(check)]), flush=True)


if __name__ == "__main__":
    main()
