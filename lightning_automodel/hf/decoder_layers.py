"""The decoder blocks of a model: what tensor parallel must shard, activation checkpointing recomputes and FSDP2
gathers one at a time."""

from __future__ import annotations

import inspect
import re
from collections import Counter

from torch import nn
from transformers import PreTrainedModel


def named_decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model`` with their names, in registration order: the items of its outermost ModuleLists that
    hold parameters (``model.layers.*``, and a vision tower's encoder layers in a multimodal model).

    Lists inside a block (per-head norms, a block's own sub-layers) belong to the block; the items of a list of lists
    are blocks, and so are those of the lists in an item without a forward of its own (a container its model indexes
    into, never calls: Chameleon's VQ-GAN's resolution levels). A block listed twice (one module shared by two lists)
    appears once, under its first name.
    """
    found: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, nn.ModuleList):
                take_items(path, child)
            else:
                visit(f"{path}.", child)

    def take_items(path: str, items: nn.ModuleList) -> None:
        for index, block in items.named_children():
            if isinstance(block, nn.ModuleList):
                take_items(f"{path}.{index}", block)
            elif type(block).forward is nn.Module.forward:
                visit(f"{path}.{index}.", block)
            elif id(block) not in seen and any(True for _ in block.parameters()):
                seen.add(id(block))
                found.append((f"{path}.{index}", block))

    visit("", model)
    return found


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model`` (see :func:`named_decoder_layers`)."""
    return [block for _, block in named_decoder_layers(model)]


def layers_sharing_parameters(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """The layers holding a parameter that another layer or the rest of the model holds too (Zamba ties the shared
    attention block of every hybrid layer to the first one's).

    Such a parameter can live in one FSDP unit only: a layer holding it cannot be a unit of its own, and leaves it to
    the unit around it.
    """
    everywhere = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    in_layers = Counter(id(p) for layer in layers for _, p in layer.named_parameters(remove_duplicate=False))
    layers_holding = Counter(id(p) for layer in layers for p in layer.parameters())
    shared = {pid for pid, count in layers_holding.items() if count > 1 or everywhere[pid] > in_layers[pid]}
    return [layer for layer in layers if any(id(p) in shared for p in layer.parameters())]


def named_multimodal_parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The parts of a multimodal model beside its language model, with their names: the vision tower and the projector
    (LLaVA's and Gemma 3's ``multi_modal_projector``; Qwen2-VL's merger sits in its tower ``visual``), the modules
    holding parameters that sit next to the language model. None for a model whose language model is the base model
    itself (a causal LM: its siblings are the lm_head and other heads)."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    owners = {id(child): (name, module) for name, module in model.named_modules() for child in module.children()}
    if decoder is None or id(decoder) not in owners:
        return []
    owner_name, owner = owners[id(decoder)]
    if owner is model:
        return []
    prefix = f"{owner_name}." if owner_name else ""
    return [
        (f"{prefix}{name}", child)
        for name, child in owner.named_children()
        if child is not decoder and any(True for _ in child.parameters())
    ]


def named_language_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks of :func:`named_decoder_layers` outside :func:`named_multimodal_parts`: the language model's, whose
    residual stream sequence parallel splits (all of them, in a text model)."""
    beside = tuple(f"{name}." for name, _ in named_multimodal_parts(model))
    return [(name, block) for name, block in named_decoder_layers(model) if not beside or not name.startswith(beside)]


def multimodal_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP units of :func:`named_multimodal_parts` beside their blocks'. A part that is a model of its own
    (CLIP's ``CLIPVisionModel``) gives its children instead (its embeddings and norms; Qwen2-VL's patch embedding and
    merger): transformers finds the layers whose outputs it records (LLaVA reads a tower layer's hidden states) by
    the model's class, which a unit's class would replace."""
    return [unit for _, unit in named_multimodal_units(model)]


def named_multimodal_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """:func:`multimodal_units` with their names."""
    return [unit for name, part in named_multimodal_parts(model) for unit in _units(name, part)]


def _units(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module`` (named ``name``) as units: none where its parameters all sit in lists of blocks (units of their
    own)."""
    in_lists = {id(p) for child in module.modules() if isinstance(child, nn.ModuleList) for p in child.parameters()}
    if all(id(p) in in_lists for p in module.parameters()):
        return []
    if not isinstance(module, PreTrainedModel):
        return [(name, module)]
    read = _read_without_calls(module)
    children = [(child_name, child) for child_name, child in module.named_children() if child_name not in read]
    return [unit for child_name, child in children for unit in _units(f"{name}.{child_name}", child)]


def _read_without_calls(module: nn.Module) -> set[str]:
    """The children whose weights ``module``'s own forward reads and never calls (DeepSeek-OCR 2's learned queries,
    ``self.query_768_resolution.weight``): FSDP2 gathers a unit's weights around its calls only, so the unit around
    ``module`` holds them."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return set()
    read = set(re.findall(r"self\.(\w+)\.(?:weight|bias)\b", source))
    return {name for name in read if not re.search(rf"self\.{name}\(", source)}
