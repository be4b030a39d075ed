"""A pipeline rank's peak, measured on a few layers and a few micro-batches and extrapolated.

Under pp a rank's estimate steps its stages through every micro-batch of the schedule, so it costs time in
proportion to the stage's layers times the micro-batches. The peak grows by the same bytes with each alike layer
(:mod:`.layer_extrapolation`), and, once the schedule's warm-up is full, by the same bytes with each further
micro-batch: the stage's output of each, which the schedule's send keeps until the step ends (measured: 8 MiB a
micro-batch on the first stage of the 70B example at tp=8 with sp, one micro-batch's hidden states on the rank). So
the peak of L layers and M micro-batches is measured at three layer counts and the first micro-batch count past the
warm-up, and at two more micro-batch counts with the fewest layers; it is extrapolated where each direction grows
by the same with each step and a fourth measurement (more layers and micro-batches at once) agrees to the byte with
the two directions added, else the rank's stages are stepped through every micro-batch.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

from torch import nn

from lightning_automodel.hf.decoder_layers import named_language_layers
from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.parallel.pipeline import PipelineOptions, stage_layers
from lightning_automodel.planning.memory.layer_extrapolation import (
    FEW_LAYERS,
    alike_layers,
    common_increment,
    extrapolated,
    slid,
    with_layers,
)

# A peak of (layers in the rank's smallest stage, micro-batches a step).
Measure = Callable[[int, int], int]


def warm_up_microbatches(pipeline: PipelineOptions, *, pp: int, stage: int) -> int | None:
    """The micro-batch count from which every further one adds the same to the peak of pp rank ``stage``: under
    1F1B, pp or 2 (pp - stage) - 1, the larger (measured on every rank of tiny models at pp = 2, 3 and 4, from pp to
    3 pp + 2 micro-batches: before it, the first ranks' peaks grow by more); under GPipe, 1 (each micro-batch held as
    it comes); None for the schedules whose growth was not measured (their steps are not extrapolated over
    micro-batches)."""
    schedule = pipeline.schedule.lower()
    if schedule == "1f1b":
        return max(pp, 2 * (pp - stage) - 1)
    return 1 if schedule == "gpipe" else None


def over_stage_layers(
    step: Callable[..., int],
    model: nn.Module,
    *,
    dims: ParallelDims,
    rank: int,
    pipeline: PipelineOptions | None,
    micro_batch: int | None = None,
    few: tuple[int, ...] = FEW_LAYERS,
) -> int:
    """``step(model, pipeline=...)`` under pp, where ``rank`` holds only its stages' layers: for stages of many alike
    layers, extrapolated from the model with each of the rank's stages cut by the same count, to ``few`` layers in
    the smallest of them, and the other stages cut to one layer each (this rank runs none of theirs, and holds
    nothing of them but the shapes it sends and receives: their layers only cost the time of ``parallelize``'s
    checks, which run the whole model). For a step of ``micro_batch`` rows (the step's keyword), also over
    micro-batches as the module says; None: a step that does not run them (the optimizer's)."""
    pipeline = pipeline or PipelineOptions()
    microbatches = pipeline.microbatches_for(dims.pp)

    def rows(micro: int) -> dict[str, int]:  # the step's keyword for ``micro`` micro-batches of the step's size
        return {} if micro_batch is None else {"micro_batch": micro_batch // microbatches * micro}

    if alike_layers(model) is None:
        return step(model, pipeline=pipeline, **rows(microbatches))
    num_layers = len(named_language_layers(model))  # the layers pp splits
    stages = stage_layers(num_layers, dims.pp * pipeline.stages_per_rank, pipeline.layers_per_stage)
    counts = [len(layers) for layers in stages]
    pp_rank = rank // dims.ranks_per_stage
    mine = pipeline.stages_of_rank(pp_rank, dims.pp)
    smallest = min(counts[stage] for stage in mine)

    def measure(count: int, micro: int) -> int:
        cut = [layers - (smallest - count) if stage in mine else 1 for stage, layers in enumerate(counts)]
        copied = with_layers(copy.deepcopy(model), layers=sum(cut))
        cut_pipeline = dataclasses.replace(pipeline, layers_per_stage=cut, microbatches=micro)
        return step(copied, pipeline=cut_pipeline, **rows(micro))

    warm = None if micro_batch is None else warm_up_microbatches(pipeline, pp=dims.pp, stage=pp_rank)
    few_micro = None if warm is None else (warm, warm + 1, warm + 2)
    return over_layers_and_microbatches(
        measure, layers=smallest, microbatches=microbatches, few_layers=few, few_microbatches=few_micro
    )


def over_layers_and_microbatches(
    measure: Measure,
    *,
    layers: int,
    microbatches: int,
    few_layers: tuple[int, ...],
    few_microbatches: tuple[int, ...] | None,
) -> int:
    """``measure(layers, microbatches)``: over layers extrapolated as :func:`.layer_extrapolation.extrapolated` does
    (layers more than twice ``few_layers[-1]``), and over micro-batches too (see the module; ``few_microbatches``:
    consecutive counts from the warm-up's end, None for none) where that steps fewer layers x micro-batches; the
    layer counts slide as there (:data:`~.layer_extrapolation.SLIDES`)."""
    over_layers = layers > 2 * few_layers[-1]

    def every_microbatch() -> int:
        return extrapolated(lambda count: measure(count, microbatches), layers=layers, few=few_layers)

    if few_microbatches is None or microbatches <= few_microbatches[-1]:
        return every_microbatch()
    first, *more = few_microbatches
    peaks: dict[tuple[int, int], int] = {}
    for counts in slid(few_layers, layers=layers) if over_layers else [(layers,)]:
        points = [(count, first) for count in counts] + [(counts[0], micro) for micro in more]
        if over_layers:  # a term in layers x micro-batches would show here
            points.append((counts[1], more[0]))
        if sum(count * micro for count, micro in points) >= sum(counts) * microbatches:
            break
        peaks.update({point: measure(*point) for point in points if point not in peaks})
        per_layer = common_increment([peaks[count, first] for count in counts]) if over_layers else 0
        per_micro = common_increment([peaks[counts[0], micro] for micro in few_microbatches])
        if per_layer is None:  # not yet linear in the layers: the counts slide
            continue
        if per_micro is None or over_layers and peaks[counts[1], more[0]] != peaks[counts[1], first] + per_micro:
            break  # not linear in micro-batches, or a term in both: every micro-batch decides
        return peaks[counts[0], first] + (layers - counts[0]) * per_layer + (microbatches - first) * per_micro
    return every_microbatch()
