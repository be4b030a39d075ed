"""Layouts that fit a GPU: every layout's least recomputing fit (``plan --fit``'s table, :func:`fitting_layouts`),
and the one ``layout="auto"`` trains with (:func:`choose_layout`): the fastest that fits, estimates within 1% a tie
won by less recomputation, then less memory (:func:`.waves.tie_ordered`), the same as the table's first row.

The candidates are :mod:`.layouts`' (the sizes a user gave fixed, the global batch kept by accumulation), ranked by
:mod:`.throughput`'s model and measured by :mod:`.waves`'s waves. Under cp the activation estimate counts
SDPA's dense mask (see :mod:`..memory.activations`), which flex attention on a GPU does not hold: cp layouts are listed
with more memory than they take there.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

from torch import nn

from lightning_automodel.planning.memory.attention_kernel import ASSUMED_KERNEL
from lightning_automodel.planning.memory.routing import assumed_routing
from lightning_automodel.planning.memory.step_images import step_images
from lightning_automodel.planning.memory.step_options import StepOptions
from lightning_automodel.planning.search.layouts import (
    HEADROOM,
    Candidate,
    Outcome,
    SearchSpace,
    candidates,
    tensor_budget,
)
from lightning_automodel.planning.search.pinned_config import pinned_config
from lightning_automodel.planning.search.throughput import Hardware
from lightning_automodel.planning.search.waves import (
    Evaluate,
    SearchRecord,
    chosen_fit,
    least_recomputing_fits,
    search_every_layout,
    search_layout,
)
from lightning_automodel.planning.search.workers import ChildWorkers, Measurements

_HEADER = (
    f"  {'pp':>3} {'tp':>3} {'cp':>3} {'dp_shard':>8} {'dp_replicate':>12}  {'checkpointing':<13}"
    f" {'memory/GPU':>10}  {'est. tokens/s/GPU':>17}  accumulates"
)


@dataclass
class LayoutFit:
    """A layout with the setting it was listed at, and its memory per GPU."""

    candidate: Candidate
    outcome: Outcome

    @property
    def dims(self):
        return self.candidate.dims

    @property
    def checkpointing(self) -> str:
        return self.candidate.checkpointing

    @property
    def memory_bytes(self) -> int:
        return self.outcome.memory_bytes

    @property
    def tokens_per_second(self) -> float:
        return self.candidate.tokens_per_second


@dataclass
class Fitting:
    hardware: Hardware
    batch_shape: tuple[int, int]
    fits: list[LayoutFit] = field(default_factory=list)  # best estimated throughput first
    too_large: list[LayoutFit] = field(default_factory=list)  # with full checkpointing, the least they need
    refused: dict[str, str] = field(default_factory=dict)  # layout -> why the plan refuses it
    carried: str | None = None  # beside the tokens: a vision-language model's images, an MoE model's routing
    adamw: str = "foreach"  # the AdamW implementation whose step's temporaries are counted

    def __str__(self) -> str:
        lines = [
            f"layouts that fit {self.hardware.memory_gib:g} GiB per GPU"
            f" ({tensor_budget(self.hardware.memory_gib) / 2**30:.1f} GiB for tensors),"
            f" {_batch(self.batch_shape, self.carried)} (each data-parallel rank's; the global batch kept by"
            " accumulating batches; pp: 1F1B over micro-batches of the rows); best estimated throughput first:",
            _HEADER,
        ]
        lines += [_row(layout.candidate, layout.outcome) for layout in self.fits] or ["  (none)"]
        if self.too_large:
            lines.append("too large even with full checkpointing:")
            lines += [_row(layout.candidate, layout.outcome) for layout in self.too_large]
        lines += [f"refused: {layout}: {why}" for layout, why in self.refused.items()]
        lines += _notes(self.hardware, [layout.candidate for layout in [*self.fits, *self.too_large]], adamw=self.adamw)
        if self.fits:
            lines += pinned_config(self.fits[0].candidate, heading="the first, as the config's strategy:")
        return "\n".join(lines)


def fitting_layouts(
    model: nn.Module,
    world_size: int,
    *,
    hardware: Hardware,
    batch_shape: tuple[int, int],
    space: SearchSpace | None = None,
    workers: int = 1,
    step: StepOptions | None = None,
) -> Fitting:
    """Every layout of ``world_size`` ranks ``space`` allows, each with the least recomputing checkpointing setting
    that fits ``hardware.memory_gib`` less :data:`~lightning_automodel.planning.search.layouts.HEADROOM`.

    ``model`` is on the meta device (left as it is: each layout parallelizes copies); ``step``: how each layout's step
    is parallelized and computed beside its sizes; ``workers``: child processes measuring layouts side by side (1:
    this process). A layout the plan or the step refuses is listed with the refusal's first line."""
    step = step if step is not None else StepOptions()
    fitting = Fitting(
        hardware, batch_shape, carried=_carried(model, step=step, batch_shape=batch_shape), adamw=step.adamw
    )
    ranked, fitting.refused = candidates(
        model,
        world_size,
        space=space or SearchSpace(),
        hardware=hardware,
        batch_shape=batch_shape,
        mp_policy=step.mp_policy,
    )
    budget = tensor_budget(hardware.memory_gib)
    measurements = Measurements(model, batch_shape=batch_shape, budget=budget, step=step)
    with _workers(measurements, workers) as evaluate:
        record = search_every_layout(ranked, budget=budget, evaluate=evaluate, workers=workers)
    fits, too_large, refused = least_recomputing_fits(record)
    fitting.fits = [LayoutFit(ranked[index], record.outcomes[index]) for index in fits]
    fitting.too_large = [LayoutFit(ranked[index], record.outcomes[index]) for index in too_large]
    fitting.refused.update(refused)
    return fitting


