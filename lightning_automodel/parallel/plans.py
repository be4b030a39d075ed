"""Tensor-parallel plans: one per model family, a registry keyed by model class name, and plan selection.

A plan maps fully qualified module names (``*`` matches one path component) to ``ParallelStyle`` objects, as
``torch.distributed.tensor.parallel.parallelize_module`` expects. Every plan here leaves the logits sharded on
the vocabulary as a DTensor, so the loss runs under ``loss_parallel`` and the full logits are never gathered.
"""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Callable, Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_automodel.parallel.hf_plan import hf_style_strings, hf_tp_plan, translate_style
from lightning_automodel.parallel.styles import (
    HeadShardedNorm,
    PackedColwiseParallel,
    RegroupedColwiseParallel,
    SequenceParallelAllGather,
)
from lightning_automodel.parallel.validation import model_config

TPPlan = dict[str, ParallelStyle]
PlanFunction = Callable[[nn.Module, bool], Mapping[str, ParallelStyle]]
PlanSpec = Mapping[str, ParallelStyle | str] | str | PlanFunction

_FAMILY_PLANS: dict[str, PlanFunction] = {}


def register_tp_plan(*class_names: str) -> Callable[[PlanFunction], PlanFunction]:
    """Register ``fn(model, sp) -> plan`` as the plan for models whose class has one of ``class_names``."""

    def register(fn: PlanFunction) -> PlanFunction:
        for name in class_names:
            _FAMILY_PLANS[name] = fn
        return fn

    return register


def _decoder_plan(
    prefix: str,
    *,
    sp: bool,
    gathering_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm"),
    stream_norms: tuple[str, ...] = (),
    qk_norm: bool = False,
    lm_head: bool = True,
) -> TPPlan:
    """The Llama-architecture plan: attention and MLP Megatron-style, vocab-parallel embedding and lm_head.

    ``gathering_norms`` open a block (attention or MLP) and must hand it the full sequence; ``stream_norms`` act
    on a block's output before the residual add (Gemma's sandwich norms) and stay sequence-sharded. With ``sp``
    the residual stream between blocks stays a ``Shard(1)`` DTensor: model-level code (rotary embeddings, mask
    construction) then sees the global sequence length, which plain local shards would hide.
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
    }
    if qk_norm:
        plan[f"{layer}.self_attn.q_norm"] = HeadShardedNorm()
        plan[f"{layer}.self_attn.k_norm"] = HeadShardedNorm()
    if lm_head:
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if sp:
        plan.update(
            {
                f"{prefix}.embed_tokens": RowwiseParallel(
                    input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
                ),
                f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                f"{prefix}.norm": SequenceParallel(use_local_output=False),
            }
        )
        plan.update({f"{layer}.{norm}": SequenceParallelAllGather() for norm in gathering_norms})
        plan.update({f"{layer}.{norm}": SequenceParallel(use_local_output=False) for norm in stream_norms})
        if lm_head:
            plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    return plan


@register_tp_plan("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
def llama_plan(model: nn.Module, sp: bool) -> TPPlan:
    return _decoder_plan("model", sp=sp)


@register_tp_plan("Qwen3ForCausalLM")
def qwen3_plan(model: nn.Module, sp: bool) -> TPPlan:
    """Llama plus per-head q_norm/k_norm, whose weights see only this rank's heads."""
    return _decoder_plan("model", sp=sp, qk_norm=True)


@register_tp_plan("Qwen3ForSequenceClassification")
def qwen3_classification_plan(model: nn.Module, sp: bool) -> TPPlan:
    """The Qwen3 body; the small ``score`` head stays replicated and, with sp, gets the full sequence back."""
    plan = _decoder_plan("model", sp=sp, qk_norm=True, lm_head=False)
    if sp:
        plan["score"] = PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True
        )
    return plan


