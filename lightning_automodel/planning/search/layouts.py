"""The layouts a world can train in, and what one costs.

A layout is a split of the world into pp x dp_replicate x dp_shard x cp x tp ranks with an activation-checkpointing
setting. :func:`candidates` lists those a :class:`SearchSpace` allows (the sizes a user gave fixed, the others
searched), each with its estimated throughput (:mod:`.throughput`), best first; :func:`layout_memory` measures one by
running the code: the plan report's parameters, gradients and AdamW state per rank (the model parallelized in a fake
process group) plus the larger of :mod:`..memory.activations`'s activation peak (one training step on fake tensors)
and the temporaries of the AdamW step after it (:mod:`..memory.optimizer_step`); under pp, those of the stage where
they add up to the most.

The global batch stays the one the user gave: every rank the fixed model-parallel sizes leave is a data-parallel rank
reading the data module's rows, so a layout of k times as many pp x tp x cp ranks accumulates k batches per optimizer
step (:attr:`Candidate.accumulation`). Where the optimizer cannot accumulate (manual optimization), such layouts are
refused as training a smaller global batch.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from functools import partial

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_automodel.hf.decoder_layers import named_language_layers
from lightning_automodel.parallel.activation_checkpointing import AC_MODES, ACMode
from lightning_automodel.parallel.compile import CompileSpec, check_compile
from lightning_automodel.parallel.context_parallel import check_cp_with_pipeline
from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.parallel.pipeline import PipelineOptions, stage_layers
from lightning_automodel.planning.memory.activations import activation_bytes
from lightning_automodel.planning.memory.layer_extrapolation import over_layers
from lightning_automodel.planning.memory.optimizer_step import optimizer_step_bytes, peak_bytes
from lightning_automodel.planning.memory.step_options import StepOptions
from lightning_automodel.planning.report import plan_report
from lightning_automodel.planning.search.throughput import Hardware, tokens_per_second

# What a GPU's memory holds besides tensors: the CUDA context, NCCL's buffers, the allocator's fragmentation.
HEADROOM = 0.1


def tensor_budget(memory_gib: float) -> float:
    """The bytes of a GPU of ``memory_gib`` GiB that a layout's tensors may take."""
    return (1 - HEADROOM) * memory_gib * 2**30


@dataclass(frozen=True)
class SearchSpace:
    """The layouts a search may choose from: a size or setting given is fixed, one left None is searched."""

    pp: int | None = None
    tp: int | None = None
    cp: int | None = None
    dp_shard: int | None = None
    dp_replicate: int | None = None
    ep: int = 1  # never searched: it borrows its ranks from dp_shard x cp
    checkpointing: ACMode | None = None  # None: each mode, the least recomputing first
    sp: bool = True  # sequence parallel wherever tp > 1
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)  # microbatches None: one row each
    compile: CompileSpec = False
    no_accumulation: str | None = None  # why the optimizer cannot accumulate batches, where it cannot

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "cp", "dp_shard", "dp_replicate"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} is invalid: {name} must be a positive integer (or left unset).")
        if self.checkpointing is not None and self.checkpointing not in AC_MODES:
            raise ValueError(f"checkpointing={self.checkpointing!r}: use one of {', '.join(AC_MODES)} (or None).")

    @property
    def fixed_model_parallel(self) -> int:
        """The pp x tp x cp ranks the fixed sizes ask for: what the global batch is counted against."""
        return (self.pp or 1) * (self.tp or 1) * (self.cp or 1)

    def fixed_sizes(self) -> dict[str, int]:
        return {
            name: value for name in ("pp", "tp", "cp", "dp_shard", "dp_replicate") if (value := getattr(self, name))
        }


@dataclass(frozen=True)
class Candidate:
    """One layout with one checkpointing setting, and what it would train at."""

    dims: ParallelDims
    checkpointing: ACMode
    tokens_per_second: float  # estimated, per GPU
    accumulation: int  # batches per optimizer step that keep the global batch (times the Trainer's own)
    sp: bool
    pipeline: PipelineOptions | None  # under pp: the schedule and its micro-batches of the rows

    @property
    def name(self) -> str:
        return layout_name(self.dims)


