"""Layouts that fit a GPU: each way to split a world into pp x tp x cp x dp_shard, and on several nodes into HSDP's
node-wide shard groups replicated across nodes, with the activation-checkpointing mode that recomputes least while the
step fits, the best estimated throughput first.

A layout's memory is measured by running the code: the plan report's parameters, gradients and AdamW state per rank
(the model parallelized in a fake process group) plus :mod:`.activation_memory`'s activation peak
(one training step on fake tensors); under pp, that of the stage where they add up to the most. Its throughput is a
model, not a measurement, and says so: matmul FLOPs at a fixed share of the GPU's peak, times the checkpointing mode's
recomputation; tensor- and context-parallel collectives and the hidden states stages hand each other exposed (they sit
between the matmuls that need them), all of it stretched under pp by the schedule's idle share; FSDP2's gathers and
reductions, and HSDP's all-reduce of the gradient shards across replicas, hidden behind the compute up to its length
(under pp, a stage gathers its weights once a step, behind its first micro-batch's forward, and reduces their gradients
after its last backward, exposed). Its
constants are :class:`Hardware`'s, an H100 node by default. It ranks layouts; measure the chosen one.

Each data-parallel rank keeps the rows it is given (the data module's ``batch_size``): a layout with more pp, tp or cp
ranks trains a smaller global batch, and tokens/s per GPU compares the layouts at their own batches. pp layouts run
torch's 1F1B schedule over micro-batches of one row (as many as the rows: 1F1B needs at least pp of them), which keeps
the fewest activations and the smallest idle share. Under cp the activation estimate counts SDPA's dense mask (see
:mod:`.activation_memory`), which flex attention on a GPU does not hold: cp layouts are listed with
more memory than they take there.

HSDP layouts (dp_replicate > 1) are those whose shard group (tp x cp x dp_shard) fills a node exactly, replicated
over the nodes: a smaller group holds more per GPU for no less traffic between nodes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_automodel.parallel.activation_checkpointing import AC_SETTINGS
from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.parallel.pipeline import PipelineOptions, bubble_fraction
from lightning_automodel.planning.activation_memory import activation_bytes
from lightning_automodel.planning.flops import flops_per_token
from lightning_automodel.planning.layer_extrapolation import over_layers
from lightning_automodel.planning.report import gathered_bytes_per_token, plan_report


class _Recomputation(NamedTuple):
    compute: float  # the step's FLOPs with the recomputation, over those without
    forward_again: bool  # whether a layer's forward collectives run again in backward


# The forward is a third of a step's FLOPs. "selective" recomputes every other matmul (about half of them: which
# half depends on their sizes) and every collective between them (its policy keeps attention and matmuls only);
# "submodule" and "full" recompute the whole forward.
RECOMPUTATION = {
    "off": _Recomputation(1.0, forward_again=False),
    "selective": _Recomputation(7 / 6, forward_again=True),
    "submodule": _Recomputation(4 / 3, forward_again=True),
    "full": _Recomputation(4 / 3, forward_again=True),
}
# What a GPU's memory holds besides tensors: the CUDA context, NCCL's buffers, the allocator's fragmentation.
HEADROOM = 0.1


@dataclass(frozen=True)
class Hardware:
    """What the throughput model assumes of each GPU. Defaults: an H100 SXM node (dense bf16, NVLink 4, a 400 Gb/s
    network port per GPU)."""

    memory_gib: float
    tflops: float = 989.0
    matmul_efficiency: float = 0.5  # the share of ``tflops`` a training step's matmuls reach
    node_gbps: float = 450.0  # GB/s per GPU and direction within a node
    network_gbps: float = 50.0  # GB/s per GPU between nodes
    gpus_per_node: int = 8


@dataclass
class LayoutFit:
    dims: ParallelDims
    checkpointing: str  # a name of AC_SETTINGS
    memory_bytes: int  # parameters, gradients, AdamW state and activations per rank
    tokens_per_second: float | None = None  # estimated, per GPU (for a layout that fits)


@dataclass
class Fitting:
    hardware: Hardware
    batch_shape: tuple[int, int]
    fits: list[LayoutFit] = field(default_factory=list)
    too_large: list[LayoutFit] = field(default_factory=list)  # with full checkpointing, the least they need
    refused: dict[str, str] = field(default_factory=dict)  # layout -> why the plan refuses it

    def __str__(self) -> str:
        rows, tokens = self.batch_shape
        budget = (1 - HEADROOM) * self.hardware.memory_gib
        lines = [
            f"layouts that fit {self.hardware.memory_gib:g} GiB per GPU ({budget:.1f} GiB for tensors), {rows} rows x"
            f" {tokens:,} tokens per data-parallel rank and step (the global batch shrinks as pp x tp x cp grows; pp:"
            " 1F1B over micro-batches of one row); best estimated throughput first:",
            f"  {'pp':>3} {'tp':>3} {'cp':>3} {'dp_shard':>8} {'dp_replicate':>12}  {'checkpointing':<13}"
            f" {'memory/GPU':>10}  est. tokens/s/GPU",
        ]
        lines += [_row(layout) for layout in self.fits] or ["  (none)"]
        if self.too_large:
            lines.append("too large even with full checkpointing:")
            lines += [_row(layout) for layout in self.too_large]
        lines += [f"refused: {layout}: {why}" for layout, why in self.refused.items()]
        hardware = self.hardware
        lines.append(
            f"throughput model: {hardware.tflops:g} TFLOP/s at {hardware.matmul_efficiency:.0%}, {hardware.node_gbps:g}"
            f" GB/s within a node of {hardware.gpus_per_node}, {hardware.network_gbps:g} GB/s between nodes (see"
            " lightning_automodel/planning/fitting.py); measure the layout you pick"
        )
        if any(layout.dims.cp > 1 for layout in [*self.fits, *self.too_large]):
            lines.append(
                "cp layouts: counted with SDPA's dense [rows, S/cp, S] mask, which flex attention on GPUs does not hold"
            )
        if self.fits:
            arguments = strategy_arguments(self.fits[0], rows=rows)
            lines.append("the first, as the config's strategy:")
            lines += ["trainer:", "  strategy:", "    class_path: lightning_automodel.AutoModelParallelStrategy"]
            lines += ["    init_args:", *(f"      {name}: {_yaml(value)}" for name, value in arguments.items())]
            lines.append("or as fit's overrides:")
            lines.append(
                " ".join(f"--trainer.strategy.init_args.{name}={_yaml(value)}" for name, value in arguments.items())
            )
        return "\n".join(lines)


def strategy_arguments(layout: LayoutFit, *, rows: int) -> dict[str, int | bool | str]:
    """The strategy's arguments that select ``layout``: its sizes, sequence parallel where tp > 1, its checkpointing,
    and under pp micro-batches of one of the ``rows`` (as the estimate has them)."""
    dims = layout.dims
    arguments: dict[str, int | bool | str] = {
        "pp": dims.pp,
        "tp": dims.tp,
        "sp": dims.tp > 1,
        "cp": dims.cp,
        "dp_shard": dims.dp_shard,
        "dp_replicate": dims.dp_replicate,
        "activation_checkpointing": AC_SETTINGS[layout.checkpointing],
    }
    if dims.pp > 1:
        arguments["pp_microbatches"] = rows
    return arguments


def _yaml(value: int | bool | str) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _row(layout: LayoutFit) -> str:
    dims = layout.dims
    speed = f"{layout.tokens_per_second:>10,.0f}" if layout.tokens_per_second is not None else ""
    return (
        f"  {dims.pp:>3} {dims.tp:>3} {dims.cp:>3} {dims.dp_shard:>8} {dims.dp_replicate:>12}"
        f"  {layout.checkpointing:<13} {layout.memory_bytes / 2**30:>6.2f} GiB  {speed}"
    )


def fitting_layouts(
    model: nn.Module,
    world_size: int,
    *,
    hardware: Hardware,
    batch_shape: tuple[int, int],
    **options: Any,
) -> Fitting:
    """Every pp x tp x cp x dp_shard layout of ``world_size`` ranks (tp dividing a node, sp on where tp > 1), and on
    several nodes every HSDP layout of node-wide shard groups, each with the least recomputing checkpointing setting
    that fits ``hardware.memory_gib`` less :data:`HEADROOM`.

    ``model`` is on the meta device (left as it is: each layout parallelizes copies); ``options``: parallelize's
    (``tp_plan``, ``allow_unsharded_linears``, ``mp_policy``, ...). A layout the plan or the step refuses is listed
    with the refusal's first line."""
    fitting = Fitting(hardware, batch_shape)
    budget = (1 - HEADROOM) * hardware.memory_gib * 2**30
    for dims in _layouts(world_size, gpus_per_node=hardware.gpus_per_node):
        layout_options = {**options, "sp": dims.tp > 1}
        if dims.pp > 1:
            if batch_shape[0] < dims.pp:
                fitting.refused[_name(dims)] = (
                    f"1F1B over micro-batches of one row needs at least pp={dims.pp} rows per data-parallel rank and"
                    f" step; the batch has {batch_shape[0]}"
                )
                continue
            layout_options["pipeline"] = PipelineOptions(microbatches=batch_shape[0])
        try:
            fit = _least_recomputing_fit(model, dims, budget=budget, batch_shape=batch_shape, **layout_options)
        except ValueError as refusal:
            fitting.refused[_name(dims)] = str(refusal).splitlines()[0]
            continue
        if fit.memory_bytes > budget:
            fitting.too_large.append(fit)
            continue
        fit.tokens_per_second = _tokens_per_second(
            model, dims, batch_shape=batch_shape, setting=fit.checkpointing, hardware=hardware, **layout_options
        )
        fitting.fits.append(fit)
    fitting.fits.sort(key=lambda layout: -layout.tokens_per_second)
    return fitting


