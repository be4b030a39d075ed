"""Each data-parallel rank's share of the sources, in units a stream reads one at a time and shuffles the order of.

A text or JSONL file is shared out by bytes: a rank reads the documents that start in its 1/dp of the file's bytes,
cut in units of at most 64 MiB. A table is shared out by groups (a Parquet file's row groups, see
:mod:`lightning_automodel.data.sources.tables`): counted over all the tables in order, group ``g`` goes to rank
``g % dp``, so that tables of a single group still spread over the ranks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from lightning_automodel.data.encoding import DocumentEncoder, PieceBatch
from lightning_automodel.data.sources.expand import Source, source_kind, source_name
from lightning_automodel.data.sources.tables import open_table, table_rows
from lightning_automodel.data.sources.text_files import pieces_in_range

UNIT_BYTES = 64 << 20


class Unit(NamedTuple):
    """Pieces of ``sources[source]`` starting in positions ``[start, end)``: bytes of a file, rows of a table."""

    source: int
    start: int
    end: int


def byte_range(path: str, *, rank: int, num_replicas: int) -> tuple[int, int]:
    """The bytes of ``path`` whose documents data-parallel rank ``rank`` reads."""
    size = os.path.getsize(path)
    return size * rank // num_replicas, size * (rank + 1) // num_replicas


def shares(sources: list[Source], num_replicas: int) -> list[list[Unit]]:
    """Every data-parallel rank's units, in the sources' order."""
    by_rank: list[list[Unit]] = [[] for _ in range(num_replicas)]
    groups = 0
    for index, source in enumerate(sources):
        if source_kind(source) == "table":
            starts = np.concatenate([[0], np.cumsum(open_table(source).group_rows, dtype=np.int64)]).tolist()
            for start, end in zip(starts[:-1], starts[1:], strict=True):
                by_rank[groups % num_replicas].append(Unit(index, start, end))
                groups += 1
            continue
        for rank in range(num_replicas):
            start, end = byte_range(source, rank=rank, num_replicas=num_replicas)
            by_rank[rank] += [Unit(index, at, min(at + UNIT_BYTES, end)) for at in range(start, end, UNIT_BYTES)]
    return by_rank


def unit_pieces(
    source: Source, encoder: DocumentEncoder, *, start: int, end: int
) -> tuple[Iterator[tuple[int, Any]], str, str]:
    """The pieces of ``source`` starting in ``[start, end)``, with their kind and what their positions count."""
    kind = source_kind(source)
    if kind == "table":
        table = open_table(source)
        return table_rows(table, encoder.columns(table), start=start, stop=end), "row", "row"
    return pieces_in_range(source, start=start, end=end), kind, "byte"


def check_enough_documents(sources: list[Source], encoder: DocumentEncoder, num_replicas: int) -> list[list[Unit]]:
    """Every rank's units; a corpus in which a data-parallel rank's share holds no document is refused, on every
    rank alike before any collective (that rank could make no row: it would stop while the others wait for it)."""
    by_rank = shares(sources, num_replicas)
    for rank, units in enumerate(by_rank):
        if not any(_has_document(sources[unit.source], unit, encoder) for unit in units):
            names = [source_name(source) for source in sources]
            raise ValueError(
                f"Data-parallel rank {rank} of {num_replicas} gets no document of {names!r}: each rank streams the"
                f" documents that start in its 1/{num_replicas} of every file's bytes, and every {num_replicas}th"
                " group of rows of the tables; these sources are too small for that many. Add documents, or use"
                " fewer data-parallel ranks."
            )
    return by_rank


def _has_document(source: Source, unit: Unit, encoder: DocumentEncoder) -> bool:
    pieces, kind, position = unit_pieces(source, encoder, start=unit.start, end=unit.end)
    name = source_name(source)
    return any(encoder.documents(PieceBatch(name, kind, [piece], position)) for piece in pieces)
