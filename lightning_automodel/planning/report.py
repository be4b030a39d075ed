"""Plan report: what parallelize() would do to a model on a mesh, computed without GPUs or real weights.

The model is built (or kept) on the meta device and parallelized for real inside a fake process group of the
requested world size, so the per-rank shapes are the ones training would get, not a re-derivation that could
drift from the code. An 8B-parameter config takes seconds.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import DTensor

from lightning_automodel.hf.decoder_layers import named_decoder_layers, named_language_layers
from lightning_automodel.hf.layer_configs import attention_shapes
from lightning_automodel.parallel.context_parallel import context_parallel_of
from lightning_automodel.parallel.float8 import Float8Options, Float8Spec, float8_layers, float8_options
from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.parallel.parallelizer import parallelize
from lightning_automodel.parallel.pipeline import PipelineOptions, stage_layers
from lightning_automodel.parallel.preflight import check_before_collectives
from lightning_automodel.parallel.probe.remembered import probes_remembered
from lightning_automodel.parallel.tensor.apply import TensorParallelPlan, plan_not_logged
from lightning_automodel.parallel.tensor.plans.patterns import pattern_matches
from lightning_automodel.planning.memory.attention_kernel import ASSUMED_KERNEL
from lightning_automodel.planning.memory.optimizer_step import peak_bytes, training_state_bytes
from lightning_automodel.planning.memory.routing import assumed_routing
from lightning_automodel.planning.memory.step_options import StepOptions
from lightning_automodel.planning.simulation import fake_world
from lightning_automodel.planning.stage_report import StageReport, pipeline_lines
from lightning_automodel.planning.stage_report import gib as _gib
from lightning_automodel.planning.step_estimates import activations_by_mode, image_share, optimizer_temporaries
from lightning_automodel.planning.tower_report import TowerReport, per_block


@dataclass
class PlanReport:
    model_name: str
    dims: ParallelDims
    plan_source: str
    plan_reason: str = ""
    styles: dict[str, tuple[str, int]] = field(default_factory=dict)  # pattern -> (style, modules matched)
    unmatched_patterns: list[str] = field(default_factory=list)
    unsharded_weights: list[str] = field(default_factory=list)
    replicated: dict[str, int] = field(default_factory=dict)  # modules on sharded activations, as patterns -> count
    tower: TowerReport | None = None  # a vision-language model's vision tower and projector
    total_parameters: int = 0
    parameters_per_rank: int = 0
    parameter_bytes_per_rank: int = 0
    pipeline: PipelineOptions | None = None
    stages: list[StageReport] = field(default_factory=list)  # under pp: what each stage's ranks hold
    gathered_bytes_per_token: int = 0  # under cp: keys and values a rank receives per token of a row and layer
    padded_to: int = 0  # under cp: rows are padded to a multiple of this many tokens
    batch_shape: tuple[int, int] | None = None  # (rows, tokens a row) the activation estimates are for
    float8: Float8Options | None = None
    float8_converted: dict[str, int] = field(default_factory=dict)  # converted layers, as patterns -> count
    float8_kept: dict[tuple[str, str], int] = field(default_factory=dict)  # (pattern, why) -> count
    activation_bytes: dict[str, int] = field(default_factory=dict)  # checkpointing mode -> the step's peak per rank
    # (under pp: the stage whose ranks' total is the largest; each stage's are its StageReport's)
    routing: str | None = None  # a mixture-of-experts model's: the routing the estimates assume
    adamw: str = "foreach"  # the AdamW implementation the optimizer step is estimated for
    optimizer_bytes: int = 0  # its step's temporaries per rank, estimated with the activations (under pp: the most)

    trainable_bytes_per_rank: int = 0  # of the parameters a rank holds, those trained (not frozen)

    @property
    def training_bytes_per_rank(self) -> int:
        """Parameters + gradients + AdamW state on one rank (activations not included): frozen parameters (the
        strategy's ``freeze``) hold neither."""
        return training_state_bytes(parameters=self.parameter_bytes_per_rank, trainable=self.trainable_bytes_per_rank)

    def __str__(self) -> str:
        lines = [
            f"{self.model_name} on {self.dims}",
            f"tensor-parallel plan: {self.plan_source} ({self.plan_reason})"
            if self.dims.tp > 1
            else "tensor parallel: off (tp=1)",
        ]
        width = max((len(pattern) for pattern in [*self.styles, *self.replicated]), default=0)
        lines += [f"  {p:<{width}}  {style} x{count}" for p, (style, count) in self.styles.items()]
        lines += [f"  {p:<{width}}  ReplicateOnShardedInput x{count}" for p, count in self.replicated.items()]
        if self.unmatched_patterns:
            lines.append(f"patterns matching no module: {', '.join(self.unmatched_patterns)}")
        if self.unsharded_weights:
            lines.append(f"large block weights left whole on every tp rank: {', '.join(self.unsharded_weights)}")
        if self.tower is not None:
            tower = self.tower.line(
                self.dims, total_parameters=self.total_parameters, parameters_per_rank=self.parameters_per_rank
            )
            lines.append(tower)
        if self.float8 is not None:
            lines += self._float8_lines()
        if self.dims.ep > 1:
            lines.append(
                f"expert parallel: ep={self.dims.ep}, each rank holds 1/{self.dims.ep} of every layer's experts,"
                f" FSDP-sharded over efsdp={self.dims.efsdp}"
            )
        if self.dims.cp > 1:
            cp = self.dims.cp
            lines.append(
                f"context parallel: cp={cp}, each rank holds 1/{cp} of every sequence (chunks i and {2 * cp - 1}-i of"
                f" {2 * cp}; rows padded to a multiple of {self.padded_to} tokens); attention all-gathers keys and"
                f" values: {self.gathered_bytes_per_token:,} bytes received per token of a row, per layer and rank (in"
                " the weights' dtype; bf16 activations halve fp32's)"
            )
        if self.stages:
            first = "embedding, vision tower and projector" if self.tower is not None else "embedding"
            lines += pipeline_lines(self.pipeline, self.dims, self.stages, first=first)
        share = self.parameters_per_rank / max(self.total_parameters, 1)
        ideal = self.dims.pp * self.dims.tp * self.dims.dp_shard * self.dims.cp
        lines += [
            f"parameters: {self.total_parameters:,} in all, {self.parameters_per_rank:,} per rank"
            f" ({share:.2%}; ideal 1/{ideal}){' on the largest stage' if self.stages else ''}",
            f"memory per rank: {_gib(self.parameter_bytes_per_rank)} parameters,"
            f" {_gib(self.training_bytes_per_rank)} with gradients and AdamW state{self._frozen_note()}"
            f"{'' if self.activation_bytes else ' (activations not included)'}",
        ]
        return "\n".join(lines + self._activation_lines())

    def _frozen_note(self) -> str:
        frozen = self.parameter_bytes_per_rank - self.trainable_bytes_per_rank
        return f" (of which {_gib(frozen)} frozen, without either)" if frozen else ""

    def total_bytes(self, mode: str) -> int:
        """The largest memory of a rank in a training step under checkpointing ``mode``: parameters, gradients and
        AdamW state, with the larger of the activations and the optimizer step's temporaries (under pp, of the stage
        where they add up to the most; see :func:`~.memory.optimizer_step.peak_bytes`)."""
        if not self.stages:
            state, activations = self.training_bytes_per_rank, self.activation_bytes[mode]
            return peak_bytes(state=state, activations=activations, optimizer=self.optimizer_bytes)
        return max(stage.total_bytes(mode) for stage in self.stages)

    def _float8_lines(self) -> list[str]:
        converted = sum(self.float8_converted.values())
        lines = [
            f"float8 ({self.float8.recipe} scaling): {converted} linear layers,"
            f" {sum(self.float8_kept.values())} kept in high precision"
        ]
        width = max(len(pattern) for pattern in [*self.float8_converted, *(p for p, _ in self.float8_kept)])
        lines += [f"  {pattern:<{width}}  float8 x{count}" for pattern, count in self.float8_converted.items()]
        lines += [f"  {p:<{width}}  kept x{count}: {why}" for (p, why), count in self.float8_kept.items()]
        return lines

    def _activation_lines(self) -> list[str]:
        if not self.activation_bytes:
            return []
        rows, tokens = self.batch_shape
        lines = [
            f"activations per rank, {rows} rows x {tokens:,} tokens a step (the step's peak above parameters and"
            " gradients; the total adds them and AdamW's state"
            f"{'; under pp, of the stage where it is the largest' if self.stages else ''}):"
        ]
        lines.append(f"  attention: {ASSUMED_KERNEL}")
        if self.tower is not None:
            lines.append(f"  {self.tower.step_line()}")
        if self.routing is not None:
            lines.append(f"  {self.routing}")
        width = max(len(mode) for mode in self.activation_bytes)
        images = self.tower.activation_bytes if self.tower is not None else {}
        for mode, size in self.activation_bytes.items():
            stages = ", ".join(f"{_gib(stage.activation_bytes[mode])}" for stage in self.stages)
            each = f" (pp ranks: {stages})" if self.stages else ""
            of_images = f" (images {_gib(images[mode])})" if mode in images else ""
            lines.append(
                f"  checkpointing {mode:<{width}}  {_gib(size)}{of_images}  total {_gib(self.total_bytes(mode))}{each}"
            )
        return [*lines, self._optimizer_line()]

    def _optimizer_line(self) -> str:
        stages = ", ".join(_gib(stage.optimizer_bytes) for stage in self.stages)
        each = f" (pp ranks: {stages})" if self.stages else ""
        return (
            f"  AdamW step ({self.adamw}): {_gib(self.optimizer_bytes)} of temporaries{each}, after backward: the total"
            " takes the larger of it and the activations"
        )


@probes_remembered()  # a copy of the model parallelized a stage, a checkpointing mode and a few layer counts
def plan_report(
    model: nn.Module,
    dims: ParallelDims,
    *,
    sp: bool = False,
    pipeline: PipelineOptions | None = None,
    batch_shape: tuple[int, int] | None = None,
    step: StepOptions | None = None,
    rank: int = 0,
    float8: Float8Spec | Float8Options | None = False,
) -> PlanReport:
    """Parallelize ``model`` (on the meta device) as ``rank`` of a fake world of ``dims`` and describe the result.

    ``dims`` must be resolved (a world size is needed). Must be called outside any real process group. A plan that
    training would refuse is refused here too, with the same message. Under pp, each stage is parallelized (as its
    first rank) on a copy of the model, for its layers and per-rank memory; the largest is the report's per rank.

    ``step`` (:class:`~lightning_automodel.planning.StepOptions`, its defaults if None): the plan's ``tp_plan`` and
    ``allow_unsharded_linears``, and what shapes a training step but not the plan (``mp_policy``, ``cp_attention``,
    ``loss_chunks``). With ``batch_shape`` (rows per data-parallel rank and step, tokens a row), the report adds
    the activation memory of a training step under each activation-checkpointing mode (see
    :mod:`.memory.activations`) and the temporaries of the optimizer step that follows (``step.adamw``'s, see
    :mod:`.memory.optimizer_step`). Under pp each stage's are estimated on its first rank (a zero-bubble schedule,
    which runs no checkpointing, under "off" alone), and the report's per mode is that of the stage whose total is the
    largest: :meth:`PlanReport.total_bytes`.

    ``float8``: the strategy's option; the report lists the layers it converts and those it keeps, and why (the
    parallelizer's own choice, :func:`~lightning_automodel.parallel.float8.float8_layers`).
    """
    if not all(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise ValueError("plan_report needs a model on the meta device: build it under `with torch.device('meta'):`.")
    report = PlanReport(type(model).__name__, dims, plan_source="", float8=float8_options(float8))
    report.total_parameters = sum(p.numel() for p in model.parameters())
    report.tower = TowerReport.of(model)
    report.gathered_bytes_per_token = gathered_bytes_per_token(model, dims)
    step = step if step is not None else StepOptions()
    options = dict(
        sp=sp, tp_plan=step.tp_plan, allow_unsharded_linears=step.allow_unsharded_linears, freeze=step.freeze
    )
    report.batch_shape, report.adamw = batch_shape, step.adamw
    report.routing = assumed_routing(model, step.expert_imbalance) if batch_shape is not None else None
    pristine = copy.deepcopy(model) if batch_shape is not None else None
    estimate = dict(sp=sp, **step.keywords())
    if dims.pp == 1:
        held = _parallelized(model, dims, rank=rank, report=report, options=options)  # the plan's refusals first
        report.parameters_per_rank, report.parameter_bytes_per_rank, report.trainable_bytes_per_rank = held
        if pristine is not None:
            report.activation_bytes = activations_by_mode(pristine, dims, batch_shape, rank=rank, **estimate)
            report.optimizer_bytes = optimizer_temporaries(pristine, dims, rank=rank, sp=sp, step=step)
            image_share(
                report.tower,
                pristine,
                dims,
                batch_shape=batch_shape,
                step=step,
                estimated=report.activation_bytes,
                rank=rank,
                **estimate,
            )
        return report
    report.pipeline = pipeline = pipeline or PipelineOptions()
    stages = dims.pp * pipeline.stages_per_rank
    layers = stage_layers(len(named_language_layers(model)), stages, pipeline.layers_per_stage)
    ranks_per_stage = dims.ranks_per_stage
    copies = [copy.deepcopy(model) for _ in range(dims.pp)]
    for pp_rank, stage_copy in enumerate(copies):
        first_rank = pp_rank * ranks_per_stage
        described = report if pp_rank == 0 else None
        held = _parallelized(stage_copy, dims, rank=first_rank, report=described, options=options, pipeline=pipeline)
        ranks = f"{first_rank}-{first_rank + ranks_per_stage - 1}" if ranks_per_stage > 1 else str(first_rank)
        held_layers = {index: layers[index] for index in pipeline.stages_of_rank(pp_rank, dims.pp)}
        report.stages.append(StageReport(pp_rank, held_layers, ranks, *held))
        if pristine is not None:
            estimate.update(rank=first_rank, pipeline=pipeline)
            report.stages[-1].activation_bytes = activations_by_mode(pristine, dims, batch_shape, **estimate)
            report.stages[-1].optimizer_bytes = optimizer_temporaries(
                pristine, dims, rank=first_rank, sp=sp, pipeline=pipeline, step=step
            )
    largest = max(report.stages, key=lambda stage: stage.parameter_bytes_per_rank)
    report.parameters_per_rank = largest.parameters_per_rank
    report.parameter_bytes_per_rank = largest.parameter_bytes_per_rank
    report.trainable_bytes_per_rank = largest.trainable_bytes_per_rank
    if pristine is not None:
        report.activation_bytes = {
            mode: max(report.stages, key=lambda stage: stage.total_bytes(mode)).activation_bytes[mode]
            for mode in report.stages[0].activation_bytes
        }
        report.optimizer_bytes = max(stage.optimizer_bytes for stage in report.stages)
    return report


def gathered_bytes_per_token(model: nn.Module, dims: ParallelDims) -> int:
    """The key and value bytes a rank receives per token of a row and per layer under cp: the other ranks' share
    ((cp - 1) / cp) of the tokens' keys and values for the rank's tp share of the KV heads, in the weights' dtype."""
    if dims.cp == 1:
        return 0
    shapes = attention_shapes(model.config.get_text_config())  # layers of a heterogeneous config: their mean
    kv_width = sum(kv_heads // dims.tp * head_dim for _, kv_heads, head_dim in shapes) / len(shapes)
    dtype_bytes = next(model.parameters()).element_size()
    return round(2 * kv_width * dtype_bytes * (dims.cp - 1) / dims.cp)


def _parallelized(
    model: nn.Module,
    dims: ParallelDims,
    *,
    rank: int,
    report: PlanReport | None,
    options: dict,
    pipeline: PipelineOptions | None = None,
) -> tuple[int, int, int]:
    """Parallelize ``model`` as ``rank``, describing its plan in ``report`` first (unless None); the parameters,
    parameter bytes and trainable parameter bytes the rank then holds. What the report says of the plan is not logged
    too."""
    with fake_world(dims.world_size, rank=rank), plan_not_logged():
        mesh = dims.build_mesh("cpu")
        if report is not None:
            checked = {name: value for name, value in options.items() if name != "freeze"}
            planned = check_before_collectives(model, mesh, **checked).planned
            _describe_plan(report, planned, model)
            _describe_float8(report, planned, model)
        parallelize(model, mesh, pipeline=pipeline, **options)
        if report is not None and report.tower is not None:
            report.tower.count_per_rank(model)
        if report is not None and (context := context_parallel_of(model)) is not None:
            report.padded_to = context.padded_length(1)
        local = [(p.to_local() if isinstance(p, DTensor) else p, p.requires_grad) for p in model.parameters()]
    trainable = sum(t.numel() * t.element_size() for t, trained in local if trained)
    return sum(t.numel() for t, _ in local), sum(t.numel() * t.element_size() for t, _ in local), trainable


def _describe_plan(report: PlanReport, planned: TensorParallelPlan | None, model: nn.Module) -> None:
    if planned is None:
        return
    choice = planned.choice
    report.plan_source, report.plan_reason = choice.source, choice.reason
    names = [name for name, _ in model.named_modules()]
    for pattern, style in choice.plan.items():
        report.styles[pattern] = (type(style).__name__, sum(pattern_matches(pattern, name) for name in names))
    report.unmatched_patterns = choice.unmatched
    report.unsharded_weights = choice.unsharded_weights
    if report.tower is not None:
        report.tower.kept = choice.kept_whole
        beside = tuple(f"{name}." for name in report.tower.parts)
        report.tower.split = sum(
            pattern_matches(pattern, name) for pattern in choice.plan for name in names if name.startswith(beside)
        )
    report.replicated = dict(Counter(per_block(name) for name in planned.replicated))


def _describe_float8(report: PlanReport, planned: TensorParallelPlan | None, model: nn.Module) -> None:
    if report.float8 is None:
        return
    styles = planned.styles if planned is not None else {}
    found = float8_layers(model, named_decoder_layers(model), report.float8, tp_styles=styles, tp=report.dims.tp)
    report.float8_converted = dict(Counter(per_block(name) for name in found.converted))
    report.float8_kept = dict(Counter((per_block(name), why) for name, why in found.kept.items()))
