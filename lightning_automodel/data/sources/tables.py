"""Parquet and Arrow tables read column by column, a few hundred rows at a time: files, and ``datasets`` objects.

A table is cut in groups, the unit a stream deals out to its ranks: a Parquet file's row groups, an Arrow file's
record batches, a ``datasets.Dataset``'s runs of 1,024 rows. Only the columns a reader asks for are read, and a
reader holds at most one group of them (pyarrow decodes a Parquet column chunk whole), never the table: Arrow files
are memory-mapped. Rows are numbered from 0, as pyarrow and ``datasets`` index them.

pyarrow is an optional dependency, imported when a table is first read.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow", ".feather")
TABLE_SUFFIXES = PARQUET_SUFFIXES + ARROW_SUFFIXES
READ_ROWS = 512  # rows read at a time
DATASET_GROUP_ROWS = 1024  # rows a group of a datasets.Dataset, which has no groups of its own


def is_table_file(path: str) -> bool:
    return path.endswith(TABLE_SUFFIXES)


def import_pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as error:
        raise ImportError(
            "Reading Parquet or Arrow files needs pyarrow: `pip install 'lightning-automodel[tables]'` (or pyarrow)."
        ) from error
    return pyarrow


@dataclass(frozen=True)
class DatasetSource:
    """A ``datasets.Dataset`` given in Python, read through its Arrow table (memory-mapped when the dataset is on
    disk), its row order (a ``select`` or ``shuffle``) and column renames included. ``name`` is how messages and
    the cache key call it: its fingerprint, which ``datasets`` derives from its data and the transforms made."""

    dataset: Any
    name: str

    @classmethod
    def of(cls, dataset: Any) -> DatasetSource:
        return cls(dataset, f"<datasets.Dataset {dataset._fingerprint}>")


class Table(Protocol):
    name: str
    column_names: list[str]
    group_rows: list[int]

    def batches(self, columns: Sequence[str], *, start: int, stop: int) -> Iterator[Any]:
        """Rows ``[start, stop)`` of ``columns``, as pyarrow batches (anything with ``column(name)``)."""
        ...


class ParquetTable:
    def __init__(self, path: str) -> None:
        parquet = import_pyarrow().parquet
        self.name = path
        self.file = parquet.ParquetFile(path, memory_map=True)
        self.column_names = list(self.file.schema_arrow.names)
        metadata = self.file.metadata
        self.group_rows = [metadata.row_group(group).num_rows for group in range(metadata.num_row_groups)]

    def batches(self, columns: Sequence[str], *, start: int, stop: int) -> Iterator[Any]:
        starts = np.concatenate([[0], np.cumsum(self.group_rows, dtype=np.int64)])
        first = int(np.searchsorted(starts, start, side="right")) - 1
        last = int(np.searchsorted(starts, stop, side="left"))
        row = int(starts[first])
        for batch in self.file.iter_batches(READ_ROWS, row_groups=range(first, last), columns=list(columns)):
            begin, end = max(start - row, 0), min(stop - row, batch.num_rows)
            if begin < end:
                yield batch.slice(begin, end - begin)
            row += batch.num_rows


class ArrowTable:
    """An Arrow IPC file, in the file format (``.feather``, ``pyarrow.ipc.new_file``) or the stream format
    (``datasets.save_to_disk``'s shards), memory-mapped."""

    def __init__(self, path: str) -> None:
        pyarrow = import_pyarrow()
        self.name = path
        mapped = pyarrow.memory_map(path)
        try:
            self.table = pyarrow.ipc.open_file(mapped).read_all()
        except pyarrow.ArrowInvalid:
            mapped.seek(0)
            self.table = pyarrow.ipc.open_stream(mapped).read_all()
        self.column_names = list(self.table.column_names)
        self.group_rows = [batch.num_rows for batch in self.table.to_batches() if batch.num_rows]

    def batches(self, columns: Sequence[str], *, start: int, stop: int) -> Iterator[Any]:
        yield from self.table.select(list(columns)).slice(start, stop - start).to_batches(READ_ROWS)


class DatasetTable:
    def __init__(self, source: DatasetSource) -> None:
        self.name = source.name
        self.dataset = source.dataset
        self.column_names = list(self.dataset.column_names)
        rows = len(self.dataset)
        self.group_rows = [min(DATASET_GROUP_ROWS, rows - at) for at in range(0, rows, DATASET_GROUP_ROWS)]

    def batches(self, columns: Sequence[str], *, start: int, stop: int) -> Iterator[Any]:
        # Only the columns asked for are gathered where the dataset has a row order of its own.
        view = self.dataset.select_columns(list(columns)).with_format("arrow")
        for at in range(start, stop, READ_ROWS):
            yield view[at : min(stop, at + READ_ROWS)]


def open_table(source: str | DatasetSource) -> Table:
    if isinstance(source, DatasetSource):
        return DatasetTable(source)
    if source.endswith(PARQUET_SUFFIXES):
        return ParquetTable(source)
    return ArrowTable(source)


def table_rows(
    table: Table, columns: Sequence[str], *, start: int = 0, stop: int | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Rows ``[start, stop)`` (None: to the end) of ``columns``, each with its number, as dicts of Python values."""
    stop = sum(table.group_rows) if stop is None else stop
    row = start
    for batch in table.batches(columns, start=start, stop=stop):
        values = [batch.column(name).to_pylist() for name in columns]
        for fields in zip(*values, strict=True):
            yield row, dict(zip(columns, fields, strict=True))
            row += 1
