"""DiffusionModule: a ready LightningModule that trains a diffusers transformer denoiser (Flux, SD3, Wan) with the
rectified-flow objective on precomputed latents and text embeddings, with optional LoRA.

Under ``AutoModelParallelStrategy`` the denoiser is sharded over dp_shard / dp_replicate (docs/diffusion.md); each
sample's noise and timestep are drawn from a generator seeded by its index in the data set, so a run over any
number of data-parallel ranks trains as one process would."""

from __future__ import annotations

from typing import Any

import lightning as L
from torch import Tensor, nn

from lightning_automodel.diffusion.ema import WeightAverage
from lightning_automodel.diffusion.inputs import Family, check_batch, family_of
from lightning_automodel.diffusion.loss import denoising_loss
from lightning_automodel.diffusion.objective import FlowMatching, LossWeighting, TimestepDensity, sample_generators
from lightning_automodel.lm.optimization import Schedule, adamw_of_hparams
from lightning_automodel.planning.memory.optimizer_step import AdamWImplementation, check_adamw

DEFAULT_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


class DiffusionModule(L.LightningModule):
    """Train a diffusers transformer denoiser to predict the flow's velocity noise - x0 at x_t = (1 - sigma) x0 +
    sigma noise.

    Batches are dicts: ``latents`` (the VAE's, scaled as the pipeline scales them: Wan (B, C, F, H, W), Flux and
    SD3 (B, C, H, W), which Flux packs into 2x2-patch tokens itself), ``text_embeddings`` (B, T, D),
    ``pooled_text_embeddings`` (B, P) for Flux and SD3, optionally ``text_mask`` (B, T) (Wan: padded positions
    zeroed, as its pipeline does) and ``index`` (B,): each sample's index in the data set, which seeds its draws
    (without it, a sample's draws depend on the rank and step that hold it, and a parallel run is not one process's).

    Args:
        model: the denoiser, built (on the CPU), or a local diffusers model directory (its ``config.json`` names the
            class), loaded whole.
        lora: ``peft.LoraConfig`` arguments; ``target_modules`` defaults to the attention projections ``to_q, to_k,
            to_v, to_out.0``. The base weights are frozen, only the adapters train.
        shift, density, loss_weighting: the objective (:class:`~lightning_automodel.diffusion.objective.FlowMatching`);
            None: the family's (SD3: shift 3.0, logit-normal; Flux: 1.0, uniform; Wan: 3.0, uniform; weighting
            "none" for all). Flux's resolution-dependent shift is not applied: a fixed ``shift`` is.
        logit_mean, logit_std, mode_scale: the "logit_normal" and "mode" densities' parameters.
        guidance: the guidance scale a guidance-distilled Flux (``guidance_embeds``) is given, FLUX.1-dev's 3.5.
        seed: of every sample's draws.
        ema_decay: keep an exponential moving average of the trainable weights with this decay (0.9999 is usual
            for a long run), updated after every optimizer step on each rank's shards and saved in checkpoints;
            ``ema.swapped_in()`` puts it in the model for a block. None: no average.
        learning_rate, weight_decay, betas, warmup_steps, schedule, min_lr_ratio, adamw: as CausalLMModule's.
    """

    def __init__(
        self,
        model: nn.Module | str,
        lora: dict[str, Any] | None = None,
        shift: float | None = None,
        density: TimestepDensity | None = None,
        loss_weighting: LossWeighting | None = None,
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        mode_scale: float = 1.29,
        guidance: float = 3.5,
        seed: int = 0,
        ema_decay: float | None = None,
        learning_rate: float = 1e-4,
        weight_decay: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        schedule: Schedule = "constant",
        min_lr_ratio: float = 0.1,
        adamw: AdamWImplementation = "foreach",
    ) -> None:
        super().__init__()
        check_adamw(adamw)
        if schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"schedule={schedule!r} is not one of 'cosine', 'linear', 'constant'.")
        FlowMatching(  # the objective's choices refused now, not at the first step
            shift=shift if shift is not None else 1.0,
            density=density or "uniform",
            loss_weighting=loss_weighting or "none",
        )
        self.save_hyperparameters(ignore=["model"] if isinstance(model, nn.Module) else None)
        self.model: nn.Module | None = model if isinstance(model, nn.Module) else None
        self._path = model if isinstance(model, str) else None
        self.ema: WeightAverage | None = None
        self._averaged_step = 0
        if self.model is not None:
            self._take(self.model)

    def configure_model(self) -> None:
        if self.model is None:  # Lightning calls this at every stage: the trained model stays
            from diffusers import AutoModel

            self._take(AutoModel.from_pretrained(self._path))

    def _take(self, model: nn.Module) -> None:
        """The model, its adapters, and its average made now so that a single-file checkpoint loads into it."""
        self.model = self._with_lora(model)
        if self.hparams.ema_decay is not None:
            self.ema = WeightAverage(self.model, self.hparams.ema_decay)

    def on_fit_start(self) -> None:
        """After the strategy sharded the model, before a sharded checkpoint is loaded: the average sharded alike."""
        if self.ema is not None:
            self.ema.match_layout()
        self._averaged_step = self.global_step

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Average after each optimizer step (not after a batch whose gradients were only accumulated)."""
        if self.ema is not None and self.global_step > self._averaged_step:
            self.ema.update()
            self._averaged_step = self.global_step

    def _with_lora(self, model: nn.Module) -> nn.Module:
        """The denoiser with the objective's family checked now, and LoRA adapters injected in place (the class
        stays the diffusers one, which the strategy and the family registry know)."""
        family_of(model)
        if self.hparams.lora is None:
            return model
        from peft import LoraConfig

        model.requires_grad_(False)
        model.add_adapter(LoraConfig(**{"target_modules": DEFAULT_LORA_TARGETS, **self.hparams.lora}))
        return model

    @property
    def family(self) -> Family:
        """How the model is called, and its default objective."""
        return family_of(self.model)

    @property
    def objective(self) -> FlowMatching:
        """The hyperparameters' objective, the family's defaults where they are None."""
        hparams, family = self.hparams, self.family
        return FlowMatching(
            shift=hparams.shift if hparams.shift is not None else family.shift,
            density=hparams.density or family.density,
            loss_weighting=hparams.loss_weighting or family.loss_weighting,
            logit_mean=hparams.logit_mean,
            logit_std=hparams.logit_std,
            mode_scale=hparams.mode_scale,
        )

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch, batch_idx)
        self.log("train_loss", loss.detach(), sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch, batch_idx), sync_dist=True, prog_bar=True)

    def _loss(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        family = self.family
        check_batch(family, batch, type(self.model).__name__)
        generators = sample_generators(
            seed=self.hparams.seed, keys=self._sample_keys(batch, batch_idx), device=batch["latents"].device
        )
        options = dict(family=family, objective=self.objective, generators=generators, guidance=self.hparams.guidance)
        return denoising_loss(self.model, batch, **options)

    def _sample_keys(self, batch: dict[str, Tensor], batch_idx: int) -> list[tuple[int, ...]]:
        """(stage, epoch, index) where the batch has each sample's index; else (stage, step, batch, rank, row)."""
        stage = 0 if self.training else 1
        rows = batch["latents"].shape[0]
        if "index" in batch:
            return [(stage, self.current_epoch, int(index)) for index in batch["index"].tolist()]
        return [(stage, self.global_step, batch_idx, self.global_rank, row) for row in range(rows)]

    def configure_optimizers(self) -> dict[str, Any]:
        return adamw_of_hparams(self, self.hparams, total_steps=self.trainer.estimated_stepping_batches)

    @property
    def adamw(self) -> AdamWImplementation:
        """How AdamW steps, which the strategy plans the optimizer step's memory by."""
        return self.hparams.adamw
