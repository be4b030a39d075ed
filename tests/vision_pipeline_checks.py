"""Vision-language models under pipeline parallel against one process, inside gloo workers: the vision tower and
projector on the first stage only, each micro-batch with its own rows' images (two in a row, none in a row, none in a
whole micro-batch), then AdamW steps through a real Trainer."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from packed_image_checks import _text_alone
from test_vision_demo import DEMO, TowerAtStart, tower_parameters
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader
from transformers import AutoModelForImageTextToText
from vision_checks import VisionLM, _errors, _part

from lightning_automodel import AutoModelParallelStrategy, ParallelDims, parallelize
from lightning_automodel.data import cache
from lightning_automodel.data.vision.demo import VisionDemoDataModule
from lightning_automodel.hf.vision.image_inputs import image_token
from lightning_automodel.hf.vision.tiny import tiny_image_text_config
from lightning_automodel.lm import CausalLMModule
from lightning_automodel.parallel.mesh import data_mesh
from lightning_automodel.parallel.parallelized import Parallelized
from lightning_automodel.parallel.pipeline import PipelineOptions, pipeline_of
from lightning_automodel.planning.replica_comparison import ZERO_GRADIENT, fp64_copy, gradient_limits
from lightning_automodel.testing.coverage_report.kinds import image_rows, rows_part
from lightning_automodel.testing.parity import FP32_TOLERANCE, Outputs, full, gradient_errors
from lightning_automodel.testing.trainer_parity import GLOBAL_BATCH, compare_training, reference_run, trainer
from lightning_automodel.testing.vision.models import collate_images, image_records, tiny_vision_model


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


def _rounding_limits(build: Callable[..., torch.nn.Module], rows: dict[str, torch.Tensor]) -> dict[str, float]:
    """The gradients one fp32 process rounds beyond the tolerance (against fp64), with their limits."""
    runs = [_outputs(build(), rows), _outputs(fp64_copy(build()), rows)]
    exact = Outputs(runs[1].loss, runs[1].logits, {name: grad.float() for name, grad in runs[1].grads.items()})
    return gradient_limits(gradient_errors(runs[0], exact, floor=ZERO_GRADIENT))


def _vision_parameters(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters() if _part(name) != "language"]


def check_vision_pipeline(
    family: str,
    microbatches: int = 4,
    schedule: str = "1F1B",
    *,
    tp: int = 1,
    sp: bool = False,
    stages_per_rank: int = 1,
    dp_replicate: int = 1,
) -> dict[str, float]:
    """One training call at pp=2 (dp_shard takes the rest of the world; each dp rank a contiguous half of the rows)
    against one process over every rank's rows: the loss, this stage's every gradient (the tower's and projector's on
    the first), and the logits of an evaluation call (last stage). Every rank starts from other weights. With
    ``stages_per_rank`` > 1, a language model of one layer a stage; ``dp_replicate``: HSDP's replicas."""
    build = partial(tiny_vision_model, family, text_layers=max(2, 2 * stages_per_rank))
    mesh = ParallelDims(pp=2, tp=tp, dp_replicate=dp_replicate).resolve(dist.get_world_size()).build_mesh("cpu")
    model = build(seed=dist.get_rank())
    options = PipelineOptions(schedule, microbatches=microbatches, stages_per_rank=stages_per_rank)
    parallelized = parallelize(model, mesh, pipeline=options, sp=sp)
    pipeline = pipeline_of(model)
    expected_names = _vision_parameters(build()) if pipeline.first else []
    assert _vision_parameters(model) == expected_names, f"the tower's and projector's parameters held: {model}"
    records = image_records(family)
    dp = data_mesh(mesh)
    share = len(records) // dp.size()
    part = slice(dp.get_local_rank() * share, (dp.get_local_rank() + 1) * share)
    rows = collate_images(records)
    expected = _outputs(build(), rows)
    outputs = _pipelined_outputs(parallelized, collate_images(records[part]), dp=dp)
    if not pipeline.last:  # the logits exist on the last stage only
        outputs.logits = expected.logits[part]
    held = Outputs(expected.loss, expected.logits, {name: expected.grads[name] for name in outputs.grads})
    limits = {name: limit for name, limit in _rounding_limits(build, rows).items() if name in outputs.grads}
    errors = _errors(outputs, held, part, limits=limits)
    assert max(value for key, value in errors.items() if key != "rounding_limited") < FP32_TOLERANCE, errors
    return errors


def _pipelined_outputs(parallelized: Parallelized, rows: dict[str, torch.Tensor], *, dp: DeviceMesh) -> Outputs:
    """One training call of the pipelined model on this dp rank's ``rows`` (its loss averaged over the dp ranks, as
    one process's over the whole batch), this rank's gradients, and an evaluation call's logits (None but on the last
    stage)."""
    model = parallelized.model
    with loss_parallel():  # under tp: the vocabulary-sharded logits' cross-entropy, as the strategy runs it
        loss = _loss(model, rows)
        loss.backward()
    parallelized.after_backward()  # a tied embedding's two copies (Gemma 3) sum their gradients
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=dp.get_group())  # each dp rank's: dp x its share of the global token mean
    model.eval()
    with torch.no_grad():
        logits = model(**{name: value for name, value in rows.items() if name != "labels"}).logits
    model.train()
    assert (logits is not None) == pipeline_of(model).last
    grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    return Outputs(loss / dp.size(), logits, grads)


