"""Gradient-norm clipping over parameters that live on different device meshes.

After tensor parallel and FSDP, a model's parameters are DTensors on several meshes: 2D (dp_shard_cp, tp) for
tensor-parallel weights, 1D (dp_shard_cp) for the rest. ``torch.nn.utils.clip_grad_norm_`` stacks all norms
into one tensor and fails on the mix. The norm of each mesh's gradients is exact on its own (a DTensor norm
reduces over the mesh), and the norm of those norms is the global norm. Under pipeline parallel each stage holds
other parameters: the stages' norms are combined over the pp ranks, a parameter two stages hold counted once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    *,
    stage_group: dist.ProcessGroup | None = None,
    counted_elsewhere: Collection[torch.Tensor] = (),
) -> torch.Tensor:
    """Scale gradients in place so that their global ``norm_type`` norm is at most ``max_norm``; return it.

    ``stage_group``: the pp ranks, whose stages' norms make the global one; ``counted_elsewhere``: parameters whose
    gradient another stage holds too and counts (scaled here, not counted)."""
    parameters = [p for p in parameters if p.grad is not None]
    skipped = {id(p) for p in counted_elsewhere}
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    counted: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        by_mesh[mesh].append(p.grad)
        if id(p) not in skipped:
            counted[mesh].append(p.grad)
    norms = []
    for group in counted.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.nn.utils.get_total_norm(norms, norm_type, error_if_nonfinite) if norms else torch.tensor(0.0)
    if stage_group is not None:
        total = _over_stages(total, norm_type, stage_group)
    scale = min(float(max_norm) / (float(total) + 1e-6), 1.0)
    if scale < 1.0:
        for group in by_mesh.values():
            torch._foreach_mul_(group, scale)
    return total


def _over_stages(norm: torch.Tensor, norm_type: float, group: dist.ProcessGroup) -> torch.Tensor:
    """The norm over every stage of ``group`` from this stage's (on the group's device: a stage without gradients
    has a CPU zero)."""
    if dist.get_backend(group) == "nccl":
        norm = norm.to(torch.device("cuda", torch.cuda.current_device()))
    if norm_type == float("inf"):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm.double() ** norm_type
    dist.all_reduce(powered, group=group)
    return (powered ** (1.0 / norm_type)).to(norm.dtype)
