"""A sequence-parallel layout for a tensor-parallel plan that has none (a model's Hugging Face plan, a derived plan),
found from the plan's styles and one probe step of the model, not from module names.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Placement, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from lightning_automodel.hf.decoder_layers import named_language_layers
from lightning_automodel.parallel.probe.step import TensorArg, Trace
from lightning_automodel.parallel.tensor.lora import LoraParallel
from lightning_automodel.parallel.tensor.plans.family import TPPlan
from lightning_automodel.parallel.tensor.plans.patterns import keyed_by_position, matches_inside, pattern_matches
from lightning_automodel.parallel.tensor.styles.parameters import ReturnedParameters
from lightning_automodel.parallel.tensor.styles.projections import Conv1DRowwiseParallel, OwnedOutputRowwiseParallel
from lightning_automodel.parallel.tensor.styles.state_space import StateSpaceMixerParallel
from lightning_automodel.parallel.tensor.styles.stream import (
    SequenceParallelAllGather,
    SequenceShardedStream,
    WholeSequenceRegion,
)

# Row-parallel styles a plan's exits have (where the stream is summed), as opposed to its entries.
_ROW_PARALLEL = (RowwiseParallel, OwnedOutputRowwiseParallel)


def with_sequence_parallel(model: nn.Module, plan: Mapping[str, ParallelStyle], *, trace: Trace | None) -> TPPlan:
    """``plan`` (tensor parallel only) with the sequence-parallel layout of the residual stream in its blocks.

    Inside the blocks the stream is a ``Shard(1)`` DTensor: row-parallel projections reduce-scatter into it, and the
    norms on it compute on their shard of the tokens. A norm that opens a block all-gathers its output once for the
    projections after it; a norm whose output stays in the stream (sandwich norms) does not; a column-parallel
    projection given the stream itself gathers it. The stream is split where a list of blocks the model calls one after
    another begins and gathered where it ends (:class:`SequenceShardedStream`): what a model does outside its blocks
    runs on whole tensors, for one all-gather per step more than the family plans' layout. The norms, and which
    argument of the first block is the stream, come from ``trace`` (see :mod:`lightning_automodel.parallel.probe`);
    the probe of the sharded model refuses a layout that does not fit, naming the module.

    Raises a ValueError when there is no probe of the model to find the blocks' stream and norms with, or when a
    block is not called on a (rows, tokens, hidden) stream.
    """
    if trace is None:
        raise ValueError("sp=True: deriving a sequence-parallel layout needs a probe step of the model")
    modules = dict(model.named_modules())
    names = list(modules)
    blocks = [name for name, _ in named_language_layers(model) if trace.called(name)]
    if not blocks:
        raise ValueError("sp=True: one step of the model calls none of its decoder blocks: no stream to split")
    styled = {name: style for pattern, style in plan.items() for name in modules if _matches(pattern, name)}
    regions = _whole_sequence_regions(styled, blocks=blocks)
    layout = {
        pattern: _sequence_parallel_style(style)
        if matches_inside(pattern, blocks, names=names) and not matches_inside(pattern, regions, names=names)
        else style
        for pattern, style in plan.items()
    }
    layout.update(
        keyed_by_position({name: WholeSequenceRegion() for name in regions if name not in styled}, names=names)
    )
    head = _name_of(modules, model.get_output_embeddings())
    entries = [name for name, style in styled.items() if type(style) not in _ROW_PARALLEL and name != head]
    _, stream = _stream(blocks[0], trace)
    norms = _stream_norms(
        modules, trace, hidden=stream.shape[-1], blocks=blocks, regions=regions, styled=styled, entries=entries
    )
    norm_styles = {
        name: SequenceParallelAllGather()
        if _read_by(trace, source=name, entries=entries)
        else SequenceParallel(use_local_output=False)
        for name in norms
    }
    returned = {
        name: ReturnedParameters(names=own)
        for name, own in trace.returned_parameters.items()
        if _inside(name, blocks) and not _inside(name, regions)
    }
    found = keyed_by_position({**norm_styles, **returned}, names=names)
    return {**layout, **found, **_stream_boundaries(blocks, trace)}


def _inside(name: str, modules: list[str]) -> bool:
    return name.startswith(tuple(f"{module}." for module in modules))


def _whole_sequence_regions(styled: Mapping[str, ParallelStyle], *, blocks: list[str]) -> list[str]:
    """The modules inside the blocks that compute on the whole sequence: those the plan already makes so (mixture-of-
    experts blocks), and the block's child holding a projection that gathers its output whole (a column-parallel
    ``colwise_gather_output``, as Qwen3.5's plan has for its linear attention): what it returns to the stream is
    whole, and it is handed back as this rank's slice."""
    regions = {name for name, style in styled.items() if isinstance(style, WholeSequenceRegion)}
    for name, style in styled.items():
        block = next((block for block in blocks if name.startswith(f"{block}.")), None)
        if block is not None and _gathers_output(style):
            child = name[len(block) + 1 :].split(".")[0]
            regions.add(f"{block}.{child}")
    return sorted(regions)


