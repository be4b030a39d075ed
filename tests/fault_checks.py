"""Faults of checkpoints and losses inside gloo workers (see lightning_automodel.testing.harness): a disk that fills up
during a save, a resume from a damaged, foreign or missing checkpoint, a resume after a job killed in the middle of a
save, and NaN losses under Lightning's own options."""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoint_checks import _assert_continues, _contents, fit
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch.distributed.checkpoint.filesystem import FileSystem

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.testing.models import tiny_model
from lightning_automodel.testing.parity import full
from lightning_automodel.testing.trainer_parity import CausalLM, data, trainer

TP = 2


class _FullDisk:
    """A file on a disk that fills up: ``room`` bytes go through and the next write fails with ENOSPC; with ``room``
    None, writes fit in the buffer and its flush at close() fails."""

    def __init__(self, stream, path: Path, room: int | None) -> None:
        self._stream, self._path, self._room = stream, path, room

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self._room is not None and len(view) > self._room:
            self._stream.write(view[: self._room])
            self._fail()
        self._room = None if self._room is None else self._room - len(view)
        return self._stream.write(view)

    def close(self) -> None:
        self._stream.close()
        if self._room is None:
            self._fail()

    def _fail(self) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self._path))

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextmanager
def disk_full(*, ranks: tuple[int, ...], room: int | None):
    """On ``ranks``, the files torch's distributed checkpoint writes meet a full disk (see ``_FullDisk``)."""
    real = FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            yield _FullDisk(stream, Path(path), room) if "w" in mode else stream

    if dist.get_rank() in ranks:
        FileSystem.create_stream = create_stream
    try:
        yield
    finally:
        FileSystem.create_stream = real


def check_full_disk(directory: str, ranks: tuple[int, ...], room: int | None) -> str:
    """The disk fills up on ``ranks`` during a second save to the same path: inside torch.save, which hides the OS
    error (``room`` bytes into a shard, past its few non-tensor bytes), or at the flush of a shard (``room`` None).
    Every rank raises an OSError
    that names the checkpoint, the ranks that failed and the error; the first save stays byte for byte, and
    nothing is left beside it."""
    path = Path(directory) / f"full-on-{len(ranks)}.ckpt"
    run = fit(CausalLM(tiny_model()), TP, 1)
    run.save_checkpoint(path)
    saved = _contents(path)
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    reason = "No space left on device" if room is None else "torch.save's report of a write that failed"
    with disk_full(ranks=ranks, room=room), pytest.raises(OSError) as error:
        run.save_checkpoint(path)
    message = str(error.value)
    assert message.startswith(f"Could not save the checkpoint {path}: {who} failed to write"), message
    assert reason in message, message
    assert _contents(path) == saved, "a failed save changed the previous checkpoint"
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}")] == [], "staging left"
    return message


