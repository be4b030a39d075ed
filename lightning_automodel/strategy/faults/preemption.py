"""Signals that ask a job to leave, handled at a step boundary that every rank agrees on.

Schedulers end jobs with SIGTERM (``scancel``, preemption, the time limit; SIGKILL follows after a grace time) and,
when asked to (``sbatch --signal=USR1@120``), warn with SLURM's requeue signal ahead of the time limit. Lightning
acts inside the signal handler: on SIGTERM with a broadcast that meets another collective on every rank but 0, on the
requeue signal with a checkpoint save in the middle of a step on some ranks, which a sharded save cannot survive.

Here the handler only notes the signal. At the end of every optimizer step and of every checkpoint save the ranks
agree (one all-reduce of two flags) whether any of them got one, and all stop after that same step: Lightning's
``on_exception`` callbacks run, ``last.ckpt`` is saved where ``ckpt_path="last"`` finds it (the first
ModelCheckpoint's directory; unless a save of this step just wrote it), and after the requeue signal rank 0 runs
``scontrol requeue``. Every rank then exits: 143 after SIGTERM, 0 once requeued. A signal during a save therefore
ends the job once that save is complete, never halfway through its swap.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_automodel.strategy.faults.monitor import FaultMonitor

if TYPE_CHECKING:
    import lightning.pytorch as pl

TERM, REQUEUE = 0, 1  # positions of the flags
REQUEUE_TIMEOUT = 60.0  # seconds scontrol gets


class Preemption:
    """One stage's signals: install it before the Trainer registers its handlers (after the strategy's ``setup``),
    call :meth:`begin_batch` as each training batch begins, :meth:`agree` at the end of every optimizer step,
    :meth:`saved` after every save, and :meth:`leave` from ``on_exception``."""

    def __init__(self, trainer: pl.Trainer, monitor: FaultMonitor | None) -> None:
        self._trainer = trainer
        self._monitor = monitor
        self._received = [False, False]  # by this rank
        self._agreed = [False, False]  # by every rank, after the same step
        self._last_save: tuple[Path, int] | None = None  # path and step
        self._after_step = False  # between an optimizer step and the next batch: a stop there loses nothing
        connector = trainer._signal_connector
        connector._sigterm_notifier_fn = self._on_sigterm
        connector._slurm_sigusr_handler_fn = self._on_requeue_signal

    def agree(self) -> None:
        """End of an optimizer step, on every rank: if any rank got a signal, every rank stops after this step."""
        flags = torch.tensor(self._received, dtype=torch.int32, device=self._trainer.strategy.root_device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self._after_step = True
        if flags.any():
            self._agreed = [bool(flag) for flag in flags.tolist()]
            self._trainer._signal_connector.received_sigterm = True  # Lightning's loop raises SIGTERMException

    def begin_batch(self) -> None:
        self._after_step = False

    def saved(self, path: Path) -> None:
        """A checkpoint save ended on every rank (collective). Right after an optimizer step, a signal that came
        during the save stops every rank now; elsewhere (mid-accumulation, a validation) at the next step's end."""
        self._last_save = (path, self._trainer.global_step)
        if self._after_step:
            self.agree()

    def leave(self, exception: BaseException) -> bool:
        """After the agreed step of a fit, on every rank (collective): save ``last.ckpt`` (written before anything
        else is done) and, after the requeue signal, requeue the job; the exit code says whether it was requeued.
        Whether the ranks stopped together, as agreed."""
        fitting = self._trainer.state.fn == TrainerFn.FITTING
        if not isinstance(exception, SIGTERMException) or not any(self._agreed) or not fitting:
            return False
        path = last_checkpoint_path(self._trainer)
        if path is None:
            rank_zero_warn(
                "lightning-automodel: nothing saved on the way out: the Trainer has no ModelCheckpoint (pass"
                " enable_checkpointing=True or a ModelCheckpoint callback to save last.ckpt when a job is preempted)."
            )
        else:
            if self._last_save != (path, self._trainer.global_step):
                self._trainer.save_checkpoint(path)
            self._trainer.strategy.wait_for_saves()  # an asynchronous save: in place before the job is requeued
        if self._agreed[REQUEUE]:
            exception.code = 0 if path is not None and _requeue_from_rank_zero(self._trainer) else 1
        return True

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._note(TERM, signum)

    def _on_requeue_signal(self, signum: int, frame: FrameType | None) -> None:
        self._note(REQUEUE, signum)

    def _note(self, which: int, signum: int) -> None:
        """In the signal handler: forward the signal to the ranks Lightning's launcher started (as Lightning does)
        and note it; outside a fit, where no step ends, Lightning's loop stops at its next batch."""
        launcher = self._trainer.strategy.launcher
        if not any(self._received) and launcher is not None:
            launcher.kill(signum)
        self._received[which] = True
        if self._monitor is not None:
            self._monitor.note_signal(signal.Signals(signum).name)
        if self._trainer.state.fn != TrainerFn.FITTING:
            self._trainer._signal_connector.received_sigterm = True


def last_checkpoint_path(trainer: pl.Trainer) -> Path | None:
    """``last.ckpt`` in the first ModelCheckpoint's directory, where ``ckpt_path="last"`` looks; None without one."""
    found = [callback for callback in trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)]
    if not found or found[0].dirpath is None:
        return None
    return Path(found[0].dirpath) / f"{found[0].CHECKPOINT_NAME_LAST}{found[0].FILE_EXTENSION}"


def _requeue_from_rank_zero(trainer: pl.Trainer) -> bool:
    """``scontrol requeue`` this job on rank 0, saying what happened; whether it was requeued, on every rank."""
    requeued = [False]
    if trainer.is_global_zero:
        requeued[0] = _requeue(f"after step {trainer.global_step}")
    if dist.is_initialized():
        dist.broadcast_object_list(requeued, src=0)
    return requeued[0]


def _requeue(when: str) -> bool:
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ.get("SLURM_JOB_ID", "")
    try:
        result = subprocess.run(
            ["scontrol", "requeue", job], capture_output=True, text=True, timeout=REQUEUE_TIMEOUT, check=False
        )
        failure = "" if result.returncode == 0 else f"exit code {result.returncode}: {result.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as error:
        failure = str(error)
    said = f"requeued SLURM job {job}" if not failure else f"could not requeue SLURM job {job!r} ({failure})"
    print(f"[rank 0] lightning-automodel: saved last.ckpt {when} and {said}.", file=sys.stderr, flush=True)
    return not failure
