"""Vision-language models' weights in and out (inside gloo workers): a pretrained directory read shard by shard,
and Lightning checkpoints resumed exactly, with a frozen tower and into another layout."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.utils.data import DataLoader, StackDataset
from transformers import AutoModelForImageTextToText
from vision_checks import VisionLM

from lightning_automodel import AutoModelParallelStrategy, from_pretrained, parallelize
from lightning_automodel.hf.freezing import freeze
from lightning_automodel.hf.loading import materialize_pretrained
from lightning_automodel.testing.harness import shared_directory
from lightning_automodel.testing.parity import FP32_TOLERANCE, dims_for, full
from lightning_automodel.testing.trainer_parity import GLOBAL_BATCH, compare_training, reference_run, trainer
from lightning_automodel.testing.vision.models import tiny_vision_model, vision_batch, vision_loss_and_logits


def saved_vision_model(family: str) -> Path:
    """A directory save_pretrained wrote, of a model no rank builds by itself (seed 3)."""
    directory = shared_directory()
    if dist.get_rank() == 0:
        tiny_vision_model(family, seed=3).save_pretrained(directory)
    dist.barrier()
    return directory


def check_vision_pretrained_weights(family: str, tp: int, sp: bool) -> dict[str, float]:
    """Each rank reads its shards of the directory: every weight, the tower's and projector's included, equals
    transformers' own load of it."""
    directory = saved_vision_model(family)
    reference = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).state_dict()
    model = from_pretrained(directory, model_class=AutoModelForImageTextToText, dtype=torch.float32)
    parallelize(model, dims_for(dist.get_world_size(), tp).build_mesh("cpu"), sp=sp)
    materialize_pretrained(model, torch.device("cpu"))
    state = model.state_dict()
    assert set(state) == set(reference), set(state) ^ set(reference)
    result = {"weights": max((full(t) - reference[n]).abs().max().item() for n, t in state.items())}
    assert result["weights"] == 0.0, result
    return result


class PretrainedVisionLM(VisionLM):
    """What a user writes: from_pretrained in configure_model."""

    def __init__(self, directory: Path) -> None:
        super().__init__(model=torch.nn.Identity())
        self.directory = directory

    def configure_model(self) -> None:
        if isinstance(self.model, torch.nn.Identity):
            self.model = from_pretrained(self.directory, model_class=AutoModelForImageTextToText, dtype=torch.float32)


def check_vision_pretrained_trainer(family: str, tp: int, frozen: tuple[str, ...] = ()) -> dict[str, float]:
    """Trainer.fit from a pretrained directory with images, ``frozen`` by the strategy's ``freeze=``: AdamW steps in
    parity with transformers' own load frozen by hand."""
    directory = saved_vision_model(family)
    module = PretrainedVisionLM(directory)
    rows = vision_batch(family, GLOBAL_BATCH)
    dp = dist.get_world_size() // tp
    trainer(AutoModelParallelStrategy(tp=tp, sp=tp > 1, freeze=list(frozen))).fit(module, _loader(rows, dp))
    reference = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32)
    freeze(reference, *frozen)
    loss = lambda model, rows, _: vision_loss_and_logits(model, rows)[0]  # noqa: E731
    return compare_training(module, reference, reference_run(reference, loss=loss, data=(rows, None)))


def check_vision_exact_resume(
    family: str, tp: int, resume_tp: int, frozen: tuple[str, ...] = (), trainable_only: bool = False
) -> dict[str, float]:
    """4 uninterrupted steps against 2 steps, a checkpoint at the epoch's last batch, and 2 more resumed from it
    (into a model of other weights, at tp=``resume_tp``): the same losses, and at the same layout the same weights.
    ``frozen`` (the strategy's ``freeze=``) get no optimizer state, saved or restored. ``trainable_only``
    (``save_trainable_only=True``): the checkpoint holds none of the frozen weights, which the resumed run takes
    from the model as built (seed 0 again, as a pretrained directory would give them)."""
    directory = shared_directory()
    checkpoint = directory / "step-2.ckpt"
    rows = vision_batch(family, 2 * GLOBAL_BATCH)  # two steps an epoch
    options = dict(freeze=list(frozen), save_trainable_only=trainable_only)
    whole = VisionLM(tiny_vision_model(family))
    _fit(whole, rows, tp=tp, steps=4, **options)
    _fit(VisionLM(tiny_vision_model(family)), rows, tp=tp, steps=2, **options).save_checkpoint(checkpoint)
    resumed = VisionLM(tiny_vision_model(family, seed=0 if trainable_only else 5 + dist.get_rank()))
    run = _fit(resumed, rows, tp=resume_tp, steps=4, ckpt_path=checkpoint, **options)
    result = {"losses": max(abs(a - b) / b for a, b in zip(resumed.losses, whole.losses[2:], strict=True))}
    assert len(resumed.losses) == 2 and result["losses"] < FP32_TOLERANCE, (resumed.losses, whole.losses)
    if resume_tp == tp:
        expected = dict(whole.model.named_parameters())
        differences = [(full(p) - full(expected[n])).abs().max().item() for n, p in resumed.model.named_parameters()]
        result["weights"] = max(differences)
        assert result["weights"] < 1e-6, result
    frozen_names = {name for name, p in resumed.model.named_parameters() if not p.requires_grad}
    assert bool(frozen_names) == bool(frozen), "freeze= set nothing"
    held = {id(p) for p in run.optimizers[0].state}
    assert not [n for n, p in resumed.model.named_parameters() if n in frozen_names and id(p) in held]
    saved = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    saved_frozen = [name for name in frozen_names if f"state_dict.model.{name}" in saved]
    expected_saved = 0 if trainable_only else len(frozen_names)
    assert len(saved_frozen) == expected_saved, f"frozen weights saved: {len(saved_frozen)} of {len(frozen_names)}"
    return result


def _fit(module: VisionLM, rows: dict[str, torch.Tensor], *, tp: int, steps: int, ckpt_path=None, **options):
    run = trainer(AutoModelParallelStrategy(tp=tp, sp=tp > 1, **options), max_steps=steps)
    run.fit(module, _loader(rows, dist.get_world_size() // tp), ckpt_path=ckpt_path)
    return run


def _loader(rows: dict[str, torch.Tensor], dp: int) -> DataLoader:
    """The rows in order, GLOBAL_BATCH a step: Lightning's sampler deals each step's rows to the dp ranks."""
    return DataLoader(StackDataset(**rows), batch_size=GLOBAL_BATCH // dp)
