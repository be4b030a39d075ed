"""Ranks without processes: a fake process group, and torch's single-process simulation of every rank on top of it.

A fake process group makes meshes, DTensors and styles build as on a real world of that size, with collectives that
do nothing (what :func:`~lightning_automodel.parallel.report.plan_report` needs: shapes). Under torch's
``LocalTensorMode`` each tensor holds the values of every simulated rank and collectives compute on them for real,
so one process runs a tensor-parallel step with the numbers ``tp`` processes would get, in seconds, with no port
and no process to start (what :func:`~lightning_automodel.parallel.verify.verify_plan` needs: values).

Both need the default process group of their own, so they refuse to run where one exists (inside distributed
training); :mod:`~lightning_automodel.parallel.verify` runs them in a child process there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist


@contextlib.contextmanager
def fake_world(world_size: int, *, rank: int = 0) -> Iterator[None]:
    """A default process group of ``world_size`` ranks, this process being ``rank``, whose collectives do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "This runs in a fake process group of its own; call it outside distributed training (a process group"
            " is already initialized here)."
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_meshes()


@contextlib.contextmanager
def simulated_ranks(world_size: int) -> Iterator[None]:
    """Every rank of a world of ``world_size`` simulated in this process: tensors made inside hold one value per
    rank, collectives (DTensor's included) combine them as a real process group would. Needs a world of that size
    (:func:`fake_world`); meshes built before entering serve, as seen from each rank."""
    from torch.distributed._local_tensor import LocalTensorMode

    with LocalTensorMode(world_size):
        try:
            yield
        finally:
            _forget_meshes()


def _forget_meshes() -> None:
    """DTensor keeps its random-state tracker, made for the mesh of the first random op, and caches sharding
    decisions with the meshes they were made on (found again by mesh shape): neither may outlive a fake or simulated
    world into another one, whose meshes of the same shapes have other process groups."""
    from torch.distributed.tensor import _random
    from torch.distributed.tensor.debug import _clear_fast_path_sharding_prop_cache, _clear_python_sharding_prop_cache

    _random._rng_tracker = None
    _clear_python_sharding_prop_cache()
    _clear_fast_path_sharding_prop_cache()


def rank_values(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The value of ``tensor`` on each simulated rank (one value for a plain tensor, which every rank shares)."""
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(tensor, LocalTensor):
        return [tensor._local_tensors[rank] for rank in sorted(tensor._local_tensors)]
    return [tensor]
