"""Lightning's sharded checkpoints under the strategy (inside gloo workers): exact resume, resume into another
layout, and saves that fail midway."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning.pytorch.strategies.model_parallel as lightning_model_parallel
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.io.lightning_checkpoint import check_checkpoint
from lightning_automodel.testing.exports import assert_same_directory, save_pretrained_whole
from lightning_automodel.testing.models import batch, tiny_config, tiny_model, tiny_tokenizer
from lightning_automodel.testing.parity import FP32_TOLERANCE, full
from lightning_automodel.testing.trainer_parity import GLOBAL_BATCH, CausalLM, data, trainer

# Text-only batches leave Gemma3's vision tower without gradients: AdamW has no state for it when saving.
# Phi3's packed projections are strided shards, which torch's checkpoint refuses as they are.
FAMILIES = ("gemma3_vlm", "phi3")


def fit(module: CausalLM, tp: int, steps: int, ckpt_path: Path | None = None, ep: int = 1):
    run = trainer(AutoModelParallelStrategy(tp=tp, ep=ep), max_steps=steps)
    run.fit(module, data(dist.get_world_size() // tp), ckpt_path=ckpt_path)
    return run


def check_save_and_exact_resume(directory: str, tp: int, family: str, ep: int = 1) -> list[float]:
    """4 uninterrupted steps; 2 steps and a checkpoint; a second save to the same path failing midway, which must
    raise on every rank and leave the first checkpoint whole; 2 more steps resumed from it into a model built from
    another seed give the same losses and weights. Returns the uninterrupted losses (for cross-layout resumes)."""
    checkpoint = Path(directory) / "step-2.ckpt"
    whole = CausalLM(tiny_model(family))
    fit(whole, tp, 4, ep=ep)
    interrupted = CausalLM(tiny_model(family))
    run = fit(interrupted, tp, 2, ep=ep)
    run.save_checkpoint(checkpoint)
    saved = _contents(checkpoint)
    weights = {name: full(tensor).clone() for name, tensor in interrupted.model.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save(weights, Path(directory) / "weights-step-2.pt")
        tiny_config(family).save_pretrained(Path(directory) / "config")
        tiny_tokenizer().save_pretrained(Path(directory) / "config")

    real_save = lightning_model_parallel._distributed_checkpoint_save

    def save_then_fail(state, path):
        real_save(state, path)  # every shard is written, then the job dies before the save completes
        raise OSError("No space left on device")

    lightning_model_parallel._distributed_checkpoint_save = save_then_fail
    try:
        with pytest.raises(OSError, match="No space left"):
            run.save_checkpoint(checkpoint)
    finally:
        lightning_model_parallel._distributed_checkpoint_save = real_save
    assert _contents(checkpoint) == saved, "a failed save changed the previous checkpoint"
    assert not [p.name for p in checkpoint.parent.iterdir() if p.name.startswith(".")], "staging left behind"

    resumed = CausalLM(tiny_model(family, seed=5 + dist.get_rank()))
    fit(resumed, tp, 4, ckpt_path=checkpoint, ep=ep)
    _assert_continues(resumed, whole.losses, dict(whole.model.named_parameters()))
    return whole.losses


def check_resume_into_layout(directory: str, tp: int, family: str, expected_losses: list[float], ep: int = 1) -> dict:
    """Resume the checkpoint saved by :func:`check_save_and_exact_resume` into another layout: the remaining losses
    are those of the uninterrupted run."""
    resumed = CausalLM(tiny_model(family, seed=5 + dist.get_rank()))
    fit(resumed, tp, 4, ckpt_path=Path(directory) / "step-2.ckpt", ep=ep)
    return _assert_continues(resumed, expected_losses)


def check_save_then_resume_at_ep_sizes(directory: str, family: str, ep_sizes: tuple[int, ...]) -> dict:
    """:func:`check_save_and_exact_resume` at ep=2, then its checkpoint resumed at each of ``ep_sizes`` in the same
    launch (one launch fewer than saving and resuming apart), each rank held to rank 0's uninterrupted losses."""
    losses = [check_save_and_exact_resume(directory, 1, family, ep=2)]
    dist.broadcast_object_list(losses, src=0)
    return {ep: check_resume_into_layout(directory, 1, family, losses[0], ep=ep) for ep in ep_sizes}


