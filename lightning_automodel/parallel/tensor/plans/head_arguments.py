"""Arguments an attention module receives with one entry per head, computed outside it (ALiBi's slopes times
positions in Bloom and MPT, a relative position bias in CPM-Ant and ProphetNet): once the plan splits the heads, each
rank takes its heads' entries (:class:`SplitArgument`). Found from a probe step of the model, by shape."""

from __future__ import annotations

import inspect

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_automodel.hf.decoder_layers import named_decoder_layers
from lightning_automodel.hf.layer_configs import attention_shapes
from lightning_automodel.parallel.probe.step import PROBE_ROWS, TensorArg, Trace
from lightning_automodel.parallel.tensor.head_counts import splits_outputs
from lightning_automodel.parallel.tensor.plans.family import TPPlan
from lightning_automodel.parallel.tensor.plans.patterns import keyed_by_position, pattern_matches
from lightning_automodel.parallel.tensor.sizes import model_config
from lightning_automodel.parallel.tensor.styles.inputs import SplitArgument


def with_head_arguments(model: nn.Module, plan: TPPlan, *, trace: Trace | None) -> TPPlan:
    """``plan`` with a :class:`SplitArgument` for every argument of an attention module (a module whose child's output
    the plan leaves split) that holds one entry per query head: a dimension 0 or 1 as long as the heads, or a
    dimension 0 of rows x heads. Without a probe, or for a model whose layers differ in heads, ``plan`` as it is."""
    config = model_config(model)
    if trace is None or config is None or not isinstance(getattr(config, "num_attention_heads", None), int):
        return plan
    heads = {shape[0] for shape in attention_shapes(config)}
    if len(heads) != 1:
        return plan
    (count,) = heads
    if count in (PROBE_ROWS, trace.tokens):
        return plan  # the probe's rows or tokens would look like heads: no guess
    modules = dict(model.named_modules())
    blocks = {name for name, _ in named_decoder_layers(model)}  # a block holding a split projection is no attention
    attentions = {
        name.rpartition(".")[0]
        for pattern, style in plan.items()
        if splits_outputs(style)
        for name in modules
        if pattern_matches(pattern, name)
    } - blocks
    found: dict[str, ParallelStyle] = {}
    for attention in sorted(attentions):
        calls = trace.calls.get(attention)
        if not calls:
            continue
        names = list(inspect.signature(modules[attention].forward).parameters)
        for key, arg in calls[0].inputs.items():
            split = _head_split(arg, heads=count, tokens=trace.tokens)
            name = names[key] if isinstance(key, int) and key < len(names) else key
            if split is None or not isinstance(name, str):
                continue
            if attention in found:
                raise ValueError(f"{attention} receives several arguments with one entry per head; pass tp_plan=")
            found[attention] = SplitArgument(name=name, dim=split[0], per=split[1])
    styles = keyed_by_position(found, names=list(modules))
    taken = sorted(set(styles) & set(plan))
    if taken:
        raise ValueError(f"{', '.join(taken)} already have a style and receive per-head arguments; pass tp_plan=")
    return {**plan, **styles}


def _head_split(arg: TensorArg, *, heads: int, tokens: int) -> tuple[int, int | None] | None:
    """(dim, per) of an argument holding one entry per head; None for any other (the stream, masks, positions)."""
    shape = arg.shape
    if len(shape) < 3 or (len(shape) == 3 and shape[:2] == (PROBE_ROWS, tokens)):
        return None
    if shape[0] == PROBE_ROWS * heads:
        return 0, heads
    for dim in (0, 1):
        if shape[dim] == heads:
            return dim, None
    return None
