"""Loading Lightning's sharded checkpoints, including those that hold the trainable parameters only.

A LoRA run trains a few million parameters on top of billions of frozen ones that never change and can be
rebuilt from where they came from (the pretrained checkpoint, or the seed): saving them at every checkpoint
costs disk and time for nothing. And an optimizer has no state for a parameter that never got a gradient (a
vision tower in text-only training), so its saved state lacks entries that a freshly set-up optimizer has.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_automodel.atomic_directory import unowned_entries
from lightning_automodel.hf.initialization import copy_shard
from lightning_automodel.parallel.styles import is_packed, packed_block_keys, packed_blocks


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
    :func:`~lightning_automodel.parallel.styles.packed_blocks`): torch's distributed checkpoint refuses strided
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
        if not keys:
            if strict:
                raise ValueError(f"{path} lacks a tensor this model needs ({tuple(target.shape)}).")
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
    _load({"state_dict": model_state}, path, stored, strict=strict)
    set_model_state_dict(module, model_state, options=StateDictOptions(strict=strict and not trainable_only))
    for index, optimizer in enumerate(optimizers):
        optimizer_state = get_optimizer_state_dict(module, optimizer)
        _load({f"optimizer_{index}": optimizer_state}, path, stored, strict=False)
        options = StateDictOptions(cpu_offload=True)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state, options=options)
    return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
