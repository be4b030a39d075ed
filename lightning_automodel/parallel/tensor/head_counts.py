"""Head counts where attention reads them: once a plan splits its projections, a rank computes attention on its share
of the heads, and the counts and widths the module's own code reads must be that share.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import textwrap
from collections.abc import Collection

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle
from transformers import PreTrainedModel

from lightning_automodel.hf.layer_configs import attention_shapes
from lightning_automodel.hf.packed_weights import is_packed
from lightning_automodel.parallel.tensor.lora import LoraParallel
from lightning_automodel.parallel.tensor.sizes import model_config
from lightning_automodel.parallel.tensor.styles.parameters import HeadShardedParameters, localize_sizes
from lightning_automodel.parallel.tensor.styles.projections import PackedColwiseParallel, RegroupedColwiseParallel


def localize_head_counts(model: nn.Module, tp: int, *, split: Collection[str]) -> list[str]:
    """Make the head counts and head widths that attention modules read this rank's (global // tp); return what was
    changed (``module.attribute``, ``module.config.field``). A module's ``config`` is copied first: the model's own
    keeps the global counts.

    transformers 5 reshapes most attention with ``-1`` heads and needs nothing here; some read the global count
    (StableLM's ``self.num_heads``, Phi3's ``config.num_attention_heads``) or the width of all heads. The attributes
    are found by what they hold (the config's head counts, or heads x head size, under a name that says so) and by
    whether the module's own code reads them; the probe then checks the result.

    ``split``: the modules whose outputs the plan leaves split over tp (see :func:`splits_outputs`); attention modules
    are those with such a child. A projection whose output is gathered again leaves every head on every rank.
    """
    changed = []
    configs = _owning_configs(model)
    for name, module in model.named_modules():
        if not any((f"{name}.{child}" if name else child) in split for child, _ in module.named_children()):
            continue
        config = configs.get(name)
        if not _is_int(getattr(config, "num_attention_heads", None)):
            continue
        shapes = attention_shapes(config)
        counts, widths = _sizes(shapes, layer=getattr(module, "layer_idx", None))
        read = _attributes_read(type(module))
        attributes = [a for a, value in vars(module).items() if _is_count(a, value, counts) and _reads(read, a)]
        attributes += [a for a, value in vars(module).items() if _is_query_groups(a, value, shapes)]
        head_widths = [a for a, value in vars(module).items() if _is_width(a, value, widths) and _reads(read, a)]
        if attributes or _has_packed_child(module) or any("head" in a.lower() for a in head_widths):
            attributes += head_widths  # an attention module (BERT's all_head_size says so): widths are this rank's
        localize_sizes(module, {attribute: getattr(module, attribute) // tp for attribute in attributes})
        changed += [f"{name}.{attribute}" for attribute in attributes]
        changed += [f"{name}.config.{field}" for field in _localize_config(module, read, counts, tp)]
    return changed


def _owning_configs(model: nn.Module) -> dict[str, object]:
    """Each module's config, by name: that of the innermost model holding it (a vision tower's attention reads the
    tower's head counts, the language model's its own), the model's text config where no inner model has one."""
    configs: dict[str, object] = {"": model_config(model)}
    for name, module in model.named_modules():
        if name and isinstance(module, PreTrainedModel) and getattr(module, "config", None) is not None:
            configs[name] = model_config(module)
        elif name:
            configs[name] = configs[name.rpartition(".")[0]]
    return configs


def _sizes(shapes: list[tuple[int, int, int]], *, layer: int | None) -> tuple[set[int], set[int]]:
    """The head counts and head widths (heads x head width) a layer's attention may hold: its own layer's, where a
    heterogeneous config gives layers their own (one layer's head width may be another's width of all heads), else
    every layer's."""
    if len(shapes) > 1 and _is_int(layer) and layer < len(shapes):
        shapes = [shapes[layer]]
    split = [(count, head_dim) for heads, kv_heads, head_dim in shapes for count in _split_counts(heads, kv_heads)]
    return {count for count, _ in split}, {count * head_dim for count, head_dim in split}


def _split_counts(heads: int, kv_heads: int) -> tuple[int, ...]:
    """The head counts tp splits: a single key/value head (multi-query attention) stays whole on every rank."""
    return (heads,) if kv_heads == 1 else (heads, kv_heads)


