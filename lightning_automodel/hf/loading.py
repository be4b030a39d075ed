"""Pretrained Hugging Face weights, loaded into a parallelized model with each rank reading only its slices.

``from_pretrained`` builds the model on the meta device and remembers where its weights are; the strategy
parallelizes it, materializes it (non-persistent buffers such as rotary frequencies are computed there), then
calls :func:`load_hf_checkpoint`, which reads every rank's shards straight from the safetensors files with
torch's distributed checkpoint reader: no rank ever holds the full model.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from lightning_automodel.hf.conversion import Stored, experts_of, merged, stored_as
from lightning_automodel.hf.initialization import copy_shard, materialize_hf_model
from lightning_automodel.hf.packed_weights import is_packed

log = logging.getLogger(__name__)

_CHECKPOINT_ATTRIBUTE = "_lightning_automodel_checkpoint"


def from_pretrained(
    path: str | os.PathLike, *, model_class: Any = None, dtype: torch.dtype | str = "auto", **config_overrides: Any
) -> nn.Module:
    """A model built from the config in ``path`` on the meta device, to be filled from ``path``'s safetensors
    once parallelized: call it in ``configure_model``, the strategy does the rest.

    Args:
        path: a local Hugging Face model directory (``config.json`` and ``model.safetensors`` or sharded files with
            ``model.safetensors.index.json``).
        model_class: e.g. ``AutoModelForSequenceClassification`` (default: ``AutoModelForCausalLM``).
        dtype: ``"auto"`` keeps the checkpoint's dtype (as transformers does); a dtype casts to it. Parameters the
            model pins to fp32 stay fp32.
        config_overrides: set on the config before building (``attn_implementation="sdpa"``, ``use_cache=False``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = Path(path)
    config = AutoConfig.from_pretrained(directory, **config_overrides)
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
    with torch.device("meta"):
        model = (model_class or AutoModelForCausalLM).from_config(config, dtype=dtype)
    stored_as(model, {name: t.shape for name, t in model.state_dict().items()})  # refuse what it cannot read, early
    setattr(model, _CHECKPOINT_ATTRIBUTE, directory)
    return model


def pretrained_checkpoint(model: nn.Module) -> Path | None:
    """Where ``model``'s weights are to be loaded from, if it was built by :func:`from_pretrained`."""
    return getattr(model, _CHECKPOINT_ATTRIBUTE, None)


def load_hf_checkpoint(model: nn.Module, path: str | os.PathLike, *, missing_ok: bool = False) -> None:
    """Fill ``model`` (parallelized and materialized) from the safetensors in ``path``; collective.

    Each rank reads the slices of the checkpoint its shards cover, cast to the model's dtypes. Checkpoint names
    follow transformers' conversion mapping (a model may name a tensor differently than its checkpoint does, and keep
    experts fused that the checkpoint stores one by one: each rank then reads its experts' tensors only, see
    :mod:`~lightning_automodel.hf.conversion`). A tied parameter is read once. A tensor the checkpoint lacks is an
    error naming it, or with ``missing_ok`` a warning. In a PEFT-wrapped model the base weights are loaded and the
    adapters left as initialised.
    """
    reader = HuggingFaceStorageReader(str(path))
    stored = set(reader.read_metadata().state_dict_metadata)
    state = _without_adapters(get_model_state_dict(model))
    layout = stored_as(model, {name: tensor.shape for name, tensor in state.items()})
    tied = _tied_aliases(model)
    missing = sorted(n for entry in layout.values() for n in entry.names if n not in stored and n not in tied)
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    if missing and missing_ok:
        log.warning("%s lacks %s; they keep their fresh initialisation (a new head, say).", path, shown)
    elif missing:
        raise ValueError(
            f"{path} lacks weights of {type(model).__name__}: {shown}. Is it a checkpoint of this model class?"
        )
    present = {name: tensor for name, tensor in state.items() if all(n in stored for n in layout[name].names)}
    plain = {layout[name].names[0]: tensor for name, tensor in present.items() if not layout[name].is_merged}
    packed = {name: tensor for name, tensor in plain.items() if is_packed(tensor)}
    dcp.load({name: tensor for name, tensor in plain.items() if name not in packed}, storage_reader=reader)
    for name, tensor in packed.items():
        _load_whole_then_keep_shard(name, tensor, reader)
    for name, tensor in present.items():
        if layout[name].per_expert:
            _load_held_experts(tensor, layout[name], reader)
        elif layout[name].is_merged:
            _load_merged_whole(tensor, layout[name], reader)


def _load_whole_then_keep_shard(name: str, tensor: DTensor, reader: HuggingFaceStorageReader) -> None:
    """Packed projections (Phi3's qkv_proj, gate_up_proj) hold strided shards, whose slices torch's checkpoint
    reader places wrongly (measured: a tp=2 x dp_shard=2 load of Phi3 is off by 0.12). Each rank reads the whole
    tensor, one at a time, and keeps its shard."""
    whole = {name: torch.empty(tensor.shape, dtype=tensor.dtype)}
    _read_alone(whole, reader)
    copy_shard(tensor, whole[name])


def _load_held_experts(tensor: torch.Tensor, stored: Stored, reader: HuggingFaceStorageReader) -> None:
    """Fused experts stored one tensor per expert: this rank reads the experts it holds (its ep share, all of them
    without expert parallel), merges them as transformers does, and keeps its shard of them."""
    first, last = _held_experts(tensor)
    metadata = reader.read_metadata().state_dict_metadata
    names = experts_of(stored, first=first, last=last)
    read = {name: torch.empty(metadata[name].size, dtype=tensor.dtype) for name in names}
    _read_alone(read, reader)
    whole = torch.zeros(tensor.shape, dtype=tensor.dtype)  # other ranks' experts: never part of this rank's shard
    whole[first:last] = merged(stored, read)
    copy_shard(tensor, whole)


def _load_merged_whole(tensor: torch.Tensor, stored: Stored, reader: HuggingFaceStorageReader) -> None:
    """A tensor stored as several others (Kimi's convolution over [q; k; v], stored as three): each rank reads them
    whole, merges them as transformers does and keeps its shard."""
    metadata = reader.read_metadata().state_dict_metadata
    read = {name: torch.empty(metadata[name].size, dtype=metadata[name].properties.dtype) for name in stored.names}
    _read_alone(read, reader)
    copy_shard(tensor, merged(stored, read).to(tensor.dtype))


def _read_alone(tensors: dict[str, torch.Tensor], reader: HuggingFaceStorageReader) -> None:
    """Read whole ``tensors`` on this rank alone, no collective: pipeline stages hold other tensors and experts, so
    ranks read different numbers of them. (torch warns it then assumes one process, which is what this read is.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(tensors, storage_reader=reader, no_dist=True)


def materialize_pretrained(model: nn.Module, device: torch.device) -> None:
    """Allocate a parallelized meta model built by :func:`from_pretrained` and fill it from its checkpoint;
    collective. Only what the checkpoint lacks is initialised (buffers such as rotary frequencies, a PEFT model's
    adapters, a new head such as a classifier's ``score``): no full-size tensor is made for the rest."""
    path = pretrained_checkpoint(model)
    materialize_hf_model(model, device, skip=_parameters_in_checkpoint(model, path))
    load_hf_checkpoint(model, path, missing_ok=True)


def _parameters_in_checkpoint(model: nn.Module, path: Path) -> set[str]:
    """Names (all of them, for tied parameters) of the parameters whose values ``path`` holds."""
    stored = set(HuggingFaceStorageReader(str(path)).read_metadata().state_dict_metadata)
    params = [(name, p) for name, p in model.named_parameters(remove_duplicate=False) if not _is_adapter(name)]
    layout = stored_as(model, {name.replace(".base_layer.", "."): p.shape for name, p in params})
    present = {id(p) for (_, p), entry in zip(params, layout.values(), strict=True) if set(entry.names) <= stored}
    return {name for name, p in params if id(p) in present}


def checkpoint_layout(model: nn.Module) -> dict[str, Stored]:
    """Module state-dict name -> how ``save_pretrained`` writes it, for every tensor written (a tied weight once,
    under its first name)."""
    layout = stored_as(model, {name: tensor.shape for name, tensor in model.state_dict().items()})
    tied = _tied_aliases(model)
    return {name: entry for name, entry in layout.items() if not set(entry.names) & tied}


def _held_experts(tensor: torch.Tensor) -> tuple[int, int]:
    """The experts (first, last + 1) this rank holds of an experts tensor: its share over "ep", or all of them."""
    names = (tensor.device_mesh.mesh_dim_names or ()) if isinstance(tensor, DTensor) else ()
    if "ep" not in names:
        return 0, tensor.shape[0]
    dim = names.index("ep")
    count = tensor.shape[0] // tensor.device_mesh.size(dim)
    first = tensor.device_mesh.get_local_rank(dim) * count
    return first, first + count


def _without_adapters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A PEFT-wrapped model's base weights under their own names (its adapters are not in the checkpoint)."""
    return {name.replace(".base_layer.", "."): tensor for name, tensor in state.items() if not _is_adapter(name)}


def _is_adapter(name: str) -> bool:
    return ".lora_" in name or "lora_magnitude_vector" in name


def _tied_aliases(model: nn.Module) -> set[str]:
    """Checkpoint names of the second and later names of tied parameters (save_pretrained writes one)."""
    first: dict[int, str] = {}
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.add(name)
        else:
            first[id(param)] = name
    shapes = {name: p.shape for name, p in model.named_parameters(remove_duplicate=False) if name in aliases}
    return {n for entry in stored_as(model, shapes).values() for n in entry.names}
