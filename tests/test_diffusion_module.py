"""DiffusionModule (docs/diffusion.md): the rectified-flow objective against a hand computation, each family's call,
the training step's loss by hand, LoRA's frozen base, the weights' average, and a Trainer fit over two
data-parallel ranks at parity with one process."""

import math
from functools import partial

import lightning as L
import pytest
import torch
from diffusion_module_checks import check_diffusion_module_trains_at_parity, check_sharded_resume_continues_the_average
from torch.utils.data import DataLoader, default_collate

from lightning_automodel.diffusion import DiffusionModule
from lightning_automodel.diffusion.ema import WeightAverage
from lightning_automodel.diffusion.inputs import pack_2x2
from lightning_automodel.diffusion.objective import (
    FlowMatching,
    draw,
    noisy_and_target,
    weighted_mse,
)
from lightning_automodel.testing.denoisers import latent_samples, tiny_denoiser
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.parity import FP32_TOLERANCE


def _generators(count: int, seed: int = 7) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + row) for row in range(count)]


@pytest.mark.parametrize("density", ["uniform", "logit_normal", "mode"])
def test_draws_are_the_shifted_scheduler_table_by_hand(density):
    """Each sample's noise then density value from its own generator; the timestep index floor(1000 u); the
    scheduler's timestep 1000 - index, sigma = shift s / (1 + (shift - 1) s) of s = timestep / 1000."""
    latents = torch.randn(3, 2, 4, 4)
    objective = FlowMatching(shift=3.0, density=density, logit_mean=0.2, logit_std=1.1, mode_scale=1.29)
    noise, timesteps, sigmas = draw(objective, latents, _generators(3))
    for row, generator in enumerate(_generators(3)):
        assert torch.equal(noise[row], torch.randn(2, 4, 4, generator=generator))
        if density == "logit_normal":
            u = torch.sigmoid(torch.normal(0.2, 1.1, size=(1,), generator=generator)).item()
        else:
            u = torch.rand(1, generator=generator).item()
            if density == "mode":
                u = 1 - u - 1.29 * (math.cos(math.pi * u / 2) ** 2 - 1 + u)
        s = (1000 - int(u * 1000)) / 1000
        assert sigmas[row].item() == pytest.approx(3 * s / (1 + 2 * s), rel=1e-6)
        assert timesteps[row].item() == pytest.approx(1000 * sigmas[row].item(), rel=1e-6)


def test_noisy_input_target_and_weighting_by_hand():
    latents, noise = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    sigmas = torch.tensor([0.25, 0.8])
    noisy, target = noisy_and_target(latents, noise, sigmas)
    assert torch.allclose(noisy[1], 0.2 * latents[1] + 0.8 * noise[1])
    assert torch.equal(target, noise - latents)
    prediction = torch.randn(2, 3, 4)
    errors = (prediction - target).pow(2).mean(dim=(1, 2))
    weights = {
        "none": torch.ones(2),
        "sigma_sqrt": sigmas**-2,
        "cosmap": 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2)),
    }
    for weighting, weight in weights.items():
        expected = (weight * errors).mean()
        assert torch.allclose(weighted_mse(prediction, target, sigmas, weighting), expected), weighting
    with pytest.raises(ValueError, match="density='beta' is not one of"):
        DiffusionModule(torch.nn.Linear(2, 2), density="beta")


@pytest.mark.parametrize(
    ("family", "guidance_embeds"), [("flux", True), ("flux", False), ("sd3", False), ("wan", False)]
)
def test_each_family_trains_from_its_batch(family, guidance_embeds):
    """Forward and backward from the batch format: every parameter gets a gradient (Flux's guidance embedder too,
    where the config has one)."""
    module = DiffusionModule(tiny_denoiser(family, guidance_embeds=guidance_embeds))
    batch = default_collate(latent_samples(family, rows=2))
    if family == "wan":
        batch["text_mask"] = torch.tensor([[True, True, False], [True, False, False]])
    module._loss(batch, 0).backward()
    missing = [name for name, p in module.model.named_parameters() if p.grad is None]
    assert not missing, missing


def test_flux_packs_2x2_patches():
    latents = torch.arange(2 * 3 * 4 * 6.0).view(2, 3, 4, 6)
    packed = pack_2x2(latents)
    assert packed.shape == (2, 6, 12)
    # token (1, 2) of the 2 x 3 grid: rows 2-3, columns 4-5; channel-major, then the patch's row and column
    assert torch.equal(packed[1, 5].view(3, 2, 2), latents[1, :, 2:4, 4:6])


