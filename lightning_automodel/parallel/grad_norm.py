"""Gradient-norm clipping over parameters that live on different device meshes.

After tensor parallel and FSDP, a model's parameters are DTensors on several meshes: 2D (dp_shard_cp, tp) for
tensor-parallel weights, 1D (dp_shard_cp) for the rest. ``torch.nn.utils.clip_grad_norm_`` stacks all norms
into one tensor and fails on the mix. The norm of each mesh's gradients is exact on its own (a DTensor norm
reduces over the mesh), and the norm of those norms is the global norm.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Scale gradients in place so that their global ``norm_type`` norm is at most ``max_norm``; return it."""
    grads = [p.grad for p in parameters if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        by_mesh[grad.device_mesh if isinstance(grad, DTensor) else None].append(grad)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    total = torch.nn.utils.get_total_norm(norms, norm_type, error_if_nonfinite)
    scale = min(float(max_norm) / (float(total) + 1e-6), 1.0)
    if scale < 1.0:
        for group in by_mesh.values():
            torch._foreach_mul_(group, scale)
    return total
