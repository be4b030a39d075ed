"""The Lightning strategy: hooks that hand the LightningModule's Hugging Face models to :mod:`..parallel`."""

from lightning_automodel.strategy.auto_model_parallel import AutoModelParallelStrategy

__all__ = ["AutoModelParallelStrategy"]
