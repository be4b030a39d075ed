"""Every mixture-of-experts family of the tests at every expert layout, through the Trainer against one process.

Qwen3-MoE, Mixtral, GPT-OSS and DeepSeek-V3 (tiny configs from lightning_automodel/hf/shrink.py), 3 AdamW steps each at
tp=2 (world 2), ep=2 (world 2), ep=2 x tp=2 with and without sp (world 4), ep=2 with FSDP over the other two ranks
(efsdp=2, world 4) and ep=2 x tp=2 with sp and activation checkpointing (world 4): the relative error of the first loss,
of every gradient at every step and of the weights after the last step (lightning_automodel/testing/trainer_checks.py,
which also asserts the tolerances). Then bf16-mixed at ep=2 x tp=2: the losses against fp32, beside a single-process
bf16 run's. The suite runs a subset (tests/test_expert_parallel.py); this is the whole table. About 6 minutes on 2
cores.

    PYTHONPATH=$PWD .venv/bin/python scripts/expert_parallel_sweep.py
"""

from __future__ import annotations

from functools import partial

from lightning_automodel.testing.harness import check_name, run_checks
from lightning_automodel.testing.models import SHRUNK
from lightning_automodel.testing.trainer_checks import check_bf16_trainer, check_trainer_parity

# (name, world size, tp, sp, ep, activation checkpointing)
LAYOUTS = (
    ("tp=2", 2, 2, False, 1, False),
    ("ep=2", 2, 1, False, 2, False),
    ("ep=2 x tp=2", 4, 2, False, 2, False),
    ("ep=2 x tp=2 + sp", 4, 2, True, 2, False),
    ("ep=2, efsdp=2", 4, 1, False, 2, False),
    ("ep=2 x tp=2 + sp, checkpointing", 4, 2, True, 2, True),
)


def main() -> None:
    rows = {family: {} for family in SHRUNK}
    for name, world, tp, sp, ep, checkpointing in LAYOUTS:
        checks = [partial(check_trainer_parity, tp, sp, checkpointing, family, ep=ep) for family in SHRUNK]
        results = run_checks(world, checks, timeout=900)
        for family, check in zip(SHRUNK, checks, strict=True):
            rows[family][name] = results[check_name(check)][0]
    print("| family | layout | first loss | gradients (first / later steps) | weights after 3 steps |")
    print("|---|---|---|---|---|")
    for family, by_layout in rows.items():
        for name, errors in by_layout.items():
            print(
                f"| {family} | {name} | {errors['first_loss']:.1e} | {errors['first_grads']:.1e} /"
                f" {errors['later_grads']:.1e} | {errors['weights_after_3_steps']:.1e} |"
            )
    checks = [partial(check_bf16_trainer, 2, "bf16-mixed", family, ep=2) for family in SHRUNK]
    results = run_checks(4, checks, timeout=900)
    print("\n| family (bf16-mixed, ep=2 x tp=2) | losses vs fp32 | one process in bf16 vs fp32 |")
    print("|---|---|---|")
    for family, check in zip(SHRUNK, checks, strict=True):
        errors = results[check_name(check)][0]
        print(f"| {family} | {errors['loss_error']:.1e} | {errors['single_process_bf16_loss_vs_fp32']:.1e} |")


if __name__ == "__main__":
    main()
