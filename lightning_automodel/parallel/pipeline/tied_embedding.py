"""A tied input and output embedding stays tied under pp: the last stage holds a copy of the embedding as its head,
and the two copies' gradients are summed over the pp ranks before each optimizer step, so that both take the steps
the single tied weight would."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_automodel.parallel.pipeline.gradients import ParametersByName
from lightning_automodel.parallel.pipeline.stage_split import name_of


class TiedEmbedding:
    """The tied embedding's copies on a pipeline's first and last stage; the stages in between take part in the
    collectives with zeros. ``parameters``: the model's sharded parameters by name (those FSDP steps)."""

    def __init__(
        self, model: nn.Module, *, group: dist.ProcessGroup, first: bool, last: bool, parameters: ParametersByName
    ) -> None:
        self.model = model
        self.group = group
        self.first, self.last = first, last
        self._parameters = parameters
        self._layout: tuple[tuple[int, ...], torch.dtype] | None = None

    def sum_gradients(self) -> None:
        """Sum the two copies' gradients over the pp ranks."""
        self._in_place(self._local(gradient=True), partial(dist.all_reduce, group=self.group))

    def take_first_stage_values(self) -> None:
        """The last stage's copy takes the first stage's values."""
        with torch.no_grad():
            self._in_place(self._local(gradient=False), partial(dist.broadcast, group=self.group, group_src=0))

    def _in_place(self, tensor: Tensor, collective: Callable[[Tensor], object]) -> None:
        """``collective`` on ``tensor``, through the GPU where NCCL runs it and the tensor is in CPU memory (FSDP2's
        CPU offload keeps sharded weights and gradients there)."""
        if tensor.device.type == "cpu" and dist.get_backend(self.group) == "nccl":
            on_device = tensor.to(torch.device("cuda", torch.cuda.current_device()))
            collective(on_device)
            tensor.copy_(on_device)
        else:
            collective(tensor)

    def copies(self) -> list[nn.Parameter]:
        """The last stage's copy, unless the rank holds the first stage too."""
        return [self._weight()] if self.last and not self.first else []

    def _weight(self) -> nn.Parameter:
        """The (sharded) parameter of the input embedding's weight, under whatever name it has (a PEFT layer's
        ``base_layer.weight``)."""
        embedding = self.model.get_input_embeddings()
        module = name_of(self.model, embedding)
        key = next(key for key, param in embedding.named_parameters() if param is embedding.weight)
        return self._parameters()[f"{module}.{key}" if module else key]

    def _local(self, *, gradient: bool) -> Tensor:
        """This rank's shard of the tied embedding's weight (or gradient), or zeros of its shape and dtype on middle
        stages, which the first stage tells them once."""
        weight = self._weight() if self.first or self.last else None
        tensor = None if weight is None else weight.grad if gradient else weight
        tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if self._layout is None:
            layouts = [(tuple(tensor.shape), tensor.dtype) if tensor is not None else None]
            dist.broadcast_object_list(layouts, group=self.group, group_src=0)
            self._layout = layouts[0]
        if tensor is None:
            shape, dtype = self._layout
            tensor = torch.zeros(shape, dtype=dtype, device=next(iter(self.model.parameters())).device)
        return tensor
