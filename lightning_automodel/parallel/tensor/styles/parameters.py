"""Styles for a module's own parameters where plain tensor parallel would compute them wrong (replicated, split by
head, returned to the code around), and the local views of DTensors that module and expert code compute with."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from types import MethodType

import torch
from torch import nn
from torch.distributed._local_tensor import enabled_local_tensor_mode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import Placement
from torch.utils._pytree import tree_map


class ReplicateOnShardedInput(ParallelStyle):
    """A module whose parameters every rank needs whole while it computes on activations tensor parallel splits: a
    per-head norm over head_dim (Qwen3's q_norm), an activation function's learned scalars (xIELU), a norm over a
    hidden size the plan splits (BitNet's sub-norms).

    Left as it is, each rank would compute its parameters' gradient from its own shard of the activations and keep
    it: a wrong gradient, silently. Here its parameters and buffers (its submodules' too) become replicated DTensors
    and its plain tensor inputs DTensors of the layout they have: ``input_layouts`` gives a placement per argument
    position or keyword (``Shard(d)`` for one split on dim d; an argument it does not name is whole). DTensor then
    computes the module on the global activation: it sums the parameters' partial gradients over tp, and reduces
    across a split dimension where the module reduces (a norm's mean). With ``use_local_output`` the outputs go back
    to this rank's local tensors; a module given DTensors (the sequence-parallel residual stream) keeps DTensors.
    """

    def __init__(self, *, input_layouts: Mapping[int | str, Placement], use_local_output: bool = True) -> None:
        super().__init__()
        self.input_layouts = dict(input_layouts)
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh)  # replicates every parameter and buffer not a DTensor already
        module.register_forward_pre_hook(partial(self._prepare_inputs, device_mesh), with_kwargs=True)
        if self.use_local_output:
            module.register_forward_hook(lambda module, args, output: tree_map(_local_part, output))
        return module

    def _prepare_inputs(self, device_mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        def convert(key: int | str, value: object) -> object:
            if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
                return value
            placement = self.input_layouts.get(key, Replicate())
            return DTensor.from_local(value, device_mesh, [placement], run_check=False)

        args = tuple(convert(index, value) for index, value in enumerate(args))
        return args, {key: convert(key, value) for key, value in kwargs.items()}


def _local_part(value: object) -> object:
    """This rank's part of a DTensor output (a partial sum is summed first); anything else as it is."""
    if not isinstance(value, DTensor):
        return value
    if any(p.is_partial() for p in value.placements):
        value = value.redistribute(placements=[Replicate() if p.is_partial() else p for p in value.placements])
    return value.to_local()


def whole_local(value: object) -> object:
    """A DTensor (the gathered sequence-parallel stream, a replicated DTensor) as this rank's whole copy; anything
    else as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def rank_slice(tensor: torch.Tensor, *, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """This rank's equal slice of ``dim`` of a tensor every rank holds whole; the rest of it gets no gradient from
    this rank. Under torch's simulated ranks (``LocalTensorMode``, :mod:`lightning_automodel.planning.simulation`) the
    rank is a symbolic integer that slices nothing: the indices are made rank by rank."""
    if tensor.shape[dim] % mesh.size():
        raise ValueError(f"{tensor.shape[dim]} entries of dim {dim} do not split evenly over {mesh.size()} tp ranks")
    width = tensor.shape[dim] // mesh.size()
    simulated = enabled_local_tensor_mode()
    if simulated is None:
        return tensor.narrow(dim, mesh.get_local_rank() * width, width)
    ranks = mesh.mesh.flatten().tolist()
    indices = simulated.rank_map(lambda rank: torch.arange(width, device=tensor.device) + ranks.index(rank) * width)
    return tensor.index_select(dim, indices)


def localize_sizes(module: nn.Module, local: Mapping[str, object]) -> None:
    """Set the attributes tensor parallel makes this rank's (head counts, widths, a config copy), the whole model's
    values kept in ``global_sizes`` for code that needs them: initialisation computes per-head parameters from the
    head count (hf/initialization.unsharded_view)."""
    module.global_sizes = {name: getattr(module, name) for name in local} | getattr(module, "global_sizes", {})
    for name, value in local.items():
        setattr(module, name, value)


def whole_local_args(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook handing a module that computes on the whole sequence its DTensor arguments (the gathered
    sequence-parallel stream) as this rank's whole copies."""
    return tree_map(whole_local, (args, kwargs))


def summed_gradient(value: torch.Tensor, *, mesh: DeviceMesh) -> torch.Tensor:
    """``value`` itself, whole on every rank; in backward, its gradient (each rank's part) summed over ``mesh``:
    Megatron's copy into the tensor-parallel region."""
    return DTensor.from_local(value, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class OutputGradientSummed(ParallelStyle):
    """A module computing on whole activations whose output each rank then uses for its own heads only: its output's
    gradient is partial on each rank and is summed over tp on the way back, so that its parameters and inputs get the
    whole gradient (Dots3's norm of the rotary key all heads share, between the latent down-projection and
    attention)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda module, args, output: summed_gradient(output, mesh=device_mesh))
        return module


class _NamedParameters(ParallelStyle):
    """Some of a module's own parameters, by name, distributed with one placement over tp."""

    placement: Placement

    def __init__(self, *, names: tuple[str, ...]) -> None:
        super().__init__()
        self.names = names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.names:
            param = getattr(module, name)
            distributed = distribute_tensor(param, device_mesh, [self.placement], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(distributed, requires_grad=param.requires_grad))
        return module


class ReturnedParameters(_NamedParameters):
    """Parameters a module returns for the code around it to compute with (GPT-NeoX-Japanese's attention hands its
    output bias to its block, which adds it to the residual stream).

    Under sequence parallel that code meets the stream, a ``Shard(1)`` DTensor, which computes with DTensors only. As
    replicated DTensors the parameters combine with each rank's slice of the sequence, and DTensor sums their
    gradients over tp.
    """

    placement = Replicate()


class HeadShardedParameters(_NamedParameters):
    """Parameters an attention module keeps per head (GPT-OSS's attention sinks), split with the heads it computes.

    The module's own code combines them with its heads inside attention: once the plan splits the heads, each rank
    needs the entries of its own heads, in order. They become ``Shard(0)`` DTensors (checkpoints keep the whole
    vector), and the module's forward runs on this rank's entries; each entry's gradient comes from its rank alone.
    ``buffers``: buffers with a dimension of one entry per head (MiniMax's decay rates, by name: that dimension),
    which stay whole in the module and are sliced for each call.
    """

    placement = Shard(0)

    def __init__(self, *, names: tuple[str, ...], buffers: Mapping[str, int] | None = None) -> None:
        super().__init__(names=names)
        self.buffers = dict(buffers or {})

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)
        module.head_sharded_names, module.head_sharded_buffers = self.names, self.buffers
        module.tp_mesh = device_mesh
        module.forward = MethodType(_forward_on_local_parameters, module)  # one function for all layers: one graph
        return module


def _forward_on_local_parameters(self: nn.Module, *args, **kwargs):
    """The module's own forward (its class's) on this rank's entries of its head-sharded parameters and buffers."""
    held = {name: self._buffers[name] for name in self.head_sharded_buffers}
    try:
        for name, dim in self.head_sharded_buffers.items():
            self._buffers[name] = rank_slice(held[name], mesh=self.tp_mesh, dim=dim)
        with local_parameters(self, names=self.head_sharded_names):
            return type(self).forward(self, *args, **kwargs)
    finally:
        self._buffers.update(held)


@contextmanager
def local_parameters(
    module: nn.Module,
    local_of: Callable[[DTensor], torch.Tensor] = DTensor.to_local,
    *,
    names: Iterable[str] | None = None,
) -> Iterator[None]:
    """Hand the module's own code this rank's part of its DTensor parameters (``names``, by default all;
    ``local_of``, by default the local shard) for the duration of one call: for code DTensor has no rules for, or
    that mixes them with local tensors."""
    held = dict(module._parameters)
    chosen = set(held if names is None else names)
    try:
        for name, param in held.items():
            if name in chosen and isinstance(param, DTensor):
                module._parameters[name] = local_of(param)
        yield
    finally:
        module._parameters.update(held)
