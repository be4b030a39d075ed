"""A map-style data set over latent shards: the samples of its files end to end, each numbered by its place."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_automodel.data.latents.keys import INDEX, REQUIRED
from lightning_automodel.data.latents.shards import SUFFIXES, Shard, open_shard


class LatentShards(Dataset):
    """The samples of ``files`` (directories of ``.safetensors`` and ``.parquet`` shards, read in sorted order, or
    shard files, in the given order), each a dict of its tensors (dtypes kept) and its ``index`` in the set.

    Every file's header is read here, its tensors not: a shard without a key of the first, a dtype or (``uniform``,
    for batches of several samples) a sample's shape that differs from the first sample's is refused now, naming
    the file, the sample and the key, not when a loader meets it.
    """

    def __init__(self, files: str | Path | Sequence[str | Path], *, uniform: bool = True) -> None:
        self.shards = [open_shard(path) for path in shard_files(files)]
        self.offsets = np.cumsum([0] + [shard.rows for shard in self.shards]).tolist()
        if not len(self):
            raise ValueError(f"{', '.join(str(shard.path) for shard in self.shards)}: the shards hold no sample.")
        check_keys(self.shards)
        if uniform:
            check_shapes(self.shards)

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of a latent data set of {len(self)}")
        at = bisect.bisect_right(self.offsets, index) - 1
        sample = self.shards[at].read(index - self.offsets[at])
        sample[INDEX] = torch.tensor(index)
        return sample


def shard_files(files: str | Path | Sequence[str | Path]) -> list[Path]:
    """The shard files of ``files``: a directory's in sorted order (their names decide every sample's index)."""
    found = []
    for path in map(Path, [files] if isinstance(files, str | Path) else files):
        if path.is_dir():
            inside = sorted(file for file in path.iterdir() if file.suffix in SUFFIXES)
            if not inside:
                raise ValueError(f"{path} holds no latent shard ({' or '.join(SUFFIXES)} files).")
            found += inside
        elif path.is_file():
            found.append(path)
        else:
            raise FileNotFoundError(f"{path}: no such latent shard or directory.")
    if not found:
        raise ValueError("No latent shards given: name a directory of shards or shard files.")
    return found


def check_keys(shards: list[Shard]) -> None:
    """Every shard holds the first's tensors, with its dtypes, and the keys DiffusionModule needs of any model."""
    first = shards[0]
    if missing := [key for key in REQUIRED if key not in first.dtypes]:
        raise ValueError(f"{first.path}: its samples have no {missing} (they have {first.keys}).")
    if INDEX in first.dtypes:
        raise ValueError(f"{first.path}: it stores {INDEX!r}; the data set numbers its samples itself. Drop it.")
    for shard in shards[1:]:
        for key in set(first.keys) ^ set(shard.keys):
            which = f"have no {key!r}" if key in first.dtypes else f"have a {key!r} that {first.path}'s have not"
            raise ValueError(f"{shard.path}: its samples {which}; every shard holds the same tensors.")
        for key, dtype in first.dtypes.items():
            if shard.dtypes[key] != dtype:
                raise ValueError(
                    f"{shard.path}: its samples' {key!r} are {shard.dtypes[key]}, {first.path}'s {dtype}: a data set"
                    " keeps one dtype a tensor."
                )


def check_shapes(shards: list[Shard]) -> None:
    """Every sample's tensors have the first sample's shapes: a batch stacks them."""
    first = next(shard for shard in shards if shard.rows)
    for key in first.keys:
        expected = first.shapes(key)[0]
        for shard in shards:
            shapes = shard.shapes(key)
            if (row := next((row for row, shape in enumerate(shapes) if shape != expected), None)) is not None:
                raise ValueError(
                    f"{shard.path}, sample {row}: its {key!r} is {shapes[row]}, the first sample's ({first.path},"
                    f" sample 0) {expected}. Batches of several samples stack one shape: write samples of one size"
                    " (bucketed into data sets of their own), or set batch_size=1."
                )
