"""Loading Lightning's sharded checkpoints, including those that hold the trainable parameters only.

A LoRA run trains a few million parameters on top of billions of frozen ones that never change and can be
rebuilt from where they came from (the pretrained checkpoint, or the seed): saving them at every checkpoint
costs disk and time for nothing. And an optimizer has no state for a parameter that never got a gradient (a
vision tower in text-only training), so its saved state lacks entries that a freshly set-up optimizer has.
"""

from __future__ import annotations

import shutil
import zipfile
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import nn
from torch.distributed.checkpoint import (
    CheckpointException,
    DefaultLoadPlanner,
    FileSystemReader,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_automodel.hf.initialization import copy_shard
from lightning_automodel.hf.packed_weights import is_packed, packed_block_keys, packed_blocks
from lightning_automodel.io.atomic_directory import unowned_entries


def not_checkpoint_files(path: Path) -> list[str]:
    """What stands at ``path`` that is not a Lightning checkpoint, so a save there must not replace it: anything
    but a sharded checkpoint's files (``meta.pt``, ``.metadata``, ``*.distcp``) or a single-file checkpoint."""
    if path.is_file() and not path.is_symlink():
        return [] if _is_torch_save(path) else [path.name]
    return unowned_entries(path, owned=lambda entry: entry.name in _SHARDED_FILES or entry.suffix == ".distcp")


_SHARDED_FILES = (_METADATA_FILENAME, ".metadata")


def _is_torch_save(path: Path) -> bool:
    """Whether ``path`` is a file written by ``torch.save`` (a zip archive holding a ``data.pkl``)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(name.endswith("/data.pkl") for name in archive.namelist())


def split_packed(tree: Any) -> Any:
    """``tree`` (a state dict, possibly nested) with every packed weight replaced by its blocks (see
    :func:`~lightning_automodel.hf.packed_weights.packed_blocks`): torch's distributed checkpoint refuses strided
    shards ("overlapping chunks"). The blocks share the weights' storage, so loading into them loads the weights."""
    if isinstance(tree, dict):
        return {key: split_packed(value) for key, value in tree.items()}
    return packed_blocks(tree) if is_packed(tree) else tree


def _load(state: dict[str, Any], path: Path, stored: dict[str, Any], *, strict: bool) -> None:
    """Load ``state`` in place. A packed weight saved by another layout (as one tensor, or in blocks where this
    layout holds it whole) cannot be read slice by slice: each rank reads it whole, one at a time, and keeps its
    shard. ``strict=False`` leaves entries the checkpoint lacks as they are."""
    mismatched: list[tuple[list[str], torch.Tensor]] = []
    split: list[tuple[DTensor, dict[str, DTensor]]] = []
    request = _request(state, "", stored, packed_block_keys(stored), mismatched, split)
    dcp.load(request, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=not strict))
    for target, blocks in split:  # blocks alias the weight, unless made on another device (CPU offload)
        for chunk, block in zip(target.to_local().chunk(len(blocks)), blocks.values(), strict=True):
            chunk.copy_(block.to_local())
    for keys, target in mismatched:
        if not keys:  # not in the checkpoint: refused beforehand when strict (see _misfit)
            continue
        whole = {key: torch.empty(stored[key].size, dtype=stored[key].properties.dtype) for key in keys}
        dcp.load(whole, checkpoint_id=path)
        copy_shard(target, torch.cat(list(whole.values())))


def _request(
    tree: Any, prefix: str, stored: dict[str, Any], blocks_of: dict[str, list[str]], mismatched: list, split: list
) -> Any:
    """What to ask torch's checkpoint reader for, in the shape of ``tree``; tensors stored in another form go to
    ``mismatched`` with the checkpoint keys that hold them, packed weights read as blocks to ``split``."""
    if isinstance(tree, dict):
        requests = {k: _request(v, f"{prefix}{k}.", stored, blocks_of, mismatched, split) for k, v in tree.items()}
        return {key: value for key, value in requests.items() if value is not None}
    if not isinstance(tree, torch.Tensor):
        return tree
    key = prefix[:-1]
    blocks = blocks_of.get(key, [])
    if is_packed(tree) and blocks:
        split.append((tree, packed_blocks(tree)))
        return split[-1][1]
    if not is_packed(tree) and (key in stored or not blocks):
        return tree
    mismatched.append(([key] if key in stored else blocks, tree))
    return None


