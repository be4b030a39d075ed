"""Pre-training rows read and tokenized as training goes, for corpora too large for the local disk (a network
filesystem) or to tokenize ahead: nothing is cached, and a rank holds the rows it is about to train on.

Each data-parallel rank takes every ``num_replicas``-th document of the files in order (it reads every line, and
parses and tokenizes its own only), lays its documents end to end and cuts rows as the cached rows are cut. The
stream has no end: after the last file it starts over, so every rank takes the same number of steps whatever its
share, and a run ends at ``max_steps``. Its state (the pass, the documents read, the tokens not yet in a row) is
saved in checkpoints by the StatefulDataLoader, so a resumed run reads the very rows it would have read.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from lightning_automodel.data.encoding import DocumentEncoder, PieceBatch
from lightning_automodel.data.files import file_pieces, is_jsonl
from lightning_automodel.data.rows import Piece, make_row

BATCH_DOCUMENTS = 16  # documents a rank tokenizes at a time
ENDLESS = 2**62  # the rows a stream claims: sized, so that Lightning fetches no batch ahead of the one it trains on


def check_enough_documents(files: list[str], encoder: DocumentEncoder, num_replicas: int) -> None:
    """Refuse a corpus with fewer documents than data-parallel ranks, on every rank alike before any collective
    (a rank without a document could make no row: it would stop while the others wait for it)."""
    found = 0
    for path in files:
        for piece in file_pieces(path):
            found += len(encoder.documents(PieceBatch(path, is_jsonl(path), [piece])))
            if found >= num_replicas:
                return
    raise ValueError(
        f"{files!r} hold {found} documents, fewer than the {num_replicas} data-parallel ranks that each stream a share"
        " of them. Add documents, or use fewer data-parallel ranks."
    )


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
        self.documents_read = 0  # documents of all ranks read in this pass, up to the last of this rank's tokenized
        self.pending: list[Piece] = []  # tokens tokenized and not yet in a row

    def __len__(self) -> int:
        """Endless, but sized: Lightning fetches an unsized loader's next batch before training on the current one,
        and the state it saves with a checkpoint would then be one batch ahead of the training."""
        return ENDLESS

    def state_dict(self) -> dict[str, Any]:
        pending = [(tokens.tolist(), document_start) for tokens, _, document_start in self.pending]
        return {"passes": self.passes, "documents_read": self.documents_read, "pending": pending} | {
            "num_replicas": self.num_replicas
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_replicas"] != self.num_replicas:
            raise ValueError(
                f"The streamed data was saved at {state['num_replicas']} data-parallel ranks and resumes at"
                f" {self.num_replicas}: each rank's share of the stream would differ. Resume at the same size, or use"
                " the token cache (streaming=False), which resumes at any size."
            )
        self.passes, self.documents_read = state["passes"], state["documents_read"]
        self.pending = [(np.array(tokens, dtype=np.int64), None, start) for tokens, start in state["pending"]]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            tokens, whole_pass = 0, self.documents_read == 0
            for batch, read in self._batches():
                encoded = self.encoder(batch)
                if len(encoded.lengths):
                    ends = np.cumsum(encoded.lengths)[:-1]
                    self.pending += [(document, None, True) for document in np.split(encoded.tokens, ends)]
                    tokens += len(encoded.tokens)
                self.documents_read = read
                while sum(len(pending) for pending, _, _ in self.pending) >= self.seq_len:
                    yield self._cut_row()
            if tokens == 0 and whole_pass:
                raise ValueError(
                    f"Data-parallel rank {self.rank} of {self.num_replicas} gets no document of {self.files!r}: the"
                    " corpus has fewer documents than ranks. Add documents, or use fewer data-parallel ranks."
                )
            self.passes, self.documents_read = self.passes + 1, 0

    def _batches(self) -> Iterator[tuple[PieceBatch, int]]:
        """Batches of this rank's documents from where the stream stands, each with the documents of all ranks
        read once it is."""
        index, skip = 0, self.documents_read
        for path in self.files:
            pieces = ((number, piece) for number, piece in file_pieces(path))
            while chunk := list(islice(pieces, BATCH_DOCUMENTS * self.num_replicas)):
                start, index = index, index + len(chunk)
                if index <= skip:
                    continue
                mine = [
                    piece for i, piece in enumerate(chunk, start) if i % self.num_replicas == self.rank and i >= skip
                ]
                yield PieceBatch(path, is_jsonl(path), mine), index

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
