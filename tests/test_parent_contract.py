"""The parent's contract: Lightning's ModelParallelStrategy tests (2.6) that make sense for a subclass, run against
AutoModelParallelStrategy; its argument names; saves that never delete what they did not write."""

from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch
from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.environments import LightningEnvironment
from parent_checks import (
    check_fsdp2_tensor_parallel,
    check_full_checkpoint_into_ddp,
    check_module_init_context,
    check_reduce_before_setup_and_boring_model,
    check_save_load_sharded_state_dict,
    check_saves_keep_user_files,
    check_setup_device_mesh,
    check_strategy_state_dict,
    check_tensor_parallel,
)

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.io.hf_export import export_hf
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.models import tiny_model


def test_parent_tests_on_two_ranks():
    results = run_checks(
        2,
        [
            check_setup_device_mesh,
            check_tensor_parallel,
            check_module_init_context,
            check_strategy_state_dict,
            check_full_checkpoint_into_ddp,
            check_save_load_sharded_state_dict,
            check_saves_keep_user_files,
            check_reduce_before_setup_and_boring_model,
        ],
    )
    assert_meshes_built(results, {(1, 2): (1, 2), (2, 1): (2, 1), ("auto", "auto"): (1, 2)})
    for errors in results["check_saves_keep_user_files()"]:
        assert "experiment" in errors["folder"] and "(notes.txt)" in errors["folder"], errors
        assert "Choose another path" in errors["file"], errors
        assert "(notes.txt)" in errors["single-file over a folder with notes"], errors


def test_parent_tests_on_four_ranks():
    results = run_checks(4, [check_setup_device_mesh, check_fsdp2_tensor_parallel])
    assert_meshes_built(results, {(1, 4): (1, 4), (2, 2): (2, 2), (4, 1): (4, 1), ("auto", "auto"): (1, 4)})


def assert_meshes_built(results: dict, expected: dict) -> None:
    """Every rank's strategy built the parent's (data_parallel, tensor_parallel) sizes each layout asks for ("auto":
    tensor parallel over the node)."""
    for built in results["check_setup_device_mesh()"]:
        assert {layout: mesh["sizes"] for layout, mesh in built.items()} == expected, built
        assert all(mesh["shape"] == mesh["sizes"] for mesh in built.values()), built


def test_device_mesh_access_before_setup():
    with pytest.raises(RuntimeError, match="Accessing the device mesh .* not allowed"):
        _ = AutoModelParallelStrategy().device_mesh


def _set_up(strategy: AutoModelParallelStrategy, *, num_nodes: int, devices: int) -> None:
    """``setup_environment`` on a fake cluster of ``num_nodes x devices`` processes, without a process group."""
    strategy._setup_distributed = mock.Mock()
    strategy._accelerator = mock.Mock()
    strategy.cluster_environment = mock.Mock(
        world_size=mock.Mock(return_value=num_nodes * devices), local_rank=mock.Mock(return_value=0)
    )
    strategy.parallel_devices = [torch.device("cpu")] * devices
    strategy.num_nodes = num_nodes
    strategy._lightning_module = mock.Mock()
    with mock.patch("lightning_automodel.parallel.mesh.ParallelDims.build_mesh"):
        strategy.setup_environment()


@pytest.mark.parametrize(
    ("num_nodes", "devices", "dp", "tp"), [(1, 4, 1, 1), (1, 4, 2, 3), (1, 4, 4, 2), (2, 4, 1, 4), (2, 4, 2, 1)]
)
def test_sizes_that_do_not_tile_the_world_are_refused(num_nodes, devices, dp, tp):
    strategy = AutoModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
    with pytest.raises(ValueError, match=f"needs pp\\*dp_replicate\\*dp_shard\\*cp\\*tp = {dp * tp} processes"):
        _set_up(strategy, num_nodes=num_nodes, devices=devices)


