"""How to pipeline: the schedule, micro-batches and stages per rank a user asks for, and the split of the decoder
layers into stages, checked before anything is built."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence

from torch import Tensor
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)

VIRTUAL_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """How to pipeline: the schedule, its micro-batches, the stages each rank holds and the split of the decoder
    layers into them, and the loss the last stage computes."""

    schedule: str = "1F1B"
    """The pipeline schedule, by torch's name: "1F1B" or "GPipe", or with two stages a rank or more "Interleaved1F1B",
    "LoopedBFS" or "InterleavedZeroBubble" (torch's ``get_schedule_class``)."""

    microbatches: int | None = None
    """Micro-batches a step, which must divide the batch (default: the pp size). 1F1B needs at least pp; the
    interleaved schedules run them in rounds of pp; the idle share of a step is (pp - 1) / (v m + pp - 1) for m
    micro-batches and v stages a rank."""

    layers_per_stage: Sequence[int] | None = None
    """A manual split: the decoder layers of each stage, in order (pp x stages_per_rank counts, such as [7, 9, 9, 7]).
    Default: an even split of the work, in which the embedding and the head count as one layer each."""

    stages_per_rank: int = 1
    """The stages each rank holds (virtual stages), for the schedules that interleave them: rank r holds stages r,
    r + pp, ..."""

    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None
    """A loss of one's own (in YAML, its import path), which the last stage applies to each micro-batch (default: the
    next-token cross-entropy). ``loss_fn(logits, labels)`` returns the micro-batch's loss summed over its tokens
    (labels as the model's call got them, unshifted), and the pipeline divides it by the global batch's scored tokens
    (next-token labels other than -100)."""

    def validate(self, pp: int, *, num_layers: int | None = None) -> None:
        """Refuse a schedule torch lacks, a number of stages per rank it does not run, too few micro-batches, and a
        manual split not of ``num_layers`` decoder layers (when given)."""
        multi = self._schedule_runs_several_stages()
        per_rank = self.stages_per_rank
        if not isinstance(per_rank, int) or isinstance(per_rank, bool) or per_rank < 1:
            raise ValueError(f"pp_stages_per_rank={self.stages_per_rank!r} must be a positive integer.")
        if multi and self.stages_per_rank < 2:
            raise ValueError(
                f"pp_schedule={self.schedule!r} runs several stages on every rank: set pp_stages_per_rank=2 (or more)."
            )
        if not multi and self.stages_per_rank > 1:
            raise ValueError(
                f"pp_stages_per_rank={self.stages_per_rank} needs a schedule that runs several stages per rank:"
                f" {', '.join(VIRTUAL_STAGE_SCHEDULES)}; {self.schedule!r} runs one."
            )
        if self.microbatches is not None and (isinstance(self.microbatches, bool) or self.microbatches < 1):
            raise ValueError(f"pp_microbatches={self.microbatches!r} must be a positive integer.")
        microbatches = self.microbatches_for(pp)
        if self.schedule.lower() == "1f1b" and microbatches < pp:
            raise ValueError(
                f"pp_microbatches={microbatches} with pp={pp}: the 1F1B schedule needs at least as many"
                f" micro-batches as stages. Use pp_microbatches >= {pp}, or pp_schedule='GPipe'."
            )
        rounds = max(1, microbatches // pp)  # torch's interleaved schedules run the micro-batches in equal rounds
        if self._runs_rounds() and microbatches % rounds:
            raise ValueError(
                f"pp_microbatches={microbatches} with pp={pp}: {self.schedule} runs the micro-batches in"
                f" pp_microbatches // pp = {rounds} rounds of equal size, which {microbatches} does not split into:"
                f" use a multiple of pp (e.g. {rounds * pp}), or fewer micro-batches than pp."
            )
        stages = pp * self.stages_per_rank
        if self.layers_per_stage is not None and (
            len(self.layers_per_stage) != stages or any(count < 1 for count in self.layers_per_stage)
        ):
            raise ValueError(
                f"pp_layers_per_stage={list(self.layers_per_stage)}: give {stages} positive layer counts, one per stage"
                f" (pp={pp} x pp_stages_per_rank={self.stages_per_rank})."
            )
        if num_layers is not None:
            stage_layers(num_layers, stages, self.layers_per_stage)

    def _schedule_runs_several_stages(self) -> bool:
        try:
            schedule_class = get_schedule_class(self.schedule)
        except ValueError as error:
            raise ValueError(f"pp_schedule={self.schedule!r}: {error}") from None
        if inspect.isabstract(schedule_class) or schedule_class in (PipelineScheduleSingle, PipelineScheduleMulti):
            raise ValueError(
                f"pp_schedule={self.schedule!r} is a base class of torch's schedules: use 'GPipe', '1F1B' or one of"
                f" {', '.join(VIRTUAL_STAGE_SCHEDULES)}."
            )
        if schedule_class in (ScheduleZBVZeroBubble, ScheduleDualPipeV):
            # torch 2.13's runtime hands the input gradient between the two adjacent stages of the V's middle rank
            # in steps without backward too (validate, test, predict), and fails there (PipelineStage.
            # get_local_bwd_output: "can't steal_bwd_input if this stage doesn't have backward").
            raise ValueError(
                f"pp_schedule={self.schedule!r} places a rank's two stages in a V, whose forward-only steps (validate,"
                f" test, predict) fail in torch's runtime: use one of {', '.join(VIRTUAL_STAGE_SCHEDULES)}."
            )
        return not issubclass(schedule_class, PipelineScheduleSingle)

    def microbatches_for(self, pp: int) -> int:
        return self.microbatches if self.microbatches is not None else pp

    def _runs_rounds(self) -> bool:
        return issubclass(get_schedule_class(self.schedule), ScheduleInterleaved1F1B | ScheduleInterleavedZeroBubble)

    def splits_backward(self) -> bool:
        """Whether the schedule computes the weights' gradients apart from the inputs' (zero bubble): each runs the
        layer's backward, so a checkpointed layer would be recomputed twice."""
        return issubclass(get_schedule_class(self.schedule), ScheduleInterleavedZeroBubble)

    def stages_of_rank(self, rank: int, pp: int) -> list[int]:
        """The stages pp rank ``rank`` holds, in order: ``rank``, ``rank + pp``, ... (torch's looped placement)."""
        return [rank + pp * round_ for round_ in range(self.stages_per_rank)]


def stage_layers(num_layers: int, pp: int, layers_per_stage: Sequence[int] | None = None) -> list[range]:
    """The decoder layers of each stage: ``layers_per_stage`` if given, else an even split of the work, where the
    embedding (first stage) and the head (last stage) count as one layer each."""
    if layers_per_stage is not None:
        if sum(layers_per_stage) != num_layers:
            raise ValueError(
                f"pp_layers_per_stage={list(layers_per_stage)} sums to {sum(layers_per_stage)}; the model has"
                f" {num_layers} decoder layers."
            )
        counts = list(layers_per_stage)
    else:
        work = num_layers + 2  # the embedding is work unit 0, the head the last one
        bounds = [round(stage * work / pp) for stage in range(pp + 1)]
        spans = zip(bounds, bounds[1:], strict=False)
        counts = [len(range(max(start, 1), min(end, num_layers + 1))) for start, end in spans]
        if min(counts) < 1:  # few layers: one stage would hold only the embedding or the head
            counts = [num_layers // pp + (stage < num_layers % pp) for stage in range(pp)]
    starts = [sum(counts[:stage]) for stage in range(pp)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


def bubble_fraction(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle share of a schedule's step with ``stages_per_rank`` (v) stages per rank: (p - 1) / (v m + p - 1); a
    rank waits for p - 1 stages' worth of work, each a v-th of its share."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)
