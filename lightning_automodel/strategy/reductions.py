"""How the strategy reduces over its mesh rather than the world: logged values over the data-parallel ranks only (tp
peers hold the same value), decisions over every rank, and gradients held back while micro-batches accumulate."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_automodel.parallel.mesh import reduction_mesh
from lightning_automodel.planning.search.fitting import LayoutChoice
from lightning_automodel.strategy.lightning_patches import to_local


class MeshReductions(ModelParallelStrategy):
    """The reductions of :class:`~lightning_automodel.AutoModelParallelStrategy`, over its mesh's axes."""

    layout_choice: LayoutChoice | None

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulating micro-batches: FSDP keeps the unsharded gradients and reduce-scatters them once, on the
        last micro-batch, instead of once per micro-batch (Lightning blocks only DDP's sync itself). Not under
        layout="auto": its memory estimate holds sharded gradients, which each micro-batch's reduction keeps."""
        assert self.model is not None
        if self.layout_choice is not None:
            yield
            return
        units = [module for module in self.model.modules() if isinstance(module, FSDPModule)]
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor:
        """Reduce over the data-parallel ranks (dp_replicate x dp_shard x cp) unless a group is given.

        TP peers hold the same value; reducing over them too would count it tp times in a sum.
        """
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self._device_mesh is not None:  # before setup, as the parent: the world, if any
            group = reduction_mesh(self.device_mesh).get_group()
        return _sync_ddp_if_available(to_local(tensor), group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agree over every rank (Lightning compares the sum with the world size)."""
        count = torch.tensor(int(decision), device=self.root_device)
        count = _sync_ddp_if_available(count, _group.WORLD, reduce_op=ReduceOp.SUM)
        return bool(count == self.world_size) if all else bool(count)
