"""CausalLMModule's optimizer and learning-rate schedule: AdamW with weight decay on the matrices only (built where
the plan steps it too: :mod:`~lightning_automodel.planning.memory.optimizer_step`), warmed up linearly and decayed by
a cosine or a line to the last optimizer step."""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Literal

from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from lightning_automodel.planning.memory.optimizer_step import AdamWImplementation, adamw

Schedule = Literal["cosine", "linear", "constant"]


def adamw_of_hparams(module: nn.Module, hparams: Any, *, total_steps: float) -> dict[str, Any]:
    """:func:`adamw_with_schedule` over ``module``'s trainable parameters, with the options a ready LightningModule
    keeps in its hyperparameters (CausalLMModule's, DiffusionModule's)."""
    return adamw_with_schedule(
        [p for p in module.parameters() if p.requires_grad],
        learning_rate=hparams.learning_rate,
        betas=tuple(hparams.betas),
        weight_decay=hparams.weight_decay,
        warmup_steps=hparams.warmup_steps,
        schedule=hparams.schedule,
        min_lr_ratio=hparams.min_lr_ratio,
        total_steps=total_steps,
        implementation=hparams.adamw,
    )


def adamw_with_schedule(
    parameters: list[nn.Parameter],
    *,
    learning_rate: float,
    betas: tuple[float, float],
    weight_decay: float,
    warmup_steps: int,
    schedule: Schedule,
    min_lr_ratio: float,
    total_steps: float,
    implementation: AdamWImplementation = "foreach",
) -> dict[str, Any]:
    """``configure_optimizers``' answer for the trainable ``parameters``: AdamW (no decay on vectors: norms, biases;
    stepped by ``implementation``) and its schedule stepped every optimizer step. ``total_steps`` is the Trainer's
    estimate (inf without an end, which only a constant schedule accepts)."""
    if schedule != "constant" and not math.isfinite(total_steps):
        raise ValueError(
            f'schedule="{schedule}" decays to the last step, and this run has no end: set'
            ' Trainer(max_steps=...) or max_epochs, or schedule="constant".'
        )
    optimizer = adamw(
        parameters, implementation=implementation, learning_rate=learning_rate, betas=betas, weight_decay=weight_decay
    )
    factor = partial(
        learning_rate_factor,
        warmup_steps=warmup_steps,
        total_steps=int(total_steps) if math.isfinite(total_steps) else 0,
        schedule=schedule,
        min_lr_ratio=min_lr_ratio,
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": LambdaLR(optimizer, factor), "interval": "step"}}


def learning_rate_factor(
    step: int, *, warmup_steps: int, total_steps: int, schedule: Schedule, min_lr_ratio: float
) -> float:
    """The learning rate of optimizer step ``step`` (0 to ``total_steps - 1``, as LambdaLR counts them) as a
    fraction of the peak: ``1 / (warmup_steps + 1)``, ..., rising linearly to 1 at step ``warmup_steps``, then the
    schedule's decay, reaching ``min_lr_ratio`` at the last step."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - 1 - warmup_steps))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
    return min_lr_ratio + (1 - min_lr_ratio) * decay
