"""FSDP2 sharding: one unit per decoder layer, then the root for everything else."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard


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
    options = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy(), "offload_policy": offload_policy or OffloadPolicy()}
    for index, layer in enumerate(layers):
        fully_shard(layer, reshard_after_forward=index < len(layers) - 1, **options)
    fully_shard(model, reshard_after_forward=False, **options)