def test_training_step_loss_is_the_hand_computed_one():
    """SD3 (shift 3, logit-normal): each sample's draws keyed by (seed, train, epoch, index), the model called as its
    pipeline calls it, the per-sample mean squared velocity error averaged."""
    model = tiny_denoiser("sd3")
    module = DiffusionModule(model, seed=5, loss_weighting="cosmap")
    batch = default_collate(latent_samples("sd3", rows=3))
    batch["index"] = torch.tensor([4, 9, 2])
    loss = module._loss(batch, 0)
    total = 0.0
    for row, index in enumerate([4, 9, 2]):
        generator = torch.Generator().manual_seed(hash((5, 0, 0, index)) & 0x7FFF_FFFF_FFFF_FFFF)
        x0 = batch["latents"][row : row + 1]
        noise = torch.randn(x0.shape[1:], generator=generator)
        u = torch.sigmoid(torch.normal(0.0, 1.0, size=(1,), generator=generator)).item()
        s = (1000 - int(u * 1000)) / 1000
        sigma = 3 * s / (1 + 2 * s)
        with torch.no_grad():
            prediction = model(
                hidden_states=(1 - sigma) * x0 + sigma * noise,
                timestep=torch.tensor([1000 * sigma]),
                encoder_hidden_states=batch["text_embeddings"][row : row + 1],
                pooled_projections=batch["pooled_text_embeddings"][row : row + 1],
                return_dict=False,
            )[0]
        weight = 2 / (math.pi * (1 - 2 * sigma + 2 * sigma**2))
        total += weight * (prediction - (noise - x0)).pow(2).mean().item()
    assert loss.item() == pytest.approx(total / 3, rel=1e-5)


def test_a_model_directory_is_loaded_at_configure_model(tmp_path):
    """``model=`` a local diffusers directory: the class its config names, with its weights, built once (Lightning
    calls configure_model at every stage)."""
    saved = tiny_denoiser("wan", seed=5)
    saved.save_pretrained(tmp_path)
    module = DiffusionModule(str(tmp_path))
    assert module.model is None
    module.configure_model()
    loaded = module.model
    assert type(loaded) is type(saved)
    assert all(
        torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), saved.state_dict().values(), strict=True)
    )
    module.configure_model()
    assert module.model is loaded


def test_what_the_module_cannot_train_is_refused():
    with pytest.raises(ValueError, match=r"call Linear: it trains FluxTransformer2DModel, SD3Transformer2DModel"):
        DiffusionModule(torch.nn.Linear(2, 2))
    module = DiffusionModule(tiny_denoiser("flux"))
    batch = default_collate(latent_samples("flux", rows=2))
    with pytest.raises(ValueError, match="attends every text position.*drop text_mask"):
        module._loss(batch | {"text_mask": torch.ones(2, 3, dtype=torch.bool)}, 0)
    del batch["pooled_text_embeddings"]
    with pytest.raises(ValueError, match=r"with \['pooled_text_embeddings'\]"):
        module._loss(batch, 0)


def test_lora_trains_the_attention_adapters_only():
    module = DiffusionModule(tiny_denoiser("wan"), lora={"r": 4})
    trainable = [name for name, p in module.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable), trainable
    adapted = {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in trainable}
    assert adapted == {"to_q", "to_k", "to_v", "0"}, adapted  # to_out.0
    module._loss(default_collate(latent_samples("wan", rows=2)), 0).backward()
    assert all(p.grad is None for name, p in module.model.named_parameters() if "lora_" not in name)
    assert any(p.grad.abs().sum() > 0 for name, p in module.model.named_parameters() if "lora_B" in name)


def test_weight_average_update_and_swap():
    model = torch.nn.Linear(3, 2)
    average = WeightAverage(model, decay=0.9)
    before = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    average.update()
    assert torch.allclose(average.weight, 0.9 * before + 0.1 * model.weight)
    trained = model.weight.detach().clone()
    with average.swapped_in():
        assert torch.equal(model.weight, average.weight)
    assert torch.equal(model.weight, trained)
    with pytest.raises(ValueError, match="ema_decay=1.0 must lie in"):
        WeightAverage(model, decay=1.0)


def _fit(module: DiffusionModule, steps: int, **kwargs) -> L.Trainer:
    fit = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    fit.fit(module, DataLoader(latent_samples("wan", rows=4), batch_size=2), **kwargs)
    return fit


def test_a_resumed_fit_continues_the_same_average(tmp_path):
    """3 steps, against 2, a checkpoint, and 1 more in a new module from other weights: the same average."""
    whole = DiffusionModule(tiny_denoiser("wan"), ema_decay=0.5)
    _fit(whole, 3)
    first = DiffusionModule(tiny_denoiser("wan"), ema_decay=0.5)
    _fit(first, 2).save_checkpoint(tmp_path / "two.ckpt")
    resumed = DiffusionModule(tiny_denoiser("wan", seed=3), ema_decay=0.5)
    _fit(resumed, 3, ckpt_path=tmp_path / "two.ckpt")
    for name, value in whole.ema.named_buffers():
        assert torch.allclose(value, resumed.ema.get_buffer(name), rtol=1e-5, atol=1e-7), name
    assert not torch.allclose(whole.ema.blocks__0__ffn__net__2__weight, first.ema.blocks__0__ffn__net__2__weight)


def test_diffusion_module_trains_over_two_ranks_as_one_process():
    """Flux (guidance 4.0), Wan, and Wan's LoRA adapters at dp_shard=2: every sample draws the same noise and
    timestep on whichever rank holds it, so the losses, gradients, weights and their average are one process's."""
    checks = [partial(check_diffusion_module_trains_at_parity, family) for family in ("flux", "wan")]
    checks.append(partial(check_diffusion_module_trains_at_parity, "wan", lora={"r": 4, "lora_alpha": 8}))
    checks.append(check_sharded_resume_continues_the_average)
    for name, ranks in run_checks(2, checks, timeout=600).items():
        for rank in ranks:
            assert "resumed_average" in rank or rank["first_grads"] < FP32_TOLERANCE, (name, rank)
        print(name, ranks[0])
