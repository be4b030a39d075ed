"""Pre-training rows read and tokenized as training goes, for corpora too large for the local disk (a network
filesystem) or to tokenize ahead: nothing is cached, and a rank holds the rows it is about to train on.

Each data-parallel rank reads its share of every file, the documents that start in its 1/dp of the file's bytes
(it seeks there; the pieces are the cache's: JSONL lines, a text file's paragraphs), lays them end to end and cuts
rows as the cached rows are cut. The stream has no end: after the last file it starts over, so every rank takes the
same number of steps whatever its share, and a run ends at ``max_steps``. Its state (each rank's pass, the file and
byte it reads next, the tokens not yet in a row) is saved in checkpoints by the StatefulDataLoader, so a resumed run
reads the very rows it would have read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from itertools import islice
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from lightning_automodel.data.encoding import DocumentEncoder, PieceBatch
from lightning_automodel.data.files import is_jsonl, pieces_in_range
from lightning_automodel.data.rows import Piece, make_row

BATCH_DOCUMENTS = 16  # documents a rank tokenizes at a time
ENDLESS = 2**62  # the rows a stream claims: sized, so that Lightning fetches no batch ahead of the one it trains on


def byte_range(path: str, *, rank: int, num_replicas: int) -> tuple[int, int]:
    """The bytes of ``path`` whose documents data-parallel rank ``rank`` reads."""
    size = os.path.getsize(path)
    return size * rank // num_replicas, size * (rank + 1) // num_replicas


def check_enough_documents(files: list[str], encoder: DocumentEncoder, num_replicas: int) -> None:
    """Refuse a corpus in which a data-parallel rank's share holds no document, on every rank alike before any
    collective (that rank could make no row: it would stop while the others wait for it)."""
    for rank in range(num_replicas):
        if not any(_has_document(path, encoder, rank=rank, num_replicas=num_replicas) for path in files):
            raise ValueError(
                f"Data-parallel rank {rank} of {num_replicas} gets no document of {files!r}: each rank streams the"
                f" documents that start in its 1/{num_replicas} of every file's bytes, and these files are too small"
                " for that many. Add documents, or use fewer data-parallel ranks."
            )


def _has_document(path: str, encoder: DocumentEncoder, *, rank: int, num_replicas: int) -> bool:
    start, end = byte_range(path, rank=rank, num_replicas=num_replicas)
    pieces = pieces_in_range(path, start=start, end=end)
    return any(encoder.documents(PieceBatch(path, is_jsonl(path), [piece], position="byte")) for piece in pieces)


def gather_states(own: Any, *, rank: int, num_replicas: int) -> dict[str, Any]:
    """Every data-parallel rank's ``own`` state, gathered on every rank (tensor-parallel peers send the same)."""
    gathered: list[Any] = [(rank, own)]
    if num_replicas > 1 and dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (rank, own))
    by_rank = dict(gathered)
    return {"num_replicas": num_replicas, "ranks": [by_rank.get(index) for index in range(num_replicas)]}


def rank_state(state: dict[str, Any], *, rank: int, num_replicas: int) -> Any:
    """This rank's own state in what :func:`gather_states` gathered, at the same data-parallel size only."""
    if state["num_replicas"] != num_replicas:
        raise ValueError(
            f"The streamed data was saved at {state['num_replicas']} data-parallel ranks and resumes at"
            f" {num_replicas}: each rank's share of the stream would differ. Resume at the same size, or use"
            " the token cache (streaming=False), which resumes at any size."
        )
    return state["ranks"][rank]


class StreamedRows(IterableDataset):
    """This rank's endless stream of rows of ``seq_len`` tokens from ``files`` (see the module's docstring);
    ``separate``: position ids restart at each document."""

    def __init__(
        self,
        files: list[str],
        encoder: DocumentEncoder,
        *,
        seq_len: int,
        pad_id: int,
        separate: bool,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        self.files = files
        self.encoder = encoder
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.separate = separate
        self.num_replicas = num_replicas
        self.rank = rank
        self.passes = 0  # complete passes over the files
        self.file, self.offset = 0, None  # where the next document is read (None: at the start of the rank's share)
        self.pending: list[Piece] = []  # tokens tokenized and not yet in a row

    def __len__(self) -> int:
        """Endless, but sized: Lightning fetches an unsized loader's next batch before training on the current one,
        and the state it saves with a checkpoint would then be one batch ahead of the training."""
        return ENDLESS

    def state_dict(self) -> dict[str, Any]:
        """Every data-parallel rank's state, gathered from all ranks: Lightning saves rank 0's loader state alone,
        and a rank's place in its share is its own. Called on every rank when Lightning saves a checkpoint."""
        return gather_states(self.own_state(), rank=self.rank, num_replicas=self.num_replicas)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_own_state(rank_state(state, rank=self.rank, num_replicas=self.num_replicas))

    def own_state(self) -> dict[str, Any]:
        """This rank's place in its share: a mixture gathers its sources' together, in one collective."""
        pending = [(tokens.tolist(), document_start) for tokens, _, document_start in self.pending]
        return {"passes": self.passes, "file": self.file, "offset": self.offset, "pending": pending}

    def load_own_state(self, own: dict[str, Any]) -> None:
        self.passes, self.file, self.offset = own["passes"], own["file"], own["offset"]
        self.pending = [(np.array(tokens, dtype=np.int64), None, start) for tokens, start in own["pending"]]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            for batch, resume in self._batches():
                encoded = self.encoder(batch)
                self.file, self.offset = resume
                ends = np.cumsum(encoded.lengths)[:-1]
                self.pending += [(document, None, True) for document in np.split(encoded.tokens, ends) if len(document)]
                while sum(len(pending) for pending, _, _ in self.pending) >= self.seq_len:
                    yield self._cut_row()
            self.passes, self.file, self.offset = self.passes + 1, 0, None

    def _batches(self) -> Iterator[tuple[PieceBatch, tuple[int, int | None]]]:
        """Batches of this rank's documents from where the stream stands, each with where the next one is read."""
        for index in range(self.file, len(self.files)):
            path = self.files[index]
            start, end = byte_range(path, rank=self.rank, num_replicas=self.num_replicas)
            if index == self.file and self.offset is not None:
                start = self.offset
            pieces = pieces_in_range(path, start=start, end=end)
            batch = list(islice(pieces, BATCH_DOCUMENTS))
            while batch:
                following = next(pieces, None)
                resume = (index, following[0]) if following is not None else (index + 1, None)
                yield PieceBatch(path, is_jsonl(path), batch, position="byte"), resume
                batch = [following, *islice(pieces, BATCH_DOCUMENTS - 1)] if following is not None else []

    def _cut_row(self) -> dict[str, torch.Tensor]:
        """A row from the start of the pending tokens; a document cut continues, as a piece of its own, in the next."""
        row, filled = [], 0
        while filled < self.seq_len:
            tokens, trained, document_start = self.pending.pop(0)
            take = min(len(tokens), self.seq_len - filled)
            row.append((tokens[:take], trained, document_start))
            if take < len(tokens):
                self.pending.insert(0, (tokens[take:], trained, False))
            filled += take
        made = make_row(row, seq_len=self.seq_len, pad_id=self.pad_id, positions=self.separate)
        made.pop("attention_mask", None)  # a stream's rows are full: none has padding
        return made
