"""The 5D device mesh: parallel sizes, their inference and validation, and the sub-meshes each consumer needs.

Axes run outermost to innermost: ("pp", "dp_replicate", "dp_shard", "cp", "tp"), so tensor-parallel peers are
adjacent ranks (one node) and replicas are the farthest apart (across nodes). Three flattened axes serve the
consumers that span several axes:

- "dp" = (dp_replicate, dp_shard): the data sampler; TP and CP peers read the same batch.
- "dp_shard_cp" = (dp_shard, cp): the FSDP shard group.
- "dp_cp" = (dp_replicate, dp_shard, cp): loss, token-count and metric reduction.

Two more carry the names Lightning's ModelParallelStrategy gives its 2D mesh, so that a LightningModule written for
it, which parallelizes itself with ``self.device_mesh["data_parallel"]`` and ``["tensor_parallel"]``, runs
unchanged: "data_parallel" = (dp_replicate, dp_shard), "tensor_parallel" = (tp,).

Expert parallel is no sixth axis: ``ep`` borrows its ranks from dp_shard x cp, which read different tokens (as in
torchtitan). With ep > 1 the "dp_shard_cp" axis is also read as ("efsdp", "ep"), ep innermost (neighbouring ranks
exchange tokens): each ep rank holds 1/ep of every layer's experts, and FSDP shards them over "efsdp", what dp_shard x
cp leaves. tp peers read the same tokens, so ep cannot span tp; experts are tensor parallel over tp inside each ep
rank instead.

Validation is a pure function of the sizes and the world size, so every rank raises the same error before any
process group exists: a bad configuration can never leave one rank waiting in a collective.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FLATTENED_AXES = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "data_parallel": ("dp_replicate", "dp_shard"),
    "tensor_parallel": ("tp",),
}

EXPERT_AXES = ("efsdp", "ep")  # "dp_shard_cp" read as (FSDP of the experts, expert parallel) when ep > 1

Size = int | Literal["auto"]


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the five parallel dimensions; ``dp_shard="auto"`` takes whatever the world size leaves."""

    pp: int = 1
    """Pipeline parallel: each of pp ranks holds a stage of every model (consecutive decoder layers), run by a schedule
    of torch.distributed.pipelining over micro-batches. The embedding is on the first stage, the head on the last,
    which computes the loss: training_step returns the model's own loss (``self.model(input_ids=..., labels=...)
    .loss``), and it reaches every rank. Composes with every other axis, activation checkpointing, CPU offload and
    LoRA."""

    dp_replicate: int = 1
    """Replicas of the whole sharded model (HSDP: usually one per node or group of nodes)."""

    dp_shard: Size = "auto"
    """The FSDP2 shard-group size; "auto" takes what the world size leaves."""

    cp: int = 1
    """Context parallel: every sequence is split over cp ranks, and attention all-gathers keys and values over them.
    A rank holds 2 of the 2 cp chunks of a sequence (rank i the chunks i and 2 cp - 1 - i). The model's call takes the
    whole batch and returns this rank's share of the loss: training_step returns the model's own loss
    (``self.model(input_ids=..., labels=...).loss``). FSDP shards over dp_shard x cp."""

    tp: int = 1
    """Tensor parallel: the ranks that split every layer's weights (keep them within a node)."""

    ep: int = 1
    """Expert parallel: each of ep ranks holds 1/ep of every mixture-of-experts layer's experts, and tokens travel to
    their experts by all-to-all. ep borrows its ranks from dp_shard x cp, which it must divide (see the module
    docstring); FSDP shards the experts over what dp_shard x cp leaves, and with tp > 1 each expert is also split over
    tp."""

    def __post_init__(self) -> None:
        for name in (*MESH_AXES, "ep"):
            value = getattr(self, name)
            if name == "dp_shard" and value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                allowed = 'a positive integer or "auto"' if name == "dp_shard" else "a positive integer"
                raise ValueError(f"{name}={value!r} is invalid: {name} must be {allowed}.")

    @property
    def _fixed_product(self) -> int:
        """Product of every size but dp_shard."""
        return self.pp * self.dp_replicate * self.cp * self.tp

    def resolve(self, world_size: int) -> ParallelDims:
        """Return these sizes with dp_shard inferred, after checking that they tile ``world_size`` exactly."""
        if world_size < 1:
            raise ValueError(f"world_size must be positive, got {world_size}.")
        fixed = self._fixed_product
        if self.dp_shard == "auto":
            if world_size % fixed:
                raise ValueError(
                    f"{self._describe(dp_shard='auto')} cannot tile a world of {world_size} processes:"
                    f" pp*dp_replicate*cp*tp = {fixed} does not divide {world_size}."
                    f" {self._suggestion(world_size)}"
                )
            return dataclasses.replace(self, dp_shard=world_size // fixed)._check_ep()
        total = fixed * self.dp_shard
        if total != world_size:
            raise ValueError(
                f"{self._describe()} needs pp*dp_replicate*dp_shard*cp*tp = {total} processes, but the world size"
                f" is {world_size}. {self._suggestion(world_size)}"
            )
        return self._check_ep()

    def _check_ep(self) -> ParallelDims:
        """ep must divide dp_shard x cp, the ranks it borrows."""
        borrowed = self.dp_shard * self.cp
        if borrowed % self.ep:
            valid = [size for size in range(1, borrowed + 1) if borrowed % size == 0]
            raise ValueError(
                f"ep={self.ep} does not fit {self._describe()}: expert parallel borrows its ranks from dp_shard*cp ="
                f" {borrowed} (ranks reading different tokens; tp peers read the same ones), so ep must divide it."
                f" Valid ep sizes here: {valid}; or raise dp_shard."
            )
        return self

    @property
    def efsdp(self) -> int:
        """The ranks FSDP shards experts over: what dp_shard x cp leaves after ep."""
        self._require_resolved()
        return self.dp_shard * self.cp // self.ep

    @property
    def is_resolved(self) -> bool:
        return self.dp_shard != "auto"

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in :data:`MESH_AXES` order."""
        self._require_resolved()
        return tuple(getattr(self, name) for name in MESH_AXES)

    @property
    def world_size(self) -> int:
        self._require_resolved()
        return self._fixed_product * self.dp_shard

    @property
    def ranks_per_stage(self) -> int:
        """The ranks of one pipeline stage: pp is the mesh's outermost axis, so stage s holds ranks s x this on."""
        return self.world_size // self.pp

    @property
    def dp(self) -> int:
        """Number of distinct batches per step (data-parallel degree)."""
        self._require_resolved()
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str, *, timeout: timedelta | None = None) -> DeviceMesh:
        """Create the 5D mesh and its flattened axes; every process group it creates gets ``timeout``.

        Without an explicit timeout, sub-groups fall back to torch's 30-minute default instead of the one the
        default group was created with, so a rank that fails would leave its peers hanging that long.
        """
        self._require_resolved()
        backend = dist.get_backend()
        override = None
        if timeout is not None:
            override = {axis: _backend_options(backend, timeout) for axis in MESH_AXES}
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_AXES, backend_override=override)
        flat_override = _backend_options(backend, timeout) if timeout is not None else None
        for name, axes in FLATTENED_AXES.items():
            mesh[axes]._flatten(name, backend_override=flat_override)
        if self.ep > 1:
            overrides = {index: flat_override for index in range(2)} if timeout is not None else None
            # Unflattened under other names, then each flattened under its own: that registers it on the root,
            # where it is found by name like the flattened axes (flattening a 1D mesh into its own name does not).
            unflattened = tuple(f"{axis}_of_dp_shard_cp" for axis in EXPERT_AXES)
            experts = flattened(mesh, "dp_shard_cp")._unflatten(
                0, (self.efsdp, self.ep), unflattened, backend_override=overrides
            )
            for axis, name in zip(EXPERT_AXES, unflattened, strict=True):
                experts[name]._flatten(axis, backend_override=flat_override)
        return mesh

    def _require_resolved(self) -> None:
        if not self.is_resolved:
            raise RuntimeError('dp_shard is still "auto": call ParallelDims.resolve(world_size) first.')

    def _describe(self, **overrides: Size) -> str:
        names = (*MESH_AXES, "ep") if self.ep > 1 else MESH_AXES
        values = {name: overrides.get(name, getattr(self, name)) for name in names}
        return "(" + ", ".join(f"{name}={values[name]!r}" for name in names) + ")"

    def _suggestion(self, world_size: int) -> str:
        """Name a valid layout that keeps as much of the request as possible."""
        fixed = self._fixed_product
        if world_size % fixed == 0:
            return f'Use dp_shard="auto" (= {world_size // fixed}) or dp_shard={world_size // fixed}.'
        others = self.pp * self.dp_replicate * self.cp
        if world_size % others == 0:
            rest = world_size // others
            valid_tp = [t for t in range(1, rest + 1) if rest % t == 0]
            return f'With these pp, dp_replicate and cp, valid tp sizes are {valid_tp} (dp_shard="auto").'
        return f'For example pp=1, dp_replicate=1, cp=1, tp=1, dp_shard="auto" (= {world_size}).'


