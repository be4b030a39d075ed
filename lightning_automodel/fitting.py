"""Layouts that fit a GPU: each way to split a world into tp x cp x dp_shard, with the activation-checkpointing mode
that recomputes least while the step fits, the best estimated throughput first.

A layout's memory is measured by running the code: the plan report's parameters, gradients and AdamW state per rank
(the model parallelized in a fake process group) plus :mod:`~lightning_automodel.parallel.memory`'s activation peak
(one training step on fake tensors). Its throughput is a model, not a measurement, and says so: matmul FLOPs at a
fixed share of the GPU's peak, times the checkpointing mode's recomputation; tensor- and context-parallel
collectives exposed (they sit between the matmuls that need them); FSDP2's gathers and reductions hidden behind the
compute up to its length. Its constants are :class:`Hardware`'s, an H100 node by default. It ranks layouts; measure
the chosen one.

Not yet: pipeline parallel (the activation estimate does not run under pp), and HSDP (every data-parallel rank
shards).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import NamedTuple

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_automodel.lm.flops import flops_per_token
from lightning_automodel.mesh import ParallelDims
from lightning_automodel.parallel.memory import activation_bytes
from lightning_automodel.parallel.report import plan_report


class _Mode(NamedTuple):
    argument: bool | str  # parallelize's activation_checkpointing
    compute: float  # the step's FLOPs with the recomputation, over those without
    forward_again: bool  # whether a layer's forward collectives run again in backward


# From least to most recomputation. The forward is a third of a step's FLOPs: "selective" recomputes every other
# matmul of it (and keeps attention), "submodule" and "full" all of it, collectives included.
CHECKPOINTING = {
    "off": _Mode(False, 1.0, forward_again=False),
    "selective": _Mode("selective", 7 / 6, forward_again=False),
    "submodule": _Mode("submodule", 4 / 3, forward_again=True),
    "full": _Mode("full", 4 / 3, forward_again=True),
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
    checkpointing: str
    memory_bytes: int  # parameters, gradients, AdamW state and activations per rank
    tokens_per_second: float  # estimated, per GPU


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
            f" {tokens:,} tokens per data-parallel rank and step; best estimated throughput first:",
            f"  {'tp':>3} {'cp':>3} {'dp_shard':>8}  {'checkpointing':<13} {'memory/GPU':>10}  est. tokens/s/GPU",
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
            " lightning_automodel/fitting.py); measure the layout you pick"
        )
        return "\n".join(lines)


def _row(layout: LayoutFit) -> str:
    dims = layout.dims
    return (
        f"  {dims.tp:>3} {dims.cp:>3} {dims.dp_shard:>8}  {layout.checkpointing:<13}"
        f" {layout.memory_bytes / 2**30:>6.1f} GiB  {layout.tokens_per_second:>10,.0f}"
    )


def fitting_layouts(
    model: nn.Module,
    world_size: int,
    *,
    hardware: Hardware,
    batch_shape: tuple[int, int],
    mp_policy: MixedPrecisionPolicy | None = None,
    **options,
) -> Fitting:
    """Every tp x cp x dp_shard layout of ``world_size`` ranks (tp within a node, sp on where tp > 1), each with the
    least recomputing checkpointing mode that fits ``hardware.memory_gib`` less :data:`HEADROOM`.

    ``model`` is on the meta device (left as it is: each layout parallelizes a copy); ``options``: parallelize's
    (``tp_plan``, ``cp_attention``, ...)."""
    fitting = Fitting(hardware, batch_shape)
    budget = (1 - HEADROOM) * hardware.memory_gib * 2**30
    for dims in _layouts(world_size, gpus_per_node=hardware.gpus_per_node):
        plan_options = dict(sp=dims.tp > 1, tp_plan=options.get("tp_plan"))
        try:
            report = plan_report(copy.deepcopy(model), dims, **plan_options)
        except ValueError as refusal:
            fitting.refused[_name(dims)] = str(refusal).splitlines()[0]
            continue
        for label, mode in CHECKPOINTING.items():
            activations = activation_bytes(
                copy.deepcopy(model),
                dims,
                micro_batch=batch_shape[0],
                seq_len=batch_shape[1],
                activation_checkpointing=mode.argument,
                mp_policy=mp_policy,
                **{**options, **plan_options},
            )
            memory = report.training_bytes_per_rank + activations
            speed = _tokens_per_second(
                model,
                dims,
                batch_shape=batch_shape,
                mode=mode,
                gathered_per_token=report.gathered_bytes_per_token,
                hardware=hardware,
                mp_policy=mp_policy,
            )
            layout = LayoutFit(dims, label, memory, speed)
            if memory <= budget:
                fitting.fits.append(layout)
                break
        else:
            fitting.too_large.append(layout)
    fitting.fits.sort(key=lambda layout: -layout.tokens_per_second)
    return fitting


def _layouts(world_size: int, *, gpus_per_node: int) -> list[ParallelDims]:
    return [
        ParallelDims(tp=tp, cp=cp, dp_shard=world_size // (tp * cp)).resolve(world_size)
        for tp in _divisors(world_size)
        if tp <= gpus_per_node
        for cp in _divisors(world_size // tp)
    ]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _name(dims: ParallelDims) -> str:
    return f"tp={dims.tp} cp={dims.cp} dp_shard={dims.dp_shard}"


def _tokens_per_second(
    model: nn.Module,
    dims: ParallelDims,
    *,
    batch_shape: tuple[int, int],
    mode: _Mode,
    gathered_per_token: int,
    hardware: Hardware,
    mp_policy: MixedPrecisionPolicy | None,
) -> float:
    """Estimated tokens per second and GPU: a data-parallel rank's rows x tokens, shared by its tp x cp ranks, over
    the step time of the model in this module's docstring. ``gathered_per_token``: the plan report's key and value
    bytes a rank receives per token of a row and layer under cp, in the weights' dtype."""
    rows, tokens = batch_shape
    config = model.config.get_text_config()
    weight_bytes = next(model.parameters()).itemsize
    compute_bytes = mp_policy.param_dtype.itemsize if mp_policy and mp_policy.param_dtype else weight_bytes
    reduce_bytes = mp_policy.reduce_dtype.itemsize if mp_policy and mp_policy.reduce_dtype else compute_bytes
    local_tokens = rows * tokens // dims.cp
    flops = flops_per_token(model, tokens) * local_tokens / dims.tp * mode.compute
    compute = flops / (hardware.tflops * 1e12 * hardware.matmul_efficiency)
    passes = 2 + mode.forward_again  # forward, backward, the recomputed forward
    # Per layer and pass, two all-reduces (attention's and the MLP's output; sp's halves move as much), each moving
    # 2 (tp - 1) / tp of the activation; cp gathers keys and values forward and reduces their gradients backward.
    tp_bytes = 2 * passes * 2 * (dims.tp - 1) / dims.tp * local_tokens * config.hidden_size * compute_bytes
    cp_bytes = passes * gathered_per_token * rows * tokens * compute_bytes / weight_bytes
    weights = sum(p.numel() for p in model.parameters()) / dims.tp
    # FSDP2 gathers the weights in forward and again in backward, and reduce-scatters their gradients.
    fsdp_bytes = weights * (dims.dp_shard - 1) / dims.dp_shard * (2 * compute_bytes + reduce_bytes)
    inside_node = dims.tp * dims.cp <= hardware.gpus_per_node
    model_parallel = (hardware.node_gbps if inside_node else hardware.network_gbps) * 1e9
    spans_nodes = dims.world_size > hardware.gpus_per_node
    data_parallel = (hardware.network_gbps if spans_nodes else hardware.node_gbps) * 1e9
    exposed = config.num_hidden_layers * (tp_bytes + cp_bytes) / model_parallel
    step = compute + exposed + max(0.0, fsdp_bytes / data_parallel - compute)
    return rows * tokens / (dims.tp * dims.cp * step)