@dataclass
class LayoutChoice:
    """The layout ``layout="auto"`` trains with, and what the search measured to find it."""

    hardware: Hardware
    batch_shape: tuple[int, int]
    record: SearchRecord
    index: int  # the chosen candidate's, in the record's ranking
    refused: dict[str, str]
    seconds: float = 0.0  # the search's wall time
    workers: int = 1
    carried: str | None = None  # beside the tokens: a vision-language model's images, an MoE model's routing
    adamw: str = "foreach"  # the AdamW implementation whose step's temporaries are counted

    @property
    def candidate(self) -> Candidate:
        return self.record.ranked[self.index]

    @property
    def outcome(self) -> Outcome:
        return self.record.outcomes[self.index]

    def __str__(self) -> str:
        candidate = self.candidate
        measured = len(self.record.outcomes)
        lines = [
            f'layout="auto" chose {candidate.name} with {candidate.checkpointing} checkpointing on'
            f" {candidate.dims.world_size} GPUs of {self.hardware.memory_gib:g} GiB: {_size(self.outcome.memory_bytes)}"
            f" of {_size(self.record.budget)} for tensors, est."
            f" {candidate.tokens_per_second:,.0f} tokens/s/GPU at {_batch(self.batch_shape, self.carried)}"
            f"{_accumulation_note(candidate)}",
            f"the candidates measured, best estimated throughput first ({measured} of {len(self.record.ranked)}, in"
            f" {_count(len(self.record.waves), 'wave')} over {_count(self.workers, 'worker')},"
            f" {self.seconds:.1f} s; the rest rank lower):",
            _HEADER,
        ]
        for index, outcome in sorted(self.record.outcomes.items()):
            mark = "  <- chosen" if index == self.index else ""
            lines.append(_row(self.record.ranked[index], outcome, budget=self.record.budget) + mark)
        lines += [f"refused: {layout}: {why}" for layout, why in self.refused.items()]
        seconds = [outcome.seconds for outcome in self.record.outcomes.values() if isinstance(outcome, Outcome)]
        lines.append(f"each candidate measured in {min(seconds):.1f}-{max(seconds):.1f} s of CPU")
        lines += _notes(self.hardware, [self.candidate], adamw=self.adamw)
        return "\n".join(lines + pinned_config(candidate, heading="to pin it, as the config's strategy:"))


