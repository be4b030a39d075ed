"""Shapes told to a pipeline's stages instead of exchanged at their first step: a fake process group, whose messages
carry nothing, needs them (the activation estimate runs the schedule in one:
:mod:`~lightning_automodel.planning.memory.activations`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import stage as torch_stage
from torch.distributed.tensor import Placement, Shard


@dataclass(frozen=True)
class ToldShapes:
    """What stages hand each other for batches of ``batch_shape`` (rows, tokens): ``stream``, a micro-batch's hidden
    states on the meta device (this rank's share of them under sp)."""

    batch_shape: tuple[int, int]
    stream: Tensor

    def metadata(self, stage: int) -> dict[str, Tensor]:
        """``stage``'s static metadata (torch's ``input_args`` and ``output_args``). A last stage's outputs go to the
        loss, not to another stage: torch reads their metadata for their count only."""
        rows, tokens = self.stream.shape[0], self.batch_shape[1]
        inputs = torch.empty(rows, tokens, dtype=torch.long, device="meta") if stage == 0 else self.stream
        return dict(input_args=inputs, output_args=self.stream)


def told_shapes(
    *,
    batch_shape: tuple[int, int],
    microbatches: int,
    hidden_size: int,
    dtype: torch.dtype,
    stream_layout: tuple[DeviceMesh, tuple[Placement, ...]] | None,
) -> ToldShapes:
    """The hidden states of a micro-batch, [rows, tokens, ``hidden_size``] in ``dtype``, cut as ``stream_layout``'s
    placements shard them (see :meth:`.Pipeline.receive_stream_as`)."""
    rows, tokens = batch_shape
    shape = [rows // microbatches, tokens, hidden_size]
    if stream_layout is not None:
        mesh, placements = stream_layout
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                shape[placement.dim] //= mesh.size(mesh_dim)
    stream = torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)
    return ToldShapes(batch_shape=(rows, tokens), stream=stream)


def every_stage_told(stages: list[PipelineStage], has_backward: bool, p2p_done: bool) -> None:
    """What torch's schedules decide at their first step by a vote over the stages' process group (its
    ``_warmup_p2p``, from torch 2.13), where every stage was told its shapes: each takes them as told."""
    for stage in stages:
        stage._inference_mode = torch_stage.InferenceMode.STATIC