def check_asynchronous_save_failure(directory: str) -> str:
    """``async_save=True``: the disk fills up on rank 1 while it writes the second save in the background. The next
    save raises on every rank, naming the checkpoint, the rank and the error; the first save stays byte for byte,
    and an older checkpoint whose removal waited for the failed save is kept."""
    path, older = Path(directory) / "async-full.ckpt", Path(directory) / "async-older.ckpt"
    run = trainer(AutoModelParallelStrategy(tp=TP, async_save=True), max_steps=1)
    run.fit(CausalLM(tiny_model()), data(dist.get_world_size() // TP))
    run.save_checkpoint(older)
    run.save_checkpoint(path)
    run.strategy.wait_for_saves()
    saved = _contents(path)
    with disk_full(ranks=(1,), room=None):
        run.save_checkpoint(path)  # returns once the shards are copied; the write fails later
        run.strategy.remove_checkpoint(older)  # as ModelCheckpoint removes a checkpoint a new one replaces
        with pytest.raises(OSError) as error:
            run.save_checkpoint(Path(directory) / "async-other.ckpt")
    message = str(error.value)
    assert message.startswith(f"Could not save the checkpoint {path}: rank 1 failed to write"), message
    assert "No space left on device" in message, message
    assert _contents(path) == saved, "a failed save changed the previous checkpoint"
    left = sorted(p.name for p in Path(directory).iterdir() if "async" in p.name)
    assert left == sorted([older.name, path.name]), left
    return message


def check_damaged_checkpoints(directory: str) -> dict[str, str]:
    """Resumes from a checkpoint with a truncated shard, a missing shard, no ``meta.pt``, no ``.metadata``, from
    another model's checkpoint and from a path that does not exist: every rank raises, before any collective of
    the load, an error that names the file."""
    root = Path(directory)
    good = root / "good.ckpt"
    fit(CausalLM(tiny_model()), TP, 1).save_checkpoint(good)
    fit(CausalLM(tiny_model(hidden_size=32, intermediate_size=64)), TP, 1).save_checkpoint(root / "other.ckpt")
    shard = "__1_0.distcp"
    damage = {
        "truncated": (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), shard, r"truncated"),
        "missing": (Path.unlink, shard, r"missing"),
        "no-meta": (Path.unlink, "meta.pt", r"incomplete .* meta\.pt missing"),
        "no-index": (Path.unlink, ".metadata", r"incomplete .* \.metadata missing"),
    }
    if dist.get_rank() == 0:
        for name, (harm, file, _) in damage.items():
            shutil.copytree(good, root / f"{name}.ckpt")
            harm(root / f"{name}.ckpt" / file)
    dist.barrier()
    expected = {name: (str(root / f"{name}.ckpt" / file), pattern) for name, (_, file, pattern) in damage.items()}
    expected["other"] = (str(root / "other.ckpt"), r"does not fit this model: .* \(128, 32\) there, \(128, 64\) here")
    expected["absent"] = (str(root / "absent.ckpt"), "No checkpoint at")
    messages = {}
    for name, (file, pattern) in expected.items():
        checkpoint = root / f"{name}.ckpt"
        with pytest.raises((OSError, ValueError), match=pattern) as error:
            fit(CausalLM(tiny_model(seed=3)), TP, 2, ckpt_path=checkpoint)
        assert file in str(error.value) or str(checkpoint) in str(error.value), (file, str(error.value))
        messages[name] = f"{type(error.value).__name__}: {error.value}"
    return messages


def check_resume_after_killed_save(directory: str) -> dict:
    """fault_train.py ran with a rank SIGKILLed halfway through its second save of last.ckpt (at step 4): last.ckpt
    is still the save of step 2, and 2 steps resumed from it equal steps 3 and 4 of an uninterrupted run, losses
    and weights."""
    checkpoints = Path(directory) / "ckpt"
    last = checkpoints / "last.ckpt"
    whole = CausalLM(tiny_model())
    fit(whole, TP, 4)
    resumed = CausalLM(tiny_model(seed=5 + dist.get_rank()))
    run = fit(resumed, TP, 4, ckpt_path=last)
    result = _assert_continues(resumed, whole.losses, dict(whole.model.named_parameters()))
    left = sorted(p.name for p in checkpoints.iterdir() if p.name != "last.ckpt")
    assert len(left) == 1 and left[0].startswith(".last.ckpt.staging-"), f"expected the killed save's staging: {left}"
    run.save_checkpoint(last)  # the next save there removes what the killed one left
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]
    return result


