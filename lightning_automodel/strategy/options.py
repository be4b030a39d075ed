"""The strategy's options: its arguments checked once, in the constructor, and held typed and frozen.

The constructor builds each part from the arguments that set it: the layout as given (:class:`GivenLayout`: the sizes,
sequence parallel, checkpointing and the pipeline's options), how the axes are applied (``ParallelOptions``, with
``FSDPOptions``), and these options, which hold the mesh's sizes, or under ``layout="auto"`` the search. What needs the
world (tp per node, dp_shard="auto") or the Trainer (its precision) is resolved at setup.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from lightning_automodel.parallel.activation_checkpointing import ACMode
from lightning_automodel.parallel.compile import CompileSpec, check_compile
from lightning_automodel.parallel.context_parallel import check_cp_with_pipeline
from lightning_automodel.parallel.fsdp.precision import mixed_precision_policy
from lightning_automodel.parallel.mesh import ParallelDims, Size
from lightning_automodel.parallel.options import ParallelOptions, check_sequence_parallel
from lightning_automodel.parallel.pipeline import PipelineOptions
from lightning_automodel.planning.memory.routing import ExpertRouting
from lightning_automodel.planning.memory.step_options import check_images
from lightning_automodel.planning.search.layouts import Candidate, SearchSpace


@dataclass(frozen=True)
class GivenLayout:
    """The layout as the strategy's arguments give it: the mesh's sizes (tp and dp_shard under our names or
    Lightning's), sequence parallel and activation checkpointing, None where unset, and the pipeline's options. Under
    ``layout="auto"`` those given are fixed and the search chooses the rest; otherwise unset sizes are 1 and unset
    settings off."""

    pp: int | None = None
    dp_replicate: int | None = None
    dp_shard: Size = "auto"
    cp: int | None = None
    tp: int | None = None
    ep: int = 1
    sp: bool | None = None
    checkpointing: ACMode | None = None  # the activation-checkpointing mode given (None: unset)
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    data_parallel_size: Size | None = None  # Lightning's ModelParallelStrategy name for dp_shard
    tensor_parallel_size: Size | None = None  # and for tp; "auto": a node's devices, known at setup

    def __post_init__(self) -> None:
        if self.sp is not None:
            require_flags(sp=self.sp)
        _ = self.tp_size, self.dp_shard_size  # refused here: two sizes that disagree

    @property
    def tp_per_node(self) -> bool:
        """Lightning's ``tensor_parallel_size="auto"``: tp is the devices of one node."""
        return self.tensor_parallel_size == "auto"

    @property
    def tp_size(self) -> int | None:
        """tp under either name (both given must agree); None where unset or per node."""
        size = size_by_either_name("tensor_parallel_size", self.tensor_parallel_size, "tp", self.tp, unset=(None, 1))
        return None if self.tp_per_node else size

    @property
    def dp_shard_size(self) -> Size:
        """dp_shard under either name (both given must agree)."""
        return size_by_either_name(
            "data_parallel_size", self.data_parallel_size, "dp_shard", self.dp_shard, unset=("auto",)
        )

    def placed(
        self, parallel: ParallelOptions, *, layout: Literal["auto"] | None
    ) -> tuple[ParallelDims, ParallelOptions, SearchSpace | None]:
        """The mesh's sizes and ``parallel`` with this layout's sequence parallel, checkpointing and pipeline; under
        ``layout="auto"``, placeholders for them (``ParallelDims()``, ``parallel`` as it is) and the search."""
        if layout is None:
            dims = ParallelDims(
                pp=_or_one(self.pp),
                dp_replicate=_or_one(self.dp_replicate),
                dp_shard=self.dp_shard_size,
                cp=_or_one(self.cp),
                tp=_or_one(self.tp_size),  # tp per node: 1 until setup
                ep=self.ep,
            )
            pipeline = self.pipeline if dims.pp > 1 else None
            applied = dataclasses.replace(
                parallel, sp=self.sp is True, activation_checkpointing=self.checkpointing or "off", pipeline=pipeline
            )
            return dims, applied, None
        if layout != "auto":
            raise ValueError(f'layout={layout!r}: use "auto" (the strategy chooses the sizes) or leave it unset.')
        return ParallelDims(), parallel, self._search(compile=parallel.compile)

    def _search(self, *, compile: CompileSpec) -> SearchSpace:
        """What ``layout="auto"`` may choose from: the sizes, checkpointing and micro-batches given stay fixed."""
        if self.pipeline.layers_per_stage is not None and self.pp is None:
            raise ValueError('layout="auto" with pp_layers_per_stage: a manual split is one of pp stages; give pp too.')
        return SearchSpace(
            pp=self.pp,
            tp=self.tp_size,
            cp=self.cp,
            dp_shard=None if self.dp_shard_size == "auto" else self.dp_shard_size,
            dp_replicate=self.dp_replicate,
            ep=self.ep,
            checkpointing=self.checkpointing,
            sp=self.sp is not False,
            pipeline=self.pipeline,
            compile=compile,
        )


def _or_one(size: int | None) -> int:
    return 1 if size is None else size


@dataclass(frozen=True)
class StrategyOptions:
    """What :class:`~lightning_automodel.AutoModelParallelStrategy` is asked for. The parent's
    ``process_group_backend`` and ``timeout`` stay the parent's, as in Lightning's ModelParallelStrategy (``timeout``
    also bounds every sub-group of the mesh); ``save_distributed_checkpoint`` is the parent's too, and held here for
    the checks of the saves that need it."""

    dims: ParallelDims = field(default_factory=ParallelDims)
    """The mesh's sizes (the strategy's ``tp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``pp`` and ``ep``, described
    on :class:`~lightning_automodel.parallel.mesh.ParallelDims`' fields)."""

    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    """How each axis is applied (its ``pipeline``: the strategy's ``pp_*`` arguments; its ``fsdp``: ``mp_policy``,
    ``reshard_after_forward``, ``forward_prefetch`` and ``backward_prefetch``). Its ``fsdp.mp_policy`` defaults to the
    one of ``Trainer(precision=...)``, and ``cpu_offload`` sets its ``fsdp.offload_policy``, both at setup."""

    tp_per_node: bool = False
    """``tensor_parallel_size="auto"``, as in the parent: tp is the devices of one node, known at setup."""

    verify_plans: bool = False
    """Verify the tensor-parallel plan of a model whose class no family plan is registered for (or with ``tp_plan``
    given) once per class, before parallelizing it. :func:`~lightning_automodel.verify_plan` runs one step of a
    shrunk replica, tp simulated on CPU, against one process: a plan that trains wrong raises on every rank before any
    collective. Costs seconds per class (a child process on every rank)."""

    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory."""

    save_trainable_only: bool = False
    """Checkpoints hold the trainable parameters only (LoRA adapters) with the optimizer and loop state; resuming
    takes the frozen rest from the model as built (its pretrained weights or seed)."""

    save_distributed_checkpoint: bool = True
    """Each rank saves its shards of the weights and optimizer state (True, the default), or rank 0 gathers them into
    one file (False), as Lightning's ModelParallelStrategy does."""

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

    layout_images_per_row: int | None = None
    """``layout="auto"``: a vision-language model's images a row the search plans for (default one; 0: none), whose
    pixels each layout's estimated step runs through the vision tower."""

    layout_image_tokens: int | None = None
    """``layout="auto"``: the tokens an image the search plans for, for a tower taking images of any size (Qwen2-VL's;
    default 256); others' are their config's."""

    layout_expert_imbalance: float | None = None
    """``layout="auto"``: a mixture-of-experts model's routing the search plans for, the busiest expert's share of a
    rank's choices relative to a balanced one (default 1: balanced; see
    :class:`~lightning_automodel.planning.memory.routing.ExpertRouting`)."""

    def __post_init__(self) -> None:
        require_flags(
            allow_unsharded_linears=self.parallel.allow_unsharded_linears,
            verify_plans=self.verify_plans,
            cpu_offload=self.cpu_offload,
            save_trainable_only=self.save_trainable_only,
            save_distributed_checkpoint=self.save_distributed_checkpoint,
            async_save=self.async_save,
        )
        require_sharded_saves(
            save_distributed_checkpoint=self.save_distributed_checkpoint,
            save_trainable_only=self.save_trainable_only,
            async_save=self.async_save,
        )
        require_search_for(
            search=self.search,
            gpu_memory=self.gpu_memory,
            layout_batch=self.layout_batch,
            layout_images_per_row=self.layout_images_per_row,
            layout_image_tokens=self.layout_image_tokens,
            layout_expert_imbalance=self.layout_expert_imbalance,
        )
        pp = self.dims.pp if self.search is None else self.search.pp
        if not self.save_distributed_checkpoint and pp != 1:
            raise ValueError(
                "save_distributed_checkpoint=False writes one file from rank 0, which under pipeline parallel holds"
                " its own stages only: the file would lack the others' layers. Keep sharded checkpoints (the default;"
                " `lightning-automodel export` turns one into a Hugging Face model), or give pp=1."
            )
        if self.search is not None:
            refuse_unmodelled(cpu_offload=self.cpu_offload, float8=self.parallel.float8 is not None)
        dims, parallel = self.dims, self.parallel
        check_cp_with_pipeline(cp=dims.cp, pipeline=parallel.pipeline if dims.pp > 1 else None)
        if parallel.pipeline is not None:
            parallel.pipeline.validate(dims.pp)
        check_compile(compile=parallel.compile, activation_checkpointing=parallel.activation_checkpointing, ep=dims.ep)
        if not self.tp_per_node:  # checked at setup, once tp is known
            check_sequence_parallel(sp=parallel.sp, tp=dims.tp)

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
            activation_checkpointing=candidate.checkpointing,
            pipeline=candidate.pipeline,
        )
        return dataclasses.replace(
            self,
            dims=candidate.dims,
            parallel=parallel,
            search=None,
            gpu_memory=None,
            layout_batch=None,
            layout_images_per_row=None,
            layout_image_tokens=None,
            layout_expert_imbalance=None,
        )

    def mp_policy_for(self, precision: str) -> MixedPrecisionPolicy | None:
        """FSDP2's mixed precision: the one given, else that of ``Trainer(precision=...)``; a precision flag FSDP2
        does not train in is refused either way."""
        derived = mixed_precision_policy(precision)
        given = self.parallel.fsdp.mp_policy
        return given if given is not None else derived


