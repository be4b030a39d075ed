"""Lightning's own tests of ModelParallelStrategy (2.6), run against AutoModelParallelStrategy in gloo workers.

Ported from Lightning's tests/tests_pytorch/strategies/test_model_parallel_integration.py, where they need 2 to 4
GPUs: a LightningModule written for the parent, which parallelizes itself in configure_model through
``self.device_mesh["data_parallel"]`` and ``["tensor_parallel"]``, must run unchanged under the subclass. The
strategy is built with the parent's argument names and defaults (``parent_strategy``); where the subclass differs
on purpose, the check says so.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler
from torchmetrics.classification import Accuracy

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.testing.harness import shared_directory


def parent_strategy(**kwargs) -> AutoModelParallelStrategy:
    """The subclass configured as ``ModelParallelStrategy(**kwargs)`` would be: the parent's names and defaults
    (tensor parallel over a node's devices, data parallel over the nodes)."""
    kwargs = {"data_parallel_size": "auto", "tensor_parallel_size": "auto", **kwargs}
    return AutoModelParallelStrategy(**kwargs)


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(32, 64)
        self.w2 = nn.Linear(32, 64)
        self.w3 = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


def parallelize_tp(model: FeedForward, device_mesh) -> None:
    plan = {"w1": ColwiseParallel(), "w2": ColwiseParallel(), "w3": RowwiseParallel()}
    parallelize_module(model, device_mesh["tensor_parallel"], plan)


def parallelize_fsdp2_tp(model: FeedForward, device_mesh) -> None:
    parallelize_tp(model, device_mesh)
    dp_mesh = device_mesh["data_parallel"]
    assert dp_mesh.ndim == 1
    for layer in (model.w1, model.w2, model.w3):
        fully_shard(layer, mesh=dp_mesh)


class TemplateModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = FeedForward()

    def training_step(self, batch):
        return self.model(batch).sum()

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 8), batch_size=2)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters())


class TensorParallelModel(TemplateModel):
    def configure_model(self) -> None:
        parallelize_tp(self.model, self.device_mesh)


class FSDP2TensorParallelModel(TemplateModel):
    def configure_model(self) -> None:
        parallelize_fsdp2_tp(self.model, self.device_mesh)


def _trainer(strategy: AutoModelParallelStrategy | str, **kwargs) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=2,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return L.Trainer(strategy=strategy, **{**options, **kwargs})


class MeshModel(FSDP2TensorParallelModel):
    """Records the parent's two mesh names as the strategy built them, when ``configure_model`` reads them."""

    def configure_model(self) -> None:
        mesh = self.device_mesh
        assert mesh.device_type == self.device.type
        self.built = {
            "sizes": (mesh["data_parallel"].size(), mesh["tensor_parallel"].size()),
            "shape": tuple(mesh["data_parallel", "tensor_parallel"].shape),
        }
        super().configure_model()


