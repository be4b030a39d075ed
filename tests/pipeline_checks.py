"""Pipeline-parallel checks inside gloo workers: a real Trainer against one process, and the refusals."""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning_checks import GLOBAL_BATCH, CausalLM, data, reference_run, trainer
from models import batch, tiny_model
from parity import (
    FP32_TOLERANCE,
    STEPS,
    TRAINED_GRAD_TOLERANCE,
    TRAINED_LOSS_TOLERANCE,
    WEIGHT_TOLERANCE,
    full,
    relative_error,
)

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.parallel.pipeline import pipeline_of

LAYERS = 4  # two per stage at pp=2, one per stage at pp=4


class HFLossCausalLM(CausalLM):
    """What a user writes under pp: the Hugging Face model's own loss, from labels."""

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = self.model(input_ids=tokens, labels=labels).loss
        self.log("train_loss", loss, sync_dist=True)
        self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, labels = batch
        self.log("val_loss", self.model(input_ids=tokens, labels=labels).loss, sync_dist=True)


def hf_loss(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=labels).loss


def compare_stage_training(module: CausalLM, reference: torch.nn.Module, reference_steps: tuple[list, list]) -> dict:
    """Every step's loss (each rank has the whole model's), then this stage's gradients at every step and weights
    after the last; the stages together hold every parameter of the reference, each exactly once but a tied
    embedding's copy."""
    reference_losses, reference_grads = reference_steps
    names = set(module.grads[0])
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, sorted(names))
    union = set().union(*map(set, held))
    assert union == set(reference_grads[0]), f"the stages hold {union ^ set(reference_grads[0])} wrong"
    grad_errors = [
        max(relative_error(grads[n], ref[n]) for n in names) for grads, ref in zip(module.grads, reference_grads)
    ]
    errors = [abs(a - b) / abs(b) for a, b in zip(module.losses, reference_losses, strict=True)]
    reference_params = dict(reference.named_parameters())
    weights = max((full(p) - reference_params[n]).abs().max().item() for n, p in module.model.named_parameters())
    result = {
        "first_loss": errors[0],
        "later_losses": max(errors[1:]),
        "first_grads": grad_errors[0],
        "later_grads": max(grad_errors[1:]),
        "weights_after_3_steps": weights,
    }
    assert errors[0] < FP32_TOLERANCE and max(errors[1:]) < TRAINED_LOSS_TOLERANCE, result
    assert grad_errors[0] < FP32_TOLERANCE and max(grad_errors[1:]) < TRAINED_GRAD_TOLERANCE, result
    assert weights < WEIGHT_TOLERANCE, result
    return result


def check_pipeline_trainer_parity(
    pp: int,
    schedule: str,
    family: str = "llama",
    *,
    microbatches: int | None = None,
    dp_replicate: int = 1,
    activation_checkpointing: bool = False,
) -> dict:
    """3 AdamW steps through Trainer.fit at pp stages (dp_shard takes the rest) match one process; validate's loss
    too. The weights every rank starts from differ: rank 0's must win."""
    strategy = AutoModelParallelStrategy(
        pp=pp,
        pp_schedule=schedule,
        pp_microbatches=microbatches,
        dp_replicate=dp_replicate,
        activation_checkpointing=activation_checkpointing,
    )
    module = HFLossCausalLM(tiny_model(family, seed=dist.get_rank(), num_hidden_layers=LAYERS))
    dp = dist.get_world_size() // pp
    fit = trainer(strategy, limit_val_batches=1)
    fit.fit(module, data(dp), data(dp))
    pipeline = pipeline_of(module.model)
    assert pipeline is not None and pipeline.pp == pp
    reference = tiny_model(family, num_hidden_layers=LAYERS)
    result = compare_stage_training(module, reference, reference_run(reference, loss=hf_loss))
    tokens, labels = batch(GLOBAL_BATCH)
    with torch.no_grad():
        expected = hf_loss(reference, tokens, labels).item()
    result["validation_loss"] = abs(fit.callback_metrics["val_loss"].item() - expected) / expected
    assert result["validation_loss"] < FP32_TOLERANCE, result
    return result


def check_loss_from_logits_is_refused(pp: int) -> str:
    """A training_step computing its loss from the logits stops at its first step, naming the way that works."""
    module = CausalLM(tiny_model(num_hidden_layers=LAYERS))
    try:
        trainer(AutoModelParallelStrategy(pp=pp)).fit(module, data(dist.get_world_size() // pp))
    except ValueError as error:
        assert "self.model(input_ids=..., labels=...).loss" in str(error), error
        return str(error).split(":")[0]
    raise AssertionError("a loss computed from the logits under pp was not refused")


def check_pipeline_refusals(pp: int) -> list[str]:
    """Bad input is refused on every rank, before any collective, naming the fix."""
    refused = []
    cases = [
        (dict(pp=pp, pp_schedule="Bogus"), "Bogus"),
        (dict(pp=pp, pp_schedule="Interleaved1F1B"), "virtual stages"),
        (dict(pp=pp, pp_microbatches=pp - 1), "at least as many"),
        (dict(pp=pp, pp_layers_per_stage=[1] * (pp + 1)), "one per stage"),
    ]
    for options, expected in cases:
        try:
            AutoModelParallelStrategy(**options)
        except ValueError as error:
            assert expected in str(error), error
            refused.append(str(error))
        else:
            raise AssertionError(f"{options} was not refused")
    fits = [
        (AutoModelParallelStrategy(pp=pp), tiny_model(num_hidden_layers=pp - 1), "fewer than the pp"),
        (AutoModelParallelStrategy(pp=pp, tp=2), tiny_model(num_hidden_layers=LAYERS), "set tp=1"),
        (AutoModelParallelStrategy(pp=pp, pp_microbatches=3), tiny_model(num_hidden_layers=LAYERS), "divide"),
    ]
    for options in (dict(accumulate_grad_batches=2), dict(gradient_clip_val=1.0)):
        fits.append(
            (AutoModelParallelStrategy(pp=pp), tiny_model(num_hidden_layers=LAYERS), "not available yet", options)
        )
    for strategy, model, expected, *options in fits:
        try:
            trainer(strategy, **(options[0] if options else {})).fit(
                HFLossCausalLM(model), data(dist.get_world_size() // pp)
            )
        except ValueError as error:
            assert expected in str(error), error
            refused.append(str(error))
        else:
            raise AssertionError(f"{expected!r} was not refused")
    return [message[:60] for message in refused]
