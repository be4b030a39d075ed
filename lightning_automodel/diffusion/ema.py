"""An exponential moving average of a denoiser's trainable weights, shard by shard: each rank averages the local
shards of its (FSDP2-sharded) parameters, with no collective, into buffers of the same layout, which a Lightning
checkpoint saves and restores with the module's state (a resume continues the very same average)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class WeightAverage(nn.Module):
    """average <- decay * average + (1 - decay) * weight after every optimizer step, for every trainable parameter
    of ``model`` (a constant decay: no warm-up of it)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        super().__init__()
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema_decay={decay} must lie in (0, 1): e.g. 0.999, or None for no average.")
        self.decay = decay
        self._model = [model]  # not a submodule: its weights are not this module's state
        for name, param in self._trainable():
            self.register_buffer(_buffer_name(name), param.detach().clone())

    def _trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(name, param) for name, param in self._model[0].named_parameters() if param.requires_grad]

    def _pairs(self) -> tuple[list[Tensor], list[Tensor]]:
        trainable = self._trainable()
        averages = [_local(getattr(self, _buffer_name(name))) for name, _ in trainable]
        return averages, [_local(param.detach()) for _, param in trainable]

    def match_layout(self) -> None:
        """Shard each average as its parameter is sharded (made before the strategy parallelized the model): the
        same placements on the same mesh, so that each rank averages its own shard."""
        for name, param in self._trainable():
            average = getattr(self, _buffer_name(name))
            if isinstance(param, DTensor) and not isinstance(average, DTensor):
                average = distribute_tensor(average.to(param.device), param.device_mesh, param.placements)
                setattr(self, _buffer_name(name), average)

    @torch.no_grad()
    def update(self) -> None:
        averages, weights = self._pairs()
        torch._foreach_lerp_(averages, weights, 1.0 - self.decay)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The averaged weights in the model for the block's length (evaluate or export them), the trained ones
        back after."""
        averages, weights = self._pairs()
        with torch.no_grad():
            trained = [weight.clone() for weight in weights]
            torch._foreach_copy_(weights, averages)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(weights, trained)


def _buffer_name(parameter_name: str) -> str:
    return parameter_name.replace(".", "__")