def check_setup_device_mesh() -> dict:
    """The parent's mesh names and sizes as the strategy built them, for every (data_parallel_size,
    tensor_parallel_size) that tiles the world and for "auto"/"auto" (the parent's defaults: tensor parallel over the
    node). The mesh has our five axes and the flattened ones beside the parent's two names, so ``mesh_dim_names`` and
    ``ndim`` differ from the parent's."""
    world = dist.get_world_size()
    built = {}
    for dp, tp in [(dp, world // dp) for dp in (1, 2, 4) if world % dp == 0] + [("auto", "auto")]:
        model = MeshModel()
        _trainer(parent_strategy(data_parallel_size=dp, tensor_parallel_size=tp), max_steps=1).fit(model)
        built[(dp, tp)] = model.built
    return built


def check_tensor_parallel() -> None:
    """A module that tensor-parallelizes itself through ``device_mesh["tensor_parallel"]``, built on the meta device
    by ``trainer.init_module``: its weights are DTensors on that mesh, every tp rank reads the same batch, and a
    metric without parameters is moved to the device."""

    class Model(TensorParallelModel):
        def __init__(self) -> None:
            super().__init__()
            self.metric = Accuracy("multiclass", num_classes=10)

        def on_train_start(self) -> None:
            mesh = self.device_mesh["tensor_parallel"]
            assert all(p.device_mesh == mesh for p in self.optimizers().param_groups[0]["params"])
            assert all(isinstance(p, DTensor) for p in self.model.parameters())
            loader = self.trainer.train_dataloader
            assert len(loader) == 8 // loader.batch_size  # no data sharding across the tp group
            assert isinstance(loader.sampler, DistributedSampler)

        def training_step(self, batch):
            batches = self.all_gather(batch)
            assert all(torch.equal(batches[0], other) for other in batches[1:])
            assert self.metric.device.type == self.metric.tp.device.type == self.device.type
            self.metric(torch.rand(2, 10), torch.randint(0, 10, size=(2,)))
            return super().training_step(batch)

    run = _trainer(parent_strategy())
    L.seed_everything(0)
    with run.init_module(empty_init=True):
        model = Model()
    assert model.model.w1.weight.is_meta
    run.fit(model)


def check_fsdp2_tensor_parallel() -> None:
    """FSDP2 over "data_parallel" and tensor parallel over "tensor_parallel" (2 x 2): 2D DTensors, batches equal
    across the tp group and different across the dp group."""

    class Model(FSDP2TensorParallelModel):
        def on_train_start(self) -> None:
            params = self.optimizers().param_groups[0]["params"]
            assert all(isinstance(p, DTensor) and p.device_mesh.ndim == 2 for p in params)
            assert self.model.w1.weight.device_mesh.shape == (2, 2)
            assert not any(p.is_meta for p in self.model.parameters())
            loader = self.trainer.train_dataloader
            assert len(loader) == 8 // loader.batch_size // self.device_mesh["data_parallel"].size()

        def training_step(self, batch):
            batches = self.all_gather(batch)
            tp_batches = batches[self.device_mesh["tensor_parallel"].mesh]
            dp_batches = batches[self.device_mesh["data_parallel"].mesh]
            assert all(torch.equal(tp_batches[0], other) for other in tp_batches[1:])
            assert not any(torch.equal(dp_batches[0], other) for other in dp_batches[1:])
            return super().training_step(batch)

    run = _trainer(parent_strategy(data_parallel_size=2, tensor_parallel_size=2))
    L.seed_everything(0)
    with run.init_module(empty_init=True):
        model = Model()
    run.fit(model)


class DtypeModel(FSDP2TensorParallelModel):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype_expected = dtype

    def on_train_start(self) -> None:
        assert (self.model.w1.weight.device.type, self.model.w1.weight.dtype) == ("cpu", self.dtype_expected)
        assert self.optimizers(use_pl_optimizer=False).param_groups[0]["params"][0].device.type == "cpu"


def check_module_init_context() -> None:
    """Under ``trainer.init_module`` the module is built in the precision's dtype, on the CPU or (empty_init) the
    meta device, and lives on the device in that dtype once set up."""
    for precision, dtype in (("32-true", torch.float32), ("bf16-true", torch.bfloat16)):
        for empty_init, device in ((False, "cpu"), (True, "meta")):
            run = _trainer(parent_strategy(), precision=precision, max_steps=1, barebones=True)
            with run.init_module(empty_init=empty_init):
                model = DtypeModel(dtype)
            assert (model.model.w1.weight.device.type, model.model.w1.weight.dtype) == (device, dtype)
            run.fit(model)


def check_strategy_state_dict() -> None:
    """``lightning_module_state_dict`` has the unwrapped module's keys: on every rank for sharded checkpoints, on
    rank 0 alone (the others empty) for single-file ones."""
    for distributed in (True, False):
        model = FSDP2TensorParallelModel()
        keys = list(model.state_dict())
        run = _trainer(parent_strategy(save_distributed_checkpoint=distributed), max_epochs=1, max_steps=-1)
        run.fit(model)
        state = run.strategy.lightning_module_state_dict()
        assert list(state) == (keys if distributed or run.global_rank == 0 else [])


def check_full_checkpoint_into_ddp() -> None:
    """A single-file checkpoint of the sharded model loads into a plain model under DDP, weights and optimizer
    state exactly; and a DDP checkpoint loads into the sharded model."""
    directory = shared_directory()
    path = directory / "sharded.ckpt"
    model = FSDP2TensorParallelModel()
    run = _trainer(parent_strategy(save_distributed_checkpoint=False), max_epochs=1, max_steps=-1)
    run.fit(model)
    run.save_checkpoint(path)
    weights, optimizer = run.strategy.lightning_module_state_dict(), run.strategy.optimizer_state(model.optimizers())
    if run.global_rank != 0:
        assert not weights and not optimizer

    ddp = _trainer("ddp", max_epochs=1, max_steps=-1)
    plain = TemplateModel()
    ddp.fit(plain, ckpt_path=path)
    _assert_equal_on_rank_zero(
        (weights, optimizer),
        (ddp.strategy.lightning_module_state_dict(), ddp.strategy.optimizer_state(plain.optimizers())),
    )

    ddp_path = directory / "ddp.ckpt"
    ddp.save_checkpoint(ddp_path)
    weights, optimizer = ddp.strategy.lightning_module_state_dict(), ddp.strategy.optimizer_state(plain.optimizers())
    model = FSDP2TensorParallelModel()
    run = _trainer(parent_strategy(save_distributed_checkpoint=False), max_epochs=1, max_steps=-1)
    run.fit(model, ckpt_path=ddp_path)
    restored = run.strategy.lightning_module_state_dict(), run.strategy.optimizer_state(model.optimizers())
    if run.global_rank != 0:
        assert not restored[0] and not restored[1]
    _assert_equal_on_rank_zero((weights, optimizer), restored)


def _assert_equal_on_rank_zero(expected, actual) -> None:
    if dist.get_rank() == 0:
        torch.testing.assert_close(expected, actual, atol=0, rtol=0)
    dist.barrier()


def check_save_load_sharded_state_dict() -> None:
    """A sharded checkpoint holds meta.pt, .metadata and one shard per rank; resuming from it restores every
    weight exactly."""
    directory = shared_directory()

    class Model(FSDP2TensorParallelModel):
        def __init__(self, expected=None) -> None:
            super().__init__()
            self.expected = expected

        def on_train_start(self) -> None:
            for before, now in zip(self.expected or [], self.trainer.model.parameters(), strict=False):
                assert torch.equal(before, now.full_tensor())

    options = dict(max_epochs=1, max_steps=-1, enable_checkpointing=True, default_root_dir=directory)
    L.seed_everything(0)
    run = _trainer(parent_strategy(), **options)
    run.fit(Model())
    before = [p.full_tensor() for p in run.model.parameters()]
    path = Path(run.strategy.broadcast(run.checkpoint_callback.best_model_path))
    assert set(os.listdir(path)) == {"meta.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"}
    metadata = torch.load(path / "meta.pt", weights_only=True)
    assert "pytorch-lightning_version" in metadata and len(metadata["callbacks"]) == 1
    assert "state_dict" not in metadata and "optimizer_states" not in metadata
    _trainer(parent_strategy(), **{**options, "max_epochs": 2}).fit(Model(before), ckpt_path=path)


def check_saves_keep_user_files() -> dict[str, str]:
    """A save replaces a previous checkpoint at its path and nothing else. A directory holding other files, or a
    file that is not a checkpoint, is refused on every rank and left byte for byte, with nothing written beside it.
    (The parent writes a sharded checkpoint among a folder's files, and deletes a sharded checkpoint's folder,
    whatever else it holds, for a single-file save.)"""
    directory = shared_directory()
    model = FSDP2TensorParallelModel()
    run = _trainer(parent_strategy(), max_steps=1)
    run.fit(model)
    user_folder, user_file = directory / "experiment", directory / "notes.txt"
    checkpoint = directory / "sharded"
    if dist.get_rank() == 0:
        user_folder.mkdir()
        (user_folder / "notes.txt").write_text("mine")
        user_file.write_text("mine")
    dist.barrier()
    errors = {}
    for name, path in (("folder", user_folder), ("file", user_file)):
        with pytest.raises(FileExistsError) as error:
            run.save_checkpoint(path)
        errors[name] = str(error.value)
    run.save_checkpoint(checkpoint)
    run.save_checkpoint(checkpoint)  # a previous checkpoint is replaced
    if dist.get_rank() == 0:
        (checkpoint / "notes.txt").write_text("mine")
    dist.barrier()
    run.strategy._save_distributed_checkpoint = False  # a single-file save to a sharded checkpoint's folder
    with pytest.raises(FileExistsError) as error:
        run.save_checkpoint(checkpoint)
    errors["single-file over a folder with notes"] = str(error.value)
    assert (user_folder / "notes.txt").read_text() == (user_file.read_text()) == "mine"
    assert (checkpoint / "notes.txt").read_text() == "mine" and (checkpoint / "meta.pt").is_file()
    assert sorted(os.listdir(directory)) == ["experiment", "notes.txt", "sharded"]  # no staging left behind
    assert os.listdir(user_folder) == ["notes.txt"]
    single = directory / "single.ckpt"
    run.save_checkpoint(single)
    run.save_checkpoint(single)  # a previous single-file checkpoint is replaced
    run.strategy._save_distributed_checkpoint = True
    run.save_checkpoint(single)  # ... also by a sharded one
    assert (single / "meta.pt").is_file()
    return errors


def check_reduce_before_setup_and_boring_model() -> None:
    """``reduce`` before setup reduces over the world, as the parent's does (there is no mesh yet). A BoringModel,
    which neither holds a Hugging Face model nor parallelizes itself, is refused on every rank: the parent would
    train a separate, unsynchronised copy on each."""
    strategy = parent_strategy()
    mean = strategy.reduce(torch.tensor(float(dist.get_rank())))
    assert mean.item() == (dist.get_world_size() - 1) / 2
    with pytest.raises(TypeError, match="found no Hugging Face model"):
        _trainer(strategy).fit(BoringModel())
