"""Tensor-parallel plans: one per model family, a registry keyed by model class name, and plan selection.

A plan maps fully qualified module names (``*`` matches one path component) to ``ParallelStyle`` objects, as
``torch.distributed.tensor.parallel.parallelize_module`` expects. Every plan here leaves the logits sharded on
the vocabulary as a DTensor, so the loss runs under ``loss_parallel`` and the full logits are never gathered.
"""

from __future__ import annotations

import fnmatch
import importlib
from typing import Callable, Mapping, Union

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from lightning_automodel.parallel.styles import SequenceParallelAllGather

TPPlan = dict[str, ParallelStyle]
PlanFunction = Callable[[nn.Module, bool], Mapping[str, ParallelStyle]]
PlanSpec = Union[Mapping[str, ParallelStyle], str, PlanFunction]

_FAMILY_PLANS: dict[str, PlanFunction] = {}


def register_tp_plan(*class_names: str) -> Callable[[PlanFunction], PlanFunction]:
    """Register ``fn(model, sp) -> plan`` as the plan for models whose class has one of ``class_names``."""

    def register(fn: PlanFunction) -> PlanFunction:
        for name in class_names:
            _FAMILY_PLANS[name] = fn
        return fn

    return register


def _decoder_plan(prefix: str, *, sp: bool) -> TPPlan:
    """The Llama-architecture plan: attention and MLP Megatron-style, vocab-parallel embedding and lm_head.

    With ``sp`` the residual stream between blocks stays a ``Shard(1)`` DTensor: model-level code (rotary
    embeddings, mask construction) then sees the global sequence length, which plain local shards would hide.
    """
    layer = f"{prefix}.layers.*"
    plan: TPPlan = {
        f"{prefix}.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        f"{layer}.self_attn.q_proj": ColwiseParallel(),
        f"{layer}.self_attn.k_proj": ColwiseParallel(),
        f"{layer}.self_attn.v_proj": ColwiseParallel(),
        f"{layer}.self_attn.o_proj": RowwiseParallel(),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
        f"{layer}.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan.update({
            f"{prefix}.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            ),
            f"{layer}.input_layernorm": SequenceParallelAllGather(),
            f"{layer}.post_attention_layernorm": SequenceParallelAllGather(),
            f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            f"{prefix}.norm": SequenceParallel(use_local_output=False),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        })
    return plan


@register_tp_plan("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
def llama_plan(model: nn.Module, sp: bool) -> TPPlan:
    return _decoder_plan("model", sp=sp)


def default_plan(model: nn.Module, sp: bool) -> TPPlan:
    """Fallback for unregistered models: the Llama layout, which many decoder-only families share."""
    return _decoder_plan("model", sp=sp)


def _import_object(path: str) -> object:
    module_name, _, attribute = path.rpartition(".")
    if not module_name:
        raise ValueError(f"tp_plan={path!r} is not an import path; write it as 'package.module.name'.")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"tp_plan={path!r} could not be imported: {error}") from error


def _resolve_user_plan(spec: PlanSpec, model: nn.Module, sp: bool) -> TPPlan:
    if isinstance(spec, str):
        spec = _import_object(spec)
    if callable(spec) and not isinstance(spec, Mapping):
        spec = spec(model, sp)
    if not isinstance(spec, Mapping):
        raise TypeError(
            f"tp_plan must be a dict of module pattern -> ParallelStyle, an import path to one, or a function"
            f" (model, sp) -> dict; got {type(spec).__name__}."
        )
    return dict(spec)


def select_tp_plan(model: nn.Module, *, sp: bool, tp_plan: PlanSpec | None = None) -> tuple[TPPlan, str]:
    """Pick the plan for ``model`` and say where it came from: the user's, the family's, or the default."""
    if tp_plan is not None:
        return _resolve_user_plan(tp_plan, model, sp), "user"
    family = _FAMILY_PLANS.get(type(model).__name__)
    if family is not None:
        return dict(family(model, sp)), f"family plan for {type(model).__name__}"
    return default_plan(model, sp), "default Llama-style plan"


def unmatched_patterns(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> list[str]:
    """Plan keys that name no module of ``model`` (``parallelize_module`` skips them silently)."""
    names = [name for name, _ in model.named_modules()]
    return [pattern for pattern in plan if not any(_matches(pattern, name) for name in names)]


def _matches(pattern: str, name: str) -> bool:
    parts, name_parts = pattern.split("."), name.split(".")
    return len(parts) == len(name_parts) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, name_parts))
