"""Vision-language models (LLaVA, Qwen2-VL, Gemma 3) against one process inside gloo workers: loss, logits and every
gradient (the vision tower's and projector's included) of ``parallelize``, then AdamW steps through a real Trainer."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from lightning_automodel import parallelize
from lightning_automodel.parallel.mesh import data_mesh
from lightning_automodel.planning.replica_comparison import ZERO_GRADIENT
from lightning_automodel.testing.parity import (
    FP32_TOLERANCE,
    Outputs,
    assert_gradients_placed_as_parameters,
    dims_for,
    dp_slice,
    full,
    gradient_errors,
    relative_error,
)
from lightning_automodel.testing.vision_models import (
    rows_slice,
    tiny_vision_model,
    vision_batch,
    vision_loss_and_logits,
)


def _outputs(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> Outputs:
    loss, logits = vision_loss_and_logits(model, rows)
    loss.backward()
    grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    return Outputs(full(loss).detach().clone(), full(logits), grads)


def check_vision_layout(family: str, tp: int, sp: bool, activation_checkpointing: bool = False) -> dict[str, float]:
    """fp32 parity of one step with images; dp_shard takes the rest of the world. Every rank builds its model from
    another seed: parallelize must make them all rank 0's."""
    mesh = dims_for(dist.get_world_size(), tp).build_mesh("cpu")
    reference, model = tiny_vision_model(family), tiny_vision_model(family, seed=dist.get_rank())
    parallelize(model, mesh, sp=sp, activation_checkpointing=activation_checkpointing)
    rows = vision_batch(family)
    expected = _outputs(reference, rows)
    dp = data_mesh(mesh)
    part = dp_slice(dp, len(rows["input_ids"]))
    with loss_parallel():
        outputs = _outputs(model, rows_slice(rows, part))
    dist.all_reduce(outputs.loss, group=dp.get_group())
    outputs.loss /= dp.size()
    assert_gradients_placed_as_parameters(model)
    errors = _errors(outputs, expected, part)
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors


def _errors(outputs: Outputs, expected: Outputs, part: slice) -> dict[str, float]:
    """The loss's, this rank's logits' and the worst gradient's errors, each part's (tower, projector, language
    model) apart. A CLIP key bias's gradient is zero in exact arithmetic (softmax ignores it): rounding noise, which
    relative to itself is of order 1, counts as zero below ``ZERO_GRADIENT`` of the largest gradient."""
    grads = gradient_errors(outputs, expected, floor=ZERO_GRADIENT)
    errors = {
        "loss": relative_error(outputs.loss, expected.loss),
        "logits": relative_error(outputs.logits, expected.logits[part]),
    }
    for name, error in grads.items():
        key = f"grad_{_part(name)}"
        errors[key] = max(errors.get(key, 0.0), error)
    return errors


def _part(name: str) -> str:
    """Which part of the model a parameter belongs to."""
    parts = {
        "vision_tower": "tower",
        "visual.merger": "projector",
        "visual": "tower",
        "multi_modal_projector": "projector",
    }
    return next((part for key, part in parts.items() if f".{key}." in f".{name}"), "language")
