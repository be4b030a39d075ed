"""The rectified-flow (flow-matching) objective as diffusers' train_dreambooth_lora_{sd3,flux} scripts train it: a
density over the training timesteps (``compute_density_for_timestep_sampling``), the shifted sigma of the drawn
timestep read from ``FlowMatchEulerDiscreteScheduler``'s own table, x_t = (1 - sigma) x0 + sigma noise, the velocity
target noise - x0, and a per-sample loss weight (``compute_loss_weighting_for_sd3``).

Each sample's noise and timestep come from a generator of its own, seeded by (seed, epoch, the sample's index in the
data set): what a sample draws does not depend on which data-parallel rank holds it, nor on the batch size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

TimestepDensity = Literal["uniform", "logit_normal", "mode"]
LossWeighting = Literal["none", "sigma_sqrt", "cosmap"]


@dataclass(frozen=True)
class FlowMatching:
    """How timesteps are drawn and losses weighted.

    shift: the scheduler's static shift, sigma' = shift sigma / (1 + (shift - 1) sigma) (more noise for shift > 1).
    density: where on [0, 1] the timesteps fall ("logit_normal": sigmoid of N(logit_mean, logit_std); "mode": with
        ``mode_scale``; "uniform"). loss_weighting: "none", "sigma_sqrt" (sigma^-2) or "cosmap".
    """

    shift: float
    density: TimestepDensity = "uniform"
    loss_weighting: LossWeighting = "none"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    num_train_timesteps: int = 1000

    def __post_init__(self) -> None:
        if self.density not in ("uniform", "logit_normal", "mode"):
            raise ValueError(f"density={self.density!r} is not one of 'uniform', 'logit_normal', 'mode'.")
        if self.loss_weighting not in ("none", "sigma_sqrt", "cosmap"):
            raise ValueError(f"loss_weighting={self.loss_weighting!r} is not one of 'none', 'sigma_sqrt', 'cosmap'.")
        if self.shift <= 0:
            raise ValueError(f"shift={self.shift} must be positive (1.0: no shift).")


def sample_generators(*, seed: int, keys: list[tuple[int, ...]], device: torch.device) -> list[torch.Generator]:
    """One generator a sample, seeded by (seed, *its key): a tuple of ints hashes the same in every process."""
    return [torch.Generator(device).manual_seed(hash((seed, *key)) & 0x7FFF_FFFF_FFFF_FFFF) for key in keys]


def draw(objective: FlowMatching, latents: Tensor, generators: list[torch.Generator]) -> tuple[Tensor, Tensor, Tensor]:
    """Each sample's noise (like its latents), scheduler timestep (in [0, num_train_timesteps)) and sigma: the
    timestep's density value u picks the scheduler's training timestep at index floor(u * num_train_timesteps), whose
    shifted sigma the scheduler holds."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling

    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=objective.num_train_timesteps, shift=objective.shift
    )
    density = dict(logit_mean=objective.logit_mean, logit_std=objective.logit_std, mode_scale=objective.mode_scale)
    noise, u = [], []
    for sample, generator in zip(latents, generators, strict=True):
        noise.append(torch.randn(sample.shape, generator=generator, device=latents.device, dtype=sample.dtype))
        u.append(
            compute_density_for_timestep_sampling(
                objective.density, 1, device=latents.device, generator=generator, **density
            )
        )
    indices = (torch.cat(u).cpu() * objective.num_train_timesteps).long().clamp(0, objective.num_train_timesteps - 1)
    timesteps, sigmas = scheduler.timesteps[indices], scheduler.sigmas[indices]
    return torch.stack(noise), timesteps.to(latents.device), sigmas.to(latents.device)


def noisy_and_target(latents: Tensor, noise: Tensor, sigmas: Tensor) -> tuple[Tensor, Tensor]:
    """x_t = (1 - sigma) x0 + sigma noise, and the velocity dx_t/dsigma = noise - x0 the model predicts."""
    sigma = sigmas.view(-1, *[1] * (latents.dim() - 1)).to(latents.dtype)
    return (1 - sigma) * latents + sigma * noise, noise - latents


def weighted_mse(prediction: Tensor, target: Tensor, sigmas: Tensor, weighting: LossWeighting) -> Tensor:
    """The mean over samples of each sample's weighted mean squared error, in float32."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    weights = compute_loss_weighting_for_sd3(weighting, sigmas.float())
    squared = (prediction.float() - target.float()).pow(2).flatten(1).mean(dim=1)
    return (weights * squared).mean()
