"""A tensor-parallel plan derived from how data flows through a model's decoder blocks, for models no family plan,
Hugging Face plan or Llama-style names cover (BERT, BART/OPT, GPT-2, Bloom, Falcon, GPT-J, ...): Megatron's layout
found under any names (see :func:`derived_plan`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from lightning_automodel.hf.decoder_layers import named_decoder_layers, named_language_layers
from lightning_automodel.hf.peft import is_lora_layer
from lightning_automodel.hf.vision.image_inputs import image_token_count
from lightning_automodel.parallel.probe.meta_values import AnswerDataQuestions
from lightning_automodel.parallel.probe.step import (
    forward_step,
    image_placeholders,
    meta_copy,
    sequence_lengths,
    tensor_leaves,
)
from lightning_automodel.parallel.tensor.plans.completion import kept_whole
from lightning_automodel.parallel.tensor.plans.patterns import keyed_by_position
from lightning_automodel.parallel.tensor.styles.mixers import is_recurrent_mixer
from lightning_automodel.parallel.tensor.styles.projections import (
    Conv1DColwiseParallel,
    Conv1DRowwiseParallel,
    OwnedOutputRowwiseParallel,
    PackedColwiseParallel,
    RegroupedColwiseParallel,
    VocabParallelEmbedding,
    is_conv1d,
)

aten = torch.ops.aten
_SPLITS = {aten.split, aten.split_with_sizes, aten.unsafe_split, aten.unsafe_split_with_sizes}
# Operations taking a tensor apart along one dimension, with the position of that dimension among their arguments.
_TAKING_APART = {**dict.fromkeys(_SPLITS, 2), aten.select: 1, aten.slice: 1, aten.unbind: 1, aten.narrow: 1}
_VIEWS = {aten.view, aten._unsafe_view, aten.reshape, aten.unflatten, aten.unsqueeze}

# How an entry's output is taken apart (see derived_plan).
PLAIN = "plain"  # element by element, or by another projection
HEADS = "heads"  # viewed as (..., units, rest): contiguous rows are whole units
OTHER = "other"  # something this module cannot classify
WHOLE = "whole"  # combined element by element with a whole tensor as wide as it: the entry must stay whole


@dataclass
class ProjectionFlow:
    """What one followed step found in the decoder blocks: entries and how their outputs are taken apart (PLAIN,
    HEADS, OTHER, or the block sizes of a split along the last dimension), exits with the entries they close, and
    entries whose split output escapes the block."""

    entries: dict[str, set[Any]] = field(default_factory=dict)  # block sizes as ("blocks", (size, ...))
    exits: dict[str, set[str]] = field(default_factory=dict)
    escaped: set[str] = field(default_factory=set)
    conflicting: set[str] = field(default_factory=set)  # called once as an entry and once as an exit
    called: set[str] = field(default_factory=set)  # the followed blocks the step ran

    def unclosed(self) -> set[str]:
        closed = set().union(*self.exits.values())
        unclosed = {name for name, uses in self.entries.items() if name not in closed or WHOLE in uses}
        return unclosed | self.escaped | self.conflicting


def derived_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The plan derived from ``model``'s data flow. Raises a ValueError saying why there is none: a step that fails on
    the meta device, or an entry whose output this module cannot classify.

    One forward step of a meta-device copy is followed operation by operation (a ``TorchDispatchMode``, with hooks on
    every projection: ``nn.Linear`` or transformers' ``Conv1D``). Within a block, a projection whose input comes from
    the residual stream without passing through another projection of the block is an *entry* (column-parallel: its
    output, split over tp, is what the ranks compute on apart); one whose input is computed from entries' outputs is
    an *exit* (row-parallel: its output is whole again). An entry whose split output is never closed by an exit stays
    whole (:func:`follow_projections`).

    How the model's code takes an entry's output apart decides how its weight may be split, never its name:

    * viewed as (..., heads, rest) (q, k, v; Bloom's and Falcon's fused qkv laid out per head): contiguous rows are
      whole heads, so plain column-parallel is right once head counts are this rank's (:mod:`..head_counts`);
    * split along its last dimension into blocks (GPT-2's ``c_attn``, MPT's ``Wqkv``, fused [gate; up]), or viewed as
      (..., parts, rest) and then taken apart along ``parts`` (Moshi's [gate; up]): each rank needs its slice of every
      block (:class:`PackedColwiseParallel`, or :class:`RegroupedColwiseParallel` for blocks of unequal size);
    * used element by element, or by the next projection: plain column-parallel;
    * anything else is refused, naming the module: a plan that runs with the right shapes can still be wrong.

    The embedding and lm_head are vocabulary-parallel as in the Llama plan, unless the lm_head shares a parameter with
    anything but the input embedding. With sp the plan gets the layout of :mod:`.sequence_parallel`, as a Hugging Face
    plan does.
    """
    flow = _language_flow(model)
    modules = dict(model.named_modules())
    plan: dict[str, ParallelStyle] = _vocabulary_parallel(model)
    for name, uses in flow.entries.items():
        plan[name] = entry_style(name, modules[name], uses)
    return keyed_by_position({**plan, **exit_styles(model, flow)}, names=list(modules))


