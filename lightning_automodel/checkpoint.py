"""Lightning checkpoints that hold the trainable parameters only (LoRA adapters), and resuming from them.

A LoRA run trains a few million parameters on top of billions of frozen ones that never change and can be
rebuilt from where they came from (the pretrained checkpoint, or the seed). Saving them at every checkpoint
costs disk and time for nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies.fsdp import _distributed_checkpoint_load, _is_sharded_checkpoint
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer


def trainable_names(module: nn.Module) -> set[str]:
    return {name for name, param in module.named_parameters() if param.requires_grad}


def only_trainable(state_dict: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    trainable = trainable_names(module)
    return {name: value for name, value in state_dict.items() if name in trainable}


def load_trainable_checkpoint(
    path: Path, module: nn.Module, optimizers: list[Optimizer], *, weights_only: bool | None = None
) -> dict[str, Any]:
    """Load a sharded checkpoint written with trainable parameters only: those parameters and the optimizers'
    state come from ``path``, frozen parameters stay as the module has them. Returns the checkpoint's other
    contents (loop state, callbacks), as Lightning's loader does."""
    if not _is_sharded_checkpoint(path):
        raise ValueError(
            f"{path} is not a sharded (distributed) checkpoint. Checkpoints of trainable parameters only are written"
            " and read with save_distributed_checkpoint=True."
        )
    model_state = {"state_dict": only_trainable(get_model_state_dict(module), module)}
    _distributed_checkpoint_load(model_state, path)
    set_model_state_dict(module, model_state["state_dict"], options=StateDictOptions(strict=False))
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
        _distributed_checkpoint_load(optimizer_state, path)
        options = StateDictOptions(cpu_offload=True)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optimizer_state[key], options=options)
    return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