def only_trainable(state_dict: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    trainable = {name for name, param in module.named_parameters() if param.requires_grad}
    return {name: value for name, value in state_dict.items() if name in trainable}


def load_sharded_checkpoint(
    path: Path,
    module: nn.Module,
    optimizers: list[Optimizer],
    *,
    trainable_only: bool = False,
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Load a sharded checkpoint into ``module`` and ``optimizers``, resharding to their layout if it differs
    from the saving run's. Returns the checkpoint's other contents (loop state, callbacks), as Lightning does.

    ``trainable_only``: the checkpoint holds the trainable parameters only; frozen ones stay as built. ``strict``
    (the LightningModule's ``strict_loading``): weights the checkpoint lacks are an error. Optimizer state the
    checkpoint lacks (parameters that never got a gradient) keeps its fresh initial value.
    """
    if not _is_sharded_checkpoint(path):
        raise ValueError(
            f"{path} is not a sharded (distributed) checkpoint. Checkpoints of trainable parameters only are written"
            " and read with save_distributed_checkpoint=True."
        )
    stored = FileSystemReader(path).read_metadata().state_dict_metadata
    model_state = get_model_state_dict(module)
    model_state = only_trainable(model_state, module) if trainable_only else model_state
    raise_everywhere(_misfit(path, model_state, stored, strict=strict))
    _load({"state_dict": model_state}, path, stored, strict=strict)
    set_model_state_dict(module, model_state, options=StateDictOptions(strict=strict and not trainable_only))
    for index, optimizer in enumerate(optimizers):
        _load_optimizer(path, stored, module, optimizer, key=f"optimizer_{index}")
    return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)


def _load_optimizer(path: Path, stored: dict[str, Any], module: nn.Module, optimizer: Optimizer, *, key: str) -> None:
    """Load the state and each param group's settings (learning rate, betas, ...) of ``optimizer`` by the group's
    position. A checkpoint holds the groups' parameter names once, as one rank saved them: under pipeline parallel
    the ranks hold other parameters, and torch, matching groups by those names, would give a group of this rank
    none of the checkpoint's settings (nor one holding no parameter here)."""
    optimizer_state = get_optimizer_state_dict(module, optimizer)
    held = [list(group["params"]) for group in optimizer_state["param_groups"]]
    _load({key: optimizer_state}, path, stored, strict=False)
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer_state["param_groups"]]
    for group, params in zip(optimizer_state["param_groups"], held, strict=True):
        group["params"] = params
    set_optimizer_state_dict(
        module, optimizer, optim_state_dict=optimizer_state, options=StateDictOptions(cpu_offload=True)
    )
    for group, saved in zip(optimizer.param_groups, settings, strict=True):
        group.update(saved)


def check_checkpoint(path: Path) -> None:
    """Raise on every rank, naming the file, if ``path`` is missing or a sharded checkpoint there is incomplete or
    damaged (a shard missing or shorter than the checkpoint's index says); collective. Without it, a rank that
    cannot read its shard fails inside torch's loader, with the file's name deep in a traceback or not at all."""
    raise_everywhere(_damage(path))


def raise_everywhere(problem: Exception | None) -> None:
    """Raise the first rank's ``problem`` on every rank; collective. A rank that raised alone would leave the others
    waiting in the next collective (shared file systems can show ranks different files)."""
    problems = [problem]
    if dist.is_initialized():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    found = next((found for found in problems if found is not None), None)
    if found is not None:
        raise found


def _damage(path: Path) -> Exception | None:
    if not path.exists():
        return FileNotFoundError(f"No checkpoint at {path}.")
    if not path.is_dir():
        return None  # a single-file checkpoint: torch.load names it if it is damaged
    parts = [path / _METADATA_FILENAME, path / ".metadata"]
    if not any(part.exists() for part in parts) and not any(path.glob("*.distcp")):
        return None  # not a sharded checkpoint at all: Lightning says so
    missing = [part.name for part in parts if not part.is_file()]
    if missing:
        return FileNotFoundError(
            f"{path} is an incomplete sharded checkpoint: {' and '.join(missing)} missing. Resume from an earlier"
            " checkpoint."
        )
    if not _is_torch_save(parts[0]):
        return ValueError(f"{parts[0]} is damaged (not a file torch.save wrote). Resume from an earlier checkpoint.")
    try:
        index = FileSystemReader(path).read_metadata().storage_data
    except Exception as error:
        return ValueError(f"{parts[1]} cannot be read ({error}). Resume from an earlier checkpoint.")
    needed: dict[str, int] = {}
    for item in index.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            return FileNotFoundError(f"{shard} is missing from the checkpoint. Resume from an earlier checkpoint.")
        if shard.stat().st_size < size:
            return ValueError(
                f"{shard} is truncated: {shard.stat().st_size} bytes, where the checkpoint's index needs {size}."
                " Resume from an earlier checkpoint."
            )
    return None


def _misfit(path: Path, model_state: dict[str, Any], stored: dict[str, Any], *, strict: bool) -> Exception | None:
    """The model's tensors that ``path`` holds in another shape, or (``strict``) lacks: a checkpoint of another
    model. Packed weights stored in blocks are compared by their blocks' total size."""
    blocks_of = packed_block_keys(stored)
    wrong, absent = [], []
    for name, tensor in model_state.items():
        key = f"state_dict.{name}"
        if key in stored and isinstance(stored[key], TensorStorageMetadata):
            if tuple(stored[key].size) != tuple(tensor.shape):
                wrong.append(f"{name} is {tuple(stored[key].size)} there, {tuple(tensor.shape)} here")
        elif key in blocks_of:
            size = sum(stored[block].size.numel() for block in blocks_of[key])
            if size != tensor.numel():
                wrong.append(f"{name} holds {size} values there, {tensor.numel()} here")
        elif strict:
            absent.append(name)
    if wrong:
        return ValueError(
            f"{path} does not fit this model: {'; '.join(wrong[:3])}"
            + (f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else "")
            + ". It is a checkpoint of another model or configuration."
        )
    if absent:
        return ValueError(
            f"{path} lacks {len(absent)} of this model's {len(model_state)} tensors ({', '.join(absent[:3])}"
            + (", ..." if len(absent) > 3 else "")
            + "): a checkpoint of another model? Set strict_loading = False on the LightningModule to load what"
            " it holds."
        )
    return None


@contextmanager
def explain_save_failure(target: Path) -> Generator[None, None, None]:
    """Raise an ``OSError`` that says which ranks could not write the checkpoint ``target`` and why, in place of
    what torch raises: torch.save reports a write the OS refused (ENOSPC on a full disk) as "unexpected pos",
    and torch's distributed checkpoint hands every rank the failures without the exception chain that held the
    OS error. The free space left on the file system says the rest."""
    try:
        yield
    except CheckpointException as error:
        raise OSError(
            _save_failure(target, {rank: failure for rank, (failure, _) in error.failures.items()})
        ) from error
    except RuntimeError as error:  # torch.save of Lightning's meta.pt, on rank 0
        if "unexpected pos" not in str(error):
            raise
        raise OSError(_save_failure(target, {dist.get_rank() if dist.is_initialized() else 0: error})) from error


def _save_failure(target: Path, failures: dict[int, BaseException]) -> str:
    ranks = sorted(failures)
    first = failures[ranks[0]]
    reason = f"{type(first).__name__}: {str(first).strip().splitlines()[0] if str(first).strip() else ''}"
    if "unexpected pos" in reason:
        reason += ", torch.save's report of a write that failed"
    try:
        free = f"; {shutil.disk_usage(target.parent).free / 2**30:.2f} GiB are free on its file system"
    except OSError:
        free = ""
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return (
        f"Could not save the checkpoint {target}: {who} failed to write ({reason}){free}. {target} was left as it was."
    )
