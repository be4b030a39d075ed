"""A real Lightning Trainer against one process, inside gloo workers: the LightningModules a user writes (no parallel
code), the trainer and data the checks fit them with, the single-process run they are held to, and the comparison:
every step's loss and gradients, then the weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.parallel.experts.expert_parallel import experts_modules
from lightning_automodel.testing.models import batch, tiny_model
from lightning_automodel.testing.parity import (
    FP32_TOLERANCE,
    LR,
    STEPS,
    TRAINED_GRAD_TOLERANCE,
    TRAINED_LOSS_TOLERANCE,
    WEIGHT_TOLERANCE,
    full,
    loss_of,
    relative_error,
    weight_error,
)

GLOBAL_BATCH = 8


class CausalLM(L.LightningModule):
    """What a user writes: a Hugging Face model and a plain cross-entropy; no parallel code."""

    def __init__(
        self, model: torch.nn.Module | None = None, optimizer: type = torch.optim.AdamW, lr: float = LR
    ) -> None:
        super().__init__()
        self.model = model if model is not None else tiny_model()
        self.optimizer = optimizer
        self.lr = lr
        self.losses: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, optimizer) -> None:
        # Copies: a gradient replicated on every mesh dim hands back its own storage, which clipping then scales.
        self.grads.append(
            {name: full(p.grad).clone() for name, p in self.model.named_parameters() if p.grad is not None}
        )

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        loss, _ = loss_of(self.model, tokens, labels)
        self.log("train_loss", loss, sync_dist=True)
        self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = F.cross_entropy(self.model(tokens).logits.flatten(0, 1), labels.flatten())
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_loss_unsynced", loss)  # Lightning's default: no reduction, stored as given

    def configure_optimizers(self):
        return self.optimizer(self.parameters(), lr=self.lr)


def trainer(strategy: AutoModelParallelStrategy, **kwargs) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return L.Trainer(strategy=strategy, **options)


def data(dp: int) -> DataLoader:
    """Each step sees the whole global batch: Lightning's DistributedSampler deals it to the dp ranks."""
    tokens, labels = batch(GLOBAL_BATCH)
    return DataLoader(TensorDataset(tokens, labels), batch_size=GLOBAL_BATCH // dp)


class HFLossCausalLM(CausalLM):
    """What a user writes under pp or cp: the Hugging Face model's own loss, from labels."""

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
    """One process's: the Hugging Face loss, without the cache (which would make transformers attend across packed
    documents)."""
    return model(input_ids=tokens, labels=labels, use_cache=False).loss


def fit_against_one_process(
    strategy: AutoModelParallelStrategy,
    family: str,
    config: dict,
    *,
    dp: int,
    loss: Callable = hf_loss,
    stages: bool = False,
    callbacks: Sequence[L.Callback] = (),
) -> tuple[HFLossCausalLM, dict]:
    """3 AdamW steps of :class:`HFLossCausalLM` through Trainer.fit at ``dp`` data-parallel ranks match one process
    (see :func:`compare_training`), and validate's loss too. Every rank starts from other weights: rank 0's must
    win."""
    module = HFLossCausalLM(tiny_model(family, seed=dist.get_rank(), **config))
    fit = trainer(strategy, limit_val_batches=1, callbacks=list(callbacks))
    fit.fit(module, data(dp), data(dp))
    reference = tiny_model(family, **config)
    result = compare_training(module, reference, reference_run(reference, loss=loss), stages=stages)
    tokens, labels = batch(GLOBAL_BATCH)
    with torch.no_grad():
        expected = loss(reference, tokens, labels).item()
    result["validation_loss"] = abs(fit.callback_metrics["val_loss"].item() - expected) / expected
    assert result["validation_loss"] < FP32_TOLERANCE, result
    return module, result


def reference_run(
    model: torch.nn.Module,
    *,
    optimizers: Callable[[torch.nn.Module], list[torch.optim.Optimizer]] | None = None,
    clip: float | None = None,
    loss: Callable | None = None,
    data: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Losses and (unclipped) gradients of each single-process step over the whole batch (default: AdamW, the
    cross-entropy of ``parity.loss_of``, ``batch(GLOBAL_BATCH)``)."""
    tokens, labels = data if data is not None else batch(GLOBAL_BATCH)
    steppers = optimizers(model) if optimizers else [torch.optim.AdamW(model.parameters(), lr=LR)]
    loss = loss or (lambda model, tokens, labels: loss_of(model, tokens, labels)[0])
    losses, grads = [], []
    for _ in range(STEPS):
        value = loss(model, tokens, labels)
        for optimizer in steppers:
            optimizer.zero_grad()
        value.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for optimizer in steppers:
            optimizer.step()
        losses.append(value.item())
    return losses, grads


def compare_training(
    module: CausalLM,
    reference: torch.nn.Module,
    reference_steps: tuple[list, list],
    *,
    stages: bool = False,
    zero_gradient: float = 0.0,
    rounding_limits: dict[str, float] | None = None,
) -> dict:
    """Per-step losses and gradients, then the weights after the last step.

    AdamW all but ignores a gradient's scale, so a gradient off by a constant factor would pass the weight
    comparison: the gradients Lightning hands the optimizer are compared too, at every step. With ``stages``
    (pipeline parallel) each rank compares the parameters its stage holds, and the stages together must hold every
    one of the reference's (a tied embedding's copy on two stages). ``zero_gradient``: the share of a step's largest
    gradient below which a gradient is zero up to rounding (a key bias's before a softmax, CLIP's);
    ``rounding_limits``: the first step's limits of the gradients that round more than the tolerance allows for in
    one process (see ``replica_comparison.gradient_limits``), counted apart.
    """
    reference_losses, reference_grads = reference_steps
    names = set(module.grads[0])
    assert all(grads.keys() == names for grads in module.grads), "the gradients' names changed between steps"
    held = [names]
    if stages:
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, names)
    expected = set(reference_grads[0])
    assert set().union(*held) == expected, f"gradients held for {set().union(*held) ^ expected} are wrong"
    steps = zip(module.grads, reference_grads, strict=True)
    errors_by_name = [
        {name: relative_error(grads[name], ref[name], floor=_zero_floor(ref, zero_gradient) or 1e-12) for name in names}
        for grads, ref in steps
    ]
    limits = {name: limit for name, limit in (rounding_limits or {}).items() if name in names}
    beyond = {name: errors_by_name[0].pop(name) for name in limits if errors_by_name[0][name] >= limits[name]}
    assert not beyond, f"first gradients beyond the single process's own rounding: {beyond} (limits {limits})"
    for name in limits:
        errors_by_name[0].pop(name, None)
    grad_errors = [max(errors.values()) for errors in errors_by_name]
    errors = [abs(a - b) / abs(b) for a, b in zip(module.losses, reference_losses, strict=True)]
    weights = weight_error(module.model, reference)
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


def _zero_floor(grads: dict[str, torch.Tensor], share: float) -> float:
    return share * max(grad.abs().max().item() for grad in grads.values())


def assert_experts_distributed(model: torch.nn.Module, *, ep: int) -> None:
    """At ep > 1 every experts module holds 1/ep of its experts on this rank (before FSDP's own split)."""
    if ep == 1:
        return
    found = [module for _, module in experts_modules(model)]
    assert found, "no experts module"
    for module in found:
        for param in module.parameters(recurse=False):
            assert "ep" in param.device_mesh.mesh_dim_names, param.device_mesh
            ep_dim = param.device_mesh.mesh_dim_names.index("ep")
            assert param.placements[ep_dim] == Shard(0), param.placements


PARITY_KEYS = ("first_loss", "first_grads", "later_grads", "weights_after_3_steps", "validation_loss")


def parity_row(family: str, layout: str, ranks: list[dict]) -> str:
    """A sweep's table row of :func:`fit_against_one_process`'s errors, the worst rank's of each."""
    first_loss, first_grads, later_grads, weights, validation = (
        f"{max(rank[key] for rank in ranks):.1e}" for key in PARITY_KEYS
    )
    return f"| {family} | {layout} | {first_loss} | {first_grads} / {later_grads} | {weights} | {validation} |"