def check_save_unsharded_resume_sharded(directory: str, family: str, expected_losses: list[float]) -> dict:
    """The other way round: saved at dp_shard=2 (Phi3's projections whole), resumed at tp=2 (packed)."""
    checkpoint = Path(directory) / "dp-step-2.ckpt"
    fit(CausalLM(tiny_model(family)), 1, 2).save_checkpoint(checkpoint)
    resumed = CausalLM(tiny_model(family, seed=5 + dist.get_rank()))
    fit(resumed, 2, 4, ckpt_path=checkpoint)
    return _assert_continues(resumed, expected_losses)


def _assert_continues(resumed: CausalLM, losses: list[float], weights: dict | None = None) -> dict:
    result = {"resumed_losses": max(abs(a - b) / b for a, b in zip(resumed.losses, losses[2:], strict=True))}
    assert len(resumed.losses) == 2 and result["resumed_losses"] < FP32_TOLERANCE, result
    if weights is not None:
        differences = [(full(p) - full(weights[name])).abs().max() for name, p in resumed.model.named_parameters()]
        result["resumed_weights"] = max(differences).item()
        assert result["resumed_weights"] < 1e-6, result
    return result


def _contents(directory: Path) -> dict[str, bytes] | None:
    if dist.get_rank() != 0:
        return None
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def assert_converted(directory: Path, family: str) -> dict:
    """Outside any process group, as users run it: `lightning-automodel export` turns the checkpoint into a
    directory that from_pretrained loads, with exactly the weights the model had when it was saved; shard by shard
    (40 kB shards), it writes the files, index and tensors save_pretrained writes for the model loaded whole."""
    output = directory / "hf"
    command = [sys.executable, "-m", "lightning_automodel.cli", "export", str(directory / "step-2.ckpt")]
    options = ["--config", str(directory / "config"), "--output", str(output), "--max_shard_size", "40000"]
    subprocess.run([*command, *options], check=True)
    assert (output / "tokenizer.json").is_file(), "the tokenizer beside the config must come along"
    auto_class = AutoModelForImageTextToText if family == "gemma3_vlm" else AutoModelForCausalLM
    loaded = auto_class.from_pretrained(output).state_dict()
    expected = torch.load(directory / "weights-step-2.pt")
    assert loaded.keys() == expected.keys(), loaded.keys() ^ expected.keys()
    errors = {name: (loaded[name] - tensor).abs().max().item() for name, tensor in expected.items()}
    assert max(errors.values()) == 0.0, errors
    with torch.device("meta"):
        whole = auto_class.from_config(AutoConfig.from_pretrained(directory / "config"))
    save_pretrained_whole(directory / "step-2.ckpt", whole, directory / "peer", max_shard_size=40_000)
    return {
        "tensors": len(errors),
        "max_error": max(errors.values()),
        **assert_same_directory(output, directory / "peer"),
    }


