"""Latent shards (safetensors and Parquet) written, read back lazily, refused with errors that name the file, and
batched for DiffusionModule."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from safetensors.torch import save_file
from torch.utils.data import default_collate

from lightning_automodel.data.latents import LatentDataModule, LatentShards, write_latent_shard
from lightning_automodel.diffusion import DiffusionModule
from lightning_automodel.testing.denoisers import latent_samples, tiny_denoiser

SIZES = (3, 1, 20)  # the last Parquet shard spans two row groups (16 rows each)


def _stacked(rows: int, seed: int, latents: tuple[int, ...] = (4, 2, 4, 4)) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "latents": torch.randn(rows, *latents, generator=generator).to(torch.bfloat16),
        "text_embeddings": torch.randn(rows, 3, 8, generator=generator),
        "text_mask": torch.rand(rows, 3, generator=generator) > 0.5,
    }


def _write(directory: Path, suffix: str, sizes: tuple[int, ...] = SIZES) -> list[dict[str, torch.Tensor]]:
    """Shards ``shard-0``, ``shard-1``, ... of ``sizes`` samples; every sample, in the data set's order."""
    directory.mkdir(exist_ok=True)
    samples = []
    for number, rows in enumerate(sizes):
        stacked = _stacked(rows, seed=number)
        write_latent_shard(directory / f"shard-{number}{suffix}", stacked, rows_per_group=16)
        samples += [{key: value[row] for key, value in stacked.items()} for row in range(rows)]
    return samples


@pytest.mark.parametrize("suffix", [".safetensors", ".parquet"])
def test_shards_read_back_every_sample_with_its_index(tmp_path, suffix):
    samples = _write(tmp_path, suffix)
    data = LatentShards(tmp_path)
    assert len(data) == sum(SIZES)
    for index in (0, 2, 3, 4, 19, 20, 23):  # the first and last of every shard, and both row groups
        read = data[index]
        assert read.keys() == samples[index].keys() | {"index"}
        assert read["index"].item() == index
        for key, value in samples[index].items():
            assert read[key].dtype == value.dtype and torch.equal(read[key], value), (index, key)


def test_a_list_of_files_of_both_formats_in_its_order(tmp_path):
    parquet = _write(tmp_path / "p", ".parquet", sizes=(2,))
    safetensors = _write(tmp_path / "s", ".safetensors", sizes=(3,))
    data = LatentShards([tmp_path / "s" / "shard-0.safetensors", tmp_path / "p"])
    assert [data[i]["index"].item() for i in range(5)] == list(range(5))
    assert torch.equal(data[3]["latents"], parquet[0]["latents"])
    assert torch.equal(data[0]["text_embeddings"], safetensors[0]["text_embeddings"])


def _refusal(tmp_path: Path, case: str) -> Path:
    """Shards that break one rule; returns the file the error is to name."""
    if case == "empty directory":
        return tmp_path
    if case == "unreadable":
        (tmp_path / "a.safetensors").write_bytes(b"not a safetensors file")
        return tmp_path / "a.safetensors"
    if case == "sample counts":
        save_file({"latents": torch.zeros(3, 4), "text_embeddings": torch.zeros(2, 3, 8)}, tmp_path / "a.safetensors")
        return tmp_path / "a.safetensors"
    _write(tmp_path, ".parquet", sizes=(2,))
    stacked = _stacked(3, seed=5, latents=(4, 2, 4, 6) if case == "shape" else (4, 2, 4, 4))
    if case == "missing key":
        del stacked["text_mask"]
    if case == "dtype":
        stacked["text_embeddings"] = stacked["text_embeddings"].half()
    write_latent_shard(tmp_path / "shard-1.safetensors", stacked)
    return tmp_path / "shard-1.safetensors"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("empty directory", "holds no latent shard"),
        ("unreadable", "cannot be read as a safetensors shard"),
        ("sample counts", "'latents': 3, 'text_embeddings': 2"),
        ("missing key", "have no 'text_mask'"),
        ("dtype", "'text_embeddings' are torch.float16"),
        ("shape", "sample 0: its 'latents' is (4, 2, 4, 6)"),
    ],
)
def test_bad_shards_are_refused_naming_the_file(tmp_path, case, message):
    path = _refusal(tmp_path, case)
    with pytest.raises(ValueError, match="set batch_size=1" if case == "shape" else None) as error:
        LatentShards(tmp_path)
    assert str(path) in str(error.value) and message in str(error.value), str(error.value)


def test_samples_of_several_sizes_are_read_one_a_batch(tmp_path):
    _refusal(tmp_path, "shape")
    data = LatentDataModule(tmp_path, batch_size=1, shuffle=False)
    data.setup("fit")
    shapes = [tuple(batch["latents"].shape) for batch in data.train_dataloader()]
    assert shapes == [(1, 4, 2, 4, 4)] * 2 + [(1, 4, 2, 4, 6)] * 3


def test_a_loader_batch_trains_diffusion_module(tmp_path):
    """A batch of a Parquet and a safetensors shard fits Wan's DiffusionModule, alone and in a Trainer's fit."""
    rows = latent_samples("wan", rows=4)
    write_latent_shard(tmp_path / "a.parquet", _without_index(rows[:2]))
    write_latent_shard(tmp_path / "b.safetensors", _without_index(rows[2:]))
    data = LatentDataModule(tmp_path, batch_size=4, seed=3)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert sorted(batch["index"].tolist()) == [0, 1, 2, 3]
    module = DiffusionModule(tiny_denoiser("wan"))
    loss = module._loss(batch, 0)
    loss.backward()
    assert torch.isfinite(loss)
    fit = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False)
    fit.fit(module, LatentDataModule(tmp_path, val=tmp_path, batch_size=2))  # Lightning's own loaders' path
    assert fit.global_step == 2 and torch.isfinite(fit.callback_metrics["val_loss"])


def _without_index(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in default_collate(rows).items() if key != "index"}


def test_data_parallel_ranks_share_an_epoch_and_resume_it(tmp_path):
    """Two data-parallel ranks read disjoint halves of the seeded order; a loader restored from a state saved
    after a batch reads on as the first would have."""
    _write(tmp_path, ".safetensors", sizes=(4, 4))
    read = []
    for rank in (0, 1):
        data = LatentDataModule(tmp_path, batch_size=2, seed=7)
        data.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": rank})
        data.setup("fit")
        read.append([batch["index"].tolist() for batch in data.train_dataloader()])
    assert sorted(sum(read[0] + read[1], [])) == list(range(8))
    loader = data.train_dataloader()
    batches = iter(loader)
    next(batches)
    resumed = data.train_dataloader()
    resumed.load_state_dict(loader.state_dict())
    assert [batch["index"].tolist() for batch in resumed] == read[1][1:]
