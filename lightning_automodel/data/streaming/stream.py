"""An endless stream of pre-training rows, read and tokenized as training goes, that resumes exactly.

Each data-parallel rank reads its units (:mod:`.shares`), one after the other, in the sources' order or, with
``shuffle``, in an order drawn anew each pass from (seed, rank, pass); it lays the documents end to end, through a
shuffle buffer when one is asked for (:mod:`.buffer`), and cuts rows as the cached rows are cut. The stream has no
end: after its last unit it starts over, so every rank takes the same number of steps whatever its share, and a run
ends at ``max_steps``. Its state (each rank's pass, the unit and position it reads next, the buffer's places, the
tokens not yet in a row) is saved in checkpoints by the StatefulDataLoader, so a resumed run reads the very rows it
would have read.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from lightning_automodel.data.encoding import DocumentEncoder, Encoded, PieceBatch
from lightning_automodel.data.rows import make_row
from lightning_automodel.data.sources.expand import Source, source_name
from lightning_automodel.data.streaming.buffer import Place, ShuffleBuffer
from lightning_automodel.data.streaming.shares import Unit, shares, unit_pieces

BATCH_DOCUMENTS = 16  # documents a rank tokenizes at a time
ENDLESS = 2**62  # the rows a stream claims: sized, so that Lightning fetches no batch ahead of the one it trains on


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
    ``separate``: position ids restart at each document. ``units``: this rank's share, if already computed."""

    def __init__(
        self,
        files: list[Source],
        encoder: DocumentEncoder,
        *,
        seq_len: int,
        pad_id: int,
        separate: bool,
        num_replicas: int = 1,
        rank: int = 0,
        units: list[Unit] | None = None,
        shuffle: bool = False,
        shuffle_buffer: int = 0,
        seed: int = 0,
    ) -> None:
        self.sources = files
        self.encoder = encoder
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.separate = separate
        self.num_replicas = num_replicas
        self.rank = rank
        self.units = shares(files, num_replicas)[rank] if units is None else units
        self.shuffle = shuffle
        self.seed = seed
        self.buffer = ShuffleBuffer(shuffle_buffer, seed=seed, rank=rank) if shuffle_buffer else None
        self.passes = 0  # complete passes over the units
        self.unit, self.offset = 0, None  # the next unit in this pass's order, and where in it (None: at its start)
        # Documents read and not yet all in rows: the tokens left, the document's place, the tokens of it in rows.
        self.pending: list[tuple[np.ndarray, Place, int]] = []

    def __len__(self) -> int:
        """Endless, but sized: Lightning fetches an unsized loader's next batch before training on the current one,
        and the state it saves with a checkpoint would then be one batch ahead of the training."""
        return ENDLESS

    def order(self, passes: int) -> list[Unit]:
        """This rank's units in the order pass ``passes`` reads them."""
        if not self.shuffle:
            return self.units
        permutation = np.random.default_rng([self.seed, self.rank, passes]).permutation(len(self.units))
        return [self.units[index] for index in permutation.tolist()]

    def own_state(self) -> dict[str, Any]:
        """This rank's place in its share: a mixture gathers its sources' together, in one collective."""
        pending = [[*place, cut] for _, place, cut in self.pending]
        state = {"passes": self.passes, "unit": self.unit, "offset": self.offset, "pending": pending}
        state["shuffle"] = {"order": self.shuffle, "buffer": self.buffer.size if self.buffer is not None else 0}
        state["buffer"] = self.buffer.state_dict() if self.buffer is not None else None
        return state

    def load_own_state(self, state: dict[str, Any]) -> None:
        self._check_shuffle(state)
        self.passes, self.unit, self.offset = state["passes"], state["unit"], state["offset"]
        self.pending = [
            (self._read_again((source, at))[cut:], (source, at), cut) for source, at, cut in state["pending"]
        ]
        if self.buffer is not None:
            places = state["buffer"]["places"]
            self.buffer.load_state_dict(state["buffer"], [self._read_again(tuple(place)) for place in places])

    def state_dict(self) -> dict[str, Any]:
        """Every data-parallel rank's state, gathered from all ranks: Lightning saves rank 0's loader state alone,
        and a rank's place in its share is its own. Called on every rank when Lightning saves a checkpoint."""
        return gather_states(self.own_state(), rank=self.rank, num_replicas=self.num_replicas)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_own_state(rank_state(state, rank=self.rank, num_replicas=self.num_replicas))

    def _check_shuffle(self, state: dict[str, Any]) -> None:
        saved = state.get("shuffle", {"order": False, "buffer": 0})
        now = {"order": self.shuffle, "buffer": self.buffer.size if self.buffer is not None else 0}
        if saved != now:
            raise ValueError(
                f"The streamed data was saved with shuffle={saved['order']}, shuffle_buffer={saved['buffer']} and"
                f" resumes with shuffle={now['order']}, shuffle_buffer={now['buffer']}: the rows would differ. Resume"
                " with the settings it was saved with."
            )

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            for documents, resume in self._document_batches():
                self.unit, self.offset = resume
                for tokens, place in documents:
                    drawn = self.buffer.put(tokens, place) if self.buffer is not None else (tokens, place)
                    if drawn is not None:
                        self.pending.append((*drawn, 0))
                while sum(len(tokens) for tokens, _, _ in self.pending) >= self.seq_len:
                    yield self._cut_row()
            self.passes, self.unit, self.offset = self.passes + 1, 0, None

    def _document_batches(self) -> Iterator[tuple[list[tuple[np.ndarray, Place]], tuple[int, int | None]]]:
        """Batches of this rank's documents from where the stream stands, with their places, each with where the
        next one is read."""
        order = self.order(self.passes)
        for index in range(self.unit, len(order)):
            unit = order[index]
            start = self.offset if index == self.unit and self.offset is not None else unit.start
            pieces, kind, position = unit_pieces(self.sources[unit.source], self.encoder, start=start, end=unit.end)
            name = source_name(self.sources[unit.source])
            batch = list(islice(pieces, BATCH_DOCUMENTS))
            while batch:
                following = next(pieces, None)
                resume = (index, following[0]) if following is not None else (index + 1, None)
                encoded = self.encoder(PieceBatch(name, kind, batch, position))
                yield _documents(encoded, unit.source), resume
                batch = [following, *islice(pieces, BATCH_DOCUMENTS - 1)] if following is not None else []

    def _read_again(self, place: Place) -> np.ndarray:
        """The tokens of the document at ``place``, read and tokenized again (a resumed stream's)."""
        source, position = place
        pieces, kind, word = unit_pieces(self.sources[source], self.encoder, start=position, end=position + 1)
        encoded = self.encoder(PieceBatch(source_name(self.sources[source]), kind, list(islice(pieces, 1)), word))
        return _compact(encoded.tokens)

    def _cut_row(self) -> dict[str, torch.Tensor]:
        """A row from the start of the pending tokens; a document cut continues, as a piece of its own, in the next."""
        row, filled = [], 0
        while filled < self.seq_len:
            tokens, place, cut = self.pending.pop(0)
            take = min(len(tokens), self.seq_len - filled)
            row.append((tokens[:take], None, cut == 0))
            if take < len(tokens):
                self.pending.insert(0, (tokens[take:], place, cut + take))
            filled += take
        made = make_row(row, seq_len=self.seq_len, pad_id=self.pad_id, positions=self.separate)
        made.pop("attention_mask", None)  # a stream's rows are full: none has padding
        return made


def _documents(encoded: Encoded, source: int) -> list[tuple[np.ndarray, Place]]:
    if not len(encoded.lengths):
        return []
    documents = np.split(encoded.tokens, np.cumsum(encoded.lengths)[:-1])
    places = [(source, int(line)) for line in encoded.lines.tolist()]
    return [(_compact(tokens), place) for tokens, place in zip(documents, places, strict=True)]


def _compact(tokens: np.ndarray) -> np.ndarray:
    """A copy of a document's ``tokens`` in the smallest unsigned type that holds their ids (2 bytes a token for
    vocabularies up to 65,536, not the encoder's 8), apart from the batch it was tokenized in: a stream holds
    documents until they are in rows, a shuffle buffer 1,000 of them drawn at random from many batches."""
    return tokens.astype(np.min_scalar_type(int(tokens.max()))) if len(tokens) else tokens