class NoLayoutFits(ValueError):
    """No layout the search may choose fits: raised before any weight is allocated."""

    @classmethod
    def of(
        cls,
        record: SearchRecord,
        refused: dict[str, str],
        *,
        hardware: Hardware,
        batch_shape: tuple[int, int],
        world_size: int,
        carried: str | None = None,
    ) -> NoLayoutFits:
        """Why nothing fits: the smallest shortfall, and what would make that layout fit, scaled from its
        estimate."""
        budget = record.budget
        lines = [
            f'layout="auto": no layout of {world_size} GPUs fits {hardware.memory_gib:g} GiB per GPU'
            f" ({_size(budget)} for tensors) at {_batch(batch_shape, carried)}."
        ]
        measured = [(c, o) for c, o in record.measured() if isinstance(o, Outcome)]
        if measured:
            candidate, outcome = min(measured, key=lambda pair: pair[1].memory_bytes)
            lines.append(_shortfall(candidate, outcome, budget=budget))
            lines += _remedies(candidate, outcome, budget=budget, batch_shape=batch_shape, hardware=hardware)
        lines += [f"refused: {layout}: {why}" for layout, why in refused.items()]
        return cls("\n".join(lines))


def choose_layout(
    model: nn.Module,
    world_size: int,
    *,
    hardware: Hardware,
    batch_shape: tuple[int, int],
    space: SearchSpace,
    evaluate: Evaluate | None = None,
    workers: int = 1,
    step: StepOptions | None = None,
) -> LayoutChoice:
    """The fastest layout of ``world_size`` ranks ``space`` allows whose step fits ``hardware.memory_gib``; of those
    whose estimates tie with it (within :data:`~.waves.TIE`), the least recomputing, then the smallest. ``evaluate``
    measures a wave of ``workers`` candidates (default: ``workers`` child processes, or this process where 1, with
    ``step``). Raises :class:`NoLayoutFits` where none fits, naming the smallest shortfall and what would make it
    fit."""
    step = step if step is not None else StepOptions()
    carried = _carried(model, step=step, batch_shape=batch_shape)
    ranked, refused = candidates(
        model, world_size, space=space, hardware=hardware, batch_shape=batch_shape, mp_policy=step.mp_policy
    )
    budget, started = tensor_budget(hardware.memory_gib), time.monotonic()
    if evaluate is None:
        measurements = Measurements(model, batch_shape=batch_shape, budget=budget, step=step)
        with _workers(measurements, workers) as evaluate:
            record = search_layout(ranked, budget=budget, evaluate=evaluate, workers=workers)
    else:
        record = search_layout(ranked, budget=budget, evaluate=evaluate, workers=workers)
    refused.update({record.ranked[i].name: why for i, why in record.outcomes.items() if isinstance(why, str)})
    index = chosen_fit(record)
    if index is None:
        raise NoLayoutFits.of(
            record, refused, hardware=hardware, batch_shape=batch_shape, world_size=world_size, carried=carried
        )
    seconds = time.monotonic() - started
    return LayoutChoice(
        hardware,
        batch_shape,
        record,
        index,
        refused,
        seconds=seconds,
        workers=workers,
        carried=carried,
        adamw=step.adamw,
    )


def _carried(model: nn.Module, *, step: StepOptions, batch_shape: tuple[int, int]) -> str | None:
    """What every layout's step carries beside the tokens: the images each row holds (refused before any layout
    where the rows cannot hold them), and the routing of a mixture-of-experts model's tokens."""
    images = step_images(model, **step.images())
    if images is not None:
        images.check_fits(batch_shape[1])
    carried = [str(images)] * (images is not None) + [assumed_routing(model, step.expert_imbalance)]
    return "; ".join(part for part in carried if part) or None


def _batch(batch_shape: tuple[int, int], carried: str | None) -> str:
    rows, tokens = batch_shape
    return f"{rows} rows x {tokens:,} tokens a batch{f' ({carried})' if carried else ''}"


def _workers(measurements: Measurements, count: int):
    return nullcontext(measurements.here) if count == 1 else ChildWorkers(measurements, count=count)


