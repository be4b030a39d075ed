"""Precomputed latents and text embeddings read from safetensors or Parquet shards, for ``DiffusionModule``."""

from lightning_automodel.data.latents.dataset import LatentShards
from lightning_automodel.data.latents.module import LatentDataModule
from lightning_automodel.data.latents.shards import write_latent_shard

__all__ = ["LatentDataModule", "LatentShards", "write_latent_shard"]
