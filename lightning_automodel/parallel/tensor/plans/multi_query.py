"""Multi-query attention (a single key/value head, GPT-BigCode's and Falcon-7B's) under tensor parallel: the query
heads are split, the key/value head is kept whole on every rank and its gradient summed over tp (Megatron's answer
where tp exceeds the key/value heads)."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from lightning_automodel.hf.layer_configs import attention_shapes
from lightning_automodel.parallel.tensor.plans.family import TPPlan
from lightning_automodel.parallel.tensor.plans.patterns import pattern_matches
from lightning_automodel.parallel.tensor.sizes import model_config
from lightning_automodel.parallel.tensor.styles.parameters import OutputGradientSummed
from lightning_automodel.parallel.tensor.styles.projections import (
    KeptWhole,
    PackedColwiseParallel,
    RegroupedColwiseParallel,
    WholeKeyValueProjection,
    is_conv1d,
    output_width,
)

# transformers' per-head norms of queries (on this rank's heads: the probe sums their gradient) and of keys (on the
# whole key head: its output's gradient is summed, and k_proj before it is kept whole without a sum of its own).
_QUERY_NORM, _KEY_NORM = "q_norm", "k_norm"


def multi_query_shape(model: nn.Module) -> tuple[int, int] | None:
    """(query heads, head width) of a model whose every attention has one key/value head and several query heads;
    None for any other."""
    config = model_config(model)
    if config is None or not isinstance(getattr(config, "num_attention_heads", None), int):
        return None
    shapes = set(attention_shapes(config))
    if len(shapes) != 1:
        return None
    ((heads, kv_heads, head_dim),) = shapes
    return (heads, head_dim) if kv_heads == 1 and heads > 1 else None


def with_multi_query(model: nn.Module, plan: TPPlan) -> TPPlan:
    """``plan`` with its key/value projections of multi-query attention kept whole: a column-parallel projection one
    head wide (k_proj, v_proj) becomes :class:`WholeKeyValueProjection`; a fused [q; k; v] split plainly, packed or
    regrouped keeps its query block split and its key and value blocks whole (:class:`RegroupedColwiseParallel`).
    Any plan of any other model is returned as it is.

    A norm of the key head (Gemma 3 1B's ``k_norm``) computes on the whole key: its output's gradient is summed
    (:class:`OutputGradientSummed`) and ``k_proj`` before it is kept whole. Raises a ValueError for an attention
    holding other parameters besides its projections: each rank would compute their gradient from its own query heads
    only, and no style here sums it.
    """
    shape = multi_query_shape(model)
    if shape is None:
        return plan
    heads, head_dim = shape
    modules = dict(model.named_modules())
    fused = (heads * head_dim, head_dim, head_dim)
    changed: TPPlan = {}
    for pattern, style in plan.items():
        matched = [name for name in modules if pattern_matches(pattern, name)]
        widths = {output_width(modules[name]) for name in matched if _is_projection(modules[name])}
        if len(widths) != 1:
            changed[pattern] = style
            continue
        (width,) = widths
        if _plain_colwise(style) and width == head_dim and _beside_queries(modules, matched[0], heads * head_dim):
            attention, _, child = matched[0].rpartition(".")
            _refuse_other_parameters(modules, attention=attention)
            if child == "k_proj" and _KEY_NORM in modules[attention]._modules:  # the norm's output sums instead
                changed[pattern] = KeptWhole()
                changed[f"{pattern.rpartition('.')[0]}.{_KEY_NORM}"] = OutputGradientSummed()
            else:
                changed[pattern] = WholeKeyValueProjection()
        elif _splits_fused(style) and width == sum(fused):
            _refuse_other_parameters(modules, attention=matched[0].rpartition(".")[0])
            changed[pattern] = RegroupedColwiseParallel(block_sizes=fused, whole=(False, True, True))
        else:
            changed[pattern] = style
    return changed


def _beside_queries(modules: dict[str, nn.Module], name: str, query_width: int) -> bool:
    """Whether the module ``name`` sits beside a projection as wide as all query heads (in its attention)."""
    parent = modules[name.rpartition(".")[0]]
    return any(_is_projection(child) and output_width(child) == query_width for child in parent.children())


def _is_projection(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _plain_colwise(style: ParallelStyle) -> bool:
    return type(style) is ColwiseParallel and style.output_layouts[0].is_shard() and style.use_local_output


def _splits_fused(style: ParallelStyle) -> bool:
    """A style a plan gives a fused [q; k; v]: plain (Falcon's laid out per head), packed or regrouped into blocks."""
    return _plain_colwise(style) or isinstance(style, PackedColwiseParallel | RegroupedColwiseParallel)


def _refuse_other_parameters(modules: dict[str, nn.Module], *, attention: str) -> None:
    module = modules.get(attention)
    known = {name for name, child in module.named_children() if _is_projection(child)} | {_QUERY_NORM}
    known |= {_KEY_NORM} if "k_proj" in module._modules else set()  # its sum moves to the norm only after k_proj
    others = [
        f"{attention}.{name}"
        for name, child in module.named_children()
        if name not in known and any(True for _ in child.parameters())
    ]
    if others:
        raise ValueError(
            f"multi-query attention (one key/value head, kept whole on every tp rank) with parameters of its own"
            f" besides its projections and per-head norms ({', '.join(others)}): they might compute on the whole key,"
            " and get their gradient from this rank's query heads only. Use tp=1 (FSDP2 shards it), or a tp_plan= of"
            " your own"
        )
