"""The plan report's step estimates: the activations (:mod:`.memory.activations`), one a checkpointing setting, the
share of a vision-language model's images, and the optimizer step's temporaries (:mod:`.memory.optimizer_step`)."""

from __future__ import annotations

import copy

from torch import nn

from lightning_automodel.parallel.activation_checkpointing import AC_MODES
from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.parallel.tensor.apply import plan_not_logged
from lightning_automodel.planning.memory.activations import activation_bytes
from lightning_automodel.planning.memory.optimizer_step import optimizer_step_bytes
from lightning_automodel.planning.memory.step_images import step_images
from lightning_automodel.planning.memory.step_options import StepOptions
from lightning_automodel.planning.tower_report import TowerReport


def activations_by_mode(
    model: nn.Module, dims: ParallelDims, batch_shape: tuple[int, int], **options
) -> dict[str, int]:
    """The activation estimate of every checkpointing setting the layout runs (a zero-bubble pipeline schedule none
    but "off"), each on a copy of ``model``; the plan, which the report says, not logged."""
    rows, tokens = batch_shape
    pipeline = options.get("pipeline")
    settings = ["off"] if pipeline is not None and pipeline.splits_backward() else list(AC_MODES)
    with plan_not_logged():
        return {
            name: activation_bytes(
                copy.deepcopy(model),
                dims,
                micro_batch=rows,
                seq_len=tokens,
                activation_checkpointing=name,
                **options,
            )
            for name in settings
        }


def image_share(
    tower: TowerReport | None,
    model: nn.Module,
    dims: ParallelDims,
    *,
    batch_shape: tuple[int, int],
    step: StepOptions,
    estimated: dict[str, int],
    **estimate,
) -> None:
    """A vision-language model's images in the estimate's step, and what they add to its peak under each mode
    (``estimated``): the estimate less that of the same rows as text alone (the tower's activations, the image
    features scattered into the stream)."""
    if tower is None:
        return
    tower.images = step_images(model, **step.images())
    if tower.images is None:
        return
    text = activations_by_mode(model, dims, batch_shape, **{**estimate, "images_per_row": 0, "image_tokens": None})
    tower.activation_bytes = {mode: size - text[mode] for mode, size in estimated.items()}


def optimizer_temporaries(model: nn.Module, dims: ParallelDims, *, step: StepOptions, **options) -> int:
    """The optimizer step's temporaries on a copy of ``model`` (see
    :func:`~lightning_automodel.planning.memory.optimizer_step.optimizer_step_bytes`); the plan, which the report
    says, not logged."""
    with plan_not_logged():
        return optimizer_step_bytes(copy.deepcopy(model), dims, **options, **step.optimizer_keywords())
