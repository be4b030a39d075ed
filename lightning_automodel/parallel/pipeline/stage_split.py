"""A model cut down to its stage in place: the decoder layers it holds under their Hugging Face names, the embedding
(and a vision-language model's vision tower and projector) first, the final norm and head last; with several stages
per rank, each stage a view of the model."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from torch import nn

from lightning_automodel.hf.decoder_layers import named_language_layers, named_multimodal_parts
from lightning_automodel.hf.shrink import layers_kept

FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "final_norm", "ln_f", "norm_f", "ln_final")


def split_into_stage(
    model: nn.Module, *, layers: Sequence[int], first: bool, last: bool, config: Any | None = None
) -> None:
    """Keep this stage of ``model`` in place: its decoder ``layers`` (the language model's) under their names, the
    embedding on the first stage (and on the last when the head is tied to it), a vision tower and projector on the
    first, the final norm and the head on the last. ``config``: the whole model's config of the module looping over
    the layers (default: that module's own)."""
    if not first:
        drop_multimodal_parts(model)
    owner, attribute = blocks_owner(model)
    blocks = getattr(owner, attribute)
    kept = nn.ModuleList()
    for index in layers:  # a ModuleList iterates its values: the model's own loop runs these layers only
        kept.add_module(str(index), blocks._modules[str(index)])
    setattr(owner, attribute, kept)
    owner.config = _config_of_layers(config if config is not None else owner.config, list(layers))
    if not first and not (last and is_tied(model)):
        model.base_model.set_input_embeddings(None)
    if not last:
        setattr(owner, final_norm_name(owner), nn.Identity())
        model.set_output_embeddings(None)


def drop_multimodal_parts(model: nn.Module) -> None:
    """Remove a vision-language model's parts beside its language model (vision tower, projector): a stage after the
    first receives the hidden states their features were scattered into, and never runs them."""
    for name, _ in named_multimodal_parts(model):
        owner, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, attribute, None)


def stage_view(model: nn.Module, *, layers: Sequence[int], first: bool, last: bool, config: Any) -> nn.Module:
    """One of the stages a rank holds when it holds several (virtual stages): a module computing ``layers`` of
    ``model`` (already split to this rank's layers) as :func:`split_into_stage` would keep them, sharing every
    submodule with ``model``. Only the modules on the way to the blocks are copied, with their own children and
    hooks (FSDP makes each view a root of its own) and the same parameters and buffers (none of their own:
    :func:`pipeline_problem`); ``model`` stays what checkpoints, loading and the export see. ``config``: the whole
    model's config of the module looping over the layers. Made after tensor parallel, whose hooks the copies keep:
    hooks registered on those modules later reach the model only, and casts or moves of the model after FSDP reach
    the views' units only through :meth:`Pipeline.adopt_weights`."""
    view = _copy_along(model, [name for name, _ in path_to_blocks(model)][1:])
    split_into_stage(view, layers=layers, first=first, last=last, config=config)
    return view


def _copy_along(module: nn.Module, path: list[str]) -> nn.Module:
    """A shallow copy of ``module`` whose children and hooks are its own, and so on along ``path`` (module names
    inside ``module``, shortest first)."""
    clone = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, dict | set) and key not in ("_parameters", "_buffers"):
            clone.__dict__[key] = copy.copy(value)
    if path:
        child = path[0].rsplit(".", 1)[-1]
        clone._modules[child] = _copy_along(module._modules[child], path[1:])
    return clone


def path_to_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model`` and the modules between it and its list of blocks (their owner last), by name."""
    owner_name = name_of(model, blocks_owner(model)[0])
    parts = owner_name.split(".") if owner_name else []
    names = ["", *(".".join(parts[: depth + 1]) for depth in range(len(parts)))]
    return [(name, model.get_submodule(name)) for name in names]


def _config_of_layers(config: Any, layers: list[int]) -> Any:
    """A copy of ``config`` describing ``layers`` alone (per-layer settings cut and renumbered), for the module whose
    loop runs them: models read ``config.layer_types[i]`` by loop position (Gemma 3). The model's own config, which
    the export writes, stays whole."""
    stage_config = copy.deepcopy(config)
    for name, value in layers_kept(config.to_dict(), layers).items():
        setattr(stage_config, name, value)
    return stage_config


def name_of(model: nn.Module, module: nn.Module) -> str:
    """The name of ``module`` inside ``model``."""
    return next(name for name, candidate in model.named_modules() if candidate is module)


def is_tied(model: nn.Module) -> bool:
    """Whether the model's head is its input embedding (one weight)."""
    head = model.get_output_embeddings()
    return head is not None and (embedding := _input_embedding(model)) is not None and head.weight is embedding.weight


def _input_embedding(model: nn.Module) -> nn.Module | None:
    """The model's input embedding; None where its stage dropped it (transformers' lookup raises then through a
    vision-language model's language model)."""
    try:
        return model.get_input_embeddings()
    except NotImplementedError:
        return None


def blocks_owner(model: nn.Module) -> tuple[nn.Module, str]:
    """The module holding the model's list of decoder blocks (the language model's), and the list's attribute name."""
    list_path = named_language_layers(model)[0][0].rsplit(".", 1)[0]
    owner, _, attribute = list_path.rpartition(".")
    return (model.get_submodule(owner) if owner else model), attribute


def final_norm_name(owner: nn.Module) -> str | None:
    """The final norm beside the blocks: by its usual names, else the one child whose class is a norm. A wrong guess
    cannot pass :func:`stage_split_problem`."""
    named = next((name for name in FINAL_NORM_NAMES if isinstance(getattr(owner, name, None), nn.Module)), None)
    norms = [name for name, child in owner.named_children() if "norm" in type(child).__name__.lower()]
    return named or (norms[0] if len(norms) == 1 else None)