def _gathers_output(style: ParallelStyle) -> bool:
    return type(style) is ColwiseParallel and not style.output_layouts[0].is_shard() and style.use_local_output


def _stream_boundaries(blocks: list[str], trace: Trace) -> TPPlan:
    """Where each list of blocks begins and ends the sequence-sharded stream (see :func:`with_sequence_parallel`)."""
    lists: dict[str, list[str]] = {}
    for name in blocks:
        lists.setdefault(name.rpartition(".")[0], []).append(name)
    owners: dict[str, list[str]] = {}
    for name in lists:
        owners.setdefault(name.rpartition(".")[0], []).append(name)
    split = next((names for names in owners.values() if len(names) > 1), None)
    if split is not None:
        raise ValueError(
            f"sp=True: the blocks' parts sit in separate lists ({', '.join(split)}), and the code looping over them"
            " adds the residual stream outside any block module, where it meets whole tensors: there is no block in"
            " which to split the stream along the sequence. Use sp=False"
        )
    boundaries: TPPlan = {}
    for members in lists.values():
        first, last = members[0], members[-1]
        boundaries[last] = SequenceShardedStream(ends=True)
        boundaries[first] = SequenceShardedStream(begins_at=_stream(first, trace)[0], ends=first == last)
    return boundaries


def stage_stream_boundaries(styles: Mapping[str, ParallelStyle], stages: list[list[str]]) -> TPPlan:
    """``styles`` for a rank holding pipeline ``stages`` (each a list of consecutive blocks of the model's one list):
    the stream split where each stage's first block begins and gathered where its last ends, as it was where the
    whole model's blocks began and ended, so that stages hand each other whole tensors."""
    boundaries = {name: style for name, style in styles.items() if isinstance(style, SequenceShardedStream)}
    if not boundaries:
        return dict(styles)
    begins_at = next(style.begins_at for style in boundaries.values() if style.begins_at is not None)
    staged = {name: style for name, style in styles.items() if name not in boundaries}
    for blocks in stages:
        first, last = blocks[0], blocks[-1]
        staged[last] = SequenceShardedStream(ends=True)
        staged[first] = SequenceShardedStream(begins_at=begins_at, ends=first == last)
    return staged


def stream_placements(
    styles: Mapping[str, ParallelStyle], embedding: str, *, language_model: str = ""
) -> tuple[Placement, ...] | None:
    """How the stream leaves the input embedding, when a plan keeps it a DTensor from there (the family plans' sequence
    parallel: ``Shard(1)``), or how the ``language_model`` module splits the ``inputs_embeds`` it is given (Gemma 3's
    plan, whose image features join the embeddings whole); None when it stays a whole tensor. A pipeline stage that
    receives the stream instead of embedding it receives it so."""
    entry = styles.get(language_model)
    split = getattr(entry, "desired_input_kwarg_layouts", None) or {}
    if "inputs_embeds" in split and split["inputs_embeds"].is_shard() and not entry.use_local_output:
        return (split["inputs_embeds"],)
    style = next((style for pattern, style in styles.items() if pattern_matches(pattern, embedding)), None)
    style = style.style if isinstance(style, LoraParallel) else style  # a PEFT model's: the style it wraps
    layouts = getattr(style, "output_layouts", None)
    if layouts is None or getattr(style, "use_local_output", True) or not layouts[0].is_shard():
        return None
    return tuple(layouts)


