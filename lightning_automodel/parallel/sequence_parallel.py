"""A sequence-parallel layout for a tensor-parallel plan that has none (a model's own Hugging Face plan).

Sequence parallel keeps the residual stream between the blocks split along the sequence over tp, as a ``Shard(1)``
DTensor: the vocab-parallel embedding reduce-scatters into it, every row-parallel projection reduce-scatters its
sum back into it, and the norms that act on it compute on their shard of the tokens. A norm that opens a block
(its output feeds column-parallel projections) all-gathers its output once, for all of them; a norm whose output
stays in the stream (the final norm, sandwich norms) does not, and the lm_head gathers the sequence itself.

That layout is the usual pre-norm block's, and follows from the plan's styles and from what one step of the model
shows (see :mod:`lightning_automodel.parallel.probe`): which modules are norms on the stream (vectors of the hidden
size as their only parameters, called on a (rows, tokens, hidden) tensor), and whose output the projections read.
Anything else a block does with the stream, the probe of the sharded model checks: a layout that does not fit is
refused there, naming the module.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from lightning_automodel.parallel.experts import SequenceParallelExpertsBlock
from lightning_automodel.parallel.patterns import keyed_by_position, matches_inside, pattern_matches
from lightning_automodel.parallel.probe import Trace
from lightning_automodel.parallel.styles import SequenceParallelAllGather

TPPlan = dict[str, ParallelStyle]


def with_sequence_parallel(model: nn.Module, plan: Mapping[str, ParallelStyle], *, trace: Trace | None) -> TPPlan:
    """``plan`` (tensor parallel only) with the sequence-parallel layout of its residual stream.

    Raises a ValueError when the plan cannot carry one: its embedding is not vocab-parallel (nothing would split
    the stream), or it has no probe of the model to find the norms with.
    """
    if trace is None:
        raise ValueError("sp=True: deriving a sequence-parallel layout needs a probe step of the model")
    modules = dict(model.named_modules())
    embedding = _name_of(modules, model.get_input_embeddings())
    head = _name_of(modules, model.get_output_embeddings())
    styled = {name: style for pattern, style in plan.items() for name in modules if _matches(pattern, name)}
    if not isinstance(styled.get(embedding), RowwiseParallel):
        raise ValueError(
            f"sp=True: the plan leaves the embedding {embedding} whole, so nothing would split the residual stream"
            " along the sequence (a vocab-parallel embedding, RowwiseParallel, reduce-scatters into it)"
        )
    # Mixture-of-experts blocks compute on the whole sequence: projections inside them all-reduce as without sp.
    regions = [name for name, style in styled.items() if isinstance(style, SequenceParallelExpertsBlock)]
    layout = {
        pattern: style if matches_inside(pattern, regions, names=list(modules)) else _sequence_parallel_style(style)
        for pattern, style in plan.items()
    }
    for pattern, style in plan.items():
        if _matches(pattern, embedding):
            layout[pattern] = RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            )
        elif head is not None and _matches(pattern, head) and isinstance(style, ColwiseParallel):
            layout[pattern] = ColwiseParallel(
                input_layouts=Shard(1), output_layouts=style.output_layouts[0], use_local_output=style.use_local_output
            )
    hidden = model.get_input_embeddings().embedding_dim
    entries = [name for name, style in styled.items() if type(style) is not RowwiseParallel and name != head]
    norms = _stream_norms(modules, trace, hidden=hidden, styled=styled, entries=entries)
    norm_styles = {
        name: SequenceParallelAllGather()
        if _read_by(trace, source=name, entries=entries)
        else SequenceParallel(use_local_output=False)
        for name in norms
    }
    return {**layout, **keyed_by_position(norm_styles, names=list(modules))}


def _sequence_parallel_style(style: ParallelStyle) -> ParallelStyle:
    """A row-parallel projection reduce-scatters its sum into the sequence-sharded stream instead of all-reducing it."""
    if type(style) is RowwiseParallel:
        return RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=Shard(1), use_local_output=False)
    return style


def _stream_norms(
    modules: Mapping[str, nn.Module],
    trace: Trace,
    *,
    hidden: int,
    styled: Mapping[str, ParallelStyle],
    entries: list[str],
) -> list[str]:
    """The modules the plan leaves alone that normalise the residual stream: their own parameters are vectors of the
    hidden size (a norm's weight and bias), they hold no other module with parameters, and a step calls them on a
    (rows, tokens, hidden) tensor that no column-parallel projection returned (OLMo 2's q_norm, over all heads of
    q_proj's output, has the hidden size too: the probe gives such a norm what it needs)."""
    norms = []
    for name, calls in trace.calls.items():
        module = modules.get(name)
        if module is None or name in styled or any(True for _ in _child_parameters(module)):
            continue
        own = list(module.parameters(recurse=False))
        if not own or any(p.shape != (hidden,) for p in own):
            continue
        on_stream = [call for call in calls if _on_stream(call.inputs.get(0), tokens=trace.tokens, hidden=hidden)]
        if on_stream and not any(call.sources.get(0) in entries for call in on_stream):
            norms.append(name)
    return norms


def _child_parameters(module: nn.Module):
    return (p for child in module.children() for p in child.parameters())


def _on_stream(arg, *, tokens: int, hidden: int) -> bool:
    return arg is not None and len(arg.shape) == 3 and arg.shape[1:] == (tokens, hidden)


def _read_by(trace: Trace, *, source: str, entries: list[str]) -> bool:
    """Whether a column-parallel projection, or a module holding one, is called on what ``source`` returned."""
    readers = {name for name, calls in trace.calls.items() if any(source in call.sources.values() for call in calls)}
    return any(entry == reader or entry.startswith(f"{reader}.") for entry in entries for reader in readers)


def _name_of(modules: Mapping[str, nn.Module], module: nn.Module | None) -> str | None:
    return next((name for name, candidate in modules.items() if candidate is module), None) if module else None


def _matches(pattern: str, name: str | None) -> bool:
    return name is not None and pattern_matches(pattern, name)
