"""The model a Lightning sharded checkpoint holds, on the meta device (its names, ties and the checkpoint's dtypes),
and its tensors read from the checkpoint by name: only those asked for, each LoRA target merged as PEFT merges it.

torch's checkpoint reader reads by key, so reading a few tensors costs their size, not the model's.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_automodel.hf.packed_weights import packed_block_keys
from lightning_automodel.hf.peft import with_lora

_WEIGHTS = "state_dict."
_LORA_LAYER = ".base_layer."


class CheckpointModel:
    """``model``: the checkpoint's model on the meta device, with each tensor in the checkpoint's dtype (LoRA
    unloaded: the model ``merge_and_unload`` gives); ``peft``: the PEFT model as trained (meta), when LoRA was."""

    def __init__(self, checkpoint: Path, build: Callable[[], nn.Module], lora: dict[str, Any] | None) -> None:
        self.checkpoint = checkpoint
        self.stored = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
        self.peft = with_lora(build(), lora) if lora is not None else None
        self.model, self.trained_names = _unloaded(build, lora)
        self.unloaded_names = {trained: name for name, trained in self.trained_names.items()}
        self.keys = _checkpoint_keys(checkpoint, self.stored, list((self.peft or self.model).state_dict()))
        self._tied = {
            self.trained_names[n]: [self.trained_names[o] for o in others]
            for n, others in _tie_groups(self.model).items()
        }
        _take_checkpoint_dtypes(self)

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors of ``model``'s state-dict ``names``, read from the checkpoint (LoRA targets merged)."""
        names = list(names)
        targets = {name: self.trained_names[name].split(_LORA_LAYER)[0] for name in names if self._is_target(name)}
        wanted = [self.trained_names[name] for name in names if name not in targets]
        layers = sorted(set(targets.values()))
        wanted += [f"{layer}.{key}" for layer in layers for key in self.peft.get_submodule(layer).state_dict()]
        tensors = self.read_trained(wanted)
        merged = {name: tensor for layer in layers for name, tensor in self._merged(layer, tensors).items()}
        return {name: merged[name] if name in targets else tensors[self.trained_names[name]] for name in names}

    def read_trained(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Tensors by their names in the trained model (PEFT's where LoRA was): one read of the checkpoint, packed
        weights joined from their blocks."""
        parts = {name: self._parts(name) for name in names}
        stored = self.stored
        state = {
            key: torch.empty(stored[key].size, dtype=stored[key].properties.dtype)
            for keys in parts.values()
            for key in keys
        }
        with warnings.catch_warnings():  # torch warns that it loads in one process even when told to: it is the intent
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, checkpoint_id=self.checkpoint, no_dist=True)
        return {name: _joined([state[key] for key in keys]) for name, keys in parts.items()}

    def _parts(self, name: str) -> list[str]:
        """The checkpoint keys holding a trained tensor: its own, or a tied partner's (each pp stage saves its own)."""
        for candidate in (name, *self._tied.get(name, ())):
            if candidate in self.keys:
                return self.keys[candidate]
        raise ValueError(
            f"{self.checkpoint} lacks the weight {name} of {type(self.model).__name__}. A checkpoint saved with"
            " save_trainable_only=True holds the adapters only: export them with --lora=adapter."
        )

    def _is_target(self, name: str) -> bool:
        return _LORA_LAYER in self.trained_names[name]

    def _merged(self, layer: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The base tensors of one LoRA layer merged by PEFT's own merge, by the unloaded model's names; the layer
        goes back to the meta device."""
        module = self.peft.get_submodule(layer)
        module.load_state_dict({key: tensors[f"{layer}.{key}"] for key in module.state_dict()}, assign=True)
        module.merge()
        base = module.get_base_layer().state_dict()
        module.to("meta")
        module.merged_adapters = []
        return {self.unloaded_names[f"{layer}.base_layer.{key}"]: tensor for key, tensor in base.items()}


def _unloaded(build: Callable[[], nn.Module], lora: dict[str, Any] | None) -> tuple[nn.Module, dict[str, str]]:
    """The model without adapters, and each of its state-dict names' name in the trained model (PEFT's wraps
    rename LoRA targets and ``modules_to_save``): the tensors ``unload`` keeps are the trained model's own."""
    if lora is None:
        model = build()
        return model, {name: name for name in model.state_dict()}
    peft = with_lora(build(), lora)
    trained = {id(tensor): name for name, tensor in peft.state_dict(keep_vars=True).items()}
    model = peft.unload()
    return model, {name: trained[id(tensor)] for name, tensor in model.state_dict(keep_vars=True).items()}


def _checkpoint_keys(checkpoint: Path, metadata: dict[str, Any], names: list[str]) -> dict[str, list[str]]:
    """For each trained state-dict name the checkpoint holds, its keys (one, or a packed weight's blocks), found
    under the LightningModule attribute that held the model."""
    stored = [
        key for key, meta in metadata.items() if key.startswith(_WEIGHTS) and isinstance(meta, TensorStorageMetadata)
    ]
    prefix = next((key[: -len(names[0])] for key in stored if key.endswith(names[0])), None)
    if prefix is None:
        raise ValueError(f"{checkpoint} holds no weights of this model (no key ends with {names[0]}).")
    blocks = packed_block_keys(stored)
    held = set(stored)
    keys = {name: [prefix + name] if prefix + name in held else blocks.get(prefix + name, []) for name in names}
    return {name: parts for name, parts in keys.items() if parts}


def _tie_groups(model: nn.Module) -> dict[str, list[str]]:
    """Each tied parameter's other names."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {name: [other for other in group if other != name] for group in names.values() for name in group}


def _take_checkpoint_dtypes(source: CheckpointModel) -> None:
    """Give every meta tensor of ``source.model`` the checkpoint's dtype (kept as saved: a model of mixed dtypes
    stays mixed), in place so that tied parameters stay one; a shape other than the checkpoint's is an error."""
    for name, tensor in source.model.state_dict(keep_vars=True).items():
        parts = [source.stored[key] for key in source._parts(source.trained_names[name])]
        shape = _joined([torch.empty(part.size, device="meta") for part in parts]).shape
        if shape != tensor.shape:
            raise ValueError(
                f"{source.checkpoint} holds {name} of shape {list(shape)}, the model's is {list(tensor.shape)}: the"
                " checkpoint is of another configuration (pass --config with the model's own)."
            )
        tensor.data = torch.empty(shape, dtype=parts[0].properties.dtype, device="meta")


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