_PLAN_OPTIONS = ("sp", "tp_plan", "allow_unsharded_linears", "pipeline")


def _least_recomputing_fit(
    model: nn.Module, dims: ParallelDims, *, budget: float, batch_shape: tuple[int, int], **options: Any
) -> LayoutFit:
    """The layout with the first setting (from "off" on) whose memory fits ``budget``; with "full", the least
    recomputing, when none does. "full" is estimated first: a layout too large for it costs one estimate. Under pp,
    each stage's memory is its own state and activations, and the layout's the largest of them."""
    plan_options = {name: options[name] for name in _PLAN_OPTIONS if name in options}
    states = _state_of_each_stage(model, dims, **plan_options)
    rows, tokens = batch_shape

    def with_setting(name: str) -> LayoutFit:
        totals = [
            state
            + activation_bytes(
                copy.deepcopy(model),
                dims,
                micro_batch=rows,
                seq_len=tokens,
                rank=stage * dims.ranks_per_stage,
                activation_checkpointing=AC_SETTINGS[name],
                **options,
            )
            for stage, state in enumerate(states)
        ]
        return LayoutFit(dims, name, max(totals))

    full = with_setting("full")
    if full.memory_bytes > budget:
        return full
    for name in list(AC_SETTINGS)[:-1]:
        if (fit := with_setting(name)).memory_bytes <= budget:
            return fit
    return full


