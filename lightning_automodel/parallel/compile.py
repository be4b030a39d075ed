"""``compile``: every decoder block's forward compiled by ``torch.compile``, after tensor parallel and activation
checkpointing, before FSDP2 (torchtitan's order).

Blocks, not the whole model: a model's blocks share one graph (dynamo treats their parameters as inputs), so the
compile cost is one block's whatever the depth, and nothing outside them (embeddings, the head, the loss, Lightning's
loop) has to trace. The block's ``forward`` is replaced, not its call: the module hooks around it stay eager, so
FSDP2's all-gathers and reshards and the composable activation checkpoint run as without compile, and parameter
names stay the model's (an ``OptimizedModule`` wrapper would add ``_orig_mod.`` to every one of them). Tensor
parallel's and sequence parallel's hooks on the projections inside a block are traced with it.

Activation checkpointing composes in every mode: ``"full"``'s checkpoint wraps the compiled forward and recomputes
it; ``"selective"`` and ``"submodule"`` go inside it, as ``torch.utils.checkpoint`` calls dynamo traces (see
:mod:`~lightning_automodel.parallel.activation_checkpointing`). Under expert parallel the token exchange between the
ranks runs eagerly between a block's compiled graphs (its sizes are data: dynamo breaks the graph there), one
dispatch function for every layer; with ``"selective"`` or ``"submodule"`` that break would fall inside a checkpointed
region, where dynamo cannot break a graph and runs the whole block eagerly instead: refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from types import MethodType
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map
from transformers.cache_utils import Cache

from lightning_automodel.parallel.activation_checkpointing import ACMode
from lightning_automodel.parallel.model_calls import build_no_cache

CompileSpec = bool | dict[str, Any]

_COMPILE_OPTIONS = frozenset(inspect.signature(torch.compile).parameters) - {"model"}


def compile_options(compile: CompileSpec) -> dict[str, Any] | None:
    """The keyword arguments of ``torch.compile`` that ``compile`` asks for (None: no compile). True is torch's
    defaults; a dict is passed as it is, after its names are checked."""
    if compile is False:
        return None
    if compile is True:
        return {}
    if not isinstance(compile, dict):
        raise ValueError(f"compile={compile!r}: use False, True or a dict of torch.compile's keyword arguments.")
    unknown = sorted(set(compile) - _COMPILE_OPTIONS)
    if unknown:
        raise ValueError(
            f"compile={compile!r}: {', '.join(unknown)} not among torch.compile's keyword arguments"
            f" ({', '.join(sorted(_COMPILE_OPTIONS))})."
        )
    return dict(compile)


def check_compile(*, compile: CompileSpec, activation_checkpointing: ACMode, ep: int) -> None:
    """Under expert parallel, compile composes with full activation checkpointing or none (see the module's
    docstring)."""
    if compile is not False and ep > 1 and activation_checkpointing in ("selective", "submodule"):
        raise ValueError(
            f"compile with ep={ep} and activation_checkpointing={activation_checkpointing!r}: the experts' token"
            " exchange breaks the compiled graph (its sizes are data), and dynamo cannot break one inside a"
            " checkpointed region: it would run every block eagerly, compiling nothing. Use"
            " activation_checkpointing='full' (or True), or compile=False."
        )


def apply_compile(model: nn.Module, layers: Sequence[nn.Module], options: dict[str, Any]) -> None:
    """Compile each layer's forward in place with ``torch.compile(**options)``; calls with a cache run it eagerly.

    A key/value cache is state each layer updates in place (its index, whether its slot is filled): dynamo guards on
    it, so that every layer would compile a graph of its own, and past its recompile limit (8) run eagerly. The
    model's calls build none unless asked (:func:`build_no_cache`); ``generate``'s calls, which ask, run the blocks
    eagerly."""
    if not layers:
        raise ValueError(
            f"compile found no decoder layers in {type(model).__name__}: it compiles each block of a ModuleList of"
            " transformer blocks (model.layers in Hugging Face models)."
        )
    build_no_cache(model)
    for layer in layers:  # its current forward: the class's, or activation checkpointing's around it
        if not isinstance(layer.forward, MethodType):
            raise ValueError(
                f"compile: {type(layer).__name__}'s forward was replaced by {layer.forward!r}, not a method of the"
                " layer: compiling its class's forward would drop it. Compile the model yourself, or use compile=False."
            )
        layer.eager_forward = layer.forward.__func__
        layer.compiled_forward = torch.compile(layer.eager_forward, **options)
        layer.forward = MethodType(_compiled_unless_cached, layer)  # a module-level function: deepcopy rebinds it


# Decoder layers' names for caches that are no transformers Cache (tuples, Mamba's state); transformers 5.24 renamed
# past_key_values to cache.
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past", "cache_params")


def _compiled_unless_cached(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The layer's compiled forward, or the same eagerly when the call carries a cache."""
    cached = any(isinstance(value, Cache) for value in [*args, *kwargs.values()])
    if cached or any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS):
        return self.eager_forward(self, *args, **kwargs)
    args, kwargs = tree_map(_landed, (args, kwargs))
    return self.compiled_forward(self, *args, **kwargs)


def _landed(value: Any) -> Any:
    """``value``, or a DTensor whose shard is still in flight (tensor parallel's output redistributions are
    asynchronous: sequence parallel's first block receives the embedding's output as one) as a landed copy. Compiled
    for one and called with the other, a graph's runtime fails (torch 2.13 reads the in-flight wrapper's fields);
    and the first block would compile a graph of its own."""
    if isinstance(value, DTensor) and isinstance(value._local_tensor, AsyncCollectiveTensor):
        return value.clone()  # any op but a view waits for the collective and gives a DTensor of a plain tensor
    return value


__all__ = ["CompileSpec", "apply_compile", "check_compile", "compile_options"]
