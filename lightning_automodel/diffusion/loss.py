"""One step's flow-matching loss of a denoiser on a batch of precomputed latents and text embeddings: each sample's
draws from its own generator, the noisy latents in the family's layout, the family's call, the weighted velocity
error. A pure function, so that a one-process reference computes exactly what the module does."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_automodel.diffusion.inputs import Family, pack_2x2
from lightning_automodel.diffusion.objective import FlowMatching, draw, noisy_and_target, weighted_mse


def denoising_loss(
    model: nn.Module,
    batch: dict[str, Tensor],
    *,
    family: Family,
    objective: FlowMatching,
    generators: list[torch.Generator],
    guidance: float,
) -> Tensor:
    """The mean over the batch's samples of each one's weighted mean squared velocity error."""
    latents = batch["latents"]
    noise, timesteps, sigmas = draw(objective, latents, generators)
    noisy, target = noisy_and_target(latents, noise, sigmas)
    if family.packs:
        noisy, target = pack_2x2(noisy), pack_2x2(target)
    prediction = model(
        hidden_states=noisy,
        timestep=timesteps / family.timestep_divisor,
        **family.conditions(model, noisy, batch, guidance),
        return_dict=False,
    )[0]
    return weighted_mse(prediction, target, sigmas, objective.loss_weighting)
