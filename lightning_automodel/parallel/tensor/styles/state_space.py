"""Tensor parallel for the selective state-space mixers of Mamba and Mamba-2 and the hybrids that copy them (Jamba,
Falcon-Mamba; Bamba, Granite 4, Nemotron-H, Falcon-H1), and LFM2's gated short convolution, Megatron's layout: the
mixer's channels (Mamba, LFM2) or heads (Mamba-2) are split over tp. The input projection's blocks, the depthwise
convolution's channels and the per-channel or per-head parameters follow them; the output projection is row-parallel.
transformers' own mixer code then runs on this rank's share, its sizes made this rank's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from types import MethodType

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, parallelize_module
from torch.utils._pytree import tree_map

from lightning_automodel.parallel.tensor.styles.parameters import local_parameters, summed_gradient, whole_local
from lightning_automodel.parallel.tensor.styles.projections import PackedColwiseParallel, RegroupedColwiseParallel

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


def is_short_conv_mixer(module: nn.Module) -> bool:
    """LFM2's gated short convolution: ``in_proj`` makes [B; C; x] and a depthwise ``conv`` runs over B x x."""
    in_proj, conv = getattr(module, "in_proj", None), getattr(module, "conv", None)
    return (
        isinstance(in_proj, nn.Linear)
        and isinstance(getattr(module, "out_proj", None), nn.Linear)
        and isinstance(conv, nn.Conv1d)
        and conv.groups == conv.in_channels == conv.out_channels
        and in_proj.out_features == 3 * conv.in_channels
    )


def is_state_space_mixer(module: nn.Module) -> bool:
    return is_mamba_mixer(module) or is_mamba2_mixer(module) or is_short_conv_mixer(module)


def mixer_style(module: nn.Module) -> StateSpaceMixerParallel | None:
    """The style that splits ``module``'s channels or heads over tp, if it is a mixer this module knows."""
    if is_mamba_mixer(module):
        return MambaMixerParallel()
    if is_mamba2_mixer(module):
        return Mamba2MixerParallel()
    return ShortConvParallel() if is_short_conv_mixer(module) else None


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


def mamba2_problem(module: nn.Module, *, tp: int) -> str | None:
    """Why the mixer's heads and groups cannot be split over ``tp`` ranks, or None."""
    if module.num_heads % tp:
        return f"its {module.num_heads} heads do not split over tp={tp}"
    if module.n_groups % tp and module.n_groups != 1:
        return f"its {module.n_groups} groups of B and C neither split over tp={tp} nor are one group all heads share"
    return None


