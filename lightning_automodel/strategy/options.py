"""The strategy's options: its keyword arguments checked once, in the constructor, and held typed and frozen.

What needs the world (tp per node, dp_shard="auto") or the Trainer (its precision) is resolved at setup.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from lightning_automodel.parallel.activation_checkpointing import AC_SETTINGS, setting_name
from lightning_automodel.parallel.compile import CompileSpec, check_compile
from lightning_automodel.parallel.context_parallel import CPAttention, check_cp_with_pipeline
from lightning_automodel.parallel.fsdp.options import FSDPOptions
from lightning_automodel.parallel.fsdp.precision import mixed_precision_policy
from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.parallel.options import ParallelOptions
from lightning_automodel.parallel.pipeline import PipelineOptions
from lightning_automodel.parallel.tensor.plans.selection import PlanSpec
from lightning_automodel.planning.layouts import Candidate, SearchSpace


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

    search: SearchSpace | None = None
    """``layout="auto"``: the layouts the strategy chooses from at setup, once the model exists and before any weight
    is allocated: the fastest whose training step fits the GPU, with the least recomputation (see
    :mod:`~lightning_automodel.strategy.auto_layout`). The sizes given (``tp``, ``pp``, ``cp``, ``dp_shard``,
    ``dp_replicate``), ``activation_checkpointing`` and ``pp_microbatches`` stay fixed; the others are searched, with
    sequence parallel wherever tp > 1 unless ``sp=False``. Until then ``dims`` and ``parallel``'s sizes and settings
    are placeholders."""

    gpu_memory: float | None = None
    """``layout="auto"``: the GiB per GPU to plan for (default: the smallest of the ranks' devices; needed on CPU)."""

    layout_batch: tuple[int, int] | None = None
    """``layout="auto"``: the rows a data-parallel rank's batch holds and the tokens a row, where the data module has
    no ``batch_size`` and ``seq_len`` to read them from."""

    def __post_init__(self) -> None:
        require_search_for(gpu_memory=self.gpu_memory, layout_batch=self.layout_batch, search=self.search)
        dims, parallel = self.dims, self.parallel
        check_cp_with_pipeline(cp=dims.cp, pipeline=parallel.pipeline if dims.pp > 1 else None)
        if parallel.pipeline is not None:
            parallel.pipeline.validate(dims.pp)
        check_compile(compile=parallel.compile, activation_checkpointing=parallel.activation_checkpointing, ep=dims.ep)
        if parallel.sp and dims.tp == 1 and not self.tp_per_node:
            raise ValueError("sp=True (sequence parallel) splits activations over the tp ranks; it needs tp > 1.")

    @classmethod
    def from_arguments(
        cls,
        *,
        tp: int | None,
        sp: bool | None,
        dp_replicate: int | None,
        dp_shard: int | str,
        cp: int | None,
        pp: int | None,
        ep: int,
        pipeline: PipelineOptions,
        layout: str | None,
        activation_checkpointing: bool | str | None,
        compile: CompileSpec,
        float8: Any,
        cpu_offload: bool,
        save_distributed_checkpoint: bool,
        data_parallel_size: int | str | None,
        tensor_parallel_size: int | str | None,
        layout_batch: tuple[int, int] | None,
        gpu_memory: float | None,
        tp_plan: PlanSpec,
        allow_unsharded_linears: bool,
        cp_attention: CPAttention,
        fsdp: FSDPOptions,
        verify_plans: bool,
        save_trainable_only: bool,
        async_save: bool,
    ) -> StrategyOptions:
        """The options of :class:`~lightning_automodel.AutoModelParallelStrategy`'s arguments. Under
        ``layout="auto"`` the sizes, sp and the checkpointing are placeholders until the search chooses them."""
        require_flags(
            allow_unsharded_linears=allow_unsharded_linears,
            verify_plans=verify_plans,
            cpu_offload=cpu_offload,
            save_trainable_only=save_trainable_only,
            save_distributed_checkpoint=save_distributed_checkpoint,
            async_save=async_save,
        )
        tp = size_by_either_name("tensor_parallel_size", tensor_parallel_size, "tp", tp, unset=(None, 1))
        dp_shard = size_by_either_name("data_parallel_size", data_parallel_size, "dp_shard", dp_shard, unset=("auto",))
        tp_per_node = tensor_parallel_size == "auto"  # as in the parent: the devices of one node
        sizes = dict(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=None if tp_per_node else tp)
        search = auto_layout_search(
            layout,
            **sizes,
            ep=ep,
            sp=sp,
            activation_checkpointing=activation_checkpointing,
            pipeline=pipeline,
            compile=compile,
            float8=float8,
            cpu_offload=cpu_offload,
        )
        dims = ParallelDims() if search is not None else ParallelDims(**given_sizes(sizes), ep=ep)
        sp = False if sp is None or search is not None else sp
        require_flags(sp=sp)
        parallel = ParallelOptions(
            sp=sp,
            activation_checkpointing=False if search is not None else (activation_checkpointing or False),
            compile=compile,
            float8=float8,
            pipeline=pipeline if dims.pp > 1 else None,
            tp_plan=tp_plan,
            allow_unsharded_linears=allow_unsharded_linears,
            cp_attention=cp_attention,
            fsdp=fsdp,
        )
        require_sharded_saves(
            save_distributed_checkpoint=save_distributed_checkpoint,
            save_trainable_only=save_trainable_only,
            async_save=async_save,
        )
        return cls(
            dims=dims,
            parallel=parallel,
            tp_per_node=tp_per_node,
            cpu_offload=cpu_offload,
            search=search,
            layout_batch=tuple(layout_batch) if layout_batch is not None else None,
            gpu_memory=gpu_memory,
            verify_plans=verify_plans,
            save_trainable_only=save_trainable_only,
            async_save=async_save,
        )

    def at_setup(self, *, devices_per_node: int, num_nodes: int, precision: str) -> StrategyOptions:
        """These options for a world of ``num_nodes x devices_per_node`` processes and a Trainer's ``precision``,
        identical on every rank: tp per node known, the sizes resolved, FSDP2's policies set."""
        options = self
        if self.tp_per_node and self.search is not None:
            search = dataclasses.replace(self.search, tp=devices_per_node)
            options = dataclasses.replace(self, search=search, tp_per_node=False)
        elif self.tp_per_node:  # checked again: sp needs the tp it now has
            dims = dataclasses.replace(self.dims, tp=devices_per_node)
            options = dataclasses.replace(self, dims=dims, tp_per_node=False)
        dims = options.dims if options.search is not None else options.dims.resolve(num_nodes * devices_per_node)
        fsdp = dataclasses.replace(
            options.parallel.fsdp,
            mp_policy=options.mp_policy_for(precision),
            offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if options.cpu_offload else None,
        )
        return dataclasses.replace(options, dims=dims, parallel=dataclasses.replace(options.parallel, fsdp=fsdp))

    def with_layout(self, candidate: Candidate) -> StrategyOptions:
        """These options with the layout ``layout="auto"`` chose: its sizes, sequence parallel, checkpointing and
        pipeline, no search left."""
        parallel = dataclasses.replace(
            self.parallel,
            sp=candidate.sp,
            activation_checkpointing=AC_SETTINGS[candidate.checkpointing],
            pipeline=candidate.pipeline,
        )
        return dataclasses.replace(
            self, dims=candidate.dims, parallel=parallel, search=None, gpu_memory=None, layout_batch=None
        )

    def mp_policy_for(self, precision: str) -> MixedPrecisionPolicy | None:
        """FSDP2's mixed precision: the one given, else that of ``Trainer(precision=...)``; a precision flag FSDP2
        does not train in is refused either way."""
        derived = mixed_precision_policy(precision)
        given = self.parallel.fsdp.mp_policy
        return given if given is not None else derived


def given_sizes(sizes: dict[str, Any]) -> dict[str, Any]:
    """The mesh's sizes as given, those left unset 1 (dp_shard's "auto" stays: what the others leave)."""
    return {name: 1 if value is None else value for name, value in sizes.items()}


def auto_layout_search(
    layout: str | None,
    *,
    activation_checkpointing: bool | str | None,
    sp: bool | None,
    dp_shard: int | str,
    float8: Any,
    cpu_offload: bool,
    **given: Any,
) -> SearchSpace | None:
    """What ``layout="auto"`` may choose from (None for the sizes as given): the sizes, ``activation_checkpointing``
    and ``pp_microbatches`` given stay fixed. What the memory estimate does not model is refused."""
    if layout is None:
        return None
    if layout != "auto":
        raise ValueError(f'layout={layout!r}: use "auto" (the strategy chooses the sizes) or leave it unset.')
    if sp is not None:
        require_flags(sp=sp)
    if cpu_offload:
        raise ValueError(
            'layout="auto" with cpu_offload=True: the search counts the parameters, gradients and AdamW state on the'
            " GPU, where CPU offload keeps none. Give the sizes yourself (`lightning-automodel plan --fit` lists the"
            " layouts that fit without offload)."
        )
    if float8:
        raise ValueError(
            'layout="auto" with float8: the memory estimate runs the step in high precision, whose memory float8'
            " changes. Give the sizes yourself (`lightning-automodel plan --fit` lists the high-precision layouts)."
        )
    if given["pipeline"].layers_per_stage is not None and given["pp"] is None:
        raise ValueError('layout="auto" with pp_layers_per_stage: a manual split is one of pp stages; give pp too.')
    setting = None if activation_checkpointing is None else setting_name(activation_checkpointing)
    shard = None if dp_shard == "auto" else dp_shard
    return SearchSpace(**given, dp_shard=shard, checkpointing=setting, sp=sp is not False)


def require_search_for(*, search: SearchSpace | None, **settings: Any) -> None:
    """``settings`` (``gpu_memory``, ``layout_batch``) that only ``layout="auto"`` reads."""
    for name, value in settings.items():
        if value is not None and search is None:
            raise ValueError(f'{name}={value!r} sizes the search of layout="auto"; set layout="auto", or drop {name}.')
    if settings.get("gpu_memory") is not None and not settings["gpu_memory"] > 0:
        raise ValueError(f"gpu_memory={settings['gpu_memory']!r}: give the GiB of memory per GPU, a positive number.")
    batch = settings.get("layout_batch")
    if batch is not None and not (
        len(batch) == 2 and all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in batch)
    ):
        raise ValueError(f"layout_batch={batch!r}: give (rows a batch, tokens a row), two positive integers.")


def require_flags(**flags: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r}: {name} is a flag, True or False.")


def size_by_either_name(parent_name: str, parent_value: Any, name: str, value: Any, *, unset: tuple[Any, ...]) -> Any:
    """The size a user gave under Lightning's ModelParallelStrategy's name (``parent_name``) or ours (``name``);
    giving both with different values is an error, not a guess. ``unset``: our argument's values that mean it was not
    given (its default, and what a config printed by an earlier version writes for it)."""
    if parent_value is None:
        return value
    if value not in unset and value != parent_value:
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
