"""Ranks without processes: a fake process group, and torch's single-process simulation of every rank on top of it.

A fake process group makes meshes, DTensors and styles build as on a real world of that size, with collectives that
do nothing (what :func:`~lightning_automodel.planning.report.plan_report` needs: shapes). Under torch's
``LocalTensorMode`` each tensor holds the values of every simulated rank and collectives compute on them for real,
so one process runs a tensor-parallel step with the numbers ``tp`` processes would get, in seconds, with no port
and no process to start (what :func:`~lightning_automodel.planning.verify.verify_plan` needs: values).

The fake process group comes in a second kind, for the activation estimate: one whose sends' works keep their
tensors until dropped, as gloo's and NCCL's do (a pipeline schedule keeps them a while). torch's fake backend keeps
none, so it is wrapped in a process group of Python's, as torch's backend registry offers.

Fake worlds and simulated ranks need the default process group of their own, so they refuse to run where one exists
(inside distributed training); :mod:`~lightning_automodel.planning.verify` runs them in a child process there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist


@contextlib.contextmanager
def fake_world(world_size: int, *, rank: int = 0, sends_hold_tensors: bool = False) -> Iterator[None]:
    """A default process group of ``world_size`` ranks, this process being ``rank``, whose collectives do nothing.

    ``sends_hold_tensors``: the work of a send keeps the tensors sent until it is dropped, as gloo's and NCCL's do (a
    pipeline schedule keeps its sends' works a while: the memory estimate counts what they hold)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "This runs in a fake process group of its own; call it outside distributed training (a process group"
            " is already initialized here)."
        )
    backend = _SENDS_HOLD_TENSORS if sends_hold_tensors else "fake"
    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world_size)
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


class _HeldSend(dist.Work):
    """A send's work that keeps the tensors sent until it is dropped."""

    def __init__(self, work: dist.Work, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._work, self._tensors = work, tensors

    def wait(self, timeout: timedelta | None = None) -> bool:
        return self._work.wait() if timeout is None else self._work.wait(timeout)


class _SendsHoldTensors(dist.ProcessGroup):
    """torch's fake process group, but for its sends, whose works keep their tensors (see :func:`fake_world`): a
    process group of Python's, as torch offers (``Backend.register_backend``), over the fake backend. Made by
    :func:`_sends_hold_tensors`."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return _HeldSend(self._get_backend(torch.device("cpu")).send(tensors, dst, tag), tensors)


def _sends_hold_tensors(common_options, backend_options) -> _SendsHoldTensors:
    """The creator torch calls for each group of the backend."""
    from torch._C._distributed_c10d import FakeProcessGroup

    rank, size = common_options.group_rank, common_options.group_size
    group = _SendsHoldTensors(rank, size)
    custom = dist.ProcessGroup.BackendType.CUSTOM
    group._register_backend(torch.device("cpu"), custom, FakeProcessGroup._create_internal(rank, size, backend_options))
    group._set_default_backend(custom)
    return group


_SENDS_HOLD_TENSORS = "fake_sends_hold_tensors"
dist.Backend.register_backend(_SENDS_HOLD_TENSORS, _sends_hold_tensors, extended_api=True, devices=["cpu"])


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