def _backend_options(backend: str, timeout: timedelta) -> tuple[str, object]:
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
    elif backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
    else:
        raise ValueError(f"Cannot set a timeout for process-group backend {backend!r}; use 'nccl' or 'gloo'.")
    options._timeout = timeout
    return backend, options


def axis_size(mesh: DeviceMesh, name: str) -> int:
    """Size of a named (possibly flattened) axis of ``mesh``; 1 when the mesh does not have it."""
    names = mesh.mesh_dim_names or ()
    if name in names:
        return mesh.size(names.index(name))
    if name in FLATTENED_AXES and all(axis in names for axis in FLATTENED_AXES[name]):
        return math.prod(mesh.size(names.index(axis)) for axis in FLATTENED_AXES[name])
    if name in EXPERT_AXES and name in mesh._get_root_mesh()._flatten_mapping:
        return _expert_axis(mesh, name).size()
    return 1


def flattened(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The 1D mesh of flattened axis ``name`` ("dp", "dp_shard_cp" or "dp_cp").

    Flattening again returns the mesh :meth:`ParallelDims.build_mesh` created (with its timeout) rather than
    slicing it off the root, which torch deprecates.
    """
    return mesh[FLATTENED_AXES[name]]._flatten(name)


def _expert_axis(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The 1D mesh of expert axis ``name`` ("efsdp" or "ep") :meth:`ParallelDims.build_mesh` flattened, as the root
    mesh keeps it (slicing it off the root by name is deprecated by torch)."""
    return mesh._get_root_mesh()._flatten_mapping[name]


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over: "dp_shard_cp", or the 2D (dp_replicate, dp_shard_cp) mesh for HSDP.

    Never a 2D (dp_shard, cp) slice: FSDP would read its first axis as a replicate axis.
    """
    if axis_size(mesh, "dp_replicate") > 1:
        return DeviceMesh._concatenate([mesh["dp_replicate"], flattened(mesh, "dp_shard_cp")])
    return flattened(mesh, "dp_shard_cp")


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    return mesh["tp"]


def expert_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh experts are distributed on: "ep", with "tp" inside it when tp > 1 (needs ep > 1)."""
    if axis_size(mesh, "tp") > 1:
        return DeviceMesh._concatenate([_expert_axis(mesh, "ep"), mesh["tp"]])
    return _expert_axis(mesh, "ep")


def expert_fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards experts over (needs ep > 1): "efsdp", or (dp_replicate, efsdp) for HSDP."""
    if axis_size(mesh, "dp_replicate") > 1:
        return DeviceMesh._concatenate([mesh["dp_replicate"], _expert_axis(mesh, "efsdp")])
    return _expert_axis(mesh, "efsdp")


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Ranks that read different batches: the sampler's replicas."""
    return flattened(mesh, "dp")


def reduction_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """Ranks whose losses, token counts and metrics differ and must be reduced together."""
    return flattened(mesh, "dp_cp")