def _stream(block: str, trace: Trace) -> tuple[int | str, TensorArg]:
    """The argument of ``block``'s first call that is the residual stream, with its position or keyword: the first
    tensor of (rows, tokens, width), positions before keywords."""
    inputs = trace.calls[block][0].inputs
    for key in sorted(inputs, key=lambda key: (isinstance(key, str), str(key))):
        if _on_stream(inputs[key], tokens=trace.tokens):
            return key, inputs[key]
    raise ValueError(
        f"sp=True: {block} is called on no (rows, tokens, hidden) tensor, so there is no residual stream to split"
        " along the sequence in its blocks. Use sp=False"
    )


def _sequence_parallel_style(style: ParallelStyle) -> ParallelStyle:
    """A row-parallel projection (a state-space mixer's output projection) reduce-scatters its sum into the
    sequence-sharded stream instead of all-reducing it."""
    if isinstance(style, StateSpaceMixerParallel):
        return type(style)(sequence_parallel=True)
    if type(style) in (*_ROW_PARALLEL, Conv1DRowwiseParallel):
        return type(style)(input_layouts=style.input_layouts[0], output_layouts=Shard(1), use_local_output=False)
    return style


def _stream_norms(
    modules: Mapping[str, nn.Module],
    trace: Trace,
    *,
    hidden: int,
    blocks: list[str],
    regions: list[str],
    styled: Mapping[str, ParallelStyle],
    entries: list[str],
) -> list[str]:
    """The modules inside the blocks the plan leaves alone that normalise the residual stream: their own parameters
    are vectors of the hidden size (a norm's weight and bias), they hold no other module with parameters, and a step
    calls them on a (rows, tokens, hidden) tensor that no column-parallel projection returned (OLMo 2's q_norm, over
    all heads of q_proj's output, has the hidden size too: the probe gives such a norm what it needs). A norm inside
    a module of the block that holds a column-parallel projection normalises what that module computes from it
    (MiniMax's linear attention, over all heads' output), not the stream."""
    norms = []
    mixers = [name for name, style in styled.items() if isinstance(style, StateSpaceMixerParallel)]  # their own norms
    for name, calls in trace.calls.items():
        module = modules.get(name)
        if (
            module is None
            or not _inside(name, blocks)
            or _inside(name, regions)
            or _inside(name, mixers)
            or name in styled
            or any(True for _ in _child_parameters(module))
            or (name.rpartition(".")[0] not in blocks and _holds_entry(name.rpartition(".")[0], entries))
        ):
            continue
        own = list(module.parameters(recurse=False))
        if not own or any(p.shape != (hidden,) for p in own):
            continue
        on_stream = [call for call in calls if _on_stream(call.inputs.get(0), tokens=trace.tokens, width=hidden)]
        if on_stream and not any(call.sources.get(0) in entries for call in on_stream):
            norms.append(name)
    return norms


def _holds_entry(module: str, entries: list[str]) -> bool:
    return any(entry.startswith(f"{module}.") for entry in entries)


def _child_parameters(module: nn.Module):
    return (p for child in module.children() for p in child.parameters())


def _on_stream(arg, *, tokens: int, width: int | None = None) -> bool:
    """Whether ``arg`` has the residual stream's shape: (rows, tokens, width), of any width unless given."""
    return arg is not None and len(arg.shape) == 3 and arg.shape[1] == tokens and width in (None, arg.shape[2])


def _read_by(trace: Trace, *, source: str, entries: list[str]) -> bool:
    """Whether a column-parallel projection, or a module holding one, is called on what ``source`` returned."""
    readers = {name for name, calls in trace.calls.items() if any(source in call.sources.values() for call in calls)}
    return any(entry == reader or entry.startswith(f"{reader}.") for entry in entries for reader in readers)


def _name_of(modules: Mapping[str, nn.Module], module: nn.Module | None) -> str | None:
    return next((name for name, candidate in modules.items() if candidate is module), None) if module else None


def _matches(pattern: str, name: str | None) -> bool:
    return name is not None and pattern_matches(pattern, name)