def refuse_unmodelled(*, cpu_offload: bool, float8: bool) -> None:
    """``layout="auto"`` with what its memory estimate does not model."""
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


def require_search_for(
    *,
    search: SearchSpace | None,
    gpu_memory: float | None,
    layout_batch: tuple[int, int] | None,
    layout_images_per_row: int | None = None,
    layout_image_tokens: int | None = None,
    layout_expert_imbalance: float | None = None,
) -> None:
    """``gpu_memory``, ``layout_batch``, the images and the experts' routing size the search of ``layout="auto"``, and
    nothing else."""
    sizing = (
        ("gpu_memory", gpu_memory),
        ("layout_batch", layout_batch),
        ("layout_images_per_row", layout_images_per_row),
        ("layout_image_tokens", layout_image_tokens),
        ("layout_expert_imbalance", layout_expert_imbalance),
    )
    check_images(images_per_row=layout_images_per_row, image_tokens=layout_image_tokens, prefix="layout_")
    if layout_expert_imbalance is not None:
        ExpertRouting(layout_expert_imbalance)
    for name, value in sizing:
        if value is not None and search is None:
            raise ValueError(f'{name}={value!r} sizes the search of layout="auto"; set layout="auto", or drop {name}.')
    if gpu_memory is not None and not gpu_memory > 0:
        raise ValueError(f"gpu_memory={gpu_memory!r}: give the GiB of memory per GPU, a positive number.")
    if layout_batch is not None and not (
        len(layout_batch) == 2
        and all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in layout_batch)
    ):
        raise ValueError(f"layout_batch={layout_batch!r}: give (rows a batch, tokens a row), two positive integers.")


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