@pytest.mark.parametrize(
    ("kwargs", "dp_shard", "tp"),
    [
        (dict(data_parallel_size=2, tensor_parallel_size=4), 2, 4),
        (dict(tensor_parallel_size="auto"), 2, 4),  # the parent's "auto": a node's devices
        (dict(data_parallel_size="auto", tensor_parallel_size="auto"), 2, 4),
        (dict(data_parallel_size=8), 8, 1),
        (dict(tp=4, tensor_parallel_size=4), 2, 4),  # both names, one value
        (dict(tp=1, tensor_parallel_size=2), 4, 2),  # tp=1 is the default: print_config writes it
    ],
)
def test_parent_argument_names(kwargs, dp_shard, tp):
    strategy = AutoModelParallelStrategy(**kwargs)
    _set_up(strategy, num_nodes=2, devices=4)
    assert (strategy.options.dims.dp_shard, strategy.options.dims.tp) == (dp_shard, tp)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: AutoModelParallelStrategy(tp=2, tensor_parallel_size=4),
            ValueError,
            "tp=2 and tensor_parallel_size=4 disagree",
        ),
        (
            lambda: AutoModelParallelStrategy(dp_shard=2, data_parallel_size=4),
            ValueError,
            "dp_shard=2 and data_parallel_size=4",
        ),
        (lambda: AutoModelParallelStrategy(2, 2), TypeError, "positional argument"),
        (lambda: AutoModelParallelStrategy(tp=2, sp=2), TypeError, "sp=2: sp is a flag, True or False"),
        (lambda: AutoModelParallelStrategy(tp="2"), ValueError, "tp='2' is invalid"),
        (lambda: AutoModelParallelStrategy(tp="auto"), ValueError, "tp='auto' is invalid"),
        (lambda: AutoModelParallelStrategy(activation_checkpointing="fulll"), ValueError, '"selective" or "submodule"'),
        (lambda: AutoModelParallelStrategy(cpu_offload="yes"), TypeError, "cpu_offload is a flag"),
        (
            lambda: AutoModelParallelStrategy(pp=2, save_distributed_checkpoint=False),
            ValueError,
            "under pipeline parallel holds its own stages only",
        ),
        (
            lambda: AutoModelParallelStrategy(layout="auto", gpu_memory=80, save_distributed_checkpoint=False),
            ValueError,
            "or give pp=1",
        ),
    ],
)
def test_bad_arguments_are_refused_at_construction(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_sequence_parallel_needs_more_than_one_device_per_node_for_auto_tp():
    strategy = AutoModelParallelStrategy(tensor_parallel_size="auto", sp=True)
    with pytest.raises(ValueError, match="it needs tp > 1"):
        _set_up(strategy, num_nodes=2, devices=1)


def test_fsdp1_modules_are_refused():
    from torch.distributed.fsdp import FullyShardedDataParallel

    class Model(LightningModule):
        def configure_model(self):
            pass

    model = Model()
    model.modules = mock.Mock(return_value=[mock.Mock(spec=FullyShardedDataParallel)])
    strategy = AutoModelParallelStrategy()
    strategy.model = model
    strategy._lightning_module = model
    strategy._accelerator = mock.Mock()
    with pytest.raises(TypeError, match="FSDP1.*set dp_shard / dp_replicate on the strategy"):
        strategy.setup(mock.Mock())


def test_save_checkpoint_storage_options(tmp_path):
    with pytest.raises(TypeError, match=r"save_checkpoint\(..., storage_options=...\)` is not supported"):
        AutoModelParallelStrategy().save_checkpoint(checkpoint={}, filepath=tmp_path / "x", storage_options=mock.Mock())
    assert list(tmp_path.iterdir()) == []


def test_load_unknown_checkpoint_type(tmp_path):
    strategy = AutoModelParallelStrategy()
    strategy.model = mock.Mock()
    strategy._lightning_module = mock.Mock(strict_loading=True)
    path = tmp_path / "empty_dir"
    path.mkdir()
    with mock.patch("lightning.fabric.strategies.model_parallel._has_dtensor_modules", return_value=True):
        with pytest.raises(ValueError, match="does not point to a valid checkpoint"):
            strategy.load_checkpoint(checkpoint_path=path)


@mock.patch("torch.distributed.init_process_group")
def test_timeout_reaches_the_process_group(init_process_group):
    strategy = AutoModelParallelStrategy(timeout=timedelta(seconds=30))
    strategy._lightning_module = mock.Mock()
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.cluster_environment = LightningEnvironment()
    strategy.accelerator = mock.Mock()
    with mock.patch("lightning_automodel.parallel.mesh.ParallelDims.build_mesh") as build_mesh:
        strategy.setup_environment()
    assert init_process_group.call_args.kwargs["timeout"] == timedelta(seconds=30)
    assert build_mesh.call_args.kwargs["timeout"] == timedelta(seconds=30)


def test_reduce_before_setup_returns_the_tensor():
    value = torch.tensor(3.0)
    assert AutoModelParallelStrategy().reduce(value) is value


def test_exports_keep_user_files(tmp_path):
    """An export replaces a previous Hugging Face model directory and nothing else."""
    model = tiny_model()
    user = tmp_path / "experiment"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"would delete what no earlier save there wrote \(notes.txt\)"):
        export_hf(model, user)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["experiment"] and (user / "notes.txt").read_text() == "mine"
    export = tmp_path / "export"
    export_hf(model, export)
    model.generation_config.save_pretrained(export)  # what transformers would add there stays ours
    export_hf(model, export, max_shard_size=2**16)  # a previous export, other shards: replaced whole
    assert not (export / "model.safetensors").exists() and (export / "model.safetensors.index.json").is_file()
    (export / "data").mkdir()
    with pytest.raises(FileExistsError, match=r"\(data/\)"):
        export_hf(model, export)


def test_single_file_checkpoint_detection(tmp_path):
    from lightning_automodel.io.lightning_checkpoint import not_checkpoint_files

    torch.save({"state_dict": {}}, tmp_path / "last.ckpt")
    (tmp_path / "weights.zip").write_bytes(b"PK\x05\x06" + bytes(18))  # an empty zip archive, not torch's
    assert not_checkpoint_files(tmp_path / "last.ckpt") == []
    assert not_checkpoint_files(tmp_path / "weights.zip") == ["weights.zip"]
    assert not_checkpoint_files(tmp_path / "absent") == []
    assert not_checkpoint_files(tmp_path) == ["last.ckpt", "weights.zip"]  # a user's folder, whatever it holds
    assert not _is_sharded_checkpoint(tmp_path) and isinstance(tmp_path, Path)
