"""Styles for a module's arguments that the code inside it combines with what tensor parallel splits: each rank takes
its slice of them."""

from __future__ import annotations

import inspect
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle


class SplitArgument(ParallelStyle):
    """An argument, whole on every rank, whose ``dim`` the module's code lines up with units tensor parallel splits:
    Gemma 3n's and Gemma 4's per-layer input (its last dimension multiplies the split per-layer gate's units), an
    attention bias with one entry per head (ALiBi's: MPT's on dim 0; Bloom's on dim 0 as batch x heads, ``per`` heads
    per row; a relative position bias on dim 1).

    Each rank takes its slice of ``dim`` (of each row's ``per`` units). In backward each rank has the gradient of its
    slice only; they are gathered, so that what computed the argument gets the whole gradient on every rank.
    """

    def __init__(self, *, name: str, dim: int = -1, per: int | None = None) -> None:
        super().__init__()
        self.name = name
        self.dim = dim
        self.per = per

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        position = list(inspect.signature(module.forward).parameters).index(self.name)
        module.register_forward_pre_hook(partial(self._split, device_mesh, position), with_kwargs=True)
        return module

    def _split(self, device_mesh: DeviceMesh, position: int, module: nn.Module, args: tuple, kwargs: dict):
        if self.name in kwargs:
            return args, {**kwargs, self.name: self._slice(kwargs[self.name], mesh=device_mesh)}
        if position < len(args):
            return (*args[:position], self._slice(args[position], mesh=device_mesh), *args[position + 1 :]), kwargs
        return None

    def _slice(self, value: object, *, mesh: DeviceMesh) -> object:
        """This rank's slice of ``dim`` of a whole tensor; its gradient all-gathered in backward."""
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            return value
        dim = self.dim % value.ndim
        grouped = value if self.per is None else value.unflatten(dim, (-1, self.per))
        units = dim if self.per is None else dim + 1
        if grouped.shape[units] % mesh.size():
            raise ValueError(
                f"SplitArgument: {self.name} has {grouped.shape[units]} entries on dim {units}, which do not split over"
                f" {mesh.size()} tp ranks"
            )
        whole = DTensor.from_local(grouped, mesh, [Replicate()], run_check=False)
        local = whole.redistribute(mesh, [Shard(units)]).to_local()
        return local if self.per is None else local.flatten(dim, dim + 1)
