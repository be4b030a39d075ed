"""Text made token ids, batch by batch, over worker processes: documents for pre-training, records for fine-tuning.

The sources are read in this process (reading is cheap) and cut into batches of pieces of one source; workers parse
and tokenize them (the costly part) and hand back flat arrays, in order. A bad record raises in the worker, naming
its source and line (or row), and the error reaches the caller as it was.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from lightning_automodel.data.chat import encode_record
from lightning_automodel.data.sources.expand import Source, source_kind
from lightning_automodel.data.sources.tables import Table, open_table, table_rows
from lightning_automodel.data.sources.text_files import file_pieces, json_record, text_of

BATCH_PIECES = 512  # pieces a worker tokenizes at a time, at most
BATCH_CHARACTERS = 4 << 20  # and characters: a batch of long documents stays a few MB
IN_FLIGHT = 2  # batches queued a worker: the reading stays this far ahead, whatever the corpus's size


@dataclass(frozen=True)
class PieceBatch:
    """Consecutive pieces of one source, each with where it is: a text file's paragraphs (``kind="text"``), a JSONL
    file's lines unparsed (``"json"``), a table's rows as dicts of their columns (``"row"``). Where is a line
    number, a byte offset (``position="byte"``: a stream's pieces, read from a byte range) or a row number."""

    source: str
    kind: Literal["text", "json", "row"]
    pieces: list[tuple[int, Any]]
    position: Literal["line", "byte", "row"] = "line"

    def where(self, number: int) -> str:
        return f"{self.source}, {self.position} {number}"


@dataclass(frozen=True)
class Encoded:
    """A batch's documents: their ids end to end, each one's length and line (or row), and (fine-tuning) the 0/1
    mask of the tokens trained on."""

    source: str
    tokens: np.ndarray
    lengths: np.ndarray
    lines: np.ndarray
    trained: np.ndarray | None


def source_batches(sources: Iterable[Source], encoder: Any) -> Iterator[PieceBatch]:
    """Every piece of ``sources``, in order, in batches; a table's rows hold the columns ``encoder`` reads."""
    for source in sources:
        if (kind := source_kind(source)) == "table":
            yield from table_batches(open_table(source), encoder)
        else:
            yield from _batches(file_pieces(source), source, kind=kind, position="line")


def table_batches(table: Table, encoder: Any, *, start: int = 0, stop: int | None = None) -> Iterator[PieceBatch]:
    """Rows ``[start, stop)`` of ``table`` in batches; a table without rows is an error, as an empty file is."""
    if not sum(table.group_rows):
        raise ValueError(f"{table.name} is empty: it has no rows. Fill it, or leave it out of the files.")
    rows = table_rows(table, encoder.columns(table), start=start, stop=stop)
    return _batches(rows, table.name, kind="row", position="row")


def document_batches(documents: Iterable[str], source: str) -> Iterator[PieceBatch]:
    """Documents given in code (a subclass's, the demo's), numbered from 1."""
    return _batches(enumerate(documents, start=1), source, kind="text", position="line")


def _batches(pieces: Iterable[tuple[int, Any]], source: str, *, kind: str, position: str) -> Iterator[PieceBatch]:
    batch, characters = [], 0
    for piece in pieces:
        batch.append(piece)
        characters += _characters(piece[1])
        if len(batch) == BATCH_PIECES or characters >= BATCH_CHARACTERS:
            yield PieceBatch(source, kind, batch, position)
            batch, characters = [], 0
    if batch:
        yield PieceBatch(source, kind, batch, position)


def _characters(piece: Any) -> int:
    if isinstance(piece, str):
        return len(piece)
    return sum(len(value) for value in piece.values() if isinstance(value, str)) if isinstance(piece, dict) else 0


def missing_columns(table: Table, wanted: str, fix: str) -> ValueError:
    return ValueError(f"{table.name}: no column {wanted} (it has {', '.join(map(repr, table.column_names))}). {fix}")


class DocumentEncoder:
    """Pre-training documents: each tokenized without special tokens, followed by EOS. Text that spells a special
    token ("<eos>") stays text: a document cannot forge a boundary. Blank documents are dropped."""

    def __init__(self, tokenizer: Any, text_field: str = "text") -> None:
        self.tokenizer = tokenizer
        self.text_field = text_field

    def __call__(self, batch: PieceBatch) -> Encoded:
        numbered = self.documents(batch)
        texts = [text for _, text in numbered]
        options = dict(add_special_tokens=False, split_special_tokens=True, return_attention_mask=False)
        ids = self.tokenizer(texts, **options)["input_ids"] if texts else []
        lengths = np.array([len(document) + 1 for document in ids], dtype=np.int64)
        tokens = joined(ids, lengths)
        tokens[np.cumsum(lengths) - 1] = self.tokenizer.eos_token_id
        lines = np.array([number for number, _ in numbered], dtype=np.int64)
        return Encoded(batch.source, tokens, lengths, lines, trained=None)

    def documents(self, batch: PieceBatch) -> list[tuple[int, str]]:
        """The batch's non-blank documents, with their lines."""
        numbered = [(number, self._text(batch, number, piece)) for number, piece in batch.pieces]
        return [(number, text) for number, text in numbered if text.strip()]

    def columns(self, table: Table) -> list[str]:
        """The column a table's documents are read from."""
        if self.text_field not in table.column_names:
            raise missing_columns(table, repr(self.text_field), "Set text_field to the column with the text.")
        return [self.text_field]

    def _text(self, batch: PieceBatch, number: int, piece: Any) -> str:
        if batch.kind == "text":
            return piece
        record = json_record(batch.where(number), piece) if batch.kind == "json" else piece
        return text_of(record, self.text_field, batch.where(number))


class RecordEncoder:
    """Fine-tuning records (see :mod:`lightning_automodel.data.chat`): JSONL lines, or a table's ``messages`` column
    (else its ``prompt`` and ``completion`` columns)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, batch: PieceBatch) -> Encoded:
        if batch.kind == "text":
            raise ValueError(
                f"{batch.source}: fine-tuning records are read from .jsonl files (one record a line), Parquet or Arrow"
                " tables."
            )
        encoded = [
            encode_record(self.tokenizer, self._record(batch, number, piece), batch.where(number))
            for number, piece in batch.pieces
        ]
        lengths = np.array([len(ids) for ids, _ in encoded], dtype=np.int64)
        tokens = joined([ids for ids, _ in encoded], lengths)
        trained = np.concatenate([mask for _, mask in encoded]).astype(np.uint8)
        lines = np.array([number for number, _ in batch.pieces], dtype=np.int64)
        return Encoded(batch.source, tokens, lengths, lines, trained)

    @staticmethod
    def columns(table: Table) -> list[str]:
        """A conversation's column and a prompt's and its completion's, those the table has: a row is the record its
        non-null columns make, so a table may hold both kinds."""
        columns = [name for name in ("messages", "prompt", "completion") if name in table.column_names]
        if "messages" not in columns and len(columns) < 2:
            raise missing_columns(
                table, "'messages', nor 'prompt' and 'completion'", "Rename the columns, e.g. with pyarrow or datasets."
            )
        return columns

    @staticmethod
    def _record(batch: PieceBatch, number: int, piece: Any) -> object:
        if batch.kind == "json":
            return json_record(batch.where(number), piece)
        return {name: value for name, value in piece.items() if value is not None}


def joined(documents: list[list[int]], lengths: np.ndarray) -> np.ndarray:
    """The documents' ids end to end, each in a slot of its length (a document's slot may end in a token it lacks,
    filled by the caller): slices filled from lists, twice as fast as an iterator of every id."""
    tokens = np.zeros(int(lengths.sum()), dtype=np.int64)
    for document, start in zip(documents, (np.cumsum(lengths) - lengths).tolist(), strict=True):
        tokens[start : start + len(document)] = document
    return tokens


def encode(batches: Iterable[PieceBatch], encoder: Any, *, workers: int) -> Iterator[Encoded]:
    """``encoder`` over ``batches``, in order, in ``workers`` forked processes (0: in this one; in this one too when
    it is a daemon, which may not have children: a worker of a multiprocessing pool)."""
    if workers == 0 or multiprocessing.current_process().daemon:
        yield from map(encoder, batches)
        return
    # Forked workers inherit the encoder (tokenizer included) without pickling it. A worker that dies (killed for
    # memory) breaks the pool, which raises, rather than leaving its batch awaited for ever.
    with (
        _tokenizer_threads_off(),
        ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("fork"), initializer=_install, initargs=(encoder,)
        ) as pool,
    ):
        pending: deque[Future] = deque()
        for batch in batches:
            pending.append(pool.submit(_encode_in_worker, batch))
            if len(pending) >= IN_FLIGHT * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


@contextmanager
def _tokenizer_threads_off() -> Iterator[None]:
    """A fast tokenizer's threads in a forked process would deadlock: off while the workers are forked, as the
    tokenizers library reads it then."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


_worker_encoder: Any = None


def _install(encoder: Any) -> None:
    global _worker_encoder
    _worker_encoder = encoder


def _encode_in_worker(batch: PieceBatch) -> Encoded:
    return _worker_encoder(batch)
