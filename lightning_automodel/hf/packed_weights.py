"""Fused weights (gate_up_proj, qkv_proj) sharded block by block over tp, and how checkpoints store them: one plain
slice per block, since torch's checkpoint reader and writer reject or misplace strided shards."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def is_packed(tensor: torch.Tensor) -> bool:
    """A weight :class:`PackedColwiseParallel` sharded block by block over tp: each rank's shard is not one slice
    of the tensor (FSDP's strided placement over dp composes with tp into a plain slice, and is not this)."""
    names = tensor.device_mesh.mesh_dim_names or () if isinstance(tensor, DTensor) else ()
    return "tp" in names and isinstance(tensor.placements[names.index("tp")], _StridedShard)


def packed_blocks(tensor: DTensor) -> dict[str, DTensor]:
    """A packed weight as one DTensor per block (``block0``, ``block1``, ...), each a plain slice of its block,
    sharing this rank's storage: what torch's checkpoint reader and writer can place (they reject or misplace
    strided shards)."""
    names = tensor.device_mesh.mesh_dim_names
    strided = tensor.placements[names.index("tp")]
    parts, dim = strided.split_factor, strided.dim
    placements = [Shard(dim) if name == "tp" else p for name, p in zip(names, tensor.placements, strict=True)]
    shape = torch.Size(size // parts if index == dim else size for index, size in enumerate(tensor.shape))
    stride = torch.empty(shape, device="meta").stride()
    mesh = tensor.device_mesh
    return {
        f"block{index}": DTensor.from_local(block, mesh, placements, run_check=False, shape=shape, stride=stride)
        for index, block in enumerate(tensor.to_local().chunk(parts, dim=dim))
    }


def packed_block_keys(keys: Iterable[str]) -> dict[str, list[str]]:
    """Checkpoint keys of weights saved as :func:`packed_blocks` (``name.block0``, ...), by weight name, in order."""
    blocks: dict[str, list[str]] = {}
    for key in keys:
        name, _, index = key.rpartition(".block")
        if name and index.isdigit():
            blocks.setdefault(name, []).append(key)
    return {name: sorted(group, key=lambda key: int(key.rpartition(".block")[2])) for name, group in blocks.items()}
