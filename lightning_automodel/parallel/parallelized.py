"""What :func:`~lightning_automodel.parallel.parallelize` returns: the model, and the three moments of a training loop
at which a parallelized model needs a step of ours, as methods, so that no caller (the strategy, Fabric, a plain torch
loop) has to know which mechanism needs what::

    parallelized = parallelize(model, mesh, sp=True)
    materialize_pretrained(model, device)  # a model built on the meta device gets its weights
    parallelized.after_weights_loaded()
    for batch in batches:
        model(**batch).loss.backward()
        parallelized.after_backward()  # before clipping: the gradients are complete from here
        optimizer.step()
        parallelized.after_optimizer_step()
        optimizer.zero_grad()

Each method does nothing where the model needs nothing at that moment; where it does, it runs a collective, so every
rank calls it, and for several models in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_automodel.parallel.float8 import precompute_float8_scales
from lightning_automodel.parallel.pipeline import pipeline_of


@dataclass(frozen=True)
class Parallelized:
    """A model :func:`~lightning_automodel.parallel.parallelize` changed in place, and its duties at each step. It
    holds nothing but the model: ``Parallelized(model)`` of a model parallelized earlier is the same."""

    model: nn.Module

    def after_weights_loaded(self) -> None:
        """Once the weights exist (materialized from the meta device, or loaded into it): under pp the stages take
        them, and the last stage's copy of a tied embedding takes the first stage's values."""
        if (pipeline := pipeline_of(self.model)) is not None:
            pipeline.adopt_weights()

    def after_backward(self) -> None:
        """Once the step's last backward has run (the last micro-batch's under gradient accumulation), before anything
        reads the gradients (clipping, a gradient norm, the optimizer): under pp the two copies of a tied embedding
        sum their gradients."""
        if (pipeline := pipeline_of(self.model)) is not None:
            pipeline.sum_tied_gradients()

    def after_optimizer_step(self) -> None:
        """After each optimizer step: float8 weights that FSDP2 gathers in float8 get their next scales in one
        all-reduce."""
        precompute_float8_scales(self.model)
