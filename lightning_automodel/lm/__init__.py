"""The ready-made product over the strategy: a LightningModule for causal LMs, its limits, metrics, a progress bar in
steps, a training summary and a writer of what predict scores (the data modules are in
:mod:`lightning_automodel.data`)."""

from lightning_automodel.lm.module import CausalLMModule
from lightning_automodel.lm.predictions import PredictionWriter
from lightning_automodel.lm.progress import StepProgressBar
from lightning_automodel.lm.summary import TrainingSummary, plot_losses

__all__ = ["CausalLMModule", "PredictionWriter", "StepProgressBar", "TrainingSummary", "plot_losses"]
