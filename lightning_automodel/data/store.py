"""Tokenized documents end to end in one flat array, with their offsets: in memory, or memory-mapped from a cache.

Reading a row is slicing the array, so a rank's resident memory is the rows it holds, not the corpus: the pages of
a memory-mapped file are the operating system's page cache, shared by every rank of a machine and dropped under
pressure. The offsets take 8 bytes a document; a fine-tuning store keeps a byte a token for the mask of those
trained on.

Each source's tokens are hashed as they are written (blake2b: 426M tokens/s, about 1% of a build), so that machines
can compare their copies of the files without reading the cache again (:mod:`lightning_automodel.data.copies`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from lightning_automodel.data.encoding import Encoded
from lightning_automodel.data.sources.expand import position_word

TOKENS, OFFSETS, LINES, TRAINED, META = "tokens.bin", "offsets.bin", "lines.bin", "trained.bin", "meta.json"
IMAGES = "images.json"  # a vision store's image references (see lightning_automodel.data.vision)
STORE_FILES = (TOKENS, OFFSETS, LINES, TRAINED, IMAGES, META)


class StoredSource(NamedTuple):
    """A source of a store's documents (a file, named as given), with what it gave: its documents, its tokens, and a
    digest of them (the tokens, each document's length and the trained mask)."""

    name: str
    documents: int
    tokens: int
    digest: str


@dataclass(frozen=True)
class TokenStore:
    """``tokens[offsets[i]:offsets[i + 1]]`` is document ``i``, from line ``lines[i]`` of its source (``sources``, in
    order); ``trained`` (None: all) marks the tokens with a label; ``key``: what made a cached store (None: built in
    memory); ``directory``: where a cached store lives (files of its own beside the tokens: a vision store's)."""

    tokens: np.ndarray
    offsets: np.ndarray
    lines: np.ndarray
    sources: tuple[StoredSource, ...]
    trained: np.ndarray | None = None
    key: dict[str, Any] | None = None
    directory: Path | None = None

    @property
    def documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def where(self, document: int) -> str:
        """The file and line (a table's row) document ``document`` comes from."""
        ends = np.cumsum([source.documents for source in self.sources])
        source = int(np.searchsorted(ends, document, side="right"))
        name = self.sources[source].name
        return f"{name}, {position_word(name)} {int(self.lines[document])}"

    def first_targets(self, documents: np.ndarray) -> np.ndarray:
        """Each of ``documents``' first trained token, counted from its start (its length if none); read a document
        at a time, so that no array the size of the tokens is made."""
        if self.trained is None:
            return np.zeros(len(documents), dtype=np.int64)
        first = np.empty(len(documents), dtype=np.int64)
        for index, document in enumerate(documents.tolist()):
            trained = self.trained[self.offsets[document] : self.offsets[document + 1]]
            first[index] = trained.argmax() if trained.any() else len(trained)
        return first


def token_dtype(vocabulary: int) -> np.dtype:
    return np.dtype(np.uint16 if vocabulary <= 2**16 else np.uint32)


def _narrowed(tokens: np.ndarray, dtype: np.dtype, source: str) -> np.ndarray:
    if len(tokens) and tokens.max() > np.iinfo(dtype).max:
        raise ValueError(
            f"{source}: token id {int(tokens.max())} does not fit {dtype.name}, chosen from the tokenizer's vocabulary:"
            " its ids go past its length."
        )
    return tokens.astype(dtype)


class _Tally:
    """Each source's documents, tokens and digest, added batch by batch: the digest hashes the tokens (as stored),
    the documents' lengths and the trained mask, each as one stream, so that it does not depend on the batches."""

    def __init__(self) -> None:
        self.counts: dict[str, list[int]] = {}
        self.hashes: dict[str, list[Any]] = {}

    def add(self, batch: Encoded, tokens: np.ndarray) -> None:
        counts = self.counts.setdefault(batch.source, [0, 0])
        counts[0] += len(batch.lengths)
        counts[1] += len(tokens)
        hashes = self.hashes.setdefault(batch.source, [hashlib.blake2b(digest_size=16) for _ in range(3)])
        trained = batch.trained if batch.trained is not None else np.zeros(0, np.uint8)
        for hashed, array in zip(hashes, (tokens, batch.lengths.astype(np.int64), trained), strict=True):
            hashed.update(array.tobytes())

    def sources(self) -> tuple[StoredSource, ...]:
        def digest(hashes: list[Any]) -> str:
            return hashlib.blake2b(b"".join(hashed.digest() for hashed in hashes), digest_size=16).hexdigest()

        return tuple(StoredSource(name, *self.counts[name], digest(hashes)) for name, hashes in self.hashes.items())


def memory_store(encoded: Iterable[Encoded], *, vocabulary: int, fine_tuning: bool) -> TokenStore:
    batches, dtype, tally = list(encoded), token_dtype(vocabulary), _Tally()
    narrowed = [_narrowed(batch.tokens, dtype, batch.source) for batch in batches]
    for batch, tokens in zip(batches, narrowed, strict=True):
        tally.add(batch, tokens)

    def joined(field: str, dtype: type) -> np.ndarray:
        return np.concatenate([np.zeros(0, dtype), *(getattr(batch, field) for batch in batches)])

    offsets = np.concatenate([[0], np.cumsum(joined("lengths", np.int64))]).astype(np.int64)
    trained = joined("trained", np.uint8) if fine_tuning else None
    tokens = np.concatenate([np.zeros(0, dtype), *narrowed])
    return TokenStore(tokens, offsets, joined("lines", np.int64), tally.sources(), trained)


def write_store(directory: Path, encoded: Iterable[Encoded], *, vocabulary: int, fine_tuning: bool, key: dict) -> None:
    """Append every batch to the store's files in ``directory``; ``meta.json`` (the key, the counts, the sources)
    last, so that a store without it is incomplete."""
    dtype, tokens, tally = token_dtype(vocabulary), 0, _Tally()
    with ExitStack() as files:
        ids, offsets, lines = (files.enter_context(open(directory / name, "wb")) for name in (TOKENS, OFFSETS, LINES))
        trained = files.enter_context(open(directory / TRAINED, "wb")) if fine_tuning else None
        offsets.write(np.zeros(1, np.int64).tobytes())
        for batch in encoded:
            narrowed = _narrowed(batch.tokens, dtype, batch.source)
            ids.write(narrowed.tobytes())
            offsets.write((tokens + np.cumsum(batch.lengths)).astype(np.int64).tobytes())
            lines.write(batch.lines.astype(np.int64).tobytes())
            if trained is not None:
                trained.write(batch.trained.tobytes())
            tokens += int(batch.lengths.sum())
            tally.add(batch, narrowed)
    sources = tally.sources()
    meta = {"key": key, "dtype": dtype.name, "tokens": tokens, "documents": sum(source.documents for source in sources)}
    meta |= {"fine_tuning": fine_tuning, "sources": [list(source) for source in sources]}
    (directory / META).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


def read_meta(directory: Path) -> dict | None:
    try:
        return json.loads((directory / META).read_text())
    except (OSError, ValueError):
        return None


def open_store(directory: Path, meta: dict) -> TokenStore:
    """The store in ``directory``, memory-mapped; files whose sizes disagree with ``meta`` are an error."""
    dtype, tokens, documents = np.dtype(meta["dtype"]), meta["tokens"], meta["documents"]
    expected = {TOKENS: (dtype, tokens), OFFSETS: (np.dtype(np.int64), documents + 1), LINES: (np.int64, documents)}
    if meta["fine_tuning"]:
        expected[TRAINED] = (np.dtype(np.uint8), tokens)
    arrays = {name: _mapped(directory, name, np.dtype(kind), count) for name, (kind, count) in expected.items()}
    sources = tuple(StoredSource(*source) for source in meta["sources"])
    trained = arrays.get(TRAINED)
    return TokenStore(arrays[TOKENS], arrays[OFFSETS], arrays[LINES], sources, trained, meta["key"], directory)


def _mapped(directory: Path, name: str, dtype: np.dtype, count: int) -> np.ndarray:
    path, size = directory / name, count * dtype.itemsize
    found = path.stat().st_size if path.is_file() else None
    if found != size:
        raise ValueError(
            f"The token cache {directory} is damaged: {name} holds {found} bytes, {size} expected. Remove the"
            " directory: the next run builds it again."
        )
    # np.memmap refuses an empty file; an empty corpus is refused by what reads it.
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,)) if count else np.zeros(0, dtype)