class PipelinedVisionLM(VisionLM):
    """What a user writes under pp: the model's own loss from labels (the last stage computes it)."""

    def training_step(self, batch, batch_idx):
        loss = _loss(self.model, batch)
        self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
        return loss


def check_vision_pipeline_training(family: str, microbatches: int = 4) -> dict[str, float]:
    """AdamW steps through a real Trainer at pp=2 (dp_shard takes the rest of the world) against one process: every
    step's loss and this stage's gradients, then its weights. Batches are made of per-row records with their own
    images (Lightning's sampler deals the rows to the dp ranks)."""
    module = PipelinedVisionLM(tiny_vision_model(family, seed=dist.get_rank()))
    strategy = AutoModelParallelStrategy(pp=2, pp_schedule="GPipe", pp_microbatches=microbatches)
    dp = dist.get_world_size() // 2
    records = image_records(family)
    assert len(records) == GLOBAL_BATCH
    fit = trainer(strategy, limit_val_batches=0)
    fit.fit(module, DataLoader(records, batch_size=GLOBAL_BATCH // dp, collate_fn=collate_images))
    rows = collate_images(records)
    reference = tiny_vision_model(family)
    steps = reference_run(reference, loss=_loss, data=(rows, None))
    limits = _rounding_limits(partial(tiny_vision_model, family), rows)
    return compare_training(module, reference, steps, stages=True, zero_gradient=ZERO_GRADIENT, rounding_limits=limits)


def check_vision_demo_pipeline(directory: str) -> dict[str, float]:
    """The demo's CausalLMModule and VisionDemoDataModule (a processor's batches, records under ``directory``) at
    pp=2 through the Trainer: each step's loss is the pipelined call's, and the first stage's vision tower moves
    (its images reached it through the micro-batches)."""
    cache.DEFAULT_ROOT = Path(directory) / "tokens"
    data = VisionDemoDataModule(num_records=32, val_records=8, batch_size=4, data_dir=Path(directory) / "records")
    module = CausalLMModule(config=yaml.safe_load(DEMO.read_text())["model"]["config"], learning_rate=3e-3)
    tower = TowerAtStart()
    fit = trainer(AutoModelParallelStrategy(pp=2, pp_microbatches=4), limit_val_batches=0, callbacks=[tower])
    fit.fit(module, data)
    moved = [name for name, p in tower_parameters(module) if not torch.equal(full(p), tower.weights[name])]
    assert pipeline_of(module.model).first == bool(tower.weights) and len(moved) == len(tower.weights), moved
    return {"train_loss": fit.callback_metrics["train_loss"].item(), "tower_weights_moved": float(len(moved))}


def check_packed_pipeline(model_type: str, microbatches: int = 2) -> dict[str, float]:
    """A tiny model of ``model_type`` whose image inputs are packed across the batch (MiniCPM-V's, Molmo2's) at
    pp=2 against one process: each micro-batch's first stage takes its rows' images re-packed, later stages the
    token types and positions of their rows (MiniCPM-V 4.7's canvas M-RoPE, found for the whole batch). At pp=2 x
    dp_shard=2 the second data-parallel rank's rows hold no image: its micro-batches run the tower on a stand-in in
    the model's layout while the first's run theirs (one process's loss: the mean of the two batches')."""
    build = partial(_packed_model, model_type)
    mesh = ParallelDims(pp=2).resolve(dist.get_world_size()).build_mesh("cpu")
    dp = data_mesh(mesh)
    model = build(seed=dist.get_rank())
    parallelized = parallelize(model, mesh, pipeline=PipelineOptions("1F1B", microbatches=microbatches))
    rows = image_rows(build())
    batches = [rows] if dp.size() == 1 else _imageless_second_half(rows, model=build())
    reference = build()
    loss = sum(_loss(reference, batch) for batch in batches) / len(batches)
    loss.backward()
    mine = batches[dp.get_local_rank()]
    outputs = _pipelined_outputs(parallelized, mine, dp=dp)
    with torch.no_grad():
        logits = reference(**{name: value for name, value in mine.items() if name != "labels"}, use_cache=False).logits
    if not pipeline_of(model).last:
        outputs.logits = logits
    grads = {name: full(reference.get_parameter(name).grad) for name in outputs.grads}
    limits = {name: limit for name, limit in _rounding_limits(build, rows).items() if name in outputs.grads}
    errors = _errors(outputs, Outputs(loss.detach(), logits, grads), slice(None), limits=limits)
    assert max(value for key, value in errors.items() if key != "rounding_limited") < FP32_TOLERANCE, errors
    return errors


def _imageless_second_half(rows: dict[str, torch.Tensor], *, model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    """The rows' first half with their images, the second as text alone."""
    text = _text_alone(rows_part(rows, slice(2, 4), model=model), placeholder=image_token(model.config))
    return [rows_part(rows, slice(0, 2), model=model), text]


def _packed_model(model_type: str, *, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(copy.deepcopy(tiny_image_text_config(model_type)))