@dataclass(frozen=True)
class Outcome:
    """A candidate's memory per GPU: the state (parameters, gradients, AdamW state), the activation peak and the AdamW
    step's temporaries of the stage where they add up to the most. ``activation_bytes`` is None where the state alone
    exceeded the budget, and the step was not estimated."""

    state_bytes: int
    activation_bytes: int | None
    optimizer_bytes: int = 0
    seconds: float = 0.0  # the CPU time the measurement took

    @property
    def memory_bytes(self) -> int:
        """The state with the larger of the activations and the optimizer's temporaries (see
        :func:`~lightning_automodel.planning.memory.optimizer_step.peak_bytes`)."""
        activations = self.activation_bytes or 0
        return peak_bytes(state=self.state_bytes, activations=activations, optimizer=self.optimizer_bytes)


def candidates(
    model: nn.Module,
    world_size: int,
    *,
    space: SearchSpace,
    hardware: Hardware,
    batch_shape: tuple[int, int],
    mp_policy: MixedPrecisionPolicy | None = None,
) -> tuple[list[Candidate], dict[str, str]]:
    """Every layout ``space`` allows on ``world_size`` ranks with each setting it allows, the best estimated
    throughput first (among equals the least recomputing, then the order :func:`layouts` lists them), and the layouts
    refused before any estimate, with why."""
    found, refused = [], {}
    speed = partial(tokens_per_second, model, batch_shape=batch_shape, hardware=hardware, mp_policy=mp_policy)
    budget = tensor_budget(hardware.memory_gib)
    for dims in layouts(world_size, gpus_per_node=hardware.gpus_per_node, space=space, refused=refused):
        sp = space.sp and dims.tp > 1
        try:
            pipeline = _pipeline(dims, space=space, rows=batch_shape[0])
            accumulation = _accumulation(dims, space=space)
            inputs = kept_layer_inputs(
                model, dims, batch_shape=batch_shape, sp=sp, pipeline=pipeline, mp_policy=mp_policy
            )
            if inputs > budget:
                raise ValueError(
                    f"too large before any estimate: its decoder layers' inputs, which every checkpointing setting"
                    f" keeps for backward, take {inputs / 2**30:.2f} GiB per GPU, over the {budget / 2**30:.2f} GiB"
                    " for tensors"
                )
        except ValueError as refusal:
            refused[layout_name(dims)] = str(refusal)
            continue
        for setting in _settings(dims, space=space, pipeline=pipeline, refused=refused):
            throughput = speed(dims, setting=setting, pipeline=pipeline)
            found.append(Candidate(dims, setting, throughput, accumulation, sp=sp, pipeline=pipeline))
    found.sort(key=lambda candidate: (-candidate.tokens_per_second, AC_MODES.index(candidate.checkpointing)))
    return found, refused


def kept_layer_inputs(
    model: nn.Module,
    dims: ParallelDims,
    *,
    batch_shape: tuple[int, int],
    sp: bool,
    pipeline: PipelineOptions | None,
    mp_policy: MixedPrecisionPolicy | None,
) -> int:
    """A lower bound of a layout's activation memory under any checkpointing setting, known without a step: every
    decoder layer keeps its input for backward (full checkpointing keeps that alone), a micro-batch's rows x the
    rank's tokens (1/cp of a row, 1/tp of that under sp) x the hidden size, in the compute dtype; under pp, on the rank
    whose stages hold the most layers, for one micro-batch in flight. A vision tower's blocks, which hold images'
    patches rather than the rows' tokens, are left out."""
    config = model.config.get_text_config()
    hidden, layers = getattr(config, "hidden_size", None), len(named_language_layers(model))
    if not isinstance(hidden, int) or not layers:
        return 0
    rows, tokens = batch_shape
    if pipeline is not None:
        language = len(named_language_layers(model))  # the layers pp splits (a vision tower's go to stage 0)
        spans = stage_layers(language, dims.pp * pipeline.stages_per_rank, pipeline.layers_per_stage)
        held = [sum(len(spans[stage]) for stage in pipeline.stages_of_rank(rank, dims.pp)) for rank in range(dims.pp)]
        layers, rows = max(held), rows // pipeline.microbatches_for(dims.pp)
    tokens //= dims.cp * (dims.tp if sp else 1)
    dtype = mp_policy.param_dtype if mp_policy is not None and mp_policy.param_dtype is not None else None
    element = dtype.itemsize if dtype is not None else next(model.parameters()).element_size()
    return layers * rows * tokens * hidden * element


