"""Tensor-parallel plans written by hand for model families, registered by model class name.

A plan maps module names (``*``: one path component) to ``ParallelStyle`` objects, as ``parallelize_module`` expects;
these leave the logits vocabulary-sharded, so the loss runs under ``loss_parallel``.
"""

from __future__ import annotations

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

from lightning_automodel.parallel.tensor.sizes import model_config
from lightning_automodel.parallel.tensor.styles.projections import PackedColwiseParallel, RegroupedColwiseParallel
from lightning_automodel.parallel.tensor.styles.stream import SequenceParallelAllGather

TPPlan = dict[str, ParallelStyle]
PlanFunction = Callable[[nn.Module, bool], Mapping[str, ParallelStyle]]

_FAMILY_PLANS: dict[str, PlanFunction] = {}


def register_tp_plan(*class_names: str) -> Callable[[PlanFunction], PlanFunction]:
    """Register ``fn(model, sp) -> plan`` as the plan for models whose class has one of ``class_names``."""

    def register(fn: PlanFunction) -> PlanFunction:
        for name in class_names:
            _FAMILY_PLANS[name] = fn
        return fn

    return register


def family_plan(class_name: str) -> PlanFunction | None:
    """The plan function registered for ``class_name``, or None."""
    return _FAMILY_PLANS.get(class_name)


def _decoder_plan(
    prefix: str,
    *,
    sp: bool,
    gathering_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm"),
    stream_norms: tuple[str, ...] = (),
    lm_head: bool = True,
    merged: bool = False,
) -> TPPlan:
    """The Llama-architecture plan: attention and MLP Megatron-style, vocab-parallel embedding and lm_head.

    ``gathering_norms`` open a block (attention or MLP) and must hand it the full sequence; ``stream_norms`` act
    on a block's output before the residual add (Gemma's sandwich norms) and stay sequence-sharded. With ``sp``
    the residual stream between blocks stays a ``Shard(1)`` DTensor: model-level code (rotary embeddings, mask
    construction) then sees the global sequence length, which plain local shards would hide.

    ``merged``: the language model (``prefix``) of a multimodal model, given its embeddings by the model around it
    once image features are scattered into them: the embedding's output stays whole, and the stream is split where
    the language model receives ``inputs_embeds`` (a slice of each rank's copy, no communication).
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
        if merged:
            plan[f"{prefix}.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
            plan[prefix] = PrepareModuleInput(
                input_kwarg_layouts={"inputs_embeds": Replicate()},
                desired_input_kwarg_layouts={"inputs_embeds": Shard(1)},
                use_local_output=False,
            )
    return plan


@register_tp_plan("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
def llama_plan(model: nn.Module, sp: bool) -> TPPlan:
    """The Llama layout; an attention's output gate, where it has one (AFMoE's ``self_attn.gate_proj``, multiplied
    into the heads' output unit by unit), column-parallel with the heads."""
    plan = _decoder_plan("model", sp=sp)
    if any(name.endswith(".self_attn.gate_proj") for name, _ in model.named_modules()):
        plan["model.layers.*.self_attn.gate_proj"] = ColwiseParallel()
    return plan


@register_tp_plan("Qwen3ForCausalLM")
def qwen3_plan(model: nn.Module, sp: bool) -> TPPlan:
    """The Llama layout. Its per-head q_norm/k_norm, which see only this rank's heads, need no entry: the probe
    finds them (see :mod:`lightning_automodel.parallel.tensor.sharded_activations`)."""
    return _decoder_plan("model", sp=sp)


@register_tp_plan("Qwen3ForSequenceClassification")
def qwen3_classification_plan(model: nn.Module, sp: bool) -> TPPlan:
    """The Qwen3 body; the small ``score`` head stays replicated and, with sp, gets the full sequence back."""
    plan = _decoder_plan("model", sp=sp, lm_head=False)
    if sp:
        plan["score"] = PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True
        )
    return plan


@register_tp_plan("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
def gemma3_plan(model: nn.Module, sp: bool) -> TPPlan:
    """Sandwich norms around each block (per-head q_norm/k_norm as Qwen3); the multimodal model's language model
    receives embeddings the image features are merged into (``merged``)."""
    merged = type(model).__name__ == "Gemma3ForConditionalGeneration"
    return _decoder_plan(
        "model.language_model" if merged else "model",
        sp=sp,
        merged=merged,
        gathering_norms=("input_layernorm", "pre_feedforward_layernorm"),
        stream_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
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