def check_data_position_restored(directory: str, tp: int) -> dict:
    """Interrupted mid-epoch, a run whose loader is stateful (torchdata's StatefulDataLoader) resumes at the
    next batch: its losses are the uninterrupted run's. With a plain DataLoader, Lightning restarts the epoch and
    the losses differ (shown, so the check can tell)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    tokens, labels = batch(4 * GLOBAL_BATCH)  # four different batches per epoch
    dataset = TensorDataset(tokens, labels)
    per_rank = GLOBAL_BATCH // (dist.get_world_size() // tp)

    def run(module: CausalLM, loader_class: type, **options) -> None:
        fit_run = trainer(AutoModelParallelStrategy(tp=tp), max_steps=4, **options.pop("trainer", {}))
        fit_run.fit(module, loader_class(dataset, batch_size=per_rank), **options)

    result = {}
    for loader_class in (StatefulDataLoader, DataLoader):
        # Saved by ModelCheckpoint during the run, as in real training (after fit, the loader's state is reset).
        saving = ModelCheckpoint(dirpath=Path(directory) / loader_class.__name__, every_n_train_steps=2, save_top_k=-1)
        whole = CausalLM(tiny_model())
        run(whole, loader_class, trainer=dict(callbacks=[saving], enable_checkpointing=True))
        resumed = CausalLM(tiny_model(seed=5))
        run(resumed, loader_class, ckpt_path=Path(saving.dirpath) / "epoch=0-step=2.ckpt")
        errors = [abs(a - b) / b for a, b in zip(resumed.losses, whole.losses[2:], strict=True)]
        result[loader_class.__name__] = max(errors)
    assert result["StatefulDataLoader"] < FP32_TOLERANCE and result["DataLoader"] > 100 * FP32_TOLERANCE, result
    return result


def check_resume_with_dropout_exactly(directory: str, tp: int) -> dict:
    """Attention dropout at 0.1 draws new masks every step on every rank. 6 uninterrupted steps, saved at step 2,
    against 4 steps resumed from it: the losses and weights are the uninterrupted run's, to the bit, because every
    rank's random states come back with the checkpoint (without them: about 5e-3 apart). Mid-epoch (epochs of 4
    batches, where the resumed run's new loader iterator must not shift the draws), at an epoch's end (epochs of
    1 batch, where the uninterrupted run too begins a new epoch, and draws its iterator's seed) and at the last
    batch of an epoch of 2 (which Lightning alone resumes into an empty epoch, one epoch ahead)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    tokens, labels = batch(4 * GLOBAL_BATCH)
    per_rank = GLOBAL_BATCH // (dist.get_world_size() // tp)
    half = 2 * GLOBAL_BATCH
    loaders = {
        "mid-epoch": StatefulDataLoader(TensorDataset(tokens, labels), batch_size=per_rank),
        "epoch end": data(dist.get_world_size() // tp),
        "last batch": StatefulDataLoader(TensorDataset(tokens[:half], labels[:half]), batch_size=per_rank),
    }
    result = {}
    for when, loader in loaders.items():
        saving = ModelCheckpoint(Path(directory) / f"dropout-{when}", every_n_train_steps=2, save_top_k=-1)
        whole = CausalLM(tiny_model(attention_dropout=0.1))
        options = dict(callbacks=[saving], enable_checkpointing=True)
        trainer(AutoModelParallelStrategy(tp=tp), max_steps=6, **options).fit(whole, loader)
        resumed = CausalLM(tiny_model(attention_dropout=0.1, seed=5 + dist.get_rank()))
        checkpoint = next(Path(saving.dirpath).glob("*step=2.ckpt"))
        trainer(AutoModelParallelStrategy(tp=tp), max_steps=6).fit(resumed, loader, ckpt_path=checkpoint)
        losses = [abs(a - b) for a, b in zip(resumed.losses, whole.losses[2:], strict=True)]
        pairs = zip(resumed.model.parameters(), whole.model.parameters(), strict=True)
        result[when] = {"losses": max(losses), "weights": max((full(p) - full(q)).abs().max().item() for p, q in pairs)}
    assert all(value == 0.0 for errors in result.values() for value in errors.values()), result
    return result


def check_asynchronous_saves_resume_exactly(directory: str, tp: int) -> dict:
    """``async_save=True``: a checkpoint every 2 of 6 steps, each written while training goes on, and the best one
    by loss (ModelCheckpoint removes the previous best once the new one is in place). Every one is complete once
    fit returns, and 2 steps resumed from the one of step 4 equal steps 5 and 6, losses and weights: each holds the
    weights of its step, not of a later one."""
    saving = ModelCheckpoint(Path(directory) / "async", every_n_train_steps=2, save_top_k=-1)
    best = ModelCheckpoint(Path(directory) / "async-best", every_n_train_steps=2, save_top_k=1, monitor="train_loss")
    whole = CausalLM(tiny_model())
    options = dict(callbacks=[saving, best], enable_checkpointing=True)
    run = trainer(AutoModelParallelStrategy(tp=tp, async_save=True), max_steps=6, **options)
    run.fit(whole, data(dist.get_world_size() // tp))
    saved = sorted(path.name for path in Path(saving.dirpath).iterdir())
    assert saved == [f"epoch={step - 1}-step={step}.ckpt" for step in (2, 4, 6)], saved
    for name in saved:
        check_checkpoint(Path(saving.dirpath) / name)
    kept = [path.name for path in Path(best.dirpath).iterdir()]
    assert kept == [Path(best.best_model_path).name], kept
    check_checkpoint(Path(best.best_model_path))
    resumed = CausalLM(tiny_model(seed=5 + dist.get_rank()))
    fit(resumed, tp, 6, ckpt_path=Path(saving.dirpath) / "epoch=3-step=4.ckpt")
    return _assert_continues(resumed, whole.losses[2:], dict(whole.model.named_parameters()))  # steps 5 and 6
