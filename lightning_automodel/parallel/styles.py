"""Parallel styles that torch does not ship.

Each style is a small subclass of a torch ``ParallelStyle`` that changes only the layout at a module's edge.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import SequenceParallel


class SequenceParallelAllGather(SequenceParallel):
    """Run a norm on the sequence-sharded residual stream, then all-gather its output once.

    With sequence parallel the residual stream is a ``Shard(1)`` DTensor. The projections after a norm need the
    full sequence; gathering here costs one all-gather per block instead of one per projection (q, k and v would
    each gather the same input). The output stays a replicated DTensor so the projections take it as is.
    """

    def __init__(self, *, sequence_dim: int = 1) -> None:
        super().__init__(sequence_dim=sequence_dim, use_local_output=False)

    @staticmethod
    def _prepare_output_fn(use_local_output: bool, mod: nn.Module, outputs: DTensor, device_mesh: DeviceMesh):
        if isinstance(outputs, DTensor) and any(p.is_shard() for p in outputs.placements):
            outputs = outputs.redistribute(device_mesh, [Replicate()])
        return SequenceParallel._prepare_output_fn(use_local_output, mod, outputs, device_mesh)