def layouts(
    world_size: int, *, gpus_per_node: int, space: SearchSpace = SearchSpace(), refused: dict[str, str] | None = None
) -> list[ParallelDims]:
    """Every pp x dp_replicate x dp_shard x cp x tp split of ``world_size`` with the sizes ``space`` fixes: tp within a
    node unless fixed, and HSDP (dp_replicate > 1, unless fixed) where a stage spans several whole nodes, its shard
    group (tp x cp x dp_shard) filling one and replicated over the others. A split that expert parallel cannot borrow
    its ranks from is added to ``refused``."""
    found = []
    for pp in _divisors(world_size):
        for tp in _divisors(world_size // pp):
            if space.tp is None and gpus_per_node % tp:
                continue
            for cp in _divisors(world_size // (pp * tp)):
                data_parallel = world_size // (pp * tp * cp)
                counts = _replica_counts(data_parallel, tp=tp, cp=cp, gpus_per_node=gpus_per_node, space=space)
                for replicas in counts:
                    dims = ParallelDims(pp, replicas, data_parallel // replicas, cp, tp, ep=space.ep)
                    if any(getattr(dims, name) != size for name, size in space.fixed_sizes().items()):
                        continue
                    try:
                        found.append(dims.resolve(world_size))
                    except ValueError as refusal:
                        if refused is not None:
                            refused[layout_name(dims)] = str(refusal)
    return found


def _replica_counts(data_parallel: int, *, tp: int, cp: int, gpus_per_node: int, space: SearchSpace) -> list[int]:
    """dp_replicate's sizes for ``data_parallel`` ranks of a stage: 1 (FSDP over them all), and where the stage spans
    several whole nodes and tp x cp divides one, as many replicas as nodes (each shard group one node)."""
    if space.dp_replicate is not None:
        return [space.dp_replicate] if data_parallel % space.dp_replicate == 0 else []
    stage = data_parallel * tp * cp
    if stage > gpus_per_node and stage % gpus_per_node == 0 and gpus_per_node % (tp * cp) == 0:
        return [1, stage // gpus_per_node]
    return [1]


def layout_name(dims: ParallelDims) -> str:
    stages = f"pp={dims.pp} " if dims.pp > 1 else ""
    replicas = f" dp_replicate={dims.dp_replicate}" if dims.dp_replicate > 1 else ""
    experts = f" ep={dims.ep}" if dims.ep > 1 else ""
    return f"{stages}tp={dims.tp} cp={dims.cp} dp_shard={dims.dp_shard}{replicas}{experts}"


def _pipeline(dims: ParallelDims, *, space: SearchSpace, rows: int) -> PipelineOptions | None:
    """Under pp, the schedule over micro-batches of the rows (one row each unless fixed); refused where the rows do
    not make them."""
    if dims.pp == 1:
        return None
    pipeline = space.pipeline
    if pipeline.microbatches is None:
        pipeline = dataclasses.replace(pipeline, microbatches=rows)
    if rows % pipeline.microbatches:
        raise ValueError(f"pp_microbatches={pipeline.microbatches} does not divide a batch of {rows} rows")
    try:
        pipeline.validate(dims.pp)
    except ValueError as refusal:
        raise ValueError(f"a batch of {rows} rows: {refusal}") from None
    check_cp_with_pipeline(cp=dims.cp, pipeline=pipeline)
    return pipeline


def _accumulation(dims: ParallelDims, *, space: SearchSpace) -> int:
    """The batches an optimizer step accumulates at ``dims`` to keep the global batch of ``space``'s fixed sizes."""
    accumulation = dims.pp * dims.tp * dims.cp // space.fixed_model_parallel
    if accumulation > 1 and space.no_accumulation is not None:
        raise ValueError(
            f"it would train a global batch {accumulation} times smaller than the one given (its data-parallel ranks"
            f" read {accumulation} times fewer rows a step), and {space.no_accumulation}"
        )
    return accumulation


def _settings(
    dims: ParallelDims, *, space: SearchSpace, pipeline: PipelineOptions | None, refused: dict[str, str]
) -> list[str]:
    """The checkpointing settings a layout may run, the least recomputing first."""
    settings = [space.checkpointing] if space.checkpointing is not None else list(AC_MODES)
    allowed = []
    for setting in settings:
        try:
            if pipeline is not None and pipeline.splits_backward() and setting != "off":
                raise ValueError(f"the {pipeline.schedule} schedule runs no activation checkpointing")
            check_compile(compile=space.compile, activation_checkpointing=setting, ep=dims.ep)
        except ValueError as refusal:
            refused[f"{layout_name(dims)} with {setting} checkpointing"] = str(refusal).splitlines()[0]
            continue
        allowed.append(setting)
    return allowed


def layout_memory(
    model: nn.Module,
    candidate: Candidate,
    *,
    batch_shape: tuple[int, int],
    budget: float,
    step: StepOptions,
    temporaries: dict[tuple, int] | None = None,
    pp_rank: int | None = None,
) -> Outcome:
    """``candidate``'s memory per GPU, measured on copies of ``model`` (on the meta device) with ``step``'s plan,
    precision, loss and AdamW; the step is not estimated where the state alone exceeds ``budget``. A layout the plan
    or the step refuses raises the refusal (a ValueError). ``temporaries``: the optimizer step's of the layouts
    measured before with the same model and ``step``, which every checkpointing setting shares (read and added to).
    ``pp_rank``: under pp, the step of that pp rank's stages alone (the largest of the ranks' outcomes is the
    candidate's: :func:`~.workers.combined`), else of every pp rank."""
    dims = candidate.dims
    states = state_of_each_stage(model, candidate, step=step)
    if max(states) > budget:
        return Outcome(max(states), None)
    rows, tokens = batch_shape
    layout = dict(sp=candidate.sp, pipeline=candidate.pipeline)
    outcomes = []
    for stage, state in enumerate(states):
        if pp_rank is not None and stage != pp_rank:
            continue
        rank = stage * dims.ranks_per_stage
        activations = activation_bytes(
            copy.deepcopy(model),
            dims,
            micro_batch=rows,
            seq_len=tokens,
            rank=rank,
            activation_checkpointing=candidate.checkpointing,
            **layout,
            **step.keywords(),
        )
        known = {} if temporaries is None else temporaries
        key = (dims, candidate.sp, repr(candidate.pipeline), rank)
        if key not in known:
            known[key] = optimizer_step_bytes(
                copy.deepcopy(model), dims, rank=rank, **layout, **step.optimizer_keywords()
            )
        outcomes.append(Outcome(state, activations, known[key]))
    return max(outcomes, key=lambda outcome: outcome.memory_bytes)


def state_of_each_stage(model: nn.Module, candidate: Candidate, *, step: StepOptions) -> list[int]:
    """The parameters, gradients and AdamW state per rank of each stage (one without pp)."""
    dims = candidate.dims
    report = partial(plan_report, dims=dims, sp=candidate.sp, pipeline=candidate.pipeline, step=step)
    if dims.pp == 1:
        return [over_layers(lambda copied: report(copied).training_bytes_per_rank, copy.deepcopy(model))]
    return [stage.training_bytes_per_rank for stage in report(copy.deepcopy(model)).stages]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
