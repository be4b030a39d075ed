"""FSDP2 sharding: one unit per decoder layer, then the root for everything else."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def apply_fsdp(
    model: nn.Module,
    layers: Sequence[nn.Module],
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
) -> None:
    """Shard each decoder layer, then the root.

    Every layer but the last reshards after forward; the last one's parameters are needed again at once by the
    backward, and the root (embeddings, final norm, lm_head) is kept unsharded between forward and backward too.
    """
    options = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload_policy or OffloadPolicy(),
        "shard_placement_fn": _shard_placement,
    }
    for index, layer in enumerate(layers):
        fully_shard(layer, reshard_after_forward=index < len(layers) - 1, **options)
    fully_shard(model, reshard_after_forward=False, **options)


def _shard_placement(param: nn.Parameter) -> Shard | None:
    """Shard packed tensor-parallel weights on their input dim; every other parameter on dim 0 (FSDP's default).

    FSDP describes a dim-0 shard of a tensor-parallel shard as a strided shard that assumes the tp placement is
    a plain ``Shard(0)``. For a packed projection (tp placement ``_StridedShard(0)``) that description would
    be wrong: gathering the DTensor (``full_tensor``, checkpoints) would shuffle the rows. On another dim the two
    placements compose without ambiguity.
    """
    if isinstance(param, DTensor) and param.ndim > 1 and any(isinstance(p, _StridedShard) for p in param.placements):
        return Shard(1)
    return None
