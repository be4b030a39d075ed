"""Weighted mixtures of training sources: ``train_files`` as ``[{"path": ..., "weight": 0.7}, ...]``.

Which source each row of the training order comes from is a seeded, stratified schedule: the j-th draw of source
``s`` (weight ``w``, the weights summing to 1) falls at time ``(j + U) / w``, ``U`` uniform in [0, 1) from a
generator seeded by (seed, s, block of j), and rows follow the draws in time order. Source ``s`` then has ``floor(t
w)`` or one more draws before any time ``t``, so every prefix of ``n`` rows holds ``w n`` of its rows within
``1 + w (k - 2)`` rows for ``k`` sources (under 1 for two, under 2 for three), while the interleaving is random. A
row's source is a pure function of the seed and its position, computed for any range of positions without the
rows before it: a resumed stream continues the schedule where it stood.

The cached order (:class:`~lightning_automodel.data.sampler.MixtureShuffle`) and the streamed one
(:class:`MixedStream`) deal the same schedule round-robin over the data-parallel ranks, so a global batch is mixed
as the weights say whatever the data-parallel size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset, IterableDataset

from lightning_automodel.data.sources.hf_datasets import is_dataset_object
from lightning_automodel.data.streaming.stream import ENDLESS, StreamedRows, gather_states, rank_state

STOPPING_STRATEGIES = ("all_exhausted", "first_exhausted")
BLOCK = 4096  # a source's draws whose offsets one generator makes
CHUNK = 1 << 20  # positions of the schedule computed at a time (about 30 MB of temporary arrays)
STREAM_CHUNK = 256  # rows a rank's stream schedules at a time
_SCHEDULE, _PERMUTATION = 0, 1  # what a generator is for: the first word of its seed


@dataclass(frozen=True)
class Source:
    """One source of a mixture: paths or glob patterns, and its share of the rows (normalized: the weights sum to 1)."""

    path: Any  # a path or glob pattern, a datasets object, or a list of them
    weight: float


def parse_sources(files: Any) -> list[Source] | None:
    """``train_files`` as a mixture's sources, or None where it names paths (not a mixture)."""
    entries = list(files) if isinstance(files, list | tuple) else [files]
    weighted = [_weighted(entry) for entry in entries]
    if not any(weighted):
        return None
    if not all(weighted):
        raise ValueError(
            f"train_files mixes weighted sources and plain paths ({files!r}): give every entry as"
            ' {"path": ..., "weight": ...}, or none (all files then read as one source).'
        )
    sources = [_source(entry, index) for index, entry in enumerate(entries)]
    if len(sources) < 2:
        raise ValueError(
            f"train_files is a mixture of one source ({files!r}): a weight needs another source to weigh against."
            " Give the source's path(s) as train_files, or add sources."
        )
    total = sum(source.weight for source in sources)
    return [Source(source.path, source.weight / total) for source in sources]


def _source(entry: dict, index: int) -> Source:
    where = f"train_files[{index}] ({entry!r})"
    if set(entry) != {"path", "weight"}:
        found = ", ".join(sorted(entry)) or "no key"
        raise ValueError(
            f'{where}: a source is {{"path": ..., "weight": ...}} (found {found}). Name both, and only them.'
        )
    path, weight = entry["path"], entry["weight"]
    if not (_readable(path) or (isinstance(path, list) and path and all(map(_readable, path)))):
        raise ValueError(
            f"{where}: path must be a path or glob pattern (a datasets object in Python), or a non-empty list of them."
        )
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"{where}: weight must be a positive number (the weights are normalized to sum to 1).")
    return Source(path, float(weight))


def _weighted(entry: Any) -> bool:
    """A weighted source's dict (a DatasetDict is a dict too)."""
    return isinstance(entry, dict) and not is_dataset_object(entry)


def _readable(path: Any) -> bool:
    return isinstance(path, str) or is_dataset_object(path)


def refuse_weights(files: Any, argument: str) -> None:
    """Refuse weighted sources in ``argument`` (val_files, test_files): evaluation reads every row, unweighted."""
    if isinstance(files, list | tuple) and any(map(_weighted, files)):
        raise ValueError(
            f"{argument} takes paths or glob patterns, not weighted sources: weights mix the training rows, and"
            f" evaluation reads every row. List the paths of {argument}."
        )


def schedule(weights: Sequence[float], *, seed: int, start: int, stop: int) -> np.ndarray:
    """The source of each row at positions ``[start, stop)`` of the schedule (see the module's docstring).

    Row ``p``'s draw falls within ``k`` of time ``p`` (``k`` sources): the draws between times ``start - k - 1``
    and ``stop + k + 1`` hold the range's, and a source's draws of lower index, all earlier, count the positions
    before them."""
    count = len(weights)
    low, high = max(start - count - 1, 0), stop + count + 1
    firsts = [math.floor(low * weight) for weight in weights]
    lasts = [math.ceil(high * weight) + 1 for weight in weights]
    times = np.concatenate([_times(weights, s, seed=seed, first=firsts[s], stop=lasts[s]) for s in range(count)])
    sources = np.repeat(np.arange(count, dtype=np.min_scalar_type(count - 1)), np.subtract(lasts, firsts))
    before = start - sum(firsts)
    return sources[np.argsort(times, kind="stable")][before : before + stop - start]  # ties: the lower source first


