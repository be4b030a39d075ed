"""Checks run inside gloo workers for test_diffusion_module.py: DiffusionModule trained by the strategy over the
data-parallel ranks against one process: the losses, every step's gradients, the weights and their average."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, default_collate

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.diffusion import DiffusionModule
from lightning_automodel.diffusion.loss import denoising_loss
from lightning_automodel.diffusion.objective import sample_generators
from lightning_automodel.lm.optimization import adamw_with_schedule
from lightning_automodel.parallel.full_tensor import full_tensor
from lightning_automodel.testing.denoisers import latent_samples, tiny_denoiser
from lightning_automodel.testing.parity import LR, STEPS, WEIGHT_TOLERANCE, relative_error
from lightning_automodel.testing.trainer_parity import GLOBAL_BATCH, compare_training, trainer

EMA_DECAY = 0.5  # far from 1, so that a wrong average shows after 3 steps


class RecordedDiffusion(DiffusionModule):
    """DiffusionModule with each step's global loss and gradients kept, for the comparison."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        self.grads.append(
            {name: full_tensor(p.grad).clone() for name, p in self.model.named_parameters() if p.grad is not None}
        )


def one_process(family: str, samples: list[dict], **options) -> tuple[torch.nn.Module, tuple, dict]:
    """The same module's steps in one process over the whole batch, one epoch a step (each sample's draws keyed by
    (epoch, index)): losses, gradients, and the weights' average after the last step."""
    module = DiffusionModule(tiny_denoiser(family), **options)
    batch = default_collate(samples)
    params = [p for p in module.model.parameters() if p.requires_grad]
    hparams = module.hparams
    optimizer = adamw_with_schedule(
        params,
        learning_rate=LR,
        betas=tuple(hparams.betas),
        weight_decay=hparams.weight_decay,
        warmup_steps=0,
        schedule="constant",
        min_lr_ratio=1.0,
        total_steps=float("inf"),
    )["optimizer"]
    losses, grads = [], []
    for epoch in range(STEPS):
        keys = [(0, epoch, int(index)) for index in batch["index"]]
        generators = sample_generators(seed=hparams.seed, keys=keys, device=torch.device("cpu"))
        loss = denoising_loss(
            module.model,
            batch,
            family=module.family,
            objective=module.objective,
            generators=generators,
            guidance=hparams.guidance,
        )
        optimizer.zero_grad()
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in module.model.named_parameters() if p.grad is not None})
        optimizer.step()
        module.ema.update()
        losses.append(loss.item())
    return module.model, (losses, grads), dict(module.ema.named_buffers())


def check_diffusion_module_trains_at_parity(family: str, lora: dict | None = None) -> dict:
    """3 steps of Trainer.fit at dp_shard = the world (every rank starting from other weights: rank 0's must win)
    against one process: losses, gradients, weights, and the weights' average, each rank's shard of it. With
    ``lora``, the adapters only (their initial draws follow the model's seed)."""
    world = dist.get_world_size()
    options = dict(learning_rate=LR, ema_decay=EMA_DECAY, guidance=4.0, lora=lora)
    module = RecordedDiffusion(tiny_denoiser(family, seed=dist.get_rank()), **options)
    samples = latent_samples(family, rows=GLOBAL_BATCH)
    trainer(AutoModelParallelStrategy(dp_shard=world)).fit(
        module, DataLoader(samples, batch_size=GLOBAL_BATCH // world)
    )
    reference, steps, averages = one_process(family, samples, **options)
    result = compare_training(module, reference, steps)
    shards = dict(module.ema.named_buffers())
    assert shards.keys() == averages.keys()
    assert all(type(shard).__name__ == "DTensor" for shard in shards.values()), "the average is not sharded"
    result["ema"] = max(relative_error(full_tensor(shards[name]), averages[name]) for name in averages)
    assert result["ema"] < WEIGHT_TOLERANCE, result
    return result


def check_sharded_resume_continues_the_average() -> dict:
    """3 steps at dp_shard = the world, against 2, a sharded checkpoint, and 1 more in a new module from other weights:
    the same weights and the same average, shard by shard."""
    world = dist.get_world_size()
    directory = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory)
    path = Path(directory[0]) / "two_steps"

    def fit(steps: int, seed: int = 0, **kwargs) -> DiffusionModule:
        module = DiffusionModule(tiny_denoiser("wan", seed=seed), learning_rate=LR, ema_decay=EMA_DECAY)
        run = trainer(AutoModelParallelStrategy(dp_shard=world), max_steps=steps)
        run.fit(
            module, DataLoader(latent_samples("wan", rows=GLOBAL_BATCH), batch_size=GLOBAL_BATCH // world), **kwargs
        )
        if steps == 2:
            run.save_checkpoint(path)
        return module

    whole, _, resumed = fit(3), fit(2), fit(3, seed=5, ckpt_path=path)

    def largest_difference(expected: dict, actual: dict) -> float:
        return max(
            (full_tensor(actual[name]) - full_tensor(value)).abs().max().item() for name, value in expected.items()
        )

    result = {
        "resumed_average": largest_difference(dict(whole.ema.named_buffers()), dict(resumed.ema.named_buffers())),
        "resumed_weights": largest_difference(
            dict(whole.model.named_parameters()), dict(resumed.model.named_parameters())
        ),
    }
    assert result["resumed_average"] < 1e-6 and result["resumed_weights"] < 1e-6, result
    return result