class StateSpaceMixerParallel(ParallelStyle):
    """What the mixers' styles share: the projections in and out, and sequence parallel.

    With ``sequence_parallel`` the mixer (a scan along the whole sequence) takes the gathered stream as this rank's
    whole copy, and ``out_proj`` reduce-scatters into the sequence-sharded stream.
    """

    def __init__(self, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _project(self, module: nn.Module, device_mesh: DeviceMesh, in_proj: ParallelStyle) -> None:
        sp = self.sequence_parallel
        out_proj = RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sp else RowwiseParallel()
        parallelize_module(module, device_mesh, {"in_proj": in_proj, "out_proj": out_proj})
        if sp:
            module.register_forward_pre_hook(_whole_local_inputs, with_kwargs=True)
        module.tp_mesh = device_mesh

    @staticmethod
    def _localize(module: nn.Module, local: dict[str, int]) -> None:
        """Set the mixer's sizes to this rank's, keeping the whole model's for initialisation (``global_sizes``, read
        by hf/initialization.py); its forward then runs on its local parameters."""
        module.global_sizes = {name: getattr(module, name) for name in local}
        module.__dict__.update(local)
        module.heads_localized = True  # head_counts.py: nothing left to make this rank's


def _whole_local_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tree_map(whole_local, (args, kwargs))


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
        self._project(module, device_mesh, PackedColwiseParallel(parts=2))
        parallelize_module(module, device_mesh, {"x_proj": RowwiseParallel()})
        norms = [getattr(module, name, None) for name in _SCAN_INPUT_NORMS]
        summed = norms if all(isinstance(norm, nn.Module) for norm in norms) else [module.x_proj]
        for where in summed:
            where.register_forward_hook(lambda m, args, output: summed_gradient(output, mesh=device_mesh))
        for owner, name in ((module, "A_log"), (module, "D"), *_own_parameters(module.conv1d, module.dt_proj)):
            _distribute(owner, name, device_mesh, Shard(0))
        self._localize(module, {"intermediate_size": module.intermediate_size // tp})
        module.forward = MethodType(_mamba_forward_on_local_parameters, module)
        return module


def _own_parameters(*modules: nn.Module) -> list[tuple[nn.Module, str]]:
    return [(module, name) for module in modules for name, _ in module.named_parameters(recurse=False)]


def _mamba_forward_on_local_parameters(self: nn.Module, *args, **kwargs):
    """The mixer's own forward on this rank's channels' parameters."""
    with ExitStack() as stack:
        for module in (self, self.conv1d, self.dt_proj):
            stack.enter_context(local_parameters(module))
        return type(self).forward(self, *args, **kwargs)


class ShortConvParallel(StateSpaceMixerParallel):
    """LFM2's gated short convolution with its channels split over tp: ``in_proj``'s [B; C; x] each rank's slice of
    every block (:class:`PackedColwiseParallel`), the depthwise convolution by channel, ``out_proj`` row-parallel.
    Every operation between them is channel by channel."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if module.conv.in_channels % device_mesh.size():
            raise ValueError(f"ShortConvParallel: {module.conv.in_channels} channels do not split over tp.")
        self._project(module, device_mesh, PackedColwiseParallel(parts=3))
        for owner, name in _own_parameters(module.conv):
            _distribute(owner, name, device_mesh, Shard(0))
        module.heads_localized = True
        module.forward = MethodType(_short_conv_forward_on_local_parameters, module)
        return module


def _short_conv_forward_on_local_parameters(self: nn.Module, *args, **kwargs):
    with local_parameters(self.conv):
        return type(self).forward(self, *args, **kwargs)


class Mamba2MixerParallel(StateSpaceMixerParallel):
    """A Mamba-2 mixer's heads split over tp.

    ``in_proj`` is [z; x; B; C; dt]: each rank keeps its heads' slice of z, x and dt, and its groups' slice of B and C,
    or all of them where there is one group every head reads (most Mamba-2 models: Mamba2, Bamba, Granite 4): the
    projection is regrouped (:class:`RegroupedColwiseParallel`, one all-gather of its output), and the gradient of
    the shared B and C, each rank's heads giving their part, is summed on the way back. The depthwise convolution's
    channels follow [x; B; C]: its weights stay whole (a few per channel) and each rank convolves its channels, their
    gradient summed over tp. ``dt_bias``, ``A_log`` and ``D`` are split by head, buffers as wide as ``in_proj``'s
    output (Falcon-H1's multipliers) regrouped as it is. The gated norm over each group keeps whole groups on a rank,
    or, for a single group, sums its squares over tp. ``out_proj`` is row-parallel.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        problem = mamba2_problem(module, tp=tp)
        if problem is not None:
            raise ValueError(f"Mamba2MixerParallel: {problem}.")
        inner, groups, state = module.intermediate_size, module.n_groups, module.ssm_state_size
        shared = groups == 1  # B and C whole on every rank
        blocks = (inner, inner, groups * state, groups * state, module.num_heads)
        whole = (False, False, shared, shared, False)
        module.in_proj_layout = RegroupedColwiseParallel(block_sizes=blocks, whole=whole)
        self._project(module, device_mesh, module.in_proj_layout)
        module.conv_layout = RegroupedColwiseParallel(block_sizes=blocks[1:4], whole=whole[1:4])  # [x; B; C]
        for name in _PER_HEAD:
            _distribute(module, name, device_mesh, Shard(0))
        for name, _ in list(module.conv1d.named_parameters(recurse=False)):
            _distribute(module.conv1d, name, device_mesh, Replicate())
        norm = getattr(module, "norm", None)
        if isinstance(getattr(norm, "weight", None), nn.Parameter):
            _distribute(norm, "weight", device_mesh, Shard(0))
            if shared:
                norm.tp_mesh = device_mesh
                norm.forward = MethodType(_gated_norm_over_tp, norm)
        local_groups = groups if shared else groups // tp
        local = {
            "intermediate_size": inner // tp,
            "num_heads": module.num_heads // tp,
            "n_groups": local_groups,
            "conv_dim": inner // tp + 2 * local_groups * state,
        }
        if isinstance(getattr(module, "groups_time_state_size", None), int):  # Falcon-H1's name for n_groups x state
            local["groups_time_state_size"] = local_groups * state
        self._localize(module, local)
        module.forward = MethodType(_forward_on_local_parameters, module)
        return module


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    param = getattr(module, name)
    module.register_parameter(
        name, nn.Parameter(distribute_tensor(param, mesh, [placement]), requires_grad=param.requires_grad)
    )


def _forward_on_local_parameters(self: nn.Module, *args, **kwargs):
    """The mixer's own forward on this rank's heads' parameters and convolution channels."""
    with ExitStack() as stack:
        stack.enter_context(local_parameters(self, names=_PER_HEAD))
        stack.enter_context(_regrouped_buffers(self))
        stack.enter_context(local_parameters(self.conv1d, local_of=partial(_conv_channels_of, self)))
        if isinstance(getattr(self, "norm", None), nn.Module) and not hasattr(self.norm, "tp_mesh"):
            stack.enter_context(local_parameters(self.norm))
        return type(self).forward(self, *args, **kwargs)


@contextmanager
def _regrouped_buffers(self: nn.Module) -> Iterator[None]:
    """Buffers as wide as ``in_proj``'s output (Falcon-H1's muP multipliers, which scale it), this rank's part of them
    for one call: they stay whole in the module, where initialisation writes them."""
    width = sum(self.in_proj_layout.block_sizes)
    held = {name: b for name, b in self._buffers.items() if b is not None and b.ndim and b.shape[-1] == width}
    try:
        for name, buffer in held.items():
            self._buffers[name] = self.in_proj_layout.regrouped(buffer, mesh=self.tp_mesh)
        yield
    finally:
        self._buffers.update(held)


def _conv_channels_of(self: nn.Module, param: DTensor) -> torch.Tensor:
    """This rank's channels of a whole convolution parameter, its [x; B; C]; their gradient summed over tp."""
    return self.conv_layout.regrouped(summed_gradient(param.to_local(), mesh=self.tp_mesh), mesh=self.tp_mesh, dim=0)


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
    gradient, so the gradients are summed too."""

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