@register_tp_plan("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
def gemma3_plan(model: nn.Module, sp: bool) -> TPPlan:
    """Per-head q_norm/k_norm, sandwich norms around each block; the vision tower of the multimodal model is
    left to FSDP."""
    prefix = "model.language_model" if type(model).__name__ == "Gemma3ForConditionalGeneration" else "model"
    return _decoder_plan(
        prefix,
        sp=sp,
        gathering_norms=("input_layernorm", "pre_feedforward_layernorm"),
        stream_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
        qk_norm=True,
    )


@register_tp_plan("Phi3ForCausalLM")
def phi3_plan(model: nn.Module, sp: bool) -> TPPlan:
    """Llama layout with Phi3's fused projections sharded block by block (the reference replicates attention).

    [gate; up], and [q; k; v] with as many KV heads as heads, are blocks of equal size: each rank holds its
    slice of every block. With grouped KV heads the [q; k; v] blocks differ in size, no placement describes
    that split, and the projection output is regrouped instead (one all-gather per layer).
    """
    config = model_config(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer = "model.layers.*"
    plan = _decoder_plan("model", sp=sp)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        del plan[f"{layer}.{name}"]
    if q_size == kv_size:
        plan[f"{layer}.self_attn.qkv_proj"] = PackedColwiseParallel(parts=3)
    else:
        plan[f"{layer}.self_attn.qkv_proj"] = RegroupedColwiseParallel(block_sizes=(q_size, kv_size, kv_size))
    plan[f"{layer}.mlp.gate_up_proj"] = PackedColwiseParallel(parts=2)
    return plan


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
    plan = {}
    for pattern, style in spec.items():
        style = translate_style(style, pattern) if isinstance(style, str) else style
        if style is not None:  # "replicate": nothing to shard
            plan[pattern] = style
    return plan


def select_tp_plan(model: nn.Module, *, sp: bool, tp_plan: PlanSpec | None = None) -> tuple[TPPlan, str]:
    """Pick the plan for ``model`` and say where it came from, in this priority: the user's ``tp_plan``, the
    family plan registered for its class, the model's own Hugging Face plan, the default Llama-style plan."""
    if tp_plan is not None:
        return _resolve_user_plan(tp_plan, model, sp), "user plan"
    family = _FAMILY_PLANS.get(type(model).__name__)
    if family is not None:
        return dict(family(model, sp)), f"family plan for {type(model).__name__}"
    if hf_style_strings(model):
        return hf_tp_plan(model, sp), f"Hugging Face plan of {type(model).__name__}"
    return llama_plan(model, sp), "default Llama-style plan"  # the layout many decoder-only families share


def unmatched_patterns(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> list[str]:
    """Plan keys that name no module of ``model`` (``parallelize_module`` skips them silently)."""
    names = [name for name, _ in model.named_modules()]
    return [pattern for pattern in plan if not any(pattern_matches(pattern, name) for name in names)]


def unsharded_linears(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> list[str]:
    """Large Linears that the plan leaves whole inside the blocks it shards: a plan that misses them (an MLP
    named differently, say) runs, but every rank then holds and computes those weights in full.

    Large: at least an eighth of the largest Linear the plan shards. Blocks: the items of ModuleLists.
    """
    modules = dict(model.named_modules())
    matched = {name for name in modules if any(pattern_matches(pattern, name) for pattern in plan)}

    def covered(name: str) -> bool:  # a matched module, or inside one (a LoRA layer's base_layer and adapters)
        return any(name == m or name.startswith(f"{m}.") for m in matched)

    linears = {name: m for name, m in modules.items() if isinstance(m, nn.Linear)}
    sharded = [m.weight.numel() for name, m in linears.items() if covered(name)]
    if not sharded:
        return []
    blocks = {
        f"{name}.{index}"
        for name, module in modules.items()
        if isinstance(module, nn.ModuleList)
        for index in range(len(module))
    }
    touched = {block for block in blocks if any(name.startswith(f"{block}.") for name in matched)}
    return [
        name
        for name, module in linears.items()
        if not covered(name)
        and module.weight.numel() * 8 >= max(sharded)
        and any(name.startswith(f"{block}.") for block in touched)
    ]


def pattern_matches(pattern: str, name: str) -> bool:
    """Whether module ``name`` matches plan key ``pattern`` (``*`` stands for one path component)."""
    parts, name_parts = pattern.split("."), name.split(".")
    if len(parts) != len(name_parts):
        return False
    return all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, name_parts, strict=True))
