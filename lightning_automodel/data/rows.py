"""Rows of exactly ``seq_len`` tokens cut from a token store, made when read: a rank holds its rows, not the corpus.

Every row is a dict of ``input_ids`` and ``labels`` (aligned with the ids, as Hugging Face's: the model shifts
them; -100 where no loss is wanted), and ``position_ids`` when documents share a row, or ``attention_mask`` when a
row holds one document and padding. Position ids restart at every document, so attention keeps the documents of a
row apart (transformers masks by them: its own attention functions on any device, FlashAttention's variable-length
path on GPUs; context parallel by its own split), and each document's first token is no target: the token before it
belongs to another document.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_automodel.data.store import TokenStore

IGNORE_INDEX = -100
Segment = tuple[int, int, bool]  # where in the store, how many tokens, whether a document starts there


Piece = tuple[np.ndarray, np.ndarray | None, bool]  # token ids, which are trained (None: all), a document's start?


def make_row(pieces: list[Piece], *, seq_len: int, pad_id: int, positions: bool) -> dict[str, torch.Tensor]:
    """The row of ``pieces`` end to end, padded: with position ids restarting at each piece if ``positions``, else
    with an attention mask."""
    ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros(seq_len, dtype=np.int64)
    at = 0
    for stored, trained, document_start in pieces:
        tokens, count = stored.astype(np.int64), len(stored)
        ids[at : at + count] = tokens
        labels[at : at + count] = np.where(trained == 1, tokens, IGNORE_INDEX) if trained is not None else tokens
        if positions and document_start:
            labels[at] = IGNORE_INDEX
        position_ids[at : at + count] = np.arange(count)
        at += count
    position_ids[at:] = np.arange(seq_len - at)  # padding: a document of its own, with no target
    row = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
    if positions:
        row["position_ids"] = torch.from_numpy(position_ids)
    else:
        row["attention_mask"] = torch.from_numpy((np.arange(seq_len) < at).astype(np.int64))
    return row


def packed_row_starts(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Where each row starts among records of ``lengths`` (each at most ``seq_len``) when as many consecutive ones
    as fit share a row; the last entry is the count of records."""
    starts, filled = [0], 0
    for index, length in enumerate(lengths.tolist()):
        if filled + length > seq_len:
            starts.append(index)
            filled = 0
        filled += length
    starts.append(len(lengths))
    return np.array(starts if len(lengths) else [0], dtype=np.int64)


class _Rows(Dataset):
    def __init__(self, store: TokenStore, seq_len: int, pad_id: int) -> None:
        self.store = store
        self.seq_len = seq_len
        self.pad_id = pad_id

    def _row(self, segments: list[Segment], *, positions: bool) -> dict[str, torch.Tensor]:
        trained = self.store.trained
        pieces = [
            (
                self.store.tokens[start : start + count],
                trained[start : start + count] if trained is not None else None,
                document_start,
            )
            for start, count, document_start in segments
        ]
        return make_row(pieces, seq_len=self.seq_len, pad_id=self.pad_id, positions=positions)


class PackedRows(_Rows):
    """Pre-training rows: the ``chosen`` documents (None: all) end to end, cut every ``seq_len`` tokens; a document
    continues in the next row where it is cut, and only the last row has padding. ``separate``: position ids
    restart at each document; otherwise attention crosses from one document into the next (and rows carry neither
    position ids nor a mask: the padding trails, where causal attention keeps it from every real token)."""

    def __init__(
        self, store: TokenStore, seq_len: int, pad_id: int, *, chosen: np.ndarray | None, separate: bool
    ) -> None:
        super().__init__(store, seq_len, pad_id)
        self.chosen = chosen
        self.separate = separate
        # Where each chosen document starts in their concatenation: the store's own offsets when all are chosen.
        self.starts = store.offsets if chosen is None else np.concatenate([[0], np.cumsum(store.lengths[chosen])])

    def __len__(self) -> int:
        return math.ceil(int(self.starts[-1]) / self.seq_len)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        begin = index * self.seq_len
        segments = list(self._segments(begin, min(begin + self.seq_len, int(self.starts[-1]))))
        row = self._row(segments, positions=self.separate)
        row.pop("attention_mask", None)
        return row

    def _segments(self, begin: int, end: int) -> Iterator[Segment]:
        document = int(np.searchsorted(self.starts, begin, side="right")) - 1
        while begin < end:
            start = int(self.starts[document])
            stored = start if self.chosen is None else int(self.store.offsets[self.chosen[document]])
            count = min(end, int(self.starts[document + 1])) - begin
            yield stored + begin - start, count, begin == start
            begin += count
            document += 1


class PaddedRows(_Rows):
    """Pre-training rows of one document each, with an attention mask. A longer document is split, not truncated, so
    no text is thrown away: into chunks of ``seq_len`` that overlap by one token, because a row's first token is
    never a prediction target; so every token but a document's first is a target exactly once."""

    def __init__(self, store: TokenStore, seq_len: int, pad_id: int, *, chosen: np.ndarray | None) -> None:
        super().__init__(store, seq_len, pad_id)
        documents = np.arange(store.documents) if chosen is None else chosen
        chunks = np.maximum(-(-(store.lengths[documents] - 1) // (seq_len - 1)), 1)
        self.documents = np.repeat(documents, chunks)
        self.chunk_starts = (np.arange(chunks.sum()) - np.repeat(np.cumsum(chunks) - chunks, chunks)) * (seq_len - 1)

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        document, chunk_start = int(self.documents[index]), int(self.chunk_starts[index])
        start, end = (int(offset) for offset in self.store.offsets[document : document + 2])
        count = min(self.seq_len, end - start - chunk_start)
        return self._row([(start + chunk_start, count, chunk_start == 0)], positions=False)


class ConversationRows(_Rows):
    """Fine-tuning rows: whole conversations (or prompt/completion pairs), never split across rows. ``pack``: as
    many consecutive ones in a row as fit, position ids restarting at each; else one a row, with an attention mask.

    Truncation: a conversation longer than ``seq_len`` keeps its first ``seq_len`` tokens (the rest of its answers
    is not trained on); one whose prompt alone takes ``seq_len`` tokens, with no answer token left, is an error
    naming its file and line.
    """

    def __init__(self, store: TokenStore, seq_len: int, pad_id: int, *, chosen: np.ndarray | None, pack: bool) -> None:
        super().__init__(store, seq_len, pad_id)
        documents = np.arange(store.documents) if chosen is None else chosen
        prompts = store.first_targets(documents)
        if (too_long := np.flatnonzero(prompts >= seq_len)).size:
            document = int(documents[too_long[0]])
            raise ValueError(
                f"{store.where(document)}: the prompt alone takes {int(prompts[too_long[0]])} tokens, seq_len={seq_len}"
                f" leaves none of the answer to train on ({too_long.size} such records). Raise seq_len, or shorten"
                " or leave out these records."
            )
        self.pack = pack
        self.documents = documents
        self.kept = np.minimum(store.lengths[documents], seq_len)
        self.truncated = int((store.lengths[documents] > seq_len).sum())
        self.row_starts = packed_row_starts(self.kept, seq_len) if pack else np.arange(len(documents) + 1)

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        first, last = int(self.row_starts[index]), int(self.row_starts[index + 1])
        segments = [(int(self.store.offsets[self.documents[i]]), int(self.kept[i]), True) for i in range(first, last)]
        return self._row(segments, positions=self.pack)
