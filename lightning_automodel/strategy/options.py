"""The strategy's options: its keyword arguments checked once, in the constructor, and held typed and frozen.

What needs the world (tp per node, dp_shard="auto") or the Trainer (its precision) is resolved at setup.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from lightning_automodel.parallel.compile import check_compile
from lightning_automodel.parallel.context_parallel import check_cp_with_pipeline
from lightning_automodel.parallel.fsdp.precision import mixed_precision_policy
from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.parallel.options import ParallelOptions


@dataclass(frozen=True)
class StrategyOptions:
    """What :class:`~lightning_automodel.AutoModelParallelStrategy` is asked for. Its ``pp_*`` arguments build
    ``parallel.pipeline``, its FSDP2 ones (``mp_policy``, ``reshard_after_forward``, ``forward_prefetch``,
    ``backward_prefetch``) ``parallel.fsdp``. The parent's ``save_distributed_checkpoint``, ``process_group_backend``
    and ``timeout`` stay the parent's, as in Lightning's ModelParallelStrategy; ``timeout`` also bounds every
    sub-group of the mesh."""

    dims: ParallelDims = field(default_factory=ParallelDims)
    """The mesh's sizes. ``tp``: ranks that split every layer's weights. ``dp_replicate``: replicas of the whole
    sharded model (HSDP across nodes). ``dp_shard``: the FSDP shard-group size; "auto" takes what the world size
    leaves. ``data_parallel_size`` and ``tensor_parallel_size`` are Lightning's ModelParallelStrategy names for
    ``dp_shard`` and ``tp``, so that its configurations run unchanged; giving both names with different values is an
    error.

    ``cp``: every sequence is split over cp ranks (2 cp chunks, rank i holding chunks i and 2 cp - 1 - i), and
    attention all-gathers keys and values over them. The model's call takes the whole batch and returns this rank's
    share of the loss: training_step returns the model's own loss (``self.model(input_ids=..., labels=...).loss``).
    FSDP shards over dp_shard x cp.

    ``ep``: each of ep ranks holds 1/ep of every mixture-of-experts layer's experts, and tokens travel to their
    experts by all-to-all. ep borrows its ranks from dp_shard x cp (it must divide it); FSDP shards the experts over
    what dp_shard x cp leaves, and with tp > 1 each expert is also split over tp.

    ``pp``: each of pp ranks holds a stage of every model (consecutive decoder layers, the embedding on the first,
    the head on the last), and a schedule of torch.distributed.pipelining runs forward and backward of every
    micro-batch. training_step returns the model's own loss (``self.model(input_ids=..., labels=...).loss``): the
    last stage computes it, and it reaches every rank. Composes with tp (and sp), dp_shard, dp_replicate, cp, ep,
    activation checkpointing, CPU offload and LoRA."""

    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    """How each axis is applied. Its ``fsdp.mp_policy`` defaults to the one of ``Trainer(precision=...)``, and
    ``cpu_offload`` sets its ``fsdp.offload_policy``, both at setup."""

    tp_per_node: bool = False
    """``tensor_parallel_size="auto"``, as in the parent: tp is the devices of one node, known at setup."""

    verify_plans: bool = False
    """Before parallelizing a model whose class no family plan is registered for (or with ``tp_plan`` given), verify
    its plan once per class with :func:`~lightning_automodel.verify_plan`: one step of a shrunk replica, tp simulated
    on CPU, against one process. A plan that trains wrong raises on every rank before any collective. Costs seconds
    per class (a child process on every rank)."""

    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory."""

    save_trainable_only: bool = False
    """Checkpoints hold the trainable parameters only (LoRA adapters) with the optimizer and loop state; resuming
    takes the frozen rest from the model as built (its pretrained weights or seed)."""

    async_save: bool = False
    """Checkpoints are written while training goes on: a save costs the step only the copy of each rank's shards to
    CPU memory (pinned on GPUs). Atomic as a synchronous save; one save in flight at a time (the next save waits
    for it); a failed write is raised on every rank at the next save, load or end of the stage. Sharded saves only."""

    def __post_init__(self) -> None:
        dims, parallel = self.dims, self.parallel
        check_cp_with_pipeline(cp=dims.cp, pipeline=parallel.pipeline if dims.pp > 1 else None)
        if parallel.pipeline is not None:
            parallel.pipeline.validate(dims.pp)
        check_compile(compile=parallel.compile, activation_checkpointing=parallel.activation_checkpointing, ep=dims.ep)
        if parallel.sp and dims.tp == 1 and not self.tp_per_node:
            raise ValueError("sp=True (sequence parallel) splits activations over the tp ranks; it needs tp > 1.")

    def at_setup(self, *, devices_per_node: int, num_nodes: int, precision: str) -> StrategyOptions:
        """These options for a world of ``num_nodes x devices_per_node`` processes and a Trainer's ``precision``,
        identical on every rank: tp per node known, the sizes resolved, FSDP2's policies set."""
        options = self
        if self.tp_per_node:  # checked again: sp needs the tp it now has
            dims = dataclasses.replace(self.dims, tp=devices_per_node)
            options = dataclasses.replace(self, dims=dims, tp_per_node=False)
        dims = options.dims.resolve(num_nodes * devices_per_node)
        fsdp = dataclasses.replace(
            options.parallel.fsdp,
            mp_policy=options.mp_policy_for(precision),
            offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if options.cpu_offload else None,
        )
        return dataclasses.replace(options, dims=dims, parallel=dataclasses.replace(options.parallel, fsdp=fsdp))

    def mp_policy_for(self, precision: str) -> MixedPrecisionPolicy | None:
        """FSDP2's mixed precision: the one given, else that of ``Trainer(precision=...)``; a precision flag FSDP2
        does not train in is refused either way."""
        derived = mixed_precision_policy(precision)
        given = self.parallel.fsdp.mp_policy
        return given if given is not None else derived


def require_flags(**flags: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r}: {name} is a flag, True or False.")


def size_by_either_name(parent_name: str, parent_value: Any, name: str, value: Any, *, unset: Any) -> Any:
    """The size a user gave under Lightning's ModelParallelStrategy's name (``parent_name``) or ours (``name``);
    giving both with different values is an error, not a guess. ``unset`` is our argument's default."""
    if parent_value is None:
        return value
    if value != unset and value != parent_value:
        raise ValueError(
            f"{name}={value!r} and {parent_name}={parent_value!r} disagree: {parent_name} is Lightning's"
            f" ModelParallelStrategy name for {name}. Give one of them."
        )
    return parent_value


def require_sharded_saves(*, save_distributed_checkpoint: bool, **flags: bool) -> None:
    """``flags`` (``save_trainable_only``, ``async_save``) that need sharded checkpoints."""
    for name, value in flags.items():
        if value and not save_distributed_checkpoint:
            raise ValueError(f"{name}=True writes sharded checkpoints; it needs save_distributed_checkpoint=True.")
