"""The whole value of a tensor that may be a DTensor, gathered on every rank (a collective for a DTensor).

torch 2.11's DTensor cannot gather placements holding a ``_StridedShard`` (FSDP2 over a tensor-parallel weight, or
a fused projection split part by part): its redistribution planner fails to read them. There they are gathered here,
one mesh dim at a time from the last: on a strided dim of n ranks and split factor f, the tensor dim is cut into f x n
equal chunks and rank i holds chunks i, i + n, ..., i + (f - 1) n, which later mesh dims split further.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.torch_version import TorchVersion

GATHERS_STRIDED_SHARDS = TorchVersion(torch.__version__) >= (2, 13)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s whole value: gathered for a DTensor, ``tensor`` itself otherwise."""
    if not isinstance(tensor, DTensor):
        return tensor
    if GATHERS_STRIDED_SHARDS or not any(isinstance(p, _StridedShard) for p in tensor.placements):
        return tensor.full_tensor()
    held = tensor.to_local()
    for mesh_dim in reversed(range(tensor.device_mesh.ndim)):
        held = _undo(held, tensor.placements[mesh_dim], group=tensor.device_mesh.get_group(mesh_dim))
    return held


def _undo(held: torch.Tensor, placement, *, group) -> torch.Tensor:
    if isinstance(placement, Replicate):
        return held
    if isinstance(placement, Partial):
        if placement.reduce_op != "sum":
            raise NotImplementedError(f"torch {torch.__version__}: gathering a {placement} beside strided shards.")
        held = held.clone()
        dist.all_reduce(held, group=group)
        return held
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, held.detach().cpu(), group=group)
    every = [part.to(held.device) for part in every]
    if not isinstance(placement, _StridedShard):
        assert isinstance(placement, Shard), placement
        return torch.cat(every, dim=placement.dim)
    factor, ranks = placement.split_factor, len(every)
    if any(part.shape[placement.dim] % factor for part in every):
        raise NotImplementedError(f"torch {torch.__version__} cannot gather {placement} of uneven chunks.")
    pieces = [part.chunk(factor, dim=placement.dim) for part in every]
    return torch.cat([pieces[chunk % ranks][chunk // ranks] for chunk in range(factor * ranks)], dim=placement.dim)
