"""Lightning objects patched at setup for sharded models: gradient clipping, evaluation mode and logged values.

Each patch replaces one method on one instance, where Lightning offers no hook; ``to_local`` hands Lightning plain
tensors.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from lightning.pytorch.plugins.precision import Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_automodel.parallel.grad_norm import clip_grad_norm_
from lightning_automodel.parallel.pipeline import Pipeline

if TYPE_CHECKING:
    import lightning.pytorch as pl


def to_local(output: Any) -> Any:
    """Hand Lightning plain tensors where a step returned DTensors (a loss from vocab-sharded logits, the logits
    themselves); gradients still flow through ``full_tensor``."""
    return apply_to_collection(output, DTensor, DTensor.full_tensor)


def clip_across_meshes(precision: Precision, pipelines: list[Pipeline]) -> None:
    """Route Trainer(gradient_clip_val=...) with the "norm" algorithm to a clip that handles gradients on
    several meshes (torch's fails on the mix) and, under pp, on several stages (a tied embedding's copy on the last
    stage counted once). Precision plugins own clipping in Lightning, one class per precision flag, so the method is
    replaced on the instance rather than in a subclass of each."""

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: int | float) -> None:
        copies = [copy for pipeline in pipelines for copy in pipeline.copies()]
        stages = pipelines[0].group if pipelines else None
        clip_grad_norm_(precision.main_params(optimizer), clip_val, stage_group=stages, counted_elsewhere=copies)

    precision.clip_grad_by_norm = clip_grad_by_norm


def evaluate_without_inference_mode(trainer: pl.Trainer) -> None:
    """Evaluate under ``no_grad``, as Lightning already does in fit's validation and for its own FSDP strategy.

    FSDP2 allocates its all-gather buffers at the first unshard; made under ``inference_mode`` they are inference
    tensors, and every later unshard fails ("Inference tensors do not track version counter"). Measured on a GPU
    with ``trainer.validate`` as the first stage; on gloo Lightning uses ``no_grad`` anyway, so CPU runs never see it.
    """
    for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        loop.inference_mode = False


def log_local_values(module: pl.LightningModule) -> None:
    """Make ``module.log`` store plain tensors: a DTensor would end up in callback_metrics and checkpoints
    (ModelCheckpoint's best score), which then hold a pickled device mesh. ``log_dict`` goes through it too."""
    if getattr(module.log, "logs_local_values", False):
        return
    log_value = module.log

    @functools.wraps(log_value)
    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        log_value(name, to_local(value), *args, **kwargs)

    log.logs_local_values = True
    module.log = log
