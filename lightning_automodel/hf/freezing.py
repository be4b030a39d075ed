"""Freezing parts of a model before it is parallelized: a multimodal model's vision tower, its projector or its
language model, or parameters by name pattern. A frozen parameter gets no gradient, so an optimizer holds no state
for it (PyTorch's optimizers create state on a parameter's first gradient) and FSDP2 reduces nothing for it."""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from lightning_automodel.hf.decoder_layers import named_decoder_layers, named_multimodal_parts

PARTS = ("vision_tower", "projector", "language_model")


def freeze(model: nn.Module, *targets: str) -> list[str]:
    """Set ``requires_grad=False`` on every parameter of ``targets``, each one of :data:`PARTS` or a pattern of
    parameter names (``*`` any characters: ``"model.language_model.layers.0.*"``); the names frozen.

    Call it before the optimizer is built (``configure_model``, or before ``Trainer.fit``). A target that names no
    parameter is an error naming what the model has, before anything is changed."""
    groups = {target: _parameters_of(model, target) for target in targets}
    empty = [target for target, names in groups.items() if not names]
    if empty:
        parts = ", ".join(f"{name} ({_kind(model, name)})" for name, _ in named_multimodal_parts(model)) or "none"
        raise ValueError(
            f"freeze: {', '.join(map(repr, empty))} names no parameter of {type(model).__name__} (its parts beside the"
            f" language model: {parts}). Use one of {PARTS} or a pattern of parameter names such as"
            " 'model.visual.merger.*'"
        )
    params = dict(model.named_parameters())
    frozen = sorted({name for names in groups.values() for name in names})
    for name in frozen:
        params[name].requires_grad_(False)
    return frozen


def _parameters_of(model: nn.Module, target: str) -> list[str]:
    if target not in PARTS:
        return [name for name, _ in model.named_parameters() if fnmatchcase(name, target)]
    if target == "language_model":
        parts = [f"{name}." for name, _ in named_multimodal_parts(model)]
        return [] if not parts else [n for n, _ in model.named_parameters() if not n.startswith(tuple(parts))]
    prefixes = tuple(f"{name}." for name, _ in named_multimodal_parts(model) if _kind(model, name) == target)
    return [name for name, _ in model.named_parameters() if prefixes and name.startswith(prefixes)]


def _kind(model: nn.Module, part: str) -> str:
    """A part holding blocks is a vision tower (Qwen2-VL's holds its merger too); one without, a projector."""
    holds_blocks = any(name.startswith(f"{part}.") for name, _ in named_decoder_layers(model))
    return "vision_tower" if holds_blocks else "projector"
