"""The plan report's pipeline part: what each pp rank's group of ranks holds, and the report's lines on the schedule
and the stages."""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_automodel.parallel.float8 import Float8Options
from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.parallel.pipeline import PipelineOptions, bubble_fraction
from lightning_automodel.planning.memory.optimizer_step import peak_bytes, training_state_bytes


@dataclass
class StageReport:
    """What one pp rank's group of ranks holds: its stages' decoder layers, by stage index."""

    pp_rank: int
    layers: dict[int, range]
    ranks: str
    parameters_per_rank: int
    parameter_bytes_per_rank: int
    trainable_bytes_per_rank: int
    float8: Float8Options | None = None
    float8_converted: dict[str, int] = field(default_factory=dict)  # converted layers, as patterns -> count
    float8_kept: dict[tuple[str, str], int] = field(default_factory=dict)  # (pattern, why) -> count
    activation_bytes: dict[str, int] = field(default_factory=dict)  # checkpointing mode -> the step's peak per rank
    optimizer_bytes: int = 0  # the AdamW step's temporaries per rank

    @property
    def training_bytes_per_rank(self) -> int:
        return training_state_bytes(parameters=self.parameter_bytes_per_rank, trainable=self.trainable_bytes_per_rank)

    def total_bytes(self, mode: str) -> int:
        """The stage's ranks' peak under checkpointing ``mode`` (see
        :func:`~lightning_automodel.planning.memory.optimizer_step.peak_bytes`)."""
        return peak_bytes(
            state=self.training_bytes_per_rank, activations=self.activation_bytes[mode], optimizer=self.optimizer_bytes
        )


def pipeline_lines(
    pipeline: PipelineOptions, dims: ParallelDims, stages: list[StageReport], *, first: str = "embedding"
) -> list[str]:
    """The schedule and its bubble, then each pp rank's stages and memory (``first``: what stage 0 holds before its
    layers)."""
    microbatches = pipeline.microbatches_for(dims.pp)
    per_rank = pipeline.stages_per_rank
    bubble = bubble_fraction(dims.pp, microbatches, per_rank)
    virtual = f" x {per_rank} stages per rank" if per_rank > 1 else " stages"
    lines = [
        f"pipeline: pp={dims.pp}{virtual}, schedule {pipeline.schedule}, {microbatches} micro-batches"
        f" per step; idle (bubble) fraction (p-1)/({'vm' if per_rank > 1 else 'm'}+p-1) = {bubble:.1%}"
    ]
    last = dims.pp * per_rank - 1
    for stage in stages:
        held = [
            _stage_parts(index, layers, last=last, numbered=per_rank > 1, first=first)
            for index, layers in stage.layers.items()
        ]
        lines.append(
            f"  {'pp rank' if per_rank > 1 else 'stage'} {stage.pp_rank} (ranks {stage.ranks}): {'; '.join(held)};"
            f" {stage.parameters_per_rank:,} parameters per rank,"
            f" {gib(stage.training_bytes_per_rank)} with gradients and AdamW state"
        )
    return lines


def _stage_parts(index: int, layers: range, *, last: int, numbered: bool, first: str = "embedding") -> str:
    parts = [first] * (index == 0) + [_layer_span(layers)] + ["norm, head"] * (index == last)
    return f"{f'stage {index}: ' if numbered else ''}{', '.join(parts)}"


def _layer_span(layers: range) -> str:
    return f"layers {layers.start}-{layers.stop - 1}" if len(layers) > 1 else f"layer {layers.start}"


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"
