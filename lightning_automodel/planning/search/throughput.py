"""The throughput model that ranks layouts: tokens per second and GPU of a training step, estimated, not measured.

Matmul FLOPs at a fixed share of the GPU's peak, times the checkpointing mode's recomputation; tensor- and
context-parallel collectives and the hidden states stages hand each other exposed (they sit between the matmuls that
need them), all of it stretched under pp by the schedule's idle share; FSDP2's gathers and reductions, and HSDP's
all-reduce of the gradient shards across replicas, hidden behind the compute up to its length (under pp, a stage
gathers its weights once a step, behind its first micro-batch's forward, and reduces their gradients after its last
backward, exposed). Its constants are :class:`Hardware`'s, an H100 node by default. It ranks layouts; measure the one
chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.parallel.pipeline import PipelineOptions, bubble_fraction
from lightning_automodel.planning.flops import flops_per_token
from lightning_automodel.planning.report import gathered_bytes_per_token


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

# Dense bf16 peaks (TFLOP/s) of the GPUs the model knows, by a part of the name CUDA gives them.
_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "H20": 148.0, "A100": 312.0, "A800": 312.0, "B200": 2250.0}


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

    @classmethod
    def named(cls, device_name: str, *, memory_gib: float, gpus_per_node: int) -> Hardware:
        """The GPU called ``device_name`` (``torch.cuda.get_device_name``): its peak where the model knows it, an
        H100's otherwise; the links are an H100 node's either way."""
        parts = [part for part in _PEAK_TFLOPS if part in device_name.upper()]
        tflops = _PEAK_TFLOPS[max(parts, key=len)] if parts else cls.tflops  # "H200" over "H20"
        return cls(memory_gib, tflops=tflops, gpus_per_node=gpus_per_node)

    def __str__(self) -> str:
        return (
            f"{self.tflops:g} TFLOP/s at {self.matmul_efficiency:.0%}, {self.node_gbps:g} GB/s within a node of"
            f" {self.gpus_per_node}, {self.network_gbps:g} GB/s between nodes"
        )


def tokens_per_second(
    model: nn.Module,
    dims: ParallelDims,
    *,
    batch_shape: tuple[int, int],
    setting: str,
    hardware: Hardware,
    mp_policy: MixedPrecisionPolicy | None = None,
    pipeline: PipelineOptions | None = None,
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
    pipeline = pipeline or PipelineOptions()
    microbatches = pipeline.microbatches_for(dims.pp) if dims.pp > 1 else 1
    busy = (compute + exposed) / (1 - bubble_fraction(dims.pp, microbatches, pipeline.stages_per_rank))
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
