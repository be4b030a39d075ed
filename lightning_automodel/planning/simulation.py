"""Ranks without processes: a fake process group, and torch's single-process simulation of every rank on top of it.

A fake process group makes meshes, DTensors and styles build as on a real world of that size, with collectives that
do nothing (what :func:`~lightning_automodel.planning.report.plan_report` needs: shapes). Under torch's
``LocalTensorMode`` each tensor holds the values of every simulated rank and collectives compute on them for real,
so one process runs a tensor-parallel step with the numbers ``tp`` processes would get, in seconds, with no port
and no process to start (what :func:`~lightning_automodel.planning.verify.verify_plan` needs: values).

The fake process group comes in a second kind, for the activation estimate: one whose sends' works keep their
tensors until dropped, as gloo's and NCCL's do (a pipeline schedule keeps them a while), and whose all-to-alls of
real tensors (expert parallel's token counts) answer as if every rank held this rank's inputs (the estimate's routing
is every rank's, :mod:`~lightning_automodel.planning.memory.routing`; torch's fake all-gather already answers so, its
all-to-all hands back the input as it is). torch's fake backend keeps no send, so it is wrapped in a process group of
Python's, as torch's backend registry offers.

Fake worlds and simulated ranks need the default process group of their own, so they refuse to run where one exists
(inside distributed training); :mod:`~lightning_automodel.planning.verify` runs them in a child process there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor


@contextlib.contextmanager
def fake_world(world_size: int, *, rank: int = 0, estimate: bool = False) -> Iterator[None]:
    """A default process group of ``world_size`` ranks, this process being ``rank``, whose collectives do nothing.

    ``estimate``: the memory estimate's kind (see the module's docstring): the work of a send keeps the tensors sent
    until it is dropped, as gloo's and NCCL's do (a pipeline schedule keeps its sends' works a while), and an
    all-to-all of real tensors receives from every rank what this rank sends itself."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "This runs in a fake process group of its own; call it outside distributed training (a process group"
            " is already initialized here)."
        )
    backend = _ESTIMATE if estimate else "fake"
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


class _EstimateGroup(dist.ProcessGroup):
    """torch's fake process group, but for its sends, whose works keep their tensors, and its all-to-alls of real
    tensors, answered as between ranks alike (see :func:`fake_world`): a process group of
    Python's, as torch offers (``Backend.register_backend``), over the fake backend. Made by
    :func:`_estimate_group`."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return _HeldSend(self._get_backend(torch.device("cpu")).send(tensors, dst, tag), tensors)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: dist.AllToAllOptions,
    ) -> dist.Work:
        backend = self._get_backend(torch.device("cpu"))
        work = backend.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)
        if _values(output, input):  # every rank sends this one what this one sends itself
            mine = input.split(input_split_sizes or input.shape[0] // self.size())[self.rank()]
            output.copy_(mine.repeat(self.size(), *[1] * (mine.ndim - 1)))
        return work


def _values(*tensors: torch.Tensor) -> bool:
    """Whether ``tensors`` hold values (fake ones, the step's activations, have none to exchange)."""
    return not any(isinstance(tensor, FakeTensor) for tensor in tensors)


def _estimate_group(common_options, backend_options) -> _EstimateGroup:
    """The creator torch calls for each group of the backend."""
    from torch._C._distributed_c10d import FakeProcessGroup

    rank, size = common_options.group_rank, common_options.group_size
    group = _EstimateGroup(rank, size)
    custom = dist.ProcessGroup.BackendType.CUSTOM
    group._register_backend(torch.device("cpu"), custom, FakeProcessGroup._create_internal(rank, size, backend_options))
    group._set_default_backend(custom)
    return group


_ESTIMATE = "fake_estimate"
dist.Backend.register_backend(_ESTIMATE, _estimate_group, extended_api=True, devices=["cpu"])


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
