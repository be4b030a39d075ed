"""Tensor-parallel plans: one per model family, a registry keyed by model class name, and plan selection.

A plan maps fully qualified module names (``*`` matches one path component) to ``ParallelStyle`` objects, as
``torch.distributed.tensor.parallel.parallelize_module`` expects. Every plan here leaves the logits sharded on
the vocabulary as a DTensor, so the loss runs under ``loss_parallel`` and the full logits are never gathered.

A plan is chosen by what it covers: of the family plan, the model's own Hugging Face plan, the default Llama-style
plan and a plan derived from the model's data flow (:mod:`.derived`), the first that shards every decoder block (see
:func:`select_tp_plan`, :func:`coverage`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_automodel.hf.decoder_layers import named_decoder_layers
from lightning_automodel.hf.peft import is_lora_layer
from lightning_automodel.parallel.experts.tensor_parallel import ExpertTensorParallel, experts_problem, is_experts
from lightning_automodel.parallel.probe import Trace
from lightning_automodel.parallel.tensor.derived_plan import derived_plan
from lightning_automodel.parallel.tensor.hf_plan import hf_style_strings, hf_tp_plan, translate_style
from lightning_automodel.parallel.tensor.lora import LoraParallel
from lightning_automodel.parallel.tensor.patterns import pattern_matches
from lightning_automodel.parallel.tensor.plan_completion import completed
from lightning_automodel.parallel.tensor.sequence_parallel import with_sequence_parallel
from lightning_automodel.parallel.tensor.sizes import model_config
from lightning_automodel.parallel.tensor.styles import (
    Conv1DColwiseParallel,
    Conv1DRowwiseParallel,
    KeptWhole,
    PackedColwiseParallel,
    RegroupedColwiseParallel,
    SequenceParallelAllGather,
)

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
    """Sandwich norms around each block (per-head q_norm/k_norm as Qwen3); the vision tower of the multimodal model
    is left to FSDP."""
    prefix = "model.language_model" if type(model).__name__ == "Gemma3ForConditionalGeneration" else "model"
    return _decoder_plan(
        prefix,
        sp=sp,
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
        style = translate_style(style, pattern, model=model) if isinstance(style, str) else style
        if style is not None:  # "replicate": nothing to shard
            plan[pattern] = style
    return plan


@dataclass
class PlanChoice:
    """The plan a model gets, where it came from, why it won, and what it leaves whole."""

    plan: TPPlan
    source: str  # "user plan", "family plan for X", "Hugging Face plan of X", "default Llama-style plan", "derived ..."
    reason: str
    unsharded_weights: list[str] = field(default_factory=list)  # large block weights left whole on every tp rank
    unmatched: list[str] = field(default_factory=list)  # patterns naming no module


@dataclass
class Coverage:
    """What a plan does to the decoder blocks: the large weights it leaves whole, the share of their elements it
    shards, or why it cannot be applied at all."""

    unsharded: list[str]
    sharded_share: float
    unusable: str | None = None
    matches_any: bool = True


def select_tp_plan(
    model: nn.Module,
    *,
    sp: bool,
    tp_plan: PlanSpec | None = None,
    allow_unsharded_linears: bool = False,
    blocks: Sequence[tuple[str, nn.Module]] | None = None,
    trace: Trace | None = None,
) -> PlanChoice:
    """The plan for ``model``: the user's ``tp_plan`` if given, else the first of the family plan registered for its
    class, its own Hugging Face plan, the default Llama-style plan and the derived plan that shards every decoder
    block (candidates after the first that does are not built: deriving one runs a step on the meta device).

    ``blocks``: the decoder blocks a text-only step runs (by default every block, see
    :func:`~lightning_automodel.hf.decoder_layers.named_decoder_layers`). A plan that leaves a large weight of a block
    whole is refused unless ``allow_unsharded_linears``; then the candidate sharding the largest share of the blocks'
    weights wins. Raises a ValueError naming what each candidate lacks.

    ``trace``: a probe step of the model (see :mod:`~lightning_automodel.parallel.probe`), where known: the weights
    of modules it never calls (a decoder's cross-attention) need no sharding, and a candidate without a
    sequence-parallel layout of its own gets one with ``sp`` (see :mod:`.sequence_parallel`).
    """
    blocks = named_decoder_layers(model) if blocks is None else blocks
    called = trace.called if trace is not None else None
    if tp_plan is not None:
        plan = _resolve_user_plan(tp_plan, model, sp)
        found = coverage(model, plan, blocks, called=called)
        _refuse_if_incomplete(model, "user plan", plan, found, allow=allow_unsharded_linears)
        return _choice(model, plan, "user plan", "it was given (tp_plan=)", found)
    verdicts: list[tuple[str, TPPlan | None, Coverage]] = []
    for source, build in _candidates(model, trace=trace):
        try:
            plan = build(sp)
        except ValueError as error:  # a Hugging Face plan with styles we cannot apply, or no sequence-parallel layout
            verdicts.append((source, None, Coverage([], 0.0, unusable=str(error))))
            continue
        verdicts.append((source, plan, coverage(model, plan, blocks, called=called)))
        if _complete(verdicts[-1][2]):
            break
    complete = [(source, plan, found) for source, plan, found in verdicts if _complete(found)]
    if complete:
        source, plan, found = complete[0]
        return _choice(model, plan, source, _why(source, verdicts, "it shards every decoder block"), found)
    usable = [(source, plan, found) for source, plan, found in verdicts if found.unusable is None and found.matches_any]
    if allow_unsharded_linears and usable:
        source, plan, found = max(usable, key=lambda verdict: verdict[2].sharded_share)  # the first of equals
        reason = f"it shards the largest share of the decoder blocks' weights ({found.sharded_share:.0%})"
        return _choice(model, plan, source, _why(source, verdicts, reason), found)
    raise ValueError(_no_plan_message(model, verdicts, allow=allow_unsharded_linears))


def _candidates(model: nn.Module, *, trace: Trace | None) -> list[tuple[str, Callable[[bool], TPPlan]]]:
    name = type(model).__name__
    candidates = []
    family = _FAMILY_PLANS.get(name)
    if family is not None:
        candidates.append((f"family plan for {name}", lambda sp: dict(family(model, sp))))
    if hf_style_strings(model):
        candidates.append((f"Hugging Face plan of {name}", lambda sp: _hf_plan(model, sp=sp, trace=trace)))
    # The layout many decoder-only families share, under the names Llama gives it.
    candidates.append(("default Llama-style plan", lambda sp: completed(model, llama_plan(model, sp), sp=sp)))
    # Entries column-, exits row-parallel, found by following the data through the blocks, whatever their names.
    derived_source = f"derived plan (entries column-, exits row-parallel) for {name}"
    candidates.append((derived_source, lambda sp: _with_layout(model, derived_plan(model), sp=sp, trace=trace)))
    return candidates


def _hf_plan(model: nn.Module, *, sp: bool, trace: Trace | None) -> TPPlan:
    return _with_layout(model, hf_tp_plan(model), sp=sp, trace=trace)


def _with_layout(model: nn.Module, plan: TPPlan, *, sp: bool, trace: Trace | None) -> TPPlan:
    """A plan that carries no sequence-parallel layout (a model's Hugging Face plan, a derived plan), completed; with
    ``sp``, with the layout derived for it."""
    plan = completed(model, plan, sp=sp)
    return with_sequence_parallel(model, plan, trace=trace) if sp else plan


def _complete(found: Coverage) -> bool:
    return found.unusable is None and found.matches_any and not found.unsharded


def _choice(model: nn.Module, plan: TPPlan, source: str, reason: str, found: Coverage) -> PlanChoice:
    return PlanChoice(plan, source, reason, found.unsharded, unmatched_patterns(model, plan))


def _why(chosen: str, verdicts: Sequence[tuple[str, TPPlan | None, Coverage]], because: str) -> str:
    before = [source for source, _, _ in verdicts].index(chosen)
    passed_over = [f"the {source} {_shortcoming(found)}" for source, _, found in verdicts[:before]]
    return because + (f" ({'; '.join(passed_over)})" if passed_over else "")


def _shortcoming(found: Coverage) -> str:
    if found.unusable is not None:
        return f"cannot be used: {found.unusable}"
    if not found.matches_any:
        return "matches no module"
    return f"leaves {_listed(found.unsharded)} whole"


def _refuse_if_incomplete(model: nn.Module, source: str, plan: TPPlan, found: Coverage, *, allow: bool) -> None:
    if found.unusable is not None:
        raise ValueError(f"The {source} cannot be applied to {type(model).__name__}: {found.unusable}")
    if not found.matches_any:
        raise ValueError(
            f"The {source} matches no module of {type(model).__name__}: {sorted(plan)}. Pass tp_plan= with"
            " patterns over the names in model.named_modules()."
        )
    if found.unsharded and not allow:
        raise ValueError(
            f"The {source} leaves large weights of {type(model).__name__}'s decoder blocks unsharded:"
            f" {_listed(found.unsharded)}. Every tp rank would hold and compute them in full. Add them to tp_plan=,"
            " or pass allow_unsharded_linears=True if that is intended."
        )


def _no_plan_message(model: nn.Module, verdicts: Sequence[tuple[str, TPPlan | None, Coverage]], *, allow: bool) -> str:
    name = type(model).__name__
    found = "; ".join(f"the {source} {_shortcoming(coverage)}" for source, _, coverage in verdicts)
    absent = [f"no family plan is registered for {name}"] if name not in _FAMILY_PLANS else []
    absent += [f"{name} has no Hugging Face plan"] if not hf_style_strings(model) else []
    if allow:
        return (
            f"No tensor-parallel plan applies to {name}: {found}"
            + (f" ({'; '.join(absent)})" if absent else "")
            + ". Pass tp_plan= with styles for its modules (names as in model.named_modules()), or use tp=1."
        )
    return (
        f"No tensor-parallel plan shards every decoder block of {name}, so every tp rank would hold and compute them"
        f" whole: {found}" + (f" ({'; '.join(absent)})" if absent else "") + ". Pass tp_plan= with styles for those"
        " modules (names as in model.named_modules()), allow_unsharded_linears=True to train with them whole, or"
        " tp=1."
    )


def _listed(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def coverage(
    model: nn.Module,
    plan: Mapping[str, ParallelStyle],
    blocks: Sequence[tuple[str, nn.Module]],
    *,
    called: Callable[[str], bool] | None = None,
) -> Coverage:
    """What ``plan`` does to the large weights of ``blocks``, judged from its styles without applying it.

    Large: at least an eighth of the block's largest matrix (an expert's, for experts fused in a 3D tensor) among the
    weights (tensors of two or more dimensions) of modules a step calls (``called``, by module name; every module when
    None), but for projections a plan keeps whole on purpose (:class:`KeptWhole`: low-rank projections, routers). A
    weight counts as sharded when a style that splits weights (column-, row-wise, packed, experts, and their LoRA
    forms) matches its module or a module around it. A style matched to a module it cannot shard makes the plan
    unusable.
    """
    modules = dict(model.named_modules())
    matched = [(name, style) for pattern, style in plan.items() for name in modules if pattern_matches(pattern, name)]
    for name, style in matched:
        problem = unsupported_target(style, modules[name])
        if problem is not None:
            return Coverage([], 0.0, unusable=f"{problem} ({name})", matches_any=True)
    sharding = [name for name, style in matched if isinstance(style, _WEIGHT_SHARDING_STYLES)]
    sharded = {id(p) for name in sharding for p in modules[name].parameters()}
    whole_by_design = {
        id(p) for name, style in matched if isinstance(style, KeptWhole) for p in modules[name].parameters()
    }
    experts = {id(p) for module in modules.values() if is_experts(module) for p in module.parameters(recurse=False)}
    unsharded, total, split = [], 0, 0
    for block_name, block in blocks:
        weights = {
            id(p): (name, p)
            for name, p in block.named_parameters()
            if p.ndim >= 2
            and id(p) not in whole_by_design
            and (called is None or called(_join(block_name, name.rpartition(".")[0])))
        }
        largest = max((_matrix_size(p, experts=experts) for _, p in weights.values()), default=0)
        for pid, (name, param) in weights.items():
            if _matrix_size(param, experts=experts) * 8 < largest:
                continue
            total += param.numel()
            if pid in sharded:
                split += param.numel()
            else:
                unsharded.append(f"{block_name}.{name.rpartition('.')[0] or name}")
    unique = list(dict.fromkeys(unsharded))
    return Coverage(unique, split / total if total else 1.0, matches_any=bool(matched))


def _matrix_size(param: nn.Parameter, *, experts: set[int]) -> int:
    """The elements of one matrix of a weight: an expert's for fused experts (``experts``: their parameters' ids),
    whose tokens each meet a few experts; measured by the whole tensor, a layer of 128 experts would make every
    attention weight look small."""
    return param[0].numel() if id(param) in experts else param.numel()


def _join(block_name: str, module_name: str) -> str:
    return f"{block_name}.{module_name}" if module_name else block_name


# Styles that split the weights of the module they are given (the rest prepare inputs and outputs, or replicate).
_WEIGHT_SHARDING_STYLES = (ColwiseParallel, RowwiseParallel, PackedColwiseParallel, LoraParallel, ExpertTensorParallel)


def _shardable(style: ParallelStyle) -> tuple[type, ...]:
    """The modules ``style`` can shard (torch's column- and row-wise styles raise mid-way on others)."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(style, Conv1DColwiseParallel | Conv1DRowwiseParallel):
        return (nn.Linear, nn.Embedding, Conv1D)
    if isinstance(style, PackedColwiseParallel):
        return (nn.Linear, Conv1D)
    if isinstance(style, RegroupedColwiseParallel):
        return (nn.Linear,)
    return (nn.Linear, nn.Embedding) if isinstance(style, ColwiseParallel | RowwiseParallel) else ()


def unsupported_target(style: ParallelStyle, module: nn.Module) -> str | None:
    """Why ``style`` cannot shard ``module`` (torch's styles raise mid-way through sharding), or None."""
    base = module.base_layer if is_lora_layer(module) else module
    inner = style.style if isinstance(style, LoraParallel) else style
    if isinstance(inner, ExpertTensorParallel):
        return experts_problem(base)
    supported = _shardable(inner)
    if not supported or isinstance(base, supported):
        return None
    kinds = " and ".join(f"nn.{t.__name__}" if t.__module__.startswith("torch.") else t.__name__ for t in supported)
    return f"{type(inner).__name__} shards {kinds} only, and this module is a {type(base).__name__}"


def unmatched_patterns(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> list[str]:
    """Plan keys that name no module of ``model`` (``parallelize_module`` skips them silently)."""
    names = [name for name, _ in model.named_modules()]
    return [pattern for pattern in plan if not any(pattern_matches(pattern, name) for name in names)]
