"""Context parallel for every family the tests know, through the Trainer against one process on the whole batch.

Each registered family (Llama, Mistral, Qwen2, Qwen3, Gemma 3 with its sliding layers, Phi-3 and its GQA variant),
Granite (trained through its Hugging Face plan) and the mixture-of-experts families of the coverage report's tiny
configs (Qwen3-MoE, Mixtral, GPT-OSS with its sinks, DeepSeek-V3's latent attention), 2 decoder layers, 3 AdamW steps:
at cp=2 (world 2), cp=2 x tp=2 with sp and cp=2 x dp_shard=2 (world 4). Each row: the relative error of the first loss,
of the gradients at the first and later steps (worst rank), of the weights after the last step and of validate's loss
(lightning_automodel/testing/trainer_checks.py, which also asserts the tolerances). A family that fails prints its error
instead.

    PYTHONPATH=$PWD .venv/bin/python scripts/context_parallel_sweep.py ["tp=2"]   # only the layouts naming it
"""

from __future__ import annotations

import sys
from functools import partial

from _pytest.outcomes import Failed

from lightning_automodel.testing.harness import check_name, run_checks
from lightning_automodel.testing.trainer_checks import check_context_parallel_trainer_parity
from lightning_automodel.testing.trainer_parity import parity_row

FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "phi3_gqa", "granite",
    "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3",
)  # fmt: skip
# (name, world size, options)
LAYOUTS = (
    ("cp=2", 2, {}),
    ("cp=2 x tp=2 + sp", 4, dict(tp=2, sp=True)),
    ("cp=2 x dp_shard=2", 4, {}),
)


def main() -> None:
    print("| family | layout | first loss | gradients (first / later steps) | weights after 3 steps | validate |")
    print("|---|---|---|---|---|---|")
    chosen = sys.argv[1] if len(sys.argv) > 1 else ""
    for name, world, options in (layout for layout in LAYOUTS if chosen in layout[0]):
        for family in FAMILIES:  # a launch each: a family that fails leaves the others measured
            check = partial(check_context_parallel_trainer_parity, 2, family, **options)
            try:
                results = run_checks(world, [check], timeout=900)
            except Failed as failure:
                errors = [line.strip() for line in str(failure).splitlines() if "Error" in line] or ["?"]
                print(f"| {family} | {name} | failed: {errors[-1][:150]} | | | |", flush=True)
                continue
            print(parity_row(family, name, results[check_name(check)]), flush=True)


if __name__ == "__main__":
    main()