def _shortfall(candidate: Candidate, outcome: Outcome, *, budget: float) -> str:
    over = _size(outcome.memory_bytes - budget)
    if outcome.activation_bytes is None:
        return (
            f"The smallest: {candidate.name} needs at least {_size(outcome.memory_bytes)} per GPU, {over} more, for its"
            " parameters, gradients and AdamW state alone (its step was not estimated)."
        )
    return (
        f"The smallest: {candidate.name} with {candidate.checkpointing} checkpointing needs"
        f" {_size(outcome.memory_bytes)} per GPU, {over} more (parameters, gradients and AdamW state"
        f" {_size(outcome.state_bytes)}, the larger of activations {_size(outcome.activation_bytes)} and the AdamW"
        f" step's temporaries {_size(outcome.optimizer_bytes)})."
    )


def _remedies(
    candidate: Candidate, outcome: Outcome, *, budget: float, batch_shape: tuple[int, int], hardware: Hardware
) -> list[str]:
    """What would make ``candidate`` fit, scaled from its estimate: its state and the optimizer step's temporaries
    sharded over more GPUs (the activations stay), or activations that shrink with the rows or the tokens (the state
    and the temporaries stay)."""
    rows, tokens = batch_shape
    world = candidate.dims.world_size
    state, activations, optimizer = outcome.state_bytes, outcome.activation_bytes, outcome.optimizer_bytes
    lines = ["It would fit with (scaled from that estimate; `lightning-automodel plan --fit` measures the new sizes):"]
    if activations is None or activations < budget:
        gpus = math.ceil(world * max(state / (budget - (activations or 0)), (state + optimizer) / budget))
        per_node = hardware.gpus_per_node
        gpus = math.ceil(gpus / per_node) * per_node if gpus > per_node else gpus
        lines.append(f"  - more GPUs: about {gpus} (the state sharded over {gpus / world:.1f} times as many)")
    if activations and state + optimizer < budget:
        share = (budget - state) / activations
        if (fewer_rows := math.floor(rows * share)) >= 1:
            lines.append(f"  - a smaller batch: {fewer_rows} rows of {tokens:,} tokens")
        if (fewer_tokens := math.floor(tokens * share)) >= 1:
            lines.append(f"  - a shorter sequence: {fewer_tokens:,} tokens a row")
    if len(lines) == 1:
        lines.append("  - nothing this search can change: the parameters, gradients and AdamW state alone exceed it")
    return lines


def _notes(hardware: Hardware, listed: list[Candidate], *, adamw: str) -> list[str]:
    notes = [
        f"throughput model: {hardware} (see planning/search/throughput.py); measure the layout you pick",
        f"memory: {HEADROOM:.0%} of each GPU left to the CUDA context, NCCL's buffers and the allocator; a GPU's"
        f" parameters, gradients and AdamW state with the larger of its activations and the temporaries of the"
        f" AdamW step ({adamw}) after backward",
        f"attention: {ASSUMED_KERNEL}",
    ]
    if any(candidate.dims.cp > 1 for candidate in listed):
        notes.append(
            "cp layouts: counted with SDPA's dense [rows, S/cp, S] mask, which flex attention on GPUs does not hold"
        )
    return notes


def _accumulation_note(candidate: Candidate) -> str:
    if candidate.accumulation == 1:
        return ""
    return (
        f"; each optimizer step accumulates {candidate.accumulation} batches, so that the global batch stays the one"
        " given (every rank of the sizes not fixed a data-parallel rank)"
    )


def _row(candidate: Candidate, outcome: Outcome | str, *, budget: float | None = None) -> str:
    dims = candidate.dims
    head = (
        f"  {dims.pp:>3} {dims.tp:>3} {dims.cp:>3} {dims.dp_shard:>8} {dims.dp_replicate:>12}"
        f"  {candidate.checkpointing:<13}"
    )
    if isinstance(outcome, str):
        return f"{head} refused: {outcome}"
    memory = f"{_size(outcome.memory_bytes):>10}"
    verdict = "" if budget is None or outcome.memory_bytes <= budget else "  too large"
    if outcome.activation_bytes is None:
        verdict = "  too large (the state alone)"
    return f"{head} {memory}  {candidate.tokens_per_second:>17,.0f}  {candidate.accumulation:>11}{verdict}"


def _size(size: float) -> str:
    """Bytes in GiB, or in MiB below one (tiny models)."""
    return f"{size / 2**30:.2f} GiB" if abs(size) >= 2**30 else f"{size / 2**20:.2f} MiB"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' if number != 1 else ''}"
