"""The ready-made product over the strategy: a LightningModule for causal LMs, data modules, a byte tokenizer, a
progress bar in steps."""

from lightning_automodel.lm.data import TextDataModule
from lightning_automodel.lm.demo import DemoDataModule
from lightning_automodel.lm.module import CausalLMModule
from lightning_automodel.lm.progress import StepProgressBar
from lightning_automodel.lm.summary import TrainingSummary, plot_losses
from lightning_automodel.lm.tokenizer import byte_tokenizer

__all__ = [
    "CausalLMModule",
    "DemoDataModule",
    "StepProgressBar",
    "TextDataModule",
    "TrainingSummary",
    "byte_tokenizer",
    "plot_losses",
]
