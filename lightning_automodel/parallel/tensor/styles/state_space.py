"""Tensor parallel for the selective state-space mixers of Mamba and Mamba-2 and the hybrids that copy them (Jamba,
Falcon-Mamba; Bamba, Granite 4, Nemotron-H, Falcon-H1), and LFM2's gated short convolution, Megatron's layout: the
mixer's channels (Mamba, LFM2) or heads (Mamba-2) are split over tp. The input projection's blocks, the depthwise
convolution's channels and the per-channel or per-head parameters follow them; the output projection is row-parallel.
transformers' own mixer code then runs on this rank's share, its sizes made this rank's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from types import MethodType

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import Placement

from lightning_automodel.parallel.tensor.styles.parameters import (
    local_parameters,
    localize_sizes,
    summed_gradient,
    whole_local_args,
)
from lightning_automodel.parallel.tensor.styles.projections import (
    Blocks,
    PackedColwiseParallel,
    RegroupedColwiseParallel,
)

# The per-head parameters of a Mamba-2 mixer: one entry per head each.
_PER_HEAD = ("dt_bias", "A_log", "D")
# A Mamba mixer's norms of dt, B and C (Jamba's), between x_proj and the scan.
_SCAN_INPUT_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def is_mamba_mixer(module: nn.Module) -> bool:
    """A Mamba (1) mixer as transformers writes it: x_proj makes dt, B and C from the convolved channels."""
    return (
        all(isinstance(getattr(module, name, None), int) for name in ("intermediate_size", "ssm_state_size"))
        and all(isinstance(getattr(module, name, None), nn.Linear) for name in ("in_proj", "x_proj", "dt_proj"))
        and isinstance(getattr(module, "out_proj", None), nn.Linear)
        and isinstance(getattr(module, "conv1d", None), nn.Conv1d)
        and all(isinstance(getattr(module, name, None), nn.Parameter) for name in ("A_log", "D"))
    )


def is_mamba2_mixer(module: nn.Module) -> bool:
    """A Mamba-2 mixer as transformers writes it (and copies it into its hybrids)."""
    names = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size", "conv_dim")
    return (
        all(isinstance(getattr(module, name, None), int) for name in names)
        and isinstance(getattr(module, "in_proj", None), nn.Linear)
        and isinstance(getattr(module, "out_proj", None), nn.Linear)
        and isinstance(getattr(module, "conv1d", None), nn.Conv1d)
        and all(isinstance(getattr(module, name, None), nn.Parameter) for name in _PER_HEAD)
    )


def is_short_conv_mixer(module: nn.Module) -> bool:
    """LFM2's gated short convolution: ``in_proj`` makes [B; C; x], a depthwise ``conv`` runs over B x x, and the
    module holds nothing else."""
    in_proj, conv = getattr(module, "in_proj", None), getattr(module, "conv", None)
    return (
        set(module._modules) == {"in_proj", "conv", "out_proj"}
        and isinstance(in_proj, nn.Linear)
        and isinstance(module.out_proj, nn.Linear)
        and isinstance(conv, nn.Conv1d)
        and conv.groups == conv.in_channels == conv.out_channels
        and in_proj.out_features == 3 * conv.in_channels
    )


class StateSpaceMixerParallel(ParallelStyle):
    """What the mixers' styles share: the projections in and out, sequence parallel, and the mixer's forward on this
    rank's share of its parameters.

    With ``sequence_parallel`` the mixer (a scan along the whole sequence) takes the gathered stream as this rank's
    whole copy, and ``out_proj`` reduce-scatters into the sequence-sharded stream. The mixer's code takes its fused
    training kernel (mamba-ssm's, which computes the whole mixer from its whole weights) on ``self.training``: on a
    rank's share its reference path runs instead, with the kernels that path calls.
    """

    def __init__(self, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _project(
        self, module: nn.Module, device_mesh: DeviceMesh, inputs: dict[str, ParallelStyle], *, output: str = "out_proj"
    ) -> None:
        """The input projections column-parallel by their ``inputs`` styles, ``output`` row-parallel."""
        sp = self.sequence_parallel
        out_proj = RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sp else RowwiseParallel()
        styles = {**inputs, output: out_proj}
        for style in styles.values():
            style.src_data_rank = self.src_data_rank
        parallelize_module(module, device_mesh, styles)
        if sp:
            module.register_forward_pre_hook(whole_local_args, with_kwargs=True)
        module.tp_mesh = device_mesh

    def _distribute(self, module: nn.Module, names: tuple[str, ...], mesh: DeviceMesh, placement: Placement) -> None:
        for name in names:
            param = getattr(module, name)
            distributed = distribute_tensor(param, mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(distributed, requires_grad=param.requires_grad))

    @staticmethod
    def _run_locally(module: nn.Module, local: dict[str, int], parts: list[tuple[nn.Module, tuple | None, Callable]]):
        """Set the mixer's sizes to this rank's, keeping the whole model's for initialisation (``global_sizes``, read
        by hf/initialization.py), and run its forward on ``parts``: (module, parameter names or None for all, how to
        take this rank's part of a DTensor)."""
        localize_sizes(module, local)
        module.local_parts = parts
        module.forward = MethodType(_forward_on_this_ranks_share, module)


def _forward_on_this_ranks_share(self: nn.Module, *args, **kwargs):
    """The mixer's own forward (its class's) on this rank's share of its parameters and buffers, on its reference
    path (see :class:`StateSpaceMixerParallel`)."""
    with ExitStack() as stack:
        for module, names, local_of in self.local_parts:
            stack.enter_context(local_parameters(module, local_of, names=names))
        stack.enter_context(_regrouped_buffers(self))
        stack.enter_context(_reference_path(self))
        return type(self).forward(self, *args, **kwargs)


@contextmanager
def _reference_path(module: nn.Module) -> Iterator[None]:
    training = module.training
    module.training = False  # the mixer's own flag only: its submodules keep theirs
    try:
        yield
    finally:
        module.training = training


@contextmanager
def _regrouped_buffers(self: nn.Module) -> Iterator[None]:
    """Buffers as wide as ``in_proj``'s output (Falcon-H1's muP multipliers, which scale it), this rank's part of them
    for one call: they stay whole in the module, where initialisation writes them."""
    layout = getattr(self, "in_proj_blocks", None)
    width = sum(layout.sizes) if layout is not None else None
    held = {name: b for name, b in self._buffers.items() if b is not None and b.ndim and b.shape[-1] == width}
    try:
        for name, buffer in held.items():
            self._buffers[name] = layout.this_ranks(buffer, mesh=self.tp_mesh)
        yield
    finally:
        self._buffers.update(held)


class MambaMixerParallel(StateSpaceMixerParallel):
    """A Mamba mixer's channels split over tp.

    ``in_proj`` is [x; z], each rank keeping its channels of both (:class:`PackedColwiseParallel`); the depthwise
    convolution, ``dt_proj`` (read as a matrix by the mixer's code), ``A_log`` and ``D`` are split by channel.
    ``x_proj`` contracts the channels: row-parallel, its whole output (dt, B and C, which every channel reads) gets
    its gradient summed over tp, after Jamba's norms of them where the mixer has them. ``out_proj`` is row-parallel.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        if module.intermediate_size % tp:
            raise ValueError(f"MambaMixerParallel: {module.intermediate_size} channels do not split over tp={tp}.")
        norms = [getattr(module, name) for name in _SCAN_INPUT_NORMS if hasattr(module, name)]
        if norms and len(norms) < len(_SCAN_INPUT_NORMS):
            raise ValueError(f"MambaMixerParallel: a mixer normalises some of dt, B and C only ({len(norms)} norms).")
        self._project(module, device_mesh, {"in_proj": PackedColwiseParallel(parts=2)})
        parallelize_module(module, device_mesh, {"x_proj": RowwiseParallel()})
        for where in norms or [module.x_proj]:
            where.register_forward_hook(lambda m, args, output: summed_gradient(output, mesh=device_mesh))
        self._distribute(module, ("A_log", "D"), device_mesh, Shard(0))
        for child in (module.conv1d, module.dt_proj):
            self._distribute(child, own_parameters(child), device_mesh, Shard(0))
        local = {"intermediate_size": module.intermediate_size // tp}
        parts = [(part, None, DTensor.to_local) for part in (module, module.conv1d, module.dt_proj)]
        self._run_locally(module, local, parts)
        return module


class ShortConvParallel(StateSpaceMixerParallel):
    """LFM2's gated short convolution with its channels split over tp: ``in_proj``'s [B; C; x] each rank's slice of
    every block (:class:`PackedColwiseParallel`), the depthwise convolution by channel, ``out_proj`` row-parallel.
    Every operation between them is channel by channel."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        if module.conv.in_channels % tp:
            raise ValueError(f"ShortConvParallel: {module.conv.in_channels} channels do not split over tp={tp}.")
        self._project(module, device_mesh, {"in_proj": PackedColwiseParallel(parts=3)})
        self._distribute(module.conv, own_parameters(module.conv), device_mesh, Shard(0))
        self._run_locally(module, {}, [(module.conv, None, DTensor.to_local)])
        return module


class Mamba2MixerParallel(StateSpaceMixerParallel):
    """A Mamba-2 mixer's heads split over tp.

    ``in_proj`` is [z; x; B; C; dt]: each rank keeps its heads' slice of z, x and dt, and its groups' slice of B and C,
    or all of them where there is one group every head reads (most Mamba-2 models: Mamba2, Bamba, Granite 4): the
    projection is regrouped (:class:`RegroupedColwiseParallel`, one all-gather of its output), and the gradient of
    the shared B and C, each rank's heads giving their part, is summed on the way back. The depthwise convolution's
    channels follow [x; B; C]: its weights stay whole (a few per channel) and each rank convolves its channels, their
    gradient summed over tp. ``dt_bias``, ``A_log`` and ``D`` are split by head, buffers as wide as ``in_proj``'s
    output (Falcon-H1's multipliers) regrouped as it is. Mamba-2's gated norm (transformers' copies of it; any other
    norm is refused) keeps whole groups on a rank, or, for a single group, sums its squares over tp. ``out_proj`` is
    row-parallel.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        problem = mamba2_problem(module, tp=tp)
        if problem is not None:
            raise ValueError(f"Mamba2MixerParallel: {problem}.")
        inner, groups, state = module.intermediate_size, module.n_groups, module.ssm_state_size
        shared = groups == 1  # B and C whole on every rank
        module.in_proj_blocks = Blocks(
            (inner, inner, groups * state, groups * state, module.num_heads), (False, False, shared, shared, False)
        )
        in_proj = RegroupedColwiseParallel(block_sizes=module.in_proj_blocks.sizes, whole=module.in_proj_blocks.whole)
        self._project(module, device_mesh, {"in_proj": in_proj})
        conv_blocks = Blocks(module.in_proj_blocks.sizes[1:4], module.in_proj_blocks.whole[1:4])  # [x; B; C]
        self._distribute(module, _PER_HEAD, device_mesh, Shard(0))
        self._distribute(module.conv1d, own_parameters(module.conv1d), device_mesh, Replicate())
        parts = [(module, _PER_HEAD, DTensor.to_local), (module.conv1d, None, partial(channels_of, conv_blocks))]
        parts += self._split_norm(module, device_mesh, shared=shared)
        local_groups = groups if shared else groups // tp
        local = {
            "intermediate_size": inner // tp,
            "num_heads": module.num_heads // tp,
            "n_groups": local_groups,
            "conv_dim": inner // tp + 2 * local_groups * state,
        }
        if isinstance(getattr(module, "groups_time_state_size", None), int):  # Falcon-H1's name for n_groups x state
            local["groups_time_state_size"] = local_groups * state
        self._run_locally(module, local, parts)
        return module

    def _split_norm(self, module: nn.Module, device_mesh: DeviceMesh, *, shared: bool) -> list[tuple]:
        """The gated norm's weight split with the channels; the parts the mixer's forward must localise."""
        norm = getattr(module, "norm", None)
        if not isinstance(getattr(norm, "weight", None), nn.Parameter):
            return []  # no norm (Falcon-H1 without mamba_rms_norm)
        if not isinstance(getattr(norm, "group_size", None), int) or hasattr(norm, "norm_before_gate"):
            raise ValueError(
                f"Mamba2MixerParallel: {type(norm).__name__} is not Mamba-2's gated norm (gate, then an RMS norm per"
                " group of group_size units), the one this style splits. Use tp=1 for this model."
            )
        self._distribute(norm, ("weight",), device_mesh, Shard(0))
        if not shared:  # whole groups on each rank: the norm's own code is right on them
            return [(norm, ("weight",), DTensor.to_local)]
        norm.tp_mesh = device_mesh
        norm.forward = MethodType(_gated_norm_over_tp, norm)
        return []


def own_parameters(module: nn.Module) -> tuple[str, ...]:
    """The names of a module's own parameters (not those registered as None: a convolution without bias)."""
    return tuple(name for name, _ in module.named_parameters(recurse=False))


def mamba2_problem(module: nn.Module, *, tp: int) -> str | None:
    """Why the mixer's heads and groups cannot be split over ``tp`` ranks, or None."""
    if module.num_heads % tp:
        return f"its {module.num_heads} heads do not split over tp={tp}"
    if module.n_groups % tp and module.n_groups != 1:
        return f"its {module.n_groups} groups of B and C neither split over tp={tp} nor are one group all heads share"
    return None


def channels_of(blocks: Blocks, param: DTensor) -> torch.Tensor:
    """This rank's channels of a whole convolution parameter, its [x; B; C]; their gradient summed over tp."""
    mesh = param.device_mesh
    return blocks.this_ranks(summed_gradient(param.to_local(), mesh=mesh), mesh=mesh, dim=0)


def _gated_norm_over_tp(self: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor | None = None):
    """transformers' gated RMS norm of Mamba-2 over one group whose units are split over tp: the mean of squares is
    summed over the ranks (its gradient too), then each rank scales its own units."""
    dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    if gate is not None:
        hidden_states = hidden_states * nn.functional.silu(gate.to(torch.float32))
    squares = _SumOverRanks.apply(hidden_states.pow(2).sum(-1, keepdim=True), self.tp_mesh.get_group())
    variance = squares / (hidden_states.shape[-1] * self.tp_mesh.size())
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight.to_local() * hidden_states.to(dtype)


class _SumOverRanks(torch.autograd.Function):
    """A sum over the ranks of ``group`` that every rank uses: in backward, each rank's use gives part of every rank's
    gradient, so the gradients are summed too (torch.distributed.nn.functional.all_reduce, deprecated in torch 2.13;
    the functional collectives' all_reduce has no backward)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None
