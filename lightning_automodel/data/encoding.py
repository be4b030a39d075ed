"""Text made token ids, batch by batch, over worker processes: documents for pre-training, records for fine-tuning.

The files are read in this process (reading is cheap) and cut into batches of pieces of one file; workers parse and
tokenize them (the costly part) and hand back flat arrays, in order. A bad record raises in the worker, naming its
file and line, and the error reaches the caller as it was.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_automodel.data.chat import encode_record
from lightning_automodel.data.files import file_pieces, is_jsonl, json_record, text_of

BATCH_PIECES = 512  # pieces a worker tokenizes at a time, at most
BATCH_CHARACTERS = 4 << 20  # and characters: a batch of long documents stays a few MB
IN_FLIGHT = 2  # batches queued a worker: the reading stays this far ahead, whatever the corpus's size


@dataclass(frozen=True)
class PieceBatch:
    """Consecutive pieces of one source: (where, text) pairs, JSON lines unparsed when ``json``; where is a line
    number, or a byte offset (``position="byte"``: a stream's pieces, read from a byte range)."""

    source: str
    json: bool
    pieces: list[tuple[int, str]]
    position: str = "line"

    def where(self, number: int) -> str:
        return f"{self.source}, {self.position} {number}"


@dataclass(frozen=True)
class Encoded:
    """A batch's documents: their ids end to end, each one's length and line, and (fine-tuning) the 0/1 mask of the
    tokens trained on."""

    source: str
    tokens: np.ndarray
    lengths: np.ndarray
    lines: np.ndarray
    trained: np.ndarray | None


def file_batches(files: Iterable[str]) -> Iterator[PieceBatch]:
    for path in files:
        yield from _batches(file_pieces(path), path, json=is_jsonl(path))


def document_batches(documents: Iterable[str], source: str) -> Iterator[PieceBatch]:
    """Documents given in code (a subclass's, the demo's), numbered from 1."""
    return _batches(enumerate(documents, start=1), source, json=False)


def _batches(pieces: Iterable[tuple[int, str]], source: str, *, json: bool) -> Iterator[PieceBatch]:
    batch, characters = [], 0
    for piece in pieces:
        batch.append(piece)
        characters += len(piece[1])
        if len(batch) == BATCH_PIECES or characters >= BATCH_CHARACTERS:
            yield PieceBatch(source, json, batch)
            batch, characters = [], 0
    if batch:
        yield PieceBatch(source, json, batch)


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
        eos = self.tokenizer.eos_token_id
        tokens = np.fromiter((t for document in ids for t in (*document, eos)), dtype=np.int64)
        lengths = np.array([len(document) + 1 for document in ids], dtype=np.int64)
        lines = np.array([number for number, _ in numbered], dtype=np.int64)
        return Encoded(batch.source, tokens, lengths, lines, trained=None)

    def documents(self, batch: PieceBatch) -> list[tuple[int, str]]:
        """The batch's non-blank documents, with their lines."""
        numbered = [(number, self._text(batch, number, piece)) for number, piece in batch.pieces]
        return [(number, text) for number, text in numbered if text.strip()]

    def _text(self, batch: PieceBatch, number: int, piece: str) -> str:
        if not batch.json:
            return piece
        return text_of(json_record(batch.where(number), piece), self.text_field, batch.where(number))


class RecordEncoder:
    """Fine-tuning records (see :mod:`lightning_automodel.data.chat`), JSONL only."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, batch: PieceBatch) -> Encoded:
        if not batch.json:
            raise ValueError(f"{batch.source}: fine-tuning records are read from .jsonl files, one record a line.")
        encoded = [
            encode_record(self.tokenizer, json_record(batch.where(number), line), batch.where(number))
            for number, line in batch.pieces
        ]
        tokens = np.fromiter((t for ids, _ in encoded for t in ids), dtype=np.int64)
        trained = np.concatenate([mask for _, mask in encoded]).astype(np.uint8)
        lengths = np.array([len(ids) for ids, _ in encoded], dtype=np.int64)
        lines = np.array([number for number, _ in batch.pieces], dtype=np.int64)
        return Encoded(batch.source, tokens, lengths, lines, trained)


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
