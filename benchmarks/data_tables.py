"""Parquet read by the data pipeline against pyarrow's own read of the same column of the same files (the limit):
rows/s and tokens/s of the cache's build, the cached loader and the stream (shuffled and in order), a rank's
private memory at two corpus sizes side by side, and the size of the stream's state.

    .venv/bin/python benchmarks/data_tables.py [--sizes 10M,100M] [--seq-len 2048] [--batch-size 8] [--workers 2]

The corpus is benchmarks/data.py's (documents of 100 to 8,000 made-up words, about 24 KB each; the byte tokenizer
makes a token a byte) written as Parquet files of 64 MB of text at most, by pyarrow's defaults (Snappy), in row
groups of 32 rows (about 0.8 MB of text): the 10M-token corpus (about 400 documents) then has a group for each of 8
data-parallel ranks, which the stream deals its groups to. Every measurement runs in a fresh process (spawned) as
data-parallel rank 0 of 8, after the files were written (so read from the page cache). pyarrow's read is of the
whole files, 512 rows a batch as the tables' reader asks, the fastest of 3 passes: the Arrow batches alone, and
converted to Python strings, as a reader handing text to a tokenizer must (the limit). Rows/s of the loaders and
the stream are their tokens/s over the corpus's tokens a row.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from data import arguments, in_fresh_process, parse_sizes, private_mib, read_as_rank, shards

ROW_GROUP_ROWS = 32


def write_parquet(directory: Path, tokens: int) -> list[str]:
    """Parquet files of the corpus of ``tokens``, a column ``text``, in row groups of ``ROW_GROUP_ROWS``."""
    import pyarrow
    import pyarrow.parquet

    files = []
    for index, shard in enumerate(shards(tokens)):
        path = directory / f"part-{index:04d}.parquet"
        pyarrow.parquet.write_table(pyarrow.table({"text": shard}), path, row_group_size=ROW_GROUP_ROWS)
        files.append(str(path))
    return files


def _pyarrow_read(files: list[str], to_python: bool) -> dict:
    """In a fresh process: every row of the ``text`` column, as Arrow batches or (``to_python``) Python strings; the
    fastest of 3 passes."""
    from lightning_automodel.data.sources.tables import READ_ROWS  # torch imported before the memory is read

    before = private_mib()
    passes = [_pyarrow_pass(files, to_python, READ_ROWS) for _ in range(3)]
    seconds, rows, characters = min(passes)
    tokens = characters + rows  # a byte a token (ASCII text), and each document's EOS
    return {
        "rows": rows,
        "tokens": tokens,
        "rows_per_s": rows / seconds,
        "tokens_per_s": tokens / seconds,
        "anon_read_mib": private_mib() - before,
    }


def _pyarrow_pass(files: list[str], to_python: bool, batch_rows: int) -> tuple[float, int, int]:
    """The seconds a pass takes, the rows and the characters it reads."""
    import pyarrow.compute
    import pyarrow.parquet

    rows, characters = 0, 0
    started = time.perf_counter()
    for path in files:
        for batch in pyarrow.parquet.ParquetFile(path, memory_map=True).iter_batches(batch_rows, columns=["text"]):
            column = batch.column("text")
            if to_python:
                column.to_pylist()
            rows += batch.num_rows
            characters += pyarrow.compute.sum(pyarrow.compute.binary_length(column)).as_py()
    return time.perf_counter() - started, rows, characters


def _measure(tokens: int, options: dict, batches: int) -> dict:
    """Every reading of a Parquet corpus of ``tokens``, each in a fresh process, in one scratch directory."""
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "corpus").mkdir()
        files = write_parquet(Path(scratch) / "corpus", tokens)
        cache = str(Path(scratch) / "cache")
        streamed = {**options, "streaming": True}
        return {
            "arrow": in_fresh_process(_pyarrow_read, files, False),
            "limit": in_fresh_process(_pyarrow_read, files, True),
            "cold": in_fresh_process(read_as_rank, files, cache, options, batches),
            "warm": in_fresh_process(read_as_rank, files, cache, options, batches),
            "shuffled": in_fresh_process(read_as_rank, files, cache, {**streamed, "shuffle": True}, batches),
            "in_order": in_fresh_process(read_as_rank, files, cache, {**streamed, "shuffle": False}, batches),
        }


def _throughput_lines(tokens: int, measured: dict, workers: int) -> list[str]:
    limit = measured["limit"]
    per_row = limit["tokens"] / limit["rows"]
    built = {"tokens_per_s": limit["tokens"] / measured["cold"]["setup_s"], "setup_s": measured["cold"]["setup_s"]}
    readings = [
        ("pyarrow, Arrow batches", measured["arrow"]),
        ("pyarrow, Python strings (the limit)", limit),
        (f"cache build, {workers} processes", built),
        ("cached loader (warm)", measured["warm"]),
        ("stream, shuffled (buffer of 1,000)", measured["shuffled"]),
        ("stream, in order", measured["in_order"]),
    ]
    lines = []
    for name, reading in readings:
        setup = f"{reading['setup_s']:.2f}" if "setup_s" in reading else "-"
        lines.append(
            f"| {tokens:,} | {name} | {setup} | {reading['tokens_per_s'] / per_row:,.0f} |"
            f" {reading['tokens_per_s']:,.0f} | {100 * reading['tokens_per_s'] / limit['tokens_per_s']:.2f}% |"
        )
    return lines


def _memory_line(tokens: int, measured: dict) -> str:
    warm, shuffled, in_order = measured["warm"], measured["shuffled"], measured["in_order"]
    return (
        f"| {tokens:,} | {measured['limit']['rows']:,} | {measured['limit']['anon_read_mib']:.1f} |"
        f" {warm['anon_setup_mib']:.1f} / {warm['anon_read_mib']:.1f} | {warm['file_mib']:.1f} |"
        f" {shuffled['anon_setup_mib']:.1f} / {shuffled['anon_read_mib']:.1f} |"
        f" {in_order['anon_setup_mib']:.1f} / {in_order['anon_read_mib']:.1f} |"
        f" {shuffled['state_bytes']:,} ({shuffled['buffer_state_bytes']:,}) | {in_order['state_bytes']:,} |"
    )


def main() -> None:
    args = arguments(__doc__.split("\n\n")[0])
    options = dict(seq_len=args.seq_len, batch_size=args.batch_size, tokenize_workers=args.workers)
    measured = {tokens: _measure(tokens, options, args.batches) for tokens in parse_sizes(args.sizes)}
    print("| corpus tokens | read | setup (s) | rows/s | tokens/s | of pyarrow's Python strings |")
    print("|---:|---|---:|---:|---:|---:|")
    for tokens, readings in measured.items():
        print("\n".join(_throughput_lines(tokens, readings, args.workers)))
    print()
    print(
        "| corpus tokens | rows | pyarrow's read, private memory (MiB) | cached, private memory after setup / after"
        " reading (MiB) | cache pages resident (MiB) | stream shuffled, private memory after setup / after reading"
        " (MiB) | stream in order, the same (MiB) | a rank's stream state, shuffled (its buffer's part), JSON bytes |"
        " in order, JSON bytes |"
    )
    print("|" + "---:|" * 9)
    for tokens, readings in measured.items():
        print(_memory_line(tokens, readings))


if __name__ == "__main__":
    main()
