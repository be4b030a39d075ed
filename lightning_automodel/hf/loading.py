"""Pretrained Hugging Face weights, loaded into a parallelized model with each rank reading only its slices.

``from_pretrained`` builds the model on the meta device and remembers where its weights are; the strategy
parallelizes it, materializes it (non-persistent buffers such as rotary frequencies are computed there), then
calls :func:`load_hf_checkpoint`, which reads every rank's shards straight from the safetensors files with
torch's distributed checkpoint reader: no rank ever holds the full model.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from lightning_automodel.hf.initialization import copy_shard, unsharded_view
from lightning_automodel.parallel.styles import is_packed

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
    _by_checkpoint_name(model, model.state_dict())  # refuse a format this loader cannot read, before any work
    setattr(model, _CHECKPOINT_ATTRIBUTE, directory)
    return model


def pretrained_checkpoint(model: nn.Module) -> Path | None:
    """Where ``model``'s weights are to be loaded from, if it was built by :func:`from_pretrained`."""
    return getattr(model, _CHECKPOINT_ATTRIBUTE, None)


def load_hf_checkpoint(model: nn.Module, path: str | os.PathLike, *, missing_ok: bool = False) -> None:
    """Fill ``model`` (parallelized and materialized) from the safetensors in ``path``; collective.

    Each rank reads the slices of the checkpoint its shards cover, cast to the model's dtypes. Checkpoint names
    follow transformers' conversion mapping (a model may name a tensor differently than its checkpoint does).
    A tied parameter is read once. A tensor the checkpoint lacks is an error naming it, or with ``missing_ok`` a
    warning. In a PEFT-wrapped model the base weights are loaded and the adapters left as initialised.
    """
    reader = HuggingFaceStorageReader(str(path))
    stored = set(reader.read_metadata().state_dict_metadata)
    state = _by_checkpoint_name(model, _without_adapters(get_model_state_dict(model)))
    tied = _tied_aliases(model)
    missing = sorted(name for name in state if name not in stored and name not in tied)
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    if missing and missing_ok:
        log.warning("%s lacks %s; they keep their fresh initialisation (a new head, say).", path, shown)
    elif missing:
        raise ValueError(
            f"{path} lacks weights of {type(model).__name__}: {shown}. Is it a checkpoint of this model class?"
        )
    state = {name: tensor for name, tensor in state.items() if name in stored}
    packed = {name: tensor for name, tensor in state.items() if is_packed(tensor)}
    dcp.load({name: tensor for name, tensor in state.items() if name not in packed}, storage_reader=reader)
    for name, tensor in packed.items():
        _load_whole_then_keep_shard(name, tensor, reader)


def _load_whole_then_keep_shard(name: str, tensor: DTensor, reader: HuggingFaceStorageReader) -> None:
    """Packed projections (Phi3's qkv_proj, gate_up_proj) hold strided shards, whose slices torch's checkpoint
    reader places wrongly (measured: a tp=2 x dp_shard=2 load of Phi3 is off by 0.12). Each rank reads the whole
    tensor, one at a time, and keeps its shard."""
    whole = {name: torch.empty(tensor.shape, dtype=tensor.dtype)}
    dcp.load(whole, storage_reader=reader)
    copy_shard(tensor, whole[name])


def materialize_pretrained(model: nn.Module, device: torch.device) -> None:
    """Allocate a parallelized meta model built by :func:`from_pretrained` and fill it from its checkpoint;
    collective. Only what the checkpoint lacks is initialised (buffers such as rotary frequencies, a PEFT model's
    adapters, a new head such as a classifier's ``score``): no full-size tensor is made for the rest."""
    from lightning_automodel.hf.initialization import materialize_hf_model

    path = pretrained_checkpoint(model)
    materialize_hf_model(model, device, skip=_parameters_in_checkpoint(model, path))
    load_hf_checkpoint(model, path, missing_ok=True)


def _parameters_in_checkpoint(model: nn.Module, path: Path) -> set[str]:
    """Names (all of them, for tied parameters) of the parameters whose values ``path`` holds."""
    stored = set(HuggingFaceStorageReader(str(path)).read_metadata().state_dict_metadata)
    params = [(name, p) for name, p in model.named_parameters(remove_duplicate=False) if not _is_adapter(name)]
    stored_names = _by_checkpoint_name(model, {n.replace(".base_layer.", "."): torch.empty(0) for n, _ in params})
    present = {id(p) for (_, p), key in zip(params, stored_names, strict=True) if key in stored}
    return {name for name, p in params if id(p) in present}


def checkpoint_names(model: nn.Module) -> dict[str, str]:
    """Module state-dict name -> the name ``save_pretrained`` writes, for every tensor written (a tied weight
    once, under its first name)."""
    state = model.state_dict()
    stored = _by_checkpoint_name(model, {name: torch.empty(0) for name in state})
    tied = _tied_aliases(model)
    return {name: stored_name for name, stored_name in zip(state, stored, strict=True) if stored_name not in tied}


def _without_adapters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A PEFT-wrapped model's base weights under their own names (its adapters are not in the checkpoint)."""
    return {name.replace(".base_layer.", "."): tensor for name, tensor in state.items() if not _is_adapter(name)}


def _is_adapter(name: str) -> bool:
    return ".lora_" in name or "lora_magnitude_vector" in name


def _by_checkpoint_name(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` keyed by the names transformers' ``save_pretrained`` would write (its conversion mapping)."""
    from transformers.core_model_loading import revert_weight_conversion

    view = unsharded_view(model)  # transformers looks the mapping up by class
    renamed = {}
    for name, tensor in state.items():
        stored_names = list(revert_weight_conversion(view, {name: tensor}))
        if len(stored_names) != 1 or stored_names[0] in renamed:
            raise ValueError(
                f"{type(view).__name__}'s checkpoints store {name} converted ({stored_names}): transformers"
                " splits or merges such tensors on load (mixture-of-experts weights, for instance), which loading"
                " shard by shard does not do. Build this model with transformers' own from_pretrained instead (its"
                " real weights are then broadcast from rank 0 and sharded)."
            )
        renamed[stored_names[0]] = tensor
    return renamed


def _tied_aliases(model: nn.Module) -> set[str]:
    """Checkpoint names of the second and later names of tied parameters (save_pretrained writes one)."""
    first: dict[int, str] = {}
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.add(name)
        else:
            first[id(param)] = name
    return set(_by_checkpoint_name(model, dict.fromkeys(aliases, torch.empty(0))))