def _language_flow(model: nn.Module) -> ProjectionFlow:
    """The decoder blocks' flow in a text-only step, or with images (where the builder knows them) if that fails
    (BLIP-2 requires ``pixel_values``) or leaves a block of its language model unrun (GIT's tower blocks count)."""
    images = image_token_count(model) is not None
    try:
        flow = follow_projections(model)
    except ValueError:
        if not images:
            raise
        return follow_projections(model, images=True)
    if not images or all(name in flow.called for name, _ in named_language_layers(model)):
        return flow
    try:
        return follow_projections(model, images=True)
    except ValueError:  # a step with images the model's code cannot take on the meta device: text alone
        return flow


def exit_styles(model: nn.Module, flow: ProjectionFlow) -> dict[str, ParallelStyle]:
    """Row-parallel styles for ``flow``'s exits: model code may add to an exit's output in place (Falcon's attention
    into its MLP's), so each owns its output."""
    modules = dict(model.named_modules())
    return {
        name: Conv1DRowwiseParallel() if is_conv1d(modules[name]) else OwnedOutputRowwiseParallel()
        for name in flow.exits
    }


def follow_projections(
    model: nn.Module, *, blocks: Iterable[str] | None = None, images: bool = False, whole: Iterable[str] = ()
) -> ProjectionFlow:
    """Entries and exits of the projections of ``blocks`` (by name; the decoder blocks by default) in one step (with
    ``images``: see :func:`~lightning_automodel.parallel.probe.step.forward_step`), followed again without the entries
    found unclosed until none is left (each round can only make more projections whole). Those the completion keeps
    whole, and ``whole``, are left out."""
    whole = kept_whole(model) | set(whole)
    while True:
        flow = _follow_once(model, whole=whole, blocks=blocks, images=images)
        unclosed = flow.unclosed()
        if not unclosed:
            return flow
        whole |= unclosed


def entry_style(name: str, module: nn.Module, uses: set[Any]) -> ParallelStyle:
    """The column-parallel style for an entry whose output the step took apart as ``uses``; a ValueError saying why
    where no style fits."""
    splits = {use[1] for use in uses if isinstance(use, tuple)}
    if OTHER in uses or len(splits) > 1:
        found = ", ".join(sorted(str(use) for use in uses))
        raise ValueError(
            f"the output of {name} is taken apart in a way a derived plan cannot classify ({found}): it cannot tell"
            " which output rows may be split over tp. Pass tp_plan= with a style for it, or use tp=1"
        )
    if not splits:
        return Conv1DColwiseParallel() if is_conv1d(module) else ColwiseParallel()
    (sizes,) = splits
    if len(set(sizes)) == 1:
        return PackedColwiseParallel(parts=len(sizes))
    if is_conv1d(module):
        raise ValueError(f"{name} is a Conv1D split into blocks of unequal sizes {sizes}, which no style shards")
    return RegroupedColwiseParallel(block_sizes=sizes)


