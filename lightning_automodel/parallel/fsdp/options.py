"""FSDP2's options for :func:`~lightning_automodel.parallel.fsdp.sharding.apply_fsdp`, checked when built."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy


@dataclass(frozen=True)
class FSDPOptions:
    """How FSDP2 shards, gathers and computes: one unit per decoder layer, then the root."""

    mp_policy: MixedPrecisionPolicy | None = None
    """FSDP2's MixedPrecisionPolicy; the strategy's default: derived from ``Trainer(precision=...)``. Parameters the
    model pins to fp32 (Hugging Face's ``_keep_in_fp32_modules_strict``) compute in fp32 under any policy."""

    offload_policy: OffloadPolicy | None = None
    """FSDP2's OffloadPolicy; the strategy's ``cpu_offload=True`` keeps sharded parameters, gradients and optimizer
    state in CPU memory."""

    reshard_after_forward: bool | None = None
    """Whether each unit frees its gathered weights after its forward: True all (least memory), False none (no
    all-gather in backward, most memory), None (default) every decoder layer but the last. None keeps the last
    layer's (whose weights backward needs again at once) and the root's (embeddings, final norm, lm_head: backward
    starts with them); under pp it frees none (torch's pipeline stage keeps them gathered from a micro-batch's
    backward to the last one: freed after each forward, they would be gathered again for each micro-batch)."""

    forward_prefetch: int = 0
    """Following decoder layers each layer all-gathers before its forward (0: FSDP's default, each layer gathers its
    own when it starts). More overlaps communication further and holds more unsharded layers at once."""

    backward_prefetch: int = 1
    """Preceding decoder layers each layer all-gathers in backward (1: FSDP's default)."""

    def __post_init__(self) -> None:
        if self.forward_prefetch < 0 or self.backward_prefetch < 1:
            raise ValueError(
                f"forward_prefetch={self.forward_prefetch}, backward_prefetch={self.backward_prefetch}: they count"
                " decoder layers gathered ahead (0 or more) and behind (1 or more, FSDP's default being 1)."
            )
