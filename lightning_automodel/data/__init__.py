"""Data for causal language models: local corpora tokenized once into a memory-mapped cache, fine-tuning records
with the loss on the answers, rows that keep packed documents apart, and a resumable training order."""

from lightning_automodel.data.demo import DemoDataModule
from lightning_automodel.data.latents import LatentDataModule
from lightning_automodel.data.modules.base import TokenDataModule
from lightning_automodel.data.modules.chat import ChatDataModule
from lightning_automodel.data.modules.text import TextDataModule
from lightning_automodel.data.rows import IGNORE_INDEX
from lightning_automodel.data.tokenizer import byte_tokenizer
from lightning_automodel.data.vision.demo import VisionDemoDataModule

__all__ = [
    "IGNORE_INDEX",
    "ChatDataModule",
    "DemoDataModule",
    "LatentDataModule",
    "TextDataModule",
    "TokenDataModule",
    "VisionDemoDataModule",
    "byte_tokenizer",
]