def _vocabulary_parallel(model: nn.Module) -> dict[str, ParallelStyle]:
    """Vocabulary-parallel embedding and lm_head, as the Llama plan has them, where the lm_head's parameters are its
    own or tied to the embedding's weight (BERT's decoder bias, shared with a head parameter, is left whole)."""
    names = {id(module): name for name, module in model.named_modules()}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    plan: dict[str, ParallelStyle] = {}
    if isinstance(head, nn.Linear) and _owned_by(model, head, allowed=(head, embedding)):
        plan[names[id(head)]] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    head_weight = getattr(head, "weight", None)
    tied = head_weight is not None and head_weight is getattr(embedding, "weight", None)
    if isinstance(embedding, nn.Embedding) and (not tied or plan):
        plan[names[id(embedding)]] = VocabParallelEmbedding()
    return plan


def _owned_by(model: nn.Module, module: nn.Module, *, allowed: Iterable[nn.Module | None]) -> bool:
    """Whether every parameter of ``module`` belongs to ``allowed`` modules only."""
    own = {id(p) for p in module.parameters()}
    allowed_ids = {id(m) for m in allowed if m is not None}
    return all(
        id(owner) in allowed_ids for owner in model.modules() for p in owner.parameters(recurse=False) if id(p) in own
    )


def _follow_once(model: nn.Module, *, whole: set[str], blocks: Iterable[str] | None, images: bool) -> ProjectionFlow:
    copy = meta_copy(model)
    count = image_placeholders(copy) if images else None  # before the hooks: none of its calls is followed
    flow, tracker = ProjectionFlow(), _SplitActivations()
    handles = []
    modules = dict(copy.named_modules())
    followed = named_decoder_layers(copy) if blocks is None else [(name, modules[name]) for name in blocks]
    for block_name, block in followed:
        handles.append(block.register_forward_hook(_escape_hook(tracker, flow)))
        handles.append(block.register_forward_hook(lambda *_, name=block_name: flow.called.add(name)))
        for name, module in projections(block, prefix=block_name):
            if name not in whole:
                handles += _watch(module, name, tracker, flow)
    try:
        with AnswerDataQuestions(), tracker:
            forward_step(copy, tokens=sequence_lengths(model, tp=2, images=images)[0], images=images, count=count)
    except Exception as error:  # noqa: BLE001 - any failure of the model's code: no plan can be derived
        raise ValueError(
            f"one forward step of the model on the meta device fails ({type(error).__name__}: {error}), so its data"
            " flow cannot be followed"
        ) from error
    finally:
        for handle in handles:
            handle.remove()
    flow.entries = {name: tracker.uses.get(name, {PLAIN}) for name in flow.entries}
    return flow


def _escape_hook(tracker: _SplitActivations, flow: ProjectionFlow) -> Callable:
    """A block's forward hook: entries whose split output reaches the block's hidden states (its first output)
    escape. By-products it also returns (attention weights) are not the residual stream, and are left to the probe."""

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        flow.escaped |= tracker.entries_in(tensor_leaves(output)[:1])

    return hook


def projections(block: nn.Module, *, prefix: str) -> list[tuple[str, nn.Module]]:
    """The block's projections by full name: Linears, ``Conv1D``s and LoRA layers on them (not the Linears inside
    them), but those of a recurrent mixer, which a style of its own splits (the plan's completion gives it). A LoRA
    layer on anything else (a tower's patch convolution) is no projection: it is kept whole, as its base would be."""
    found, skipped = [], []
    for name, module in block.named_modules():
        if any(name.startswith(f"{outer}.") for outer in skipped):
            continue
        if is_lora_layer(module) or is_recurrent_mixer(module):
            skipped.append(name)
        if is_recurrent_mixer(module):
            continue
        base = module.base_layer if is_lora_layer(module) else module
        if isinstance(base, nn.Linear) or is_conv1d(base):
            found.append((f"{prefix}.{name}", module))
    return found


