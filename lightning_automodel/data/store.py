"""Tokenized documents end to end in one flat array, with their offsets: in memory, or memory-mapped from a cache.

Reading a row is slicing the array, so a rank's resident memory is the rows it holds, not the corpus: the pages of
a memory-mapped file are the operating system's page cache, shared by every rank of a machine and dropped under
pressure. The offsets take 8 bytes a document; a fine-tuning store keeps a byte a token for the mask of those
trained on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lightning_automodel.data.encoding import Encoded
from lightning_automodel.data.sources.expand import position_word

TOKENS, OFFSETS, LINES, TRAINED, META = "tokens.bin", "offsets.bin", "lines.bin", "trained.bin", "meta.json"
STORE_FILES = (TOKENS, OFFSETS, LINES, TRAINED, META)


@dataclass(frozen=True)
class TokenStore:
    """``tokens[offsets[i]:offsets[i + 1]]`` is document ``i``, from line ``lines[i]`` of its source (``sources``:
    each source's name and documents, in order); ``trained`` (None: all) marks the tokens with a label."""

    tokens: np.ndarray
    offsets: np.ndarray
    lines: np.ndarray
    sources: tuple[tuple[str, int], ...]
    trained: np.ndarray | None = None

    @property
    def documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def where(self, document: int) -> str:
        """The file and line (a table's row) document ``document`` comes from."""
        ends = np.cumsum([count for _, count in self.sources])
        source = int(np.searchsorted(ends, document, side="right"))
        name = self.sources[source][0]
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


def memory_store(encoded: Iterable[Encoded], *, vocabulary: int, fine_tuning: bool) -> TokenStore:
    batches = list(encoded)

    def joined(field: str, dtype: type) -> np.ndarray:
        return np.concatenate([np.zeros(0, dtype), *(getattr(batch, field) for batch in batches)])

    offsets = np.concatenate([[0], np.cumsum(joined("lengths", np.int64))]).astype(np.int64)
    trained = joined("trained", np.uint8) if fine_tuning else None
    tokens = _narrowed(joined("tokens", np.int64), token_dtype(vocabulary), "the documents")
    counts: dict[str, int] = {}
    for batch in batches:
        counts[batch.source] = counts.get(batch.source, 0) + len(batch.lengths)
    return TokenStore(tokens, offsets, joined("lines", np.int64), tuple(counts.items()), trained)


def write_store(directory: Path, encoded: Iterable[Encoded], *, vocabulary: int, fine_tuning: bool, key: dict) -> None:
    """Append every batch to the store's files in ``directory``; ``meta.json`` (the key, the counts, the sources)
    last, so that a store without it is incomplete."""
    dtype, tokens, sources = token_dtype(vocabulary), 0, {}
    with ExitStack() as files:
        ids, offsets, lines = (files.enter_context(open(directory / name, "wb")) for name in (TOKENS, OFFSETS, LINES))
        trained = files.enter_context(open(directory / TRAINED, "wb")) if fine_tuning else None
        offsets.write(np.zeros(1, np.int64).tobytes())
        for batch in encoded:
            ids.write(_narrowed(batch.tokens, dtype, batch.source).tobytes())
            offsets.write((tokens + np.cumsum(batch.lengths)).astype(np.int64).tobytes())
            lines.write(batch.lines.astype(np.int64).tobytes())
            if trained is not None:
                trained.write(batch.trained.tobytes())
            tokens += int(batch.lengths.sum())
            sources[batch.source] = sources.get(batch.source, 0) + len(batch.lengths)
    meta = {"key": key, "dtype": dtype.name, "tokens": tokens, "documents": sum(sources.values())}
    meta |= {"fine_tuning": fine_tuning, "sources": list(sources.items())}
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
    sources = tuple((path, count) for path, count in meta["sources"])
    return TokenStore(arrays[TOKENS], arrays[OFFSETS], arrays[LINES], sources, arrays.get(TRAINED))


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