def head_parameter_styles(model: nn.Module, *, split: Collection[str]) -> dict[str, HeadShardedParameters]:
    """Styles for the attention modules (those with a child whose output the plan splits) that hold parameters with
    one entry per head of the model (GPT-OSS's sinks), or buffers with a dimension of one entry per head (MiniMax's
    decay rates, on their first or second dimension): each rank keeps its heads' entries, by module name."""
    heads = getattr(model_config(model), "num_attention_heads", None)
    if not _is_int(heads):
        return {}
    styles = {}
    for name, module in model.named_modules():
        if not any((f"{name}.{child}" if name else child) in split for child, _ in module.named_children()):
            continue
        per_head = [n for n, p in module.named_parameters(recurse=False) if p.ndim in (1, 2) and p.shape[0] == heads]
        buffers = {
            n: dim for n, b in module.named_buffers(recurse=False) if (dim := _head_dim_of(b, heads)) is not None
        }
        if per_head or buffers:
            styles[name] = HeadShardedParameters(names=tuple(per_head), buffers=buffers)
    return styles


def _head_dim_of(buffer: torch.Tensor, heads: int) -> int | None:
    """The dimension of a buffer of three or more dimensions holding one entry per head (its first or second), or
    None (rotary tables, masks)."""
    if buffer.ndim < 3:
        return None
    return next(
        (dim for dim in (0, 1) if buffer.shape[dim] == heads and buffer.shape[dim - 1 if dim else 1] != heads), None
    )


def _localize_config(module: nn.Module, read: frozenset[str] | None, counts: set[int], tp: int) -> list[str]:
    from transformers import PretrainedConfig

    config = getattr(module, "config", None)
    if not isinstance(config, PretrainedConfig):
        return []
    aliases = getattr(config, "attribute_map", {}) or {}
    read_fields = None if read is None else {aliases.get(name, name) for name in read}
    fields = [f for f, value in vars(config).items() if _is_count(f, value, counts) and _reads(read_fields, f)]
    if fields:
        local = copy.copy(config)
        for field in fields:
            setattr(local, field, getattr(config, field) // tp)
        localize_sizes(module, {"config": local})
    return fields


def _has_packed_child(module: nn.Module) -> bool:
    """Whether a child is a packed projection: the module splits its output by the width of all heads (GPT-2's
    ``split_size``), which on this rank is the width of its heads, even where no head count is read."""
    return any(is_packed(p) for child in module.children() for p in child.parameters())


def splits_outputs(style: ParallelStyle) -> bool:
    """Whether ``style`` leaves its module's output split over tp as local tensors (column-parallel projections whose
    output is not gathered), so that the code around it holds this rank's share of the heads or hidden units."""
    inner = style.style if isinstance(style, LoraParallel) else style
    if isinstance(inner, PackedColwiseParallel | RegroupedColwiseParallel):
        return True
    return isinstance(inner, ColwiseParallel) and inner.output_layouts[0].is_shard() and inner.use_local_output


def _model_code(klass: type) -> bool:
    """A class of a model's own code: not ``object``, not torch's, not transformers' shared base classes."""
    module = klass.__module__
    if klass is object or module == "torch" or module.startswith("torch."):
        return False
    return not module.startswith("transformers.") or module.startswith("transformers.models.")


def _is_count(name: str, value: object, counts: set[int]) -> bool:
    lowered = name.lower()
    return _is_int(value) and value in counts and "head" in lowered and "dim" not in lowered and "size" not in lowered


def _is_query_groups(name: str, value: object, shapes: list[tuple[int, int, int]]) -> bool:
    """Query heads per key/value head under multi-query attention (GPT-BigCode's ``num_key_value_groups``): all the
    query heads, of which this rank computes its share against the one key/value head it keeps whole. transformers'
    shared attention functions read it, outside the module's own code."""
    return _is_int(value) and "group" in name.lower() and any(kv == 1 and value == heads for heads, kv, _ in shapes)


def _is_width(name: str, value: object, widths: set[int]) -> bool:
    lowered = name.lower()
    return _is_int(value) and value in widths and ("size" in lowered or "dim" in lowered)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _reads(read: frozenset[str] | set[str] | None, name: str) -> bool:
    return read is None or name in read


@functools.cache
def _attributes_read(cls: type) -> frozenset[str] | None:
    """Every ``x.name`` the methods of ``cls`` and of its bases read, ``__init__`` aside, up to torch's and
    transformers' own base classes; None when their source is not available (every attribute then counts as read)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not _model_code(klass):
            continue
        for attribute, function in vars(klass).items():
            if attribute == "__init__" or not inspect.isfunction(function):
                continue
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
            except (OSError, TypeError, SyntaxError):
                return None
            names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    return frozenset(names)