def _watch(module: nn.Module, name: str, tracker: _SplitActivations, flow: ProjectionFlow) -> list:
    """Hooks that classify each call of ``module``: an entry when its input carries no entry's split output."""

    calls_as_entry: list[bool] = []

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        carried = tracker.entries_in((args, kwargs))
        role, other = (flow.exits, flow.entries) if carried else (flow.entries, flow.exits)
        if name in other:
            flow.conflicting.add(name)
        role.setdefault(name, set()).update(carried)
        calls_as_entry.append(not carried)

    def after(module: nn.Module, args: tuple, output: Any) -> None:
        tracker.mark(output, entry=name if calls_as_entry.pop() else None)

    return [module.register_forward_pre_hook(before, with_kwargs=True), module.register_forward_hook(after)]


class _SplitActivations(TorchDispatchMode):
    """Which entries' split outputs each tensor of the step is computed from, and how each entry's output itself (or
    a reshape of it that keeps its last dimension) is taken apart."""

    def __init__(self) -> None:
        super().__init__()
        self.carried = WeakIdKeyDictionary()  # tensor -> frozenset of entry names
        self.direct = WeakIdKeyDictionary()  # tensor -> the entry it is the output of
        self.units = WeakIdKeyDictionary()  # an entry's output viewed as (..., units, rest) -> (entry, units' dim)
        self.uses: dict[str, set[Any]] = {}

    def entries_in(self, values: Any) -> set[str]:
        return set().union(*(self.carried.get(t, frozenset()) for t in tensor_leaves(values)))

    def mark(self, output: Any, *, entry: str | None) -> None:
        """An entry's output carries it alone; an exit's carries nothing (it is whole again)."""
        for tensor in tensor_leaves(output):
            if entry is None:
                self.carried.pop(tensor, None)
            else:
                self.carried[tensor] = frozenset({entry})
                self.direct[tensor] = entry

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        inputs, outputs = tensor_leaves((args, kwargs)), tensor_leaves(output)
        carried = frozenset().union(*(self.carried.get(t, frozenset()) for t in inputs))
        if carried:
            for tensor in outputs:
                self.carried[tensor] = self.carried.get(tensor, frozenset()) | carried
        for tensor in inputs:
            entry = self.direct.get(tensor)
            if entry is not None:
                self._classify(entry, func, tensor, args, outputs)
            if tensor in self.units:
                self._classify_units(func, tensor, args, outputs)
        return output

    def _classify(self, entry: str, func, tensor: torch.Tensor, args: tuple, outputs: list[torch.Tensor]) -> None:
        meets_whole = func.overloadpacket not in _CONTRACTIONS and self._meets_whole(tensor, args)
        use = WHOLE if meets_whole else _use(func, tensor, args, outputs)
        if use is None:  # the same values under another shape or in place: follow them
            for result in outputs:
                self.direct[result] = entry
            return
        if use == HEADS:
            units_dim = outputs[0].ndim - _trailing_dims(tensor.shape, outputs[0].shape)
            self.units[outputs[0]] = (entry, units_dim)
        self.uses.setdefault(entry, set()).add(use)

    def _meets_whole(self, tensor: torch.Tensor, args: tuple) -> bool:
        """Whether an element-wise operation combines ``tensor`` with a whole tensor along its last dimension
        (Gemma4's per-layer input gate times the per-layer input): split, the two would no longer line up. (A matrix
        product's bias, as wide as its input by chance, is not: a projector's second Linear's.)"""
        width = tensor.shape[-1] if tensor.ndim else 1
        return width > 1 and any(
            isinstance(arg, torch.Tensor)
            and arg is not tensor
            and arg.ndim
            and arg.shape[-1] == width
            and not self.carried.get(arg)
            for arg in args
        )

    def _classify_units(self, func, view: torch.Tensor, args: tuple, outputs: list[torch.Tensor]) -> None:
        """A view (..., units, rest) taken apart along ``units``: they are blocks of different meaning ([gate; up]
        viewed as (2, intermediate)), not heads. A permutation of the view is followed (Qwen2-VL's vision attention
        views its fused qkv as (tokens, 3, heads, head width), moves the 3 first and unbinds it)."""
        entry, units_dim = self.units[view]
        if func.overloadpacket is aten.permute and outputs:
            self.units[outputs[0]] = (entry, [dim % view.ndim for dim in args[1]].index(units_dim))
            return
        position = _TAKING_APART.get(func.overloadpacket)
        dim = args[position] if position is not None and len(args) > position else 0
        if position is not None and dim % view.ndim == units_dim:
            units, width = view.shape[units_dim], view.shape[units_dim:].numel()
            self.uses[entry].add(("blocks", (width // units,) * units))


def _use(func, tensor: torch.Tensor, args: tuple, outputs: list[torch.Tensor]) -> Any:
    """How one operation takes an entry's output ``tensor`` apart; None when it keeps it as it is (a reshape of the
    leading dimensions, an element-wise operation of it alone)."""
    packet, last = func.overloadpacket, tensor.ndim - 1
    if packet in _SPLITS:
        dim = args[2] if len(args) > 2 else 0
        return ("blocks", tuple(o.shape[dim] for o in outputs)) if dim % tensor.ndim == last else OTHER
    if packet is aten.slice:
        dim = args[1] if len(args) > 1 else 0
        return OTHER if dim % tensor.ndim == last else None
    if packet in _VIEWS and outputs:
        trailing = _trailing_dims(tensor.shape, outputs[0].shape)
        return OTHER if trailing is None else None if trailing == 1 else HEADS
    if packet in _CONTRACTIONS:  # the next projection contracts the split dimension: a row-parallel exit
        return PLAIN if args[_CONTRACTIONS[packet]] is tensor else OTHER
    if not _element_wise(func):  # softmax, cumsum, flip, gather, a norm: they mix the units a split would part
        return OTHER
    alone = all(not isinstance(arg, torch.Tensor) or arg is tensor for arg in args)
    if outputs and all(o.shape == tensor.shape for o in outputs):
        return None if alone else PLAIN  # element-wise with other tensors: gate * up, a bias
    if len(outputs) == 1 and outputs[0].ndim >= tensor.ndim and outputs[0].shape[-1] == tensor.shape[-1]:
        return PLAIN  # broadcast against a larger tensor along the same last dimension
    return OTHER


def _element_wise(func) -> bool:
    """Whether ``func`` computes each element from the same element of its inputs: torch's pointwise operations,
    copies and dropout (the same mask shape on every rank's units)."""
    return torch.Tag.pointwise in func.tags or func.overloadpacket in _COPIES


# Operations that copy their input element by element (a dtype cast, a detached alias, dropout's mask).
_COPIES = {aten._to_copy, aten.copy_, aten.detach, aten.alias, aten.lift_fresh, aten.native_dropout}


# Matrix products, with the position of the operand whose last dimension they contract.
_CONTRACTIONS = {aten.mm: 0, aten.bmm: 0, aten.matmul: 0, aten.addmm: 1, aten.baddbmm: 1}


def _trailing_dims(before: torch.Size, after: torch.Size) -> int | None:
    """How many trailing dimensions of a reshape ``before`` -> ``after`` the last dimension becomes (1: kept; more:
    split into units); None when it is mixed with other dimensions."""
    width, product = before[-1], 1
    for count, size in enumerate(reversed(after), start=1):
        product *= size
        if product >= width:
            return count if product == width else None
    return None
