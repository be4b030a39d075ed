"""The training order: a seeded shuffle (or a mixture's) dealt over the data-parallel ranks that a checkpoint resumes
exactly."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from lightning_automodel.data.mixture import MixedRows, epoch_length, source_rows, source_schedule


class ResumableShuffle(DistributedSampler):
    """This rank's share of a shuffle that is a pure function of (seed, epoch), and that resumes exactly.

    The order is DistributedSampler's: a seeded permutation, padded by repeating its start to a multiple of the
    data-parallel size and dealt out round-robin. Being a DistributedSampler, Lightning keeps it on several
    processes instead of swapping in its own, which does not save its epoch. Lightning calls ``set_epoch`` before
    each epoch, but on resume it builds the loader's iterator before that call, so the iterator saves its own epoch
    and position and the StatefulDataLoader restores them.
    """

    def __init__(
        self, data_source: Dataset, seed: int, num_replicas: int = 1, rank: int = 0, shuffle: bool = True
    ) -> None:
        super().__init__(data_source, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)

    def __iter__(self) -> _ShuffleIterator:
        return _ShuffleIterator(self, self.epoch)

    def order(self, epoch: int) -> torch.Tensor:
        """The indices this rank reads in ``epoch`` (a tensor: 8 bytes a row, where a list would take 36)."""
        permutation = self.epoch_order(epoch)
        padded = permutation.repeat(math.ceil(self.total_size / len(permutation)))
        return padded[self.rank : self.total_size : self.num_replicas].clone()

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Every rank's indices of ``epoch`` together, before they are dealt."""
        if not self.shuffle:
            return torch.arange(len(self.dataset))
        return torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + epoch))


class MixtureShuffle(ResumableShuffle):
    """This rank's share of a mixture's epoch (:mod:`lightning_automodel.data.mixture`), resumed as
    ``ResumableShuffle`` is: the schedule names each row's source, and a source's rows come in a seeded permutation
    of their own, a new one each epoch and each pass over the source. The schedule is the same every epoch, so an
    epoch's length is too (Lightning counts an epoch's batches once); its rows are not."""

    def __init__(
        self, data_source: MixedRows, seed: int, *, stopping_strategy: str, num_replicas: int = 1, rank: int = 0
    ) -> None:
        super().__init__(data_source, seed, num_replicas=num_replicas, rank=rank)
        self.sizes = [len(part) for part in data_source.datasets]
        self.offsets = [0, *data_source.cumulative_sizes[:-1]]  # where each source's rows start
        self.weights = data_source.weights
        self.length = epoch_length(self.weights, self.sizes, seed=seed, stopping_strategy=stopping_strategy)
        self.num_samples = math.ceil(self.length / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def epoch_order(self, epoch: int) -> torch.Tensor:
        sources = source_schedule(self.weights, seed=self.seed, stop=self.length)
        order = np.empty(self.length, dtype=np.int64)
        for source, (size, offset) in enumerate(zip(self.sizes, self.offsets, strict=True)):
            at = np.flatnonzero(sources == source)
            order[at] = offset + source_rows(size, len(at), seed=self.seed, epoch=epoch, source=source)
        return torch.from_numpy(order)


class _ShuffleIterator(Iterator[int]):
    """One epoch of ``ResumableShuffle``; torchdata's Stateful protocol (state_dict/load_state_dict) saves it.

    The position is saved as the rows all data-parallel ranks have read together, so that a resume at another
    data-parallel size continues at the same place in the epoch's permutation (exactly, when it divides that count).
    A state saved after an epoch's last row restores the start of the next epoch: resuming from it, Lightning reads
    the next epoch from the restored iterator (an exhausted one would make that epoch empty and skip its rows).
    """

    def __init__(self, sampler: ResumableShuffle, epoch: int) -> None:
        self.sampler = sampler
        self._start(epoch, yielded=0)

    def _start(self, epoch: int, yielded: int) -> None:
        self.epoch = epoch
        self.yielded = yielded
        self.order = self.sampler.order(epoch)

    def __next__(self) -> int:
        if self.yielded == len(self.order):
            raise StopIteration
        self.yielded += 1
        return int(self.order[self.yielded - 1])

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "rows_read": self.yielded * self.sampler.num_replicas}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        epoch, yielded = state_dict["epoch"], state_dict["rows_read"] // self.sampler.num_replicas
        self._start(epoch, yielded)
        if yielded >= len(self.order):
            self._start(epoch + 1, yielded=0)
