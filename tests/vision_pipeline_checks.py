"""Vision-language models under pipeline parallel against one process, inside gloo workers: the vision tower and
projector on the first stage only, each micro-batch with its own rows' images (two in a row, none in a row, none in a
whole micro-batch), then AdamW steps through a real Trainer."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from vision_checks import VisionLM, _errors, _part

from lightning_automodel import AutoModelParallelStrategy, ParallelDims, parallelize
from lightning_automodel.parallel.mesh import data_mesh
from lightning_automodel.parallel.pipeline import PipelineOptions, pipeline_of
from lightning_automodel.planning.replica_comparison import ZERO_GRADIENT, fp64_copy, gradient_limits
from lightning_automodel.testing.parity import FP32_TOLERANCE, Outputs, full, gradient_errors
from lightning_automodel.testing.trainer_parity import GLOBAL_BATCH, compare_training, reference_run, trainer
from lightning_automodel.testing.vision_models import collate_images, image_records, tiny_vision_model


def _loss(model: torch.nn.Module, rows: dict[str, torch.Tensor], _: object = None) -> torch.Tensor:
    """The model's own loss (Hugging Face's next-token cross-entropy, the pipeline's too)."""
    inputs = {name: value for name, value in rows.items() if name != "labels"}
    return model(**inputs, labels=rows["labels"], use_cache=False).loss


def _outputs(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> Outputs:
    loss = _loss(model, rows)
    loss.backward()
    with torch.no_grad():
        logits = model(**{name: value for name, value in rows.items() if name != "labels"}, use_cache=False).logits
    grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    return Outputs(loss.detach(), logits, grads)


def _rounding_limits(family: str, rows: dict[str, torch.Tensor]) -> dict[str, float]:
    """The gradients one fp32 process rounds beyond the tolerance (against fp64), with their limits."""
    model = tiny_vision_model(family)
    runs = [_outputs(tiny_vision_model(family), rows), _outputs(fp64_copy(model), rows)]
    exact = Outputs(runs[1].loss, runs[1].logits, {name: grad.float() for name, grad in runs[1].grads.items()})
    return gradient_limits(gradient_errors(runs[0], exact, floor=ZERO_GRADIENT))


def _assert_first_stage_holds_the_tower(model: torch.nn.Module, *, first: bool) -> None:
    """The tower's and projector's parameters on the first stage, every one of them; on no other."""
    held = [name for name, _ in model.named_parameters() if _part(name) != "language"]
    whole = [name for name, _ in tiny_vision_model_names(model) if _part(name) != "language"]
    assert held == (whole if first else []), f"first stage: {first}; vision parameters held: {held}"


def tiny_vision_model_names(model: torch.nn.Module) -> list[tuple[str, None]]:
    with torch.device("meta"):
        whole = type(model)(model.config)
    return [(name, None) for name, _ in whole.named_parameters()]


def check_vision_pipeline(family: str, microbatches: int = 4, schedule: str = "1F1B") -> dict[str, float]:
    """One training call at pp=2 (dp_shard takes the rest of the world; each dp rank a contiguous half of the rows)
    against one process over every rank's rows: the loss, this stage's every gradient (the tower's and projector's on
    the first), and the logits of an evaluation call (last stage). Every rank starts from other weights."""
    mesh = ParallelDims(pp=2).resolve(dist.get_world_size()).build_mesh("cpu")
    model = tiny_vision_model(family, seed=dist.get_rank())
    parallelized = parallelize(model, mesh, pipeline=PipelineOptions(schedule, microbatches=microbatches))
    pipeline = pipeline_of(model)
    _assert_first_stage_holds_the_tower(model, first=pipeline.first)
    records = image_records(family)
    dp = data_mesh(mesh)
    share = len(records) // dp.size()
    part = slice(dp.get_local_rank() * share, (dp.get_local_rank() + 1) * share)
    rows, mine = collate_images(records), collate_images(records[part])
    expected = _outputs(tiny_vision_model(family), rows)
    loss = _loss(model, mine)
    loss.backward()
    parallelized.after_backward()  # a tied embedding's two copies (Gemma 3) sum their gradients
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=dp.get_group())  # each dp rank's: dp x its share of the global token mean
    loss /= dp.size()
    model.eval()
    with torch.no_grad():
        logits = model(**{name: value for name, value in mine.items() if name != "labels"}).logits
    model.train()
    grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    assert (logits is not None) == pipeline.last
    outputs = Outputs(loss, logits if pipeline.last else expected.logits[part], grads)
    held = Outputs(expected.loss, expected.logits, {name: expected.grads[name] for name in grads})
    limits = {name: limit for name, limit in _rounding_limits(family, rows).items() if name in grads}
    errors = _errors(outputs, held, part, limits=limits)
    assert max(value for key, value in errors.items() if key != "rounding_limited") < FP32_TOLERANCE, errors
    return errors


def check_vision_pipeline_training(family: str, microbatches: int = 2) -> dict[str, float]:
    """AdamW steps through a real Trainer at pp=2 (dp_shard takes the rest of the world) against one process: every
    step's loss and this stage's gradients, then its weights. Batches are made of per-row records with their own
    images (Lightning's sampler deals the rows to the dp ranks)."""
    module = VisionLM(tiny_vision_model(family, seed=dist.get_rank()))
    module.training_step = lambda batch, batch_idx: _step(module, batch)
    strategy = AutoModelParallelStrategy(pp=2, pp_schedule="GPipe", pp_microbatches=microbatches)
    dp = dist.get_world_size() // 2
    records = image_records(family)
    assert len(records) == GLOBAL_BATCH
    fit = trainer(strategy, limit_val_batches=0)
    fit.fit(module, DataLoader(records, batch_size=GLOBAL_BATCH // dp, collate_fn=collate_images))
    rows = collate_images(records)
    reference = tiny_vision_model(family)
    steps = reference_run(reference, loss=_loss, data=(rows, None))
    limits = _rounding_limits(family, rows)
    return compare_training(module, reference, steps, stages=True, zero_gradient=ZERO_GRADIENT, rounding_limits=limits)


def _step(module: VisionLM, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    loss = _loss(module.model, batch)
    module.losses.append(module.trainer.strategy.reduce(loss.detach()).item())
    return loss
