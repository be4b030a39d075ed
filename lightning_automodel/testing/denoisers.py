"""Tiny diffusers transformer denoisers built from configs (Flux, SD3, Wan) and their samples: precomputed latents
and text embeddings in DiffusionModule's format, and, for a LightningModule a user writes around the bare model, a
flow-matching batch of its inputs with the loss that user writes. For the tests of the strategy's diffusion support
and of :mod:`lightning_automodel.diffusion` (see docs/diffusion.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_automodel.diffusion.objective import noisy_and_target

TEXT_TOKENS = 3
TEXT_DIM = 16
POOLED_DIM = 8
# One sample's latents as DiffusionModule reads them: (C, H, W) or (C, F, H, W); Flux packs 2x2 patches of 4
# channels into tokens of 16.
LATENTS = {"flux": (4, 4, 6), "sd3": (4, 8, 8), "wan": (4, 2, 4, 4)}
FLUX_TOKENS = 6  # packed latent tokens of a sample given to the bare Flux model


def tiny_denoiser(family: str, *, seed: int = 0, guidance_embeds: bool = False) -> nn.Module:
    """Flux (one double- and one single-stream block, reading 2x2-packed 4-channel latents), SD3 (2 blocks, 2x2
    patches) or Wan (2 blocks, video latents), two heads of 8 each; ``guidance_embeds``: a guidance-distilled Flux."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel

    torch.manual_seed(seed)
    heads = dict(num_attention_heads=2, attention_head_dim=8)
    if family == "flux":
        return FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=1,
            joint_attention_dim=TEXT_DIM,
            pooled_projection_dim=POOLED_DIM,
            axes_dims_rope=(2, 2, 4),
            guidance_embeds=guidance_embeds,
            **heads,
        )
    if family == "sd3":
        return SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            joint_attention_dim=TEXT_DIM,
            caption_projection_dim=16,
            pooled_projection_dim=POOLED_DIM,
            pos_embed_max_size=16,
            **heads,
        )
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        in_channels=4,
        out_channels=4,
        text_dim=TEXT_DIM,
        freq_dim=8,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
        **heads,
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
    return _rows(batched, rows)


# What the bare models read beside their latents: their latents' shape (Flux's as packed tokens), the timestep's
# scale (Flux takes the flow's t in [0, 1], Wan t x 1000), and unbatched position ids.
_BARE_LATENTS = {"flux": (FLUX_TOKENS, 16), "wan": LATENTS["wan"]}
_TIMESTEP_SCALE = {"flux": 1.0, "wan": 1000.0}


def flow_matching_samples(family: str, *, rows: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``rows`` samples of the bare Flux or Wan model's inputs: clean latents and noise mixed at a random time t
    (:func:`~lightning_automodel.diffusion.objective.noisy_and_target`), the velocity to predict as ``target``, and
    random text conditions."""
    generator = torch.Generator().manual_seed(seed)
    clean = torch.randn(rows, *_BARE_LATENTS[family], generator=generator)
    noise = torch.randn(rows, *_BARE_LATENTS[family], generator=generator)
    t = torch.rand(rows, generator=generator)
    noisy, target = noisy_and_target(clean, noise, t)
    batched = {
        "hidden_states": noisy,
        "timestep": t * _TIMESTEP_SCALE[family],
        "target": target,
        "encoder_hidden_states": torch.randn(rows, TEXT_TOKENS, TEXT_DIM, generator=generator),
    }
    if family == "flux":
        batched["pooled_projections"] = torch.randn(rows, POOLED_DIM, generator=generator)
    return _rows(batched, rows)


def velocity_loss(model: nn.Module, batch: dict[str, torch.Tensor], family: str) -> torch.Tensor:
    """What a user writes around the bare model: the mean squared error of the predicted velocity."""
    inputs = {name: value for name, value in batch.items() if name != "target"}
    if family == "flux":
        inputs.update(img_ids=torch.zeros(FLUX_TOKENS, 3), txt_ids=torch.zeros(TEXT_TOKENS, 3))
    predicted = model(**inputs, return_dict=False)[0]
    return F.mse_loss(predicted, batch["target"])


def _rows(batched: dict[str, torch.Tensor], rows: int) -> list[dict[str, torch.Tensor]]:
    return [{name: value[row] for name, value in batched.items()} for row in range(rows)]
