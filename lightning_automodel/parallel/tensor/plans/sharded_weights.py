"""What a tensor-parallel plan does to a model's decoder blocks, judged from its styles without applying it: the
large weights it leaves whole, and the modules it gives a style that cannot shard them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_automodel.hf.peft import is_lora_layer
from lightning_automodel.parallel.tensor.lora import LoraParallel
from lightning_automodel.parallel.tensor.plans.patterns import pattern_matches
from lightning_automodel.parallel.tensor.styles.experts import (
    ExpertTensorParallel,
    experts_problem,
    is_experts,
)
from lightning_automodel.parallel.tensor.styles.mixers import is_recurrent_mixer
from lightning_automodel.parallel.tensor.styles.projections import (
    Conv1DColwiseParallel,
    Conv1DRowwiseParallel,
    KeptWhole,
    PackedColwiseParallel,
    RegroupedColwiseParallel,
)
from lightning_automodel.parallel.tensor.styles.state_space import StateSpaceMixerParallel

# Styles that split the weights of the module they are given (the rest prepare inputs and outputs, or replicate).
_WEIGHT_SHARDING_STYLES = (
    ColwiseParallel,
    RowwiseParallel,
    PackedColwiseParallel,
    LoraParallel,
    ExpertTensorParallel,
    StateSpaceMixerParallel,
)


@dataclass
class ShardedWeights:
    """What a plan does to the decoder blocks: the large weights it leaves whole, the share of their elements it
    shards, or why it cannot be applied at all."""

    unsharded: list[str]
    sharded_share: float
    unusable: str | None = None
    matches_any: bool = True


def sharded_weights(
    model: nn.Module,
    plan: Mapping[str, ParallelStyle],
    blocks: Sequence[tuple[str, nn.Module]],
    *,
    called: Callable[[str], bool] | None = None,
) -> ShardedWeights:
    """What ``plan`` does to the large weights of ``blocks`` (see :func:`_large_weights`).

    A weight counts as sharded when a style that splits weights (column-, row-wise, packed, experts, and their LoRA
    forms) matches its module or a module around it. A style matched to a module it cannot shard makes the plan
    unusable.
    """
    modules = dict(model.named_modules())
    matched = [(name, style) for pattern, style in plan.items() for name in modules if pattern_matches(pattern, name)]
    for name, style in matched:
        problem = unsupported_target(style, modules[name])
        if problem is not None:
            return ShardedWeights([], 0.0, unusable=f"{problem} ({name})", matches_any=True)
    sharded = _parameter_ids(modules, [name for name, style in matched if isinstance(style, _WEIGHT_SHARDING_STYLES)])
    whole_by_design = _parameter_ids(modules, [name for name, style in matched if isinstance(style, KeptWhole)])
    experts = {id(p) for module in modules.values() if is_experts(module) for p in module.parameters(recurse=False)}
    unsharded, total, split = [], 0, 0
    for block_name, block in blocks:
        weights = _large_weights(block_name, block, whole_by_design=whole_by_design, called=called, experts=experts)
        for name, param in weights:
            total += param.numel()
            if id(param) in sharded:
                split += param.numel()
            else:
                unsharded.append(f"{block_name}.{name.rpartition('.')[0] or name}")
    unique = list(dict.fromkeys(unsharded))
    return ShardedWeights(unique, split / total if total else 1.0, matches_any=bool(matched))


def _parameter_ids(modules: Mapping[str, nn.Module], names: Sequence[str]) -> set[int]:
    return {id(p) for name in names for p in modules[name].parameters()}


def _large_weights(
    block_name: str,
    block: nn.Module,
    *,
    whole_by_design: set[int],
    called: Callable[[str], bool] | None,
    experts: set[int],
) -> list[tuple[str, nn.Parameter]]:
    """The weights of ``block`` a plan must split: those (tensors of two or more dimensions) of modules a step calls
    (``called``, by module name; every module when None) at least an eighth of the block's largest matrix (an
    expert's, for experts fused in a 3D tensor), but for projections a plan keeps whole on purpose
    (``whole_by_design``, :class:`KeptWhole`: low-rank projections, routers)."""
    weights = {
        id(p): (name, p)
        for name, p in block.named_parameters()
        if p.ndim >= 2
        and id(p) not in whole_by_design
        and (called is None or called(_module_path(block_name, name.rpartition(".")[0])))
    }
    largest = max((_matrix_size(p, experts=experts) for _, p in weights.values()), default=0)
    return [(name, p) for name, p in weights.values() if _matrix_size(p, experts=experts) * 8 >= largest]


def _matrix_size(param: nn.Parameter, *, experts: set[int]) -> int:
    """The elements of one matrix of a weight: an expert's for fused experts (``experts``: their parameters' ids),
    whose tokens each meet a few experts; measured by the whole tensor, a layer of 128 experts would make every
    attention weight look small."""
    return param[0].numel() if id(param) in experts else param.numel()


def _module_path(block_name: str, module_name: str) -> str:
    return f"{block_name}.{module_name}" if module_name else block_name


def _shardable_modules(style: ParallelStyle) -> tuple[type, ...]:
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
    if isinstance(inner, StateSpaceMixerParallel):
        return None if is_recurrent_mixer(base) else f"{type(inner).__name__} splits recurrent mixers, not {base}"
    supported = _shardable_modules(inner)
    if not supported or isinstance(base, supported):
        return None
    kinds = " and ".join(f"nn.{t.__name__}" if t.__module__.startswith("torch.") else t.__name__ for t in supported)
    return f"{type(inner).__name__} shards {kinds} only, and this module is a {type(base).__name__}"


def unmatched_patterns(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> list[str]:
    """Plan keys that name no module of ``model`` (``parallelize_module`` skips them silently)."""
    names = [name for name, _ in model.named_modules()]
    return [pattern for pattern in plan if not any(pattern_matches(pattern, name) for name in names)]
