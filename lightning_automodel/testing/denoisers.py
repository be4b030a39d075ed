"""Tiny diffusers transformer denoisers built from configs, their flow-matching batches, and the loss a user writes
for them: for the strategy's tests of diffusion transformers (see docs/diffusion.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

TEXT_TOKENS = 3
TEXT_DIM = 16


@dataclass(frozen=True)
class TinyDenoiser:
    """A family's tiny model, the shape of one sample's latents, the inputs beside them and how its timestep is
    scaled (Flux takes the flow's t in [0, 1], Wan t x 1000)."""

    build: Callable[[], nn.Module]
    latents: tuple[int, ...]
    conditions: Callable[[int, torch.Generator], dict[str, torch.Tensor]]  # batched, beside latents and timestep
    constants: Callable[[], dict[str, torch.Tensor]]  # unbatched (position ids)
    timestep_scale: float = 1.0


def _flux() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4),
    )


def _wan() -> nn.Module:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=TEXT_DIM,
        freq_dim=8,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
    )


def _text(rows: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, TEXT_TOKENS, TEXT_DIM, generator=generator)


FLUX_TOKENS = 6  # latent patches of a Flux sample, packed as a sequence
TINY_DENOISERS = {
    "flux": TinyDenoiser(
        _flux,
        latents=(FLUX_TOKENS, 4),
        conditions=lambda rows, g: {
            "encoder_hidden_states": _text(rows, g),
            "pooled_projections": torch.randn(rows, 8, generator=g),
        },
        constants=lambda: {"img_ids": torch.zeros(FLUX_TOKENS, 3), "txt_ids": torch.zeros(TEXT_TOKENS, 3)},
    ),
    "wan": TinyDenoiser(
        _wan,
        latents=(4, 2, 4, 4),  # channels, frames, height, width
        conditions=lambda rows, g: {"encoder_hidden_states": _text(rows, g)},
        constants=dict,
        timestep_scale=1000.0,
    ),
}


def tiny_denoiser(family: str, *, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TINY_DENOISERS[family].build()


def flow_matching_samples(family: str, *, rows: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``rows`` samples of rectified flow: clean latents x0 and noise mixed at a time t, x_t = (1 - t) x0 + t noise,
    whose velocity noise - x0 the model is to predict, with random text conditions."""
    spec, generator = TINY_DENOISERS[family], torch.Generator().manual_seed(seed)
    clean = torch.randn(rows, *spec.latents, generator=generator)
    noise = torch.randn(rows, *spec.latents, generator=generator)
    t = torch.rand(rows, generator=generator)
    mix = t.view(rows, *[1] * len(spec.latents))
    batched = {
        "hidden_states": (1 - mix) * clean + mix * noise,
        "timestep": t * spec.timestep_scale,
        "target": noise - clean,
        **spec.conditions(rows, generator),
    }
    return [{name: value[row] for name, value in batched.items()} for row in range(rows)]


def velocity_loss(model: nn.Module, batch: dict[str, torch.Tensor], family: str) -> torch.Tensor:
    """What a user writes: the mean squared error of the predicted velocity."""
    inputs = {name: value for name, value in batch.items() if name != "target"}
    predicted = model(**inputs, **TINY_DENOISERS[family].constants(), return_dict=False)[0]
    return F.mse_loss(predicted, batch["target"])
