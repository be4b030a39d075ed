"""Checks run inside gloo workers for test_diffusion.py: an unmodified diffusers transformer in a LightningModule a
user writes, trained by the strategy over the data-parallel ranks against one process."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, default_collate

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.hf.decoder_layers import named_decoder_layers
from lightning_automodel.testing.denoisers import flow_matching_samples, tiny_denoiser, velocity_loss
from lightning_automodel.testing.trainer_parity import (
    GLOBAL_BATCH,
    CausalLM,
    compare_training,
    reference_run,
    trainer,
)


class Denoising(CausalLM):
    """What a user writes: a diffusers transformer and the velocity's mean squared error; no parallel code."""

    def __init__(self, model, family: str) -> None:
        super().__init__(model)
        self.family = family

    def training_step(self, batch, batch_idx):
        loss = velocity_loss(self.model, batch, self.family)
        self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
        return loss


def check_denoiser_trains_at_parity(family: str, activation_checkpointing: bool = False) -> dict:
    """3 AdamW steps through Trainer.fit over dp_shard = the world: every block an FSDP2 unit of its own, the losses,
    every step's gradients and the weights those of one process (every rank starts from other weights: rank 0's
    must win)."""
    world = dist.get_world_size()
    strategy = AutoModelParallelStrategy(dp_shard=world, activation_checkpointing=activation_checkpointing)
    module = Denoising(tiny_denoiser(family, seed=dist.get_rank()), family)
    samples = flow_matching_samples(family, rows=GLOBAL_BATCH)
    trainer(strategy).fit(module, DataLoader(samples, batch_size=GLOBAL_BATCH // world))
    blocks = named_decoder_layers(module.model)
    assert len(blocks) >= 2 and all(isinstance(block, FSDPModule) for _, block in blocks), blocks
    reference = tiny_denoiser(family)
    steps = reference_run(
        reference,
        loss=lambda model, batch, _: velocity_loss(model, batch, family),
        data=(default_collate(samples), None),
    )
    return compare_training(module, reference, steps)
