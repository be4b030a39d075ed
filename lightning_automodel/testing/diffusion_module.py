"""Tiny Flux, SD3 and Wan denoisers and batches of precomputed latents and text embeddings in DiffusionModule's
format: for the tests of :mod:`lightning_automodel.diffusion`."""

from __future__ import annotations

import torch
from torch import nn

from lightning_automodel.testing.denoisers import TEXT_DIM, TEXT_TOKENS, tiny_denoiser

POOLED_DIM = 8
LATENTS = {"flux": (4, 4, 6), "sd3": (4, 8, 8), "wan": (4, 2, 4, 4)}  # one sample's: (C, H, W) or (C, F, H, W)


def tiny_module_denoiser(family: str, *, seed: int = 0, guidance_embeds: bool = False) -> nn.Module:
    """Flux reading 2x2-packed 4-channel latents (16 channels a token), SD3 with 2x2 patches, or the Wan of
    :mod:`~lightning_automodel.testing.denoisers`."""
    if family == "wan":
        return tiny_denoiser("wan", seed=seed)
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    torch.manual_seed(seed)
    common = dict(num_attention_heads=2, attention_head_dim=8, joint_attention_dim=TEXT_DIM)
    if family == "flux":
        return FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=1,
            pooled_projection_dim=POOLED_DIM,
            axes_dims_rope=(2, 2, 4),
            guidance_embeds=guidance_embeds,
            **common,
        )
    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        caption_projection_dim=16,
        pooled_projection_dim=POOLED_DIM,
        pos_embed_max_size=16,
        **common,
    )


def latent_samples(family: str, *, rows: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``rows`` samples: latents, text embeddings (+ pooled ones for Flux and SD3) and each sample's index."""
    generator = torch.Generator().manual_seed(seed)
    batched = {
        "latents": torch.randn(rows, *LATENTS[family], generator=generator),
        "text_embeddings": torch.randn(rows, TEXT_TOKENS, TEXT_DIM, generator=generator),
        "index": torch.arange(rows),
    }
    if family != "wan":
        batched["pooled_text_embeddings"] = torch.randn(rows, POOLED_DIM, generator=generator)
    return [{name: value[row] for name, value in batched.items()} for row in range(rows)]