def check_resume_after_killed_swap(directory: str) -> dict:
    """fault_train.py ran with rank 0 SIGKILLed in the middle of the swap of its second save of last.ckpt (at step
    4), between setting the save of step 2 aside and moving the new one in: last.ckpt is gone. A resume from the
    path last.ckpt and one from ``ckpt_path="last"`` both find the save of step 4 and equal steps 5 and 6 of an
    uninterrupted run; the next save finishes the swap before its own, leaving last.ckpt alone."""
    checkpoints = Path(directory) / "ckpt"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.new.ckpt", "last.old.ckpt"], checkpoints
    whole = CausalLM(tiny_model())
    fit(whole, TP, 6)
    result = {}
    for ckpt_path in (checkpoints / "last.ckpt", "last"):
        resumed = CausalLM(tiny_model(seed=5 + dist.get_rank()))
        saving = ModelCheckpoint(checkpoints, every_n_train_steps=2, save_top_k=0, save_last=True)
        callbacks = dict(callbacks=[saving], enable_checkpointing=True) if ckpt_path == "last" else {}
        run = trainer(AutoModelParallelStrategy(tp=TP), max_steps=6, **callbacks)
        run.fit(resumed, data(dist.get_world_size() // TP), ckpt_path=ckpt_path)
        weights = dict(whole.model.named_parameters())
        result[str(ckpt_path)] = _assert_continues(resumed, whole.losses[2:], weights)  # steps 5 and 6
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"], list(checkpoints.iterdir())
    return result


def check_resume_after_requeue(directory: str) -> dict:
    """The job requeued after SLURM's requeue signal runs again with ``ckpt_path="last"``: it resumes from the
    last.ckpt saved on the way out, and its next 2 steps equal the uninterrupted run's, losses and weights."""
    checkpoints = Path(directory) / "ckpt"
    step = torch.load(checkpoints / "last.ckpt" / "meta.pt", weights_only=False)["global_step"]
    whole = CausalLM(tiny_model())
    fit(whole, TP, step + 2)
    resumed = CausalLM(tiny_model(seed=5 + dist.get_rank()))
    saving = ModelCheckpoint(checkpoints, every_n_train_steps=1000, save_top_k=0, save_last=True)
    run = trainer(AutoModelParallelStrategy(tp=TP), max_steps=step + 2, callbacks=[saving], enable_checkpointing=True)
    run.fit(resumed, data(dist.get_world_size() // TP), ckpt_path="last")
    weights = dict(whole.model.named_parameters())
    return {"step": step, **_assert_continues(resumed, whole.losses[step - 2 :], weights)}  # steps step+1, step+2


class NaNProbe(CausalLM):
    """Logs, unsynced, a copy of the loss that is NaN on rank 1 alone at step 1: one rank's EarlyStopping sees it."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        nan = dist.get_rank() == 1 and self.global_step == 1
        self.log("probe", loss.detach() * float("nan") if nan else loss.detach())
        return loss


class NaNLoss(CausalLM):
    """The loss itself turns NaN on rank 1 alone at step 1."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if dist.get_rank() == 1 and self.global_step == 1 else loss


def check_nan_stops_every_rank() -> dict:
    """``EarlyStopping(check_finite=True)`` that sees a NaN on one rank stops every rank at the same step (the
    strategy agrees on the decision over all ranks); nobody waits for a rank that has left."""
    stopping = EarlyStopping(monitor="probe", check_finite=True, check_on_train_epoch_end=True)
    run = trainer(AutoModelParallelStrategy(tp=TP), max_steps=6, callbacks=[stopping])
    run.fit(NaNProbe(tiny_model()), data(dist.get_world_size() // TP))
    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, run.global_step)
    assert steps == [2] * len(steps) and run.should_stop, steps
    return {"stopped_at": steps}


def check_nan_loss_trains_on() -> dict:
    """What Lightning does with a NaN loss and no option set: FSDP's gradient reduction spreads one rank's NaN to
    every rank's weights, and every rank trains on to ``max_steps`` with NaN losses, no error and no hang."""
    module = NaNLoss(tiny_model())
    trainer(AutoModelParallelStrategy(tp=TP), max_steps=4).fit(module, data(dist.get_world_size() // TP))
    finite = [torch.isfinite(torch.tensor(loss)).item() for loss in module.losses]
    weights_finite = all(torch.isfinite(full(p)).all() for p in module.model.parameters())
    assert finite == [True, True, False, False] and not weights_finite, (finite, weights_finite)
    return {"finite_losses": finite}
