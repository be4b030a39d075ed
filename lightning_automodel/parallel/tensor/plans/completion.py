"""Completing a plan with the layouts its patterns leave out, found by structure: the experts of mixture-of-experts
layers (their block's routers kept whole, its shared experts split), state-space and short-convolution mixers,
multi-head latent attention, sparse attention's indexer and per-layer inputs. Hugging Face plans that predate fused
experts or leave attention out, and the Llama-style and derived plans, would leave them whole.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_automodel.hf.peft import is_lora_layer
from lightning_automodel.parallel.tensor.plans.patterns import keyed_by_position, matches_inside, pattern_matches
from lightning_automodel.parallel.tensor.sizes import model_config
from lightning_automodel.parallel.tensor.styles.experts import (
    ExpertTensorParallel,
    is_experts,
    is_stacked_experts,
)
from lightning_automodel.parallel.tensor.styles.inputs import SplitArgument
from lightning_automodel.parallel.tensor.styles.mixers import mixer_style
from lightning_automodel.parallel.tensor.styles.parameters import OutputGradientSummed
from lightning_automodel.parallel.tensor.styles.projections import (
    KeptWhole,
    LatentKeyValueProjection,
    OwnedOutputRowwiseParallel,
)
from lightning_automodel.parallel.tensor.styles.state_space import StateSpaceMixerParallel
from lightning_automodel.parallel.tensor.styles.stream import WholeSequenceRegion

# Multi-head latent attention under transformers' names: the down-projections stay whole, the per-head up-projections
# are column- and the output row-parallel.
_LATENT_ATTENTION = ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
_GATED_MLP = ("gate_proj", "up_proj", "down_proj")
# DeepSeek sparse attention's indexer (V3.2, GLM-MoE-DSA): its heads' scores are summed before a top-k of tokens, and
# transformers runs it without gradients. Split, each rank would need the others' partial sums in the middle of its
# code; whole, it costs every rank the same small computation.
_SPARSE_ATTENTION_INDEXER = ("wq_b", "wk", "weights_proj")
# Gemma 3n's and Gemma 4's per-layer input: a gate from the stream, times the block's per-layer input, projected back.
_PER_LAYER_INPUT = ("per_layer_input_gate", "per_layer_projection")


def completed(model: nn.Module, plan: dict[str, ParallelStyle], *, sp: bool) -> dict[str, ParallelStyle]:
    """``plan`` with styles for every experts module, state-space mixer and latent-attention projection none of its
    patterns match (the mixer's own styles replace the plan's inside it).
    Row-parallel projections inside a mixture-of-experts block all-reduce into an output of their own (the block's
    code may add to it in place); with ``sp`` the block computes on the whole sequence
    (:class:`WholeSequenceRegion`)."""
    names = [name for name, _ in model.named_modules()]
    structural = _structural_styles(model, sp=sp)
    blocks = sorted(
        {name.rpartition(".")[0] for name, style in structural.items() if isinstance(style, ExpertTensorParallel)}
    )
    if sp:
        structural.update({block: WholeSequenceRegion() for block in blocks})
    mixers = [name for name, style in structural.items() if isinstance(style, StateSpaceMixerParallel)]
    plan = {pattern: style for pattern, style in plan.items() if not matches_inside(pattern, mixers, names=names)}
    missing = {name: style for name, style in structural.items() if not any(pattern_matches(p, name) for p in plan)}
    plan = {**plan, **keyed_by_position(missing, names=names)} if missing else plan
    plan = {pattern: _rotary_key_unsummed(pattern, style, structural=structural) for pattern, style in plan.items()}
    return {
        pattern: _in_experts_block(style) if matches_inside(pattern, blocks, names=names) else style
        for pattern, style in plan.items()
    }


def _rotary_key_unsummed(pattern: str, style: ParallelStyle, *, structural: dict[str, ParallelStyle]) -> ParallelStyle:
    """The plan's latent down-projection kept whole without its sum where a norm of the rotary key sums the gradient
    instead (see :func:`_rotary_key_norms`); any other style as it is."""
    if not isinstance(style, LatentKeyValueProjection):
        return style
    replaced = [s for name, s in structural.items() if pattern_matches(pattern, name)]
    return replaced[0] if replaced and not isinstance(replaced[0], LatentKeyValueProjection) else style


def kept_whole(model: nn.Module) -> set[str]:
    """The projections the completion keeps whole on every rank (routers, sparse attention's indexer, latent
    attention's low-rank projections): a derived plan follows the others only (a router's output reaches the stream
    through the experts' weights, where it would make every later block's projections look like exits)."""
    return {name for name, style in _structural_styles(model, sp=False).items() if type(style) is KeptWhole}


def _in_experts_block(style: ParallelStyle) -> ParallelStyle:
    """A row-parallel projection inside a mixture-of-experts block (a shared expert's): all-reduced, where a family
    plan's sequence parallel would reduce-scatter into the stream (the block sees the whole sequence), into an output
    of its own."""
    if type(style) in (RowwiseParallel, OwnedOutputRowwiseParallel):
        return OwnedOutputRowwiseParallel(input_layouts=style.input_layouts[0])
    return style


def _structural_styles(model: nn.Module, *, sp: bool) -> dict[str, ParallelStyle]:
    """Styles by module name: experts, then within their blocks the shared experts (gated MLPs) and routers; state-space
    mixers, latent attention, sparse attention's indexer and per-layer inputs anywhere. A gated MLP outside an
    experts block (a vision tower's) is left to the plan."""
    modules = dict(model.named_modules())
    styles: dict[str, ParallelStyle] = {}
    for name, module in modules.items():
        mixer = mixer_style(module, sequence_parallel=sp)
        if mixer is not None:  # its own styles replace the plan's inside it
            styles[name] = mixer
        if _has_linears(module, _SPARSE_ATTENTION_INDEXER):
            styles.update({f"{name}.{child}": KeptWhole() for child in _SPARSE_ATTENTION_INDEXER})
        if _has_linears(module, _PER_LAYER_INPUT):
            styles[name] = SplitArgument(name="per_layer_input")
            styles[f"{name}.per_layer_input_gate"] = ColwiseParallel()
            styles[f"{name}.per_layer_projection"] = RowwiseParallel()
        if not is_experts(module) and not is_stacked_experts(module):
            if _has_linears(module, _LATENT_ATTENTION):
                styles.update({f"{name}.{child}": s for child, s in _latent_attention(model, module).items()})
            continue
        if is_lora_layer(modules[name.rpartition(".")[0]]):
            raise ValueError(
                f"{name} carries LoRA adapters on its expert parameters (peft's target_parameters), which tensor"
                " parallel does not split yet: target the attention and dense layers only, or use tp=1"
            )
        styles[name] = ExpertTensorParallel()
        block = name.rpartition(".")[0]
        for inner, candidate in modules.items():
            if inner.startswith(f"{block}.") and _has_linears(candidate, _GATED_MLP):
                styles.update({f"{inner}.{child}": ColwiseParallel() for child in _GATED_MLP[:2]})
                styles[f"{inner}.down_proj"] = RowwiseParallel()
        for router in _routers(model, modules, experts=name):
            styles.setdefault(router, KeptWhole())
    return styles


def _routers(model: nn.Module, modules: dict[str, nn.Module], *, experts: str) -> list[str]:
    """The modules of the experts' block (outside the experts) holding an (experts, hidden) matrix: routers, whole on
    every rank."""
    block, hidden = experts.rpartition(".")[0], model_config(model).hidden_size
    counts = {p.shape[0] for p in modules[experts].parameters(recurse=False)} | {
        getattr(modules[experts], "num_experts", 0)
    }
    return [
        name
        for name, module in modules.items()
        if name.startswith(f"{block}.")
        and not name.startswith(f"{experts}.")
        and name != experts
        and any(p.ndim == 2 and p.shape[0] in counts and p.shape[1] == hidden for p in module.parameters(recurse=False))
    ]


def _has_linears(module: nn.Module, children: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(module, child, None), nn.Linear) for child in children)


def _latent_attention(model: nn.Module, attention: nn.Module) -> dict[str, ParallelStyle]:
    rotary_width = getattr(model_config(model), "qk_rope_head_dim", None)
    if not isinstance(rotary_width, int):
        return {}  # not latent attention as transformers writes it: the plan's coverage decides
    styles: dict[str, ParallelStyle] = {
        "q_a_proj": KeptWhole(),
        "q_b_proj": ColwiseParallel(),
        "q_proj": ColwiseParallel(),  # without a query low-rank projection
        "kv_a_proj_with_mqa": LatentKeyValueProjection(rotary_width=rotary_width),
        "kv_b_proj": ColwiseParallel(),
        "o_proj": RowwiseParallel(),
        "g_proj": ColwiseParallel(),  # an output gate per head (Bailing's), or per head and unit
    }
    styles = {child: style for child, style in styles.items() if isinstance(getattr(attention, child, None), nn.Linear)}
    if "g_proj" in styles and not _per_head_gate(attention):
        del styles["g_proj"]
    return {**styles, **_rotary_key_norms(attention, rotary_width=rotary_width)}


def _per_head_gate(attention: nn.Module) -> bool:
    """Whether the attention's ``g_proj`` makes one gate per head, or per head and value unit."""
    heads, width = getattr(attention, "num_heads", None), getattr(attention, "v_head_dim", None)
    widths = {heads, heads * width} if isinstance(heads, int) and isinstance(width, int) else {heads}
    return attention.g_proj.out_features in widths


def _rotary_key_norms(attention: nn.Module, *, rotary_width: int) -> dict[str, ParallelStyle]:
    """A norm of the rotary key all heads share (Dots3's ``k_rope_only_layernorm``: a child named for the rotary key
    holding vectors of its width), between the latent down-projection and attention: its output's gradient is summed
    over tp, and the down-projection, kept whole, needs no sum of its own."""
    norms = [
        name
        for name, child in attention.named_children()
        if "rope" in name  # by name: a latent norm (kv_a_layernorm) may be as wide, and sums through kv_b_proj
        and (params := list(child.parameters()))
        and all(p.shape == (rotary_width,) for p in params)
    ]
    if not norms or not isinstance(getattr(attention, "kv_a_proj_with_mqa", None), nn.Linear):
        return {}
    return {"kv_a_proj_with_mqa": KeptWhole(), **{name: OutputGradientSummed() for name in norms}}
