"""A ready LightningModule for diffusers' transformer denoisers (Flux, SD3, Wan) trained with the rectified-flow
objective on precomputed latents and text embeddings (docs/diffusion.md). diffusers is imported on first use."""

from lightning_automodel.diffusion.module import DiffusionModule

__all__ = ["DiffusionModule"]
