"""Predict batches dealt unevenly are refused: a sharded model needs every rank in every forward pass."""

from __future__ import annotations

import torch.distributed as dist


def require_equal_batch_counts(dataloader: object, *, world_size: int) -> None:
    """Lightning deals predict batches unevenly (no padding, so that each row is predicted once): a rank with a
    batch more would wait for its peers forever. Refused on every rank, before the first batch."""
    if world_size == 1 or not hasattr(dataloader, "__len__"):
        return
    counts = [0] * world_size
    dist.all_gather_object(counts, len(dataloader))
    if len(set(counts)) > 1:
        raise ValueError(
            f"predict: the ranks hold different numbers of batches ({counts}), and a sharded model needs"
            " every rank in every forward pass. Give the predict DataLoader a DistributedSampler(dataset,"
            " shuffle=False, **trainer.distributed_sampler_kwargs) (it pads by repeating rows), or make the"
            " number of rows a multiple of the data-parallel size times the batch size."
        )
