"""Vision-language fine-tuning data: records with images, rendered by the model's processor."""

from lightning_automodel.data.vision.module import VisionChatDataModule

__all__ = ["VisionChatDataModule"]
