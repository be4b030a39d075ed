"""Lightning training features under tp x dp, inside gloo workers: token-normalised loss over uneven batches,
param groups, several optimizers, evaluation without fit, and refused precision flags."""

from __future__ import annotations

from unittest import TestCase

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from lightning_automodel import AutoModelParallelStrategy, causal_lm_loss
from lightning_automodel.testing.models import SEQ, batch, tiny_model
from lightning_automodel.testing.parity import FP32_TOLERANCE, LR, STEPS, TRAINED_LOSS_TOLERANCE, relative_error
from lightning_automodel.testing.trainer_parity import (
    GLOBAL_BATCH,
    CausalLM,
    compare_training,
    data,
    reference_run,
    trainer,
)


def uneven_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and Hugging Face style labels (aligned with the ids, -100 on padding). Even-numbered sequences
    are mostly padding, odd ones barely, so data-parallel ranks (dealt sequences round-robin) hold very
    different numbers of tokens."""
    tokens, _ = batch(GLOBAL_BATCH)
    for row in range(GLOBAL_BATCH):
        tokens[row, SEQ - (12 if row % 2 == 0 else 1) :] = 0
    return tokens, tokens.masked_fill(tokens == 0, -100)


class TokenMeanCausalLM(CausalLM):
    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        logits = self.model(tokens, attention_mask=(tokens != 0).long()).logits
        loss = causal_lm_loss(logits, labels, self.device_mesh)
        self.log("train_loss", loss, sync_dist=True)
        self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
        return loss


def hf_loss(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Transformers' own causal-LM loss over the whole batch: the mean over its non-ignored tokens."""
    return model(tokens, attention_mask=(tokens != 0).long(), labels=labels).loss


def check_token_normalised_loss(tp: int) -> dict:
    """Ranks with few tokens and ranks with many give the single-process loss, gradients and weights, and the
    loss logged with sync_dist is the global one. A mean of per-rank means (the naive loss) is measurably off."""
    tokens, labels = uneven_batch()
    dp = dist.get_world_size() // tp
    module = TokenMeanCausalLM(tiny_model())
    fit = trainer(AutoModelParallelStrategy(tp=tp))
    fit.fit(module, DataLoader(TensorDataset(tokens, labels), batch_size=GLOBAL_BATCH // dp))
    reference = tiny_model()
    result = compare_training(module, reference, reference_run(reference, loss=hf_loss, data=(tokens, labels)))
    result["logged_loss"] = abs(fit.callback_metrics["train_loss"].item() - module.losses[-1]) / module.losses[-1]
    assert result["logged_loss"] < TRAINED_LOSS_TOLERANCE, result
    with torch.no_grad():
        naive = sum(hf_loss(tiny_model(), tokens[r::dp], labels[r::dp]) for r in range(dp)) / dp
        result["naive_per_rank_mean_error"] = abs(naive.item() - module.losses[0]) / module.losses[0]
    # The naive loss would fail the first-step comparison (FP32_TOLERANCE) by far: the test can tell them apart.
    assert dp == 1 or result["naive_per_rank_mean_error"] > 10 * FP32_TOLERANCE, result
    return result


def param_groups(model: torch.nn.Module) -> list[dict]:
    """The usual split: weight decay on matrices, none on norms and biases, which also learn at half the rate."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0, "lr": LR / 2}]


class ParamGroupsCausalLM(CausalLM):
    def configure_optimizers(self):
        return torch.optim.AdamW(param_groups(self.model), lr=LR)


def check_param_groups(tp: int) -> dict:
    module = ParamGroupsCausalLM(tiny_model())
    trainer(AutoModelParallelStrategy(tp=tp)).fit(module, data(dist.get_world_size() // tp))
    reference = tiny_model()
    steps = reference_run(reference, optimizers=lambda m: [torch.optim.AdamW(param_groups(m), lr=LR)])
    return compare_training(module, reference, steps)


def two_optimizers(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """AdamW for the decoder layers, SGD for the rest (embeddings, final norm, lm_head)."""
    layers = [p for name, p in model.named_parameters() if ".layers." in name]
    rest = [p for name, p in model.named_parameters() if ".layers." not in name]
    return [torch.optim.AdamW(layers, lr=LR), torch.optim.SGD(rest, lr=1.0)]


class TwoOptimizersCausalLM(CausalLM):
    """Manual optimization stepping two optimizers on one backward."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.automatic_optimization = False

    def on_before_optimizer_step(self, optimizer) -> None:
        if len(self.grads) < len(self.losses):  # once per step, not once per optimizer
            super().on_before_optimizer_step(optimizer)

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = F.cross_entropy(
            self.model(tokens, attention_mask=(tokens != 0).long()).logits.flatten(0, 1), labels.flatten()
        )
        self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
        optimizers = self.optimizers()
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()

    def configure_optimizers(self):
        return two_optimizers(self.model)


def check_two_optimizers(tp: int) -> dict:
    module = TwoOptimizersCausalLM(tiny_model())
    # Lightning counts a step per optimizer step: two per training step here.
    trainer(AutoModelParallelStrategy(tp=tp), max_steps=2 * STEPS).fit(module, data(dist.get_world_size() // tp))
    reference = tiny_model()
    return compare_training(module, reference, reference_run(reference, optimizers=two_optimizers))


class EvaluatedCausalLM(CausalLM):
    def test_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = F.cross_entropy(self.model(tokens).logits.flatten(0, 1), labels.flatten())
        self.log("test_loss", loss, sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0]).logits


def check_evaluation_without_fit(tp: int) -> dict:
    """validate, test and predict on a fresh module (ranks seeded differently: rank 0's weights must win) give the
    single-process values; each is its own stage, with its own setup of the strategy."""
    tokens, labels = batch(GLOBAL_BATCH)
    reference = tiny_model()
    with torch.no_grad():
        expected_loss = F.cross_entropy(reference(tokens).logits.flatten(0, 1), labels.flatten()).item()
        expected_logits = reference(tokens).logits
    result = {}
    for stage in ("validate", "test", "predict"):
        module = EvaluatedCausalLM(tiny_model(seed=dist.get_rank()))
        run = getattr(trainer(AutoModelParallelStrategy(tp=tp)), stage)
        if stage == "predict":
            logits = torch.cat(run(module, DataLoader(TensorDataset(tokens), batch_size=GLOBAL_BATCH)))
            result["predict_logits"] = relative_error(logits, expected_logits)
        else:
            metrics = run(module, data(dist.get_world_size() // tp), verbose=False)[0]
            loss = metrics["val_loss" if stage == "validate" else "test_loss"]
            result[f"{stage}_loss"] = abs(loss - expected_loss) / expected_loss
    assert max(result.values()) < FP32_TOLERANCE, result
    return result


def check_refused_precision() -> str:
    """fp16 mixed precision (here passed as a plugin, which Lightning does not vet for model-parallel strategies)
    is refused on every rank with the flag to use instead, before any collective."""
    plugin = MixedPrecision("16-mixed", "cpu")
    with TestCase().assertRaisesRegex(ValueError, "bf16-mixed") as error:
        trainer(AutoModelParallelStrategy(), plugins=[plugin]).fit(CausalLM(), data(dist.get_world_size()))
    return str(error.exception)
