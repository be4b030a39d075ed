"""Compiled decoder blocks (inductor) for the families the tests know, through the Trainer against the eager model in
one process.

Each family, 4 decoder layers, 3 AdamW steps and a validation, every block compiled with torch.compile's defaults, at
dp_shard=2, tp=2 with sp and full activation checkpointing, cp=2 and pp=2 (world 2). Each row: the relative error of
the first loss, of the gradients at the first and later steps (worst rank), of the weights after the last step and of
validate's loss, then the graphs dynamo compiled (training's and the validation's: 2 when the blocks share one graph,
more for a block with graph breaks; the check asserts that later steps compile none) and the first and a later step's
seconds. A family that fails prints its error.

    PYTHONPATH=$PWD .venv/bin/python scripts/compile_sweep.py ["tp=2"]   # only the layouts naming it
"""

from __future__ import annotations

import sys
from functools import partial

from _pytest.outcomes import Failed

from lightning_automodel.testing.harness import check_name, run_checks
from lightning_automodel.testing.trainer_checks import check_compiled_trainer_parity
from lightning_automodel.testing.trainer_parity import parity_row

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "granite", "qwen3_moe", "gpt_oss")
LAYOUTS = (  # (name, options) at world 2
    ("dp_shard=2", {}),
    ("tp=2 + sp, full AC", dict(tp=2, sp=True, activation_checkpointing=True)),
    ("cp=2", dict(cp=2)),
    ("pp=2", dict(pp=2)),
)


def main() -> None:
    columns = "first loss | gradients (first / later) | weights | validate | graphs | first / later step"
    print(f"| family | layout | {columns} |")
    print("|---|---|---|---|---|---|---|---|")
    chosen = sys.argv[1] if len(sys.argv) > 1 else ""
    for name, options in (layout for layout in LAYOUTS if chosen in layout[0]):
        for family in FAMILIES:  # a launch each: a family that fails leaves the others measured
            check = partial(check_compiled_trainer_parity, family, exact_graphs=False, **options)
            try:
                ranks = run_checks(2, [check], timeout=900)[check_name(check)]
            except Failed as failure:
                errors = [line.strip() for line in str(failure).splitlines() if "Error" in line] or ["?"]
                print(f"| {family} | {name} | failed: {errors[-1][:150]} | | | | | |", flush=True)
                continue
            first, later = (max(rank[key] for rank in ranks) for key in ("first_step_s", "later_step_s"))
            print(
                f"{parity_row(family, name, ranks)} {ranks[0]['graphs']} | {first:.1f} s / {later:.2f} s |", flush=True
            )


if __name__ == "__main__":
    main()
