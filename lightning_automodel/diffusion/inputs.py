"""How each denoiser family is called on a batch of precomputed latents and text embeddings, and what it trains with
by default. A small registry keyed by the model's class name (FSDP2's subclass found through the class's bases)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_automodel.data.latents.keys import LATENTS, POOLED_TEXT_EMBEDDINGS, REQUIRED, TEXT_MASK
from lightning_automodel.diffusion.objective import LossWeighting, TimestepDensity

Conditions = Callable[[nn.Module, Tensor, dict[str, Tensor], float], dict[str, Tensor]]


@dataclass(frozen=True)
class Family:
    """A denoiser family: the layout of its latents, the inputs it takes beside them, the scale of the timestep it
    reads (the scheduler's timestep in [0, 1000) divided by ``timestep_divisor``) and the objective it trains with
    by default."""

    latent_dims: int  # of one sample
    needs_pooled: bool
    conditions: Conditions  # (model, latents in the model's layout, batch, guidance) -> keyword inputs
    shift: float
    density: TimestepDensity = "uniform"
    loss_weighting: LossWeighting = "none"
    timestep_divisor: float = 1.0
    packs: bool = False  # Flux: latents packed into 2x2-patch tokens, the target too
    masks_text: bool = False  # Wan: padded text positions zeroed, as its pipeline zeroes them


def pack_2x2(latents: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C), as diffusers' FluxPipeline packs latents for its transformer."""
    from diffusers import FluxPipeline

    rows, channels, height, width = latents.shape
    return FluxPipeline._pack_latents(latents, rows, channels, height, width)


def _flux_conditions(model: nn.Module, latents: Tensor, batch: dict[str, Tensor], guidance: float) -> dict[str, Any]:
    from diffusers import FluxPipeline

    height, width = batch["latents"].shape[-2:]
    text = batch["text_embeddings"]
    inputs = {
        "encoder_hidden_states": text,
        "pooled_projections": batch["pooled_text_embeddings"],
        "img_ids": FluxPipeline._prepare_latent_image_ids(1, height // 2, width // 2, latents.device, latents.dtype),
        "txt_ids": torch.zeros(text.shape[1], 3, device=text.device, dtype=text.dtype),
    }
    if model.config.guidance_embeds:  # guidance-distilled (FLUX.1-dev): the guidance scale it is to follow
        inputs["guidance"] = torch.full((latents.shape[0],), guidance, device=latents.device, dtype=torch.float32)
    return inputs


def _sd3_conditions(model: nn.Module, latents: Tensor, batch: dict[str, Tensor], guidance: float) -> dict[str, Any]:
    return {"encoder_hidden_states": batch["text_embeddings"], "pooled_projections": batch["pooled_text_embeddings"]}


def _wan_conditions(model: nn.Module, latents: Tensor, batch: dict[str, Tensor], guidance: float) -> dict[str, Any]:
    text = batch["text_embeddings"]
    if "text_mask" in batch:
        text = text * batch["text_mask"].unsqueeze(-1).to(text.dtype)
    return {"encoder_hidden_states": text}


# Defaults: SD3's scheduler config has shift 3.0 and its dreambooth script samples timesteps logit-normal; FLUX.1's
# scheduler shifts by resolution at inference (use_dynamic_shifting), so its training table is unshifted (1.0) and
# the flux dreambooth script samples uniformly; Wan 2.1's scheduler uses flow_shift 3.0 (480p; 5.0 for 720p).
FAMILIES: dict[str, Family] = {
    "FluxTransformer2DModel": Family(
        latent_dims=3, needs_pooled=True, conditions=_flux_conditions, shift=1.0, timestep_divisor=1000.0, packs=True
    ),
    "SD3Transformer2DModel": Family(
        latent_dims=3, needs_pooled=True, conditions=_sd3_conditions, shift=3.0, density="logit_normal"
    ),
    "WanTransformer3DModel": Family(
        latent_dims=4, needs_pooled=False, conditions=_wan_conditions, shift=3.0, masks_text=True
    ),
}


def family_of(model: nn.Module) -> Family:
    """The model's family, by its class or a base's name; a clear error for any other."""
    for cls in type(model).__mro__:
        if cls.__name__ in FAMILIES:
            return FAMILIES[cls.__name__]
    raise ValueError(
        f"DiffusionModule does not know how to call {type(model).__name__}: it trains {', '.join(sorted(FAMILIES))}."
        " Write a LightningModule of your own for it (the strategy still parallelizes it, see docs/diffusion.md)."
    )


def check_batch(family: Family, batch: dict[str, Tensor], model_name: str) -> None:
    """Refuse a batch the family cannot read, on every rank before the step's first collective."""
    missing = [key for key in REQUIRED if key not in batch]
    if family.needs_pooled and POOLED_TEXT_EMBEDDINGS not in batch:
        missing.append(POOLED_TEXT_EMBEDDINGS)
    if missing:
        raise ValueError(f"{model_name} trains on batches with {missing}: the batch has {sorted(batch)}.")
    shape = tuple(batch[LATENTS].shape)
    if len(shape) != 1 + family.latent_dims:
        layout = "(B, C, F, H, W)" if family.latent_dims == 4 else "(B, C, H, W)"
        raise ValueError(f"{model_name} takes latents {layout}; the batch's latents are {shape}.")
    if family.packs and (shape[-1] % 2 or shape[-2] % 2):
        raise ValueError(f"{model_name} packs 2x2 latent patches: height and width {shape[-2:]} must be even.")
    if TEXT_MASK in batch and not family.masks_text:
        raise ValueError(
            f"{model_name} attends every text position, padded ones too, as its pipeline gives them: drop"
            " text_mask from the batch (the embeddings are to be the pipeline's encode_prompt output)."
        )
