"""Mesh checks run inside gloo workers."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_automodel import ParallelDims
from lightning_automodel.parallel.mesh import (
    data_mesh,
    expert_fsdp_mesh,
    expert_mesh,
    flattened,
    fsdp_mesh,
    reduction_mesh,
    tp_mesh,
)


def _timeout_of(mesh) -> timedelta:
    return mesh.get_group()._get_backend(torch.device("cpu")).options._timeout


def check_mesh_axes(dp_replicate: int, tp: int, ep: int = 1) -> dict:
    """Which global ranks share each group, and that every group carries the requested timeout."""
    timeout = timedelta(seconds=17)
    dims = ParallelDims(dp_replicate=dp_replicate, tp=tp, ep=ep).resolve(dist.get_world_size())
    mesh = dims.build_mesh("cpu", timeout=timeout)
    groups = {
        "tp": tp_mesh(mesh),
        "dp": data_mesh(mesh),
        "dp_cp": reduction_mesh(mesh),
        "dp_shard_cp": flattened(mesh, "dp_shard_cp"),
        "dp_shard": mesh["dp_shard"],
        "dp_replicate": mesh["dp_replicate"],
        **({"ep": mesh["ep"], "efsdp": mesh["efsdp"]} if ep > 1 else {}),
    }
    assert all(_timeout_of(group) == timeout for group in groups.values()), {
        name: _timeout_of(group) for name, group in groups.items()
    }
    ranks = {name: sorted(group.mesh.flatten().tolist()) for name, group in groups.items()}
    ranks["fsdp_axes"] = fsdp_mesh(mesh).mesh_dim_names
    if ep > 1:
        ranks["experts_axes"] = (expert_fsdp_mesh(mesh).mesh_dim_names, expert_mesh(mesh).mesh_dim_names)
    return ranks