def _state_of_each_stage(model: nn.Module, dims: ParallelDims, **plan_options: Any) -> list[int]:
    """The parameters, gradients and AdamW state per rank of each stage (one without pp)."""
    if dims.pp == 1:
        report = partial(plan_report, dims=dims, **plan_options)
        return [over_layers(lambda copied: report(copied).training_bytes_per_rank, copy.deepcopy(model))]
    report = plan_report(copy.deepcopy(model), dims, **plan_options)
    return [stage.training_bytes_per_rank for stage in report.stages]


def _layouts(world_size: int, *, gpus_per_node: int) -> list[ParallelDims]:
    sharded = [
        ParallelDims(pp=pp, tp=tp, cp=cp, dp_shard=world_size // (pp * tp * cp)).resolve(world_size)
        for pp in _divisors(world_size)
        for tp in _divisors(world_size // pp)
        if gpus_per_node % tp == 0
        for cp in _divisors(world_size // (pp * tp))
    ]
    if world_size <= gpus_per_node or world_size % gpus_per_node:
        return sharded
    nodes = world_size // gpus_per_node
    replicated = [
        ParallelDims(tp=tp, cp=cp, dp_shard=gpus_per_node // (tp * cp), dp_replicate=nodes).resolve(world_size)
        for tp in _divisors(gpus_per_node)
        for cp in _divisors(gpus_per_node // tp)
    ]
    return sharded + replicated


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _name(dims: ParallelDims) -> str:
    stages = f"pp={dims.pp} " if dims.pp > 1 else ""
    replicas = f" dp_replicate={dims.dp_replicate}" if dims.dp_replicate > 1 else ""
    return f"{stages}tp={dims.tp} cp={dims.cp} dp_shard={dims.dp_shard}{replicas}"


def _tokens_per_second(
    model: nn.Module,
    dims: ParallelDims,
    *,
    batch_shape: tuple[int, int],
    setting: str,
    hardware: Hardware,
    mp_policy: MixedPrecisionPolicy | None = None,
    pipeline: PipelineOptions | None = None,
    **_: Any,
) -> float:
    """Estimated tokens per second and GPU: a data-parallel rank's rows x tokens, shared by its pp x tp x cp ranks,
    over the step time of the model in this module's docstring."""
    rows, tokens = batch_shape
    config = model.config.get_text_config()
    recomputation = RECOMPUTATION[setting]
    weight_bytes = next(model.parameters()).itemsize
    compute_bytes = mp_policy.param_dtype.itemsize if mp_policy and mp_policy.param_dtype else weight_bytes
    reduce_bytes = mp_policy.reduce_dtype.itemsize if mp_policy and mp_policy.reduce_dtype else compute_bytes
    local_tokens = rows * tokens // dims.cp
    flops = flops_per_token(model, tokens) * local_tokens / (dims.tp * dims.pp) * recomputation.compute
    compute = flops / (hardware.tflops * 1e12 * hardware.matmul_efficiency)
    passes = 2 + recomputation.forward_again  # forward, backward, the recomputed forward
    # Per layer and pass, two all-reduces (attention's and the MLP's output; sp's halves move as much), each moving
    # 2 (tp - 1) / tp of the activation; cp gathers keys and values forward and reduces their gradients backward.
    tp_bytes = 2 * passes * 2 * (dims.tp - 1) / dims.tp * local_tokens * config.hidden_size * compute_bytes
    cp_bytes = passes * gathered_bytes_per_token(model, dims) * rows * tokens * compute_bytes / weight_bytes
    # A stage receives each micro-batch's hidden states (its share under sp) and sends back their gradients.
    stream_bytes = 2 * local_tokens / dims.tp * config.hidden_size * compute_bytes if dims.pp > 1 else 0.0
    # FSDP2 shards over dp_shard x cp: it gathers the weights in forward and again in backward (a stage once: it keeps
    # them from its first forward to its last backward), and reduce-scatters their gradients; under HSDP each shard's
    # gradient is then all-reduced over the dp_replicate replicas.
    shards, replicas = dims.dp_shard * dims.cp, dims.dp_replicate
    weights = sum(p.numel() for p in model.parameters()) / (dims.tp * dims.pp)
    gather_bytes = weights * (shards - 1) / shards * (1 if dims.pp > 1 else 2) * compute_bytes
    reduce_scatter_bytes = weights * (shards - 1) / shards * reduce_bytes
    replica_bytes = weights / shards * 2 * (replicas - 1) / replicas * reduce_bytes
    node, network = hardware.node_gbps * 1e9, hardware.network_gbps * 1e9
    within_node = partial(_link, node=node, network=network, gpus_per_node=hardware.gpus_per_node)
    cp_link = within_node(dims.tp * dims.cp)  # the mesh's inner axes are neighbouring ranks: tp, then cp, then dp_shard
    fsdp_link = within_node(dims.tp * dims.cp * dims.dp_shard)
    layers = config.num_hidden_layers / dims.pp
    exposed = layers * (tp_bytes / node + cp_bytes / cp_link) + stream_bytes / within_node(dims.world_size)
    # Each stage's work comes in micro-batch slots: the schedule runs m + pp - 1 of them for the m it computes.
    microbatches = (pipeline or PipelineOptions()).microbatches_for(dims.pp) if dims.pp > 1 else 1
    busy = (compute + exposed) / (1 - bubble_fraction(dims.pp, microbatches))
    reductions = reduce_scatter_bytes / fsdp_link + replica_bytes / within_node(dims.world_size)
    if dims.pp > 1:
        # A stage gathers its weights in its first micro-batch's forward (a third of its compute, for one of m), and
        # reduces their gradients after its last backward, behind nothing.
        step = busy + reductions + max(0.0, gather_bytes / fsdp_link - compute / (3 * microbatches))
    else:
        step = busy + max(0.0, gather_bytes / fsdp_link + reductions - compute)
    return rows * tokens / (dims.pp * dims.tp * dims.cp * step)


def _link(ranks: int, *, node: float, network: float, gpus_per_node: int) -> float:
    """The bandwidth of a group of ``ranks`` neighbouring ranks: a node's if they fit in one, else the network's."""
    return node if ranks <= gpus_per_node else network
