"""A weighted mixture's schedule and order, measured: how close every prefix of 10,000 rows comes to the weights,
what building a cached epoch's order costs against a plain shuffle's (time, peak memory), and a stream's scheduling
per row.

    .venv/bin/python benchmarks/mixture.py [--rows 10M] [--dp 8]

Each order is built in a fresh process (spawned), as data-parallel rank 0 of ``--dp``; peak memory is the growth of
the process's peak resident set (VmHWM) over its resident set before, after the imports.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from pathlib import Path

import numpy as np

WEIGHTS = [(0.7, 0.3), (1 / 7, 2 / 7, 4 / 7), (0.5, 0.3, 0.15, 0.05), (0.02, 0.98)]  # the tests' weights
SEEDS = range(10)


def schedule_deviation(rows: int = 10_000) -> list[dict]:
    """For each weight set, over ``SEEDS``: the worst distance in rows of a source's count from its weight's share in
    any prefix, and the worst relative deviation of its share over all ``rows``."""
    from lightning_automodel.data.mixture import source_schedule

    results = []
    for weights in WEIGHTS:
        worst_rows, worst_share = 0.0, 0.0
        for seed in SEEDS:
            sources = source_schedule(weights, seed=seed, stop=rows)
            counts = np.stack([np.cumsum(sources == s) for s in range(len(weights))], axis=1)
            expected = np.arange(1, rows + 1)[:, None] * np.array(weights)
            worst_rows = max(worst_rows, float(np.abs(counts - expected).max()))
            worst_share = max(worst_share, float((np.abs(counts[-1] - expected[-1]) / expected[-1]).max()))
        results.append({"weights": [round(w, 4) for w in weights], "prefix_rows": worst_rows, "share": worst_share})
    return results


def _memory_kib(field: str) -> int:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(status[field].split()[0])


def _build(kind: str, rows: int, dp: int) -> dict:
    """In a fresh process: the sampler of ``rows`` rows (a plain shuffle, or a mixture of three sources whose epoch
    is about ``rows``), then its first epoch's order for rank 0."""
    from lightning_automodel.data.mixture import MixedRows
    from lightning_automodel.data.sampler import MixtureShuffle, ResumableShuffle

    before = _memory_kib("VmRSS")
    started = time.perf_counter()
    if kind == "shuffle":
        sampler = ResumableShuffle(range(rows), seed=0, num_replicas=dp, rank=0)
    else:  # all_exhausted: the second source (30% of the rows) sets the epoch's length
        sizes, weights = [rows // 20, rows * 3 // 10, rows // 10], [0.5, 0.3, 0.2]
        parts = MixedRows([range(size) for size in sizes], weights)
        sampler = MixtureShuffle(parts, seed=0, stopping_strategy="all_exhausted", num_replicas=dp, rank=0)
    built = time.perf_counter()
    order = sampler.order(0)
    done = time.perf_counter()
    return {
        "kind": kind,
        "epoch_rows": sampler.total_size,
        "init_s": built - started,
        "order_s": done - built,
        "peak_bytes_per_row": (_memory_kib("VmHWM") - before) * 1024 / sampler.total_size,
        "kept_bytes_per_rank_row": order.element_size(),  # the rank keeps its share's indices
    }


def stream_schedule_us_per_row(dp: int, chunks: int = 200) -> float:
    """The time a streamed rank spends scheduling, per row: one schedule of STREAM_CHUNK x dp positions a chunk."""
    from lightning_automodel.data.mixture import STREAM_CHUNK, schedule

    started = time.perf_counter()
    for chunk in range(chunks):
        first = chunk * STREAM_CHUNK * dp
        schedule([0.5, 0.3, 0.2], seed=0, start=first, stop=first + STREAM_CHUNK * dp)[::dp]
    return (time.perf_counter() - started) / (chunks * STREAM_CHUNK) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="10M", help="rows of an epoch (K, M suffixes)")
    parser.add_argument("--dp", type=int, default=8)
    args = parser.parse_args()
    rows = int(float(args.rows.rstrip("KM")) * {"K": 1e3, "M": 1e6}.get(args.rows[-1], 1))
    print(json.dumps({"schedule": schedule_deviation()}, indent=1))
    context = multiprocessing.get_context("spawn")
    for kind in ("shuffle", "mixture"):
        with context.Pool(1) as pool:
            print(json.dumps(pool.apply(_build, (kind, rows, args.dp))))
    print(json.dumps({"stream_schedule_us_per_row": stream_schedule_us_per_row(args.dp), "dp": args.dp}))


if __name__ == "__main__":
    main()
