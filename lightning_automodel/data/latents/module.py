"""``LatentDataModule``: precomputed latent shards served to ``DiffusionModule``, in a resumable seeded order."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import Sampler

from lightning_automodel.data.latents.dataset import LatentShards
from lightning_automodel.data.loaders import QuietStatefulDataLoader, data_parallel_place
from lightning_automodel.data.sampler import ResumableShuffle

Files = str | Path | Sequence[str | Path]


class LatentDataModule(L.LightningDataModule):
    """Batches of precomputed samples (see :mod:`lightning_automodel.data.latents.shards` for the shard formats).

    ``train``, ``val``: directories of shards (read in sorted order) or shard files; validate, test and predict read
    ``val``. ``batch_size`` counts samples per data-parallel rank per step; several need one shape a tensor (1 reads
    samples of any size). ``shuffle``: the training samples in an order drawn from ``seed`` and the epoch, dealt
    over the data-parallel ranks (tensor-parallel peers read the same samples) and resumed exactly from a
    checkpoint, as the text modules' are.
    """

    def __init__(
        self,
        train: Files,
        val: Files | None = None,
        batch_size: int = 1,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: it must be at least 1.")
        self.files = {"train": train, "val": val}
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.seed = seed
        self.datasets: dict[str, LatentShards] = {}

    def setup(self, stage: str) -> None:
        """Every rank reads the shards' headers itself, so a bad shard is refused on each, before any collective."""
        splits = ("train", "val") if TrainerFn(stage) == TrainerFn.FITTING else ("val",)
        for split in splits:
            if split not in self.datasets and self.files[split] is not None:
                self.datasets[split] = LatentShards(self.files[split], uniform=self.batch_size > 1)
        if TrainerFn(stage) != TrainerFn.FITTING and "val" not in self.datasets:
            raise ValueError(f"Nothing to {TrainerFn(stage).value}: set val to the shards to read.")

    def train_dataloader(self) -> QuietStatefulDataLoader:
        rows = self.datasets["train"]
        sampler = ResumableShuffle(rows, self.seed, shuffle=self.shuffle, **data_parallel_place(self.trainer))
        return self._loader(rows, sampler=sampler)

    def val_dataloader(self) -> QuietStatefulDataLoader | list:
        rows = self.datasets.get("val")
        return self._loader(rows) if rows is not None else []  # an empty list makes Lightning skip validation

    def test_dataloader(self) -> QuietStatefulDataLoader:
        return self._loader(self.datasets["val"])

    def predict_dataloader(self) -> QuietStatefulDataLoader:
        return self._loader(self.datasets["val"])

    def _loader(self, rows: LatentShards, sampler: Sampler | None = None) -> QuietStatefulDataLoader:
        # Without a sampler, Lightning puts in a DistributedSampler with the strategy's data-parallel place.
        return QuietStatefulDataLoader(rows, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers)
