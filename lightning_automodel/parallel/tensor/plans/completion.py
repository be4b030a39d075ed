"""Completing a plan with the layouts its patterns leave out, found by structure: the experts of mixture-of-experts
layers (their block's routers kept whole, its shared experts split) and multi-head latent attention. Hugging Face
plans that predate fused experts or leave attention out, and the Llama-style and derived plans, would leave them whole.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_automodel.hf.peft import is_lora_layer
from lightning_automodel.parallel.experts.expert_tensor_parallel import ExpertTensorParallel, is_experts
from lightning_automodel.parallel.tensor.plans.patterns import keyed_by_position, matches_inside, pattern_matches
from lightning_automodel.parallel.tensor.sizes import model_config
from lightning_automodel.parallel.tensor.styles.projections import KeptWhole, LatentKeyValueProjection
from lightning_automodel.parallel.tensor.styles.stream import WholeSequenceRegion

# Multi-head latent attention under transformers' names: the down-projections stay whole, the per-head up-projections
# are column- and the output row-parallel.
_LATENT_ATTENTION = ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
_GATED_MLP = ("gate_proj", "up_proj", "down_proj")


def completed(model: nn.Module, plan: dict[str, ParallelStyle], *, sp: bool) -> dict[str, ParallelStyle]:
    """``plan`` with styles for every experts module and latent-attention projection none of its patterns match;
    with ``sp``, every mixture-of-experts block computes on the whole sequence (:class:`WholeSequenceRegion`)
    and the row-parallel projections inside it all-reduce."""
    names = [name for name, _ in model.named_modules()]
    structural = _structural_styles(model)
    if sp:
        blocks = sorted(
            {name.rpartition(".")[0] for name, style in structural.items() if isinstance(style, ExpertTensorParallel)}
        )
        structural.update({block: WholeSequenceRegion() for block in blocks})
        plan = {
            pattern: _whole_sequence(style) if matches_inside(pattern, blocks, names=names) else style
            for pattern, style in plan.items()
        }
    missing = {name: style for name, style in structural.items() if not any(pattern_matches(p, name) for p in plan)}
    return {**plan, **keyed_by_position(missing, names=names)} if missing else plan


def _whole_sequence(style: ParallelStyle) -> ParallelStyle:
    """A row-parallel style that reduce-scatters into the sequence-parallel stream, all-reducing instead: inside a
    mixture-of-experts block (a derived plan's shared expert) the sequence is whole."""
    if isinstance(style, RowwiseParallel) and style.output_layouts[0].is_shard():
        return type(style)(input_layouts=style.input_layouts[0])
    return style


def _structural_styles(model: nn.Module) -> dict[str, ParallelStyle]:
    """Styles by module name: experts, then within their blocks the shared experts (gated MLPs) and routers; latent
    attention anywhere. A gated MLP outside an experts block (a vision tower's) is left to the plan."""
    modules = dict(model.named_modules())
    styles: dict[str, ParallelStyle] = {}
    for name, module in modules.items():
        if not is_experts(module):
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
    counts = {p.shape[0] for p in modules[experts].parameters(recurse=False)}
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
    }
    return {child: style for child, style in styles.items() if isinstance(getattr(attention, child, None), nn.Linear)}