def _times(weights: Sequence[float], source: int, *, seed: int, first: int, stop: int) -> np.ndarray:
    """The times of the draws ``[first, stop)`` of ``source``."""
    blocks = range(first // BLOCK, (stop - 1) // BLOCK + 1)
    offsets = np.concatenate([_generator(_SCHEDULE, seed, source, block).random(BLOCK) for block in blocks])
    skip = first - blocks.start * BLOCK
    return (np.arange(first, stop, dtype=np.float64) + offsets[skip : skip + stop - first]) / weights[source]


def _generator(*words: int) -> np.random.Generator:
    return np.random.default_rng([word % 2**64 for word in words])  # a seed may be negative


def epoch_length(weights: Sequence[float], sizes: Sequence[int], *, seed: int, stopping_strategy: str) -> int:
    """The rows of a mixture's epoch over sources of ``sizes`` rows: up to the first draw past a source's rows
    (``first_exhausted``: no row repeats), or through the last source's last row (``all_exhausted``: every row
    at least once, a source that runs out starting over). A draw ``j`` of weight ``w`` is at a position under
    ``(j + 1) / w + k``: the schedule up to that bound holds the epoch's end."""
    first = stopping_strategy == "first_exhausted"
    bound = (min if first else max)((size + 1) / weight for size, weight in zip(sizes, weights, strict=True))
    sources = source_schedule(weights, seed=seed, stop=math.ceil(bound) + len(sizes) + 1)
    positions = [np.flatnonzero(sources == source) for source in range(len(sizes))]
    if first:
        return min(int(at[size]) for at, size in zip(positions, sizes, strict=True) if len(at) > size)
    return max(int(at[size - 1]) for at, size in zip(positions, sizes, strict=True)) + 1


def source_schedule(weights: Sequence[float], *, seed: int, stop: int) -> np.ndarray:
    """The source of each row at positions ``[0, stop)``, a byte a row (up to 256 sources), computed a chunk at a
    time."""
    chunks = range(0, stop, CHUNK)
    return np.concatenate([schedule(weights, seed=seed, start=at, stop=min(at + CHUNK, stop)) for at in chunks])


def source_rows(size: int, count: int, *, seed: int, epoch: int, source: int) -> np.ndarray:
    """The first ``count`` rows of ``source`` (``size`` rows) in an epoch: its own seeded permutations, a new one a
    pass."""
    passes = max(math.ceil(count / size), 1)
    permutations = [_generator(_PERMUTATION, seed, epoch, source, n).permutation(size) for n in range(passes)]
    return np.concatenate(permutations)[:count]


class MixedRows(ConcatDataset):
    """A cached mixture's rows: its sources' rows one after another, with the sources' (normalized) weights."""

    def __init__(self, parts: list[Dataset], weights: list[float]) -> None:
        super().__init__(parts)
        self.weights = weights


class MixedStream(IterableDataset):
    """A streamed mixture: this rank's rows of the schedule (positions ``rank``, ``rank + dp``, ...), each the next row
    of the source's own endless stream (one that runs out starts over). Its state is the rows this rank yielded and
    each source's stream's, gathered from every data-parallel rank in one collective."""

    def __init__(
        self, streams: list[StreamedRows], weights: list[float], *, seed: int, num_replicas: int = 1, rank: int = 0
    ) -> None:
        self.streams = streams
        self.weights = weights
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.rows = 0  # rows this rank yielded

    def __len__(self) -> int:
        return ENDLESS  # sized for the reason StreamedRows is

    def state_dict(self) -> dict[str, Any]:
        own = {"rows": self.rows, "sources": [stream.own_state() for stream in self.streams]}
        return gather_states(own, rank=self.rank, num_replicas=self.num_replicas)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = rank_state(state, rank=self.rank, num_replicas=self.num_replicas)
        if len(own["sources"]) != len(self.streams):
            raise ValueError(
                f"The streamed mixture was saved with {len(own['sources'])} sources and resumes with"
                f" {len(self.streams)}: each source's place in its files would be lost. Resume with the same sources."
            )
        self.rows = own["rows"]
        for stream, source_state in zip(self.streams, own["sources"], strict=True):
            stream.load_own_state(source_state)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        sources = [iter(stream) for stream in self.streams]
        while True:
            first, dp = self.rows * self.num_replicas + self.rank, self.num_replicas
            for source in schedule(self.weights, seed=self.seed, start=first, stop=first + STREAM_CHUNK * dp)[::dp]:
                row = next(sources[source])
                self.rows += 1
                yield row
