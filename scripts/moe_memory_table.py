"""The activation estimate of mixture-of-experts steps against real CPU steps: Qwen3-MoE and DeepSeek-V3 (latent
attention) at tp=2 (+ sp for Qwen3-MoE) and ep=2 x dp_shard=2, 4 rows x 256 tokens a rank, fp32, two gloo ranks
(tests/moe_memory_checks.py's models). Each real step is measured twice, under its router's own routing and under the
routing the estimate assumes (balanced), by torch's count of its live tensors and by the process's resident set; the
table of docs/planning.md#mixture-of-experts. About 2 minutes on 2 cores.

    PYTHONPATH=$PWD .venv/bin/python scripts/moe_memory_table.py
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from moe_memory_checks import ROWS, TOKENS, measured_moe_activation_bytes, moe_model  # noqa: E402

from lightning_automodel import ParallelDims  # noqa: E402
from lightning_automodel.planning.memory.activations import activation_bytes  # noqa: E402
from lightning_automodel.planning.memory.routing import ExpertRouting  # noqa: E402
from lightning_automodel.testing.harness import run_checks  # noqa: E402

LAYOUTS = [
    ("qwen3_moe", ParallelDims(tp=2), dict(sp=True)),
    ("qwen3_moe", ParallelDims(dp_shard=2, ep=2), {}),
    ("deepseek_v3", ParallelDims(tp=2), {}),
    ("deepseek_v3", ParallelDims(dp_shard=2, ep=2), {}),
]


def main() -> None:
    cases = [(*layout, routing) for layout in LAYOUTS for routing in ("router's own", "assumed")]
    checks = [
        partial(measured_moe_activation_bytes, family, dims, routing=ExpertRouting() if how == "assumed" else None, **o)
        for family, dims, o, how in cases
    ]
    measured = run_checks(2, checks, timeout=1200).values()
    print(
        "| model | layout | real step's routing | estimate (bytes) | tensors, rank 0 / 1 | error | resident set,"
        " rank 0 / 1 | error |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (family, dims, options, how), per_rank in zip(cases, measured, strict=True):
        model = moe_model(family, meta=True)
        estimate = activation_bytes(model, dims.resolve(2), micro_batch=ROWS, seq_len=TOKENS, **options)
        layout = f"tp=2{' + sp' if options.get('sp') else ''}" if dims.tp > 1 else "ep=2 x dp_shard=2"
        cells = []
        for kind in ("tensors", "resident"):
            peaks = [peak[kind] for peak in per_rank]
            cells += [" / ".join(f"{peak:,}" for peak in peaks), " / ".join(f"{estimate / p - 1:+.1%}" for p in peaks)]
        print(f"| {family} | {layout} | {how} | {estimate:,} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
