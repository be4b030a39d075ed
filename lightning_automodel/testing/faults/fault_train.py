"""One rank of the fault tests: the tiny Llama trains at tp=2 x dp_shard=2 until a fault stops it.

Launched as users launch: ``python fault_train.py OUT_DIR ...`` (Lightning's own launcher starts the other ranks by
running this script again) or under torchrun. Each rank writes ``OUT_DIR/rank<r>.log`` (its stdout and stderr),
``rank<r>.pid`` once training runs, and ``rank<r>.step`` at every step, so that a driver can inject a fault mid-step
and see what every rank printed. Rank 0 under Lightning's launcher also writes ``rank<r>.exit``, the exit code of each
rank it started and reaped (the driver cannot read those).

Usage: fault_train.py OUT_DIR [--devices N] [--nodes N] [--timeout SECONDS] [--steps N] [--save-every N]
    [--in-save RANK] [--in-swap] [--slow-save SECONDS] [--nan-rank RANK [--nan-step STEP]] [--detect-anomaly]
    [--save-on-exception] [--stall-rank RANK --stall PLACE:STEP:SECONDS [--stall ...]]
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path


def global_rank() -> int:
    """Torchrun sets RANK, srun SLURM_PROCID; Lightning's launcher sets LOCAL_RANK in the processes it starts (one
    node here)."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", os.environ.get("LOCAL_RANK", "0"))))


def redirect_output(out_dir: Path) -> None:
    """This rank's stdout and stderr (Python's and native code's) to its own file, line by line."""
    log = os.open(out_dir / f"rank{global_rank()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (1, 2):
        os.dup2(log, stream)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def as_from_a_terminal() -> None:
    """Ctrl-C and the stop signals as a shell would hand them to a new process: a driver (a test worker) may have
    left SIGINT ignored or signals blocked, which a child inherits (Python then installs no KeyboardInterrupt)."""
    inherited = signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    print(f"inherited: SIGINT handler {inherited[0]}, blocked {sorted(inherited[1])}", flush=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--devices", type=int, default=4, help="processes per node")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=None, help="the strategy's timeout; default: its own")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--save-every", type=int, default=0, help="last.ckpt every N steps, in OUT_DIR/ckpt")
    parser.add_argument("--in-save", type=int, default=None, help="this rank kills itself midway through a save")
    parser.add_argument("--in-swap", action="store_true", help="rank 0 dies between the renames of its second swap")
    parser.add_argument("--slow-save", type=float, default=0.0, help="every rank's shard takes this long to write")
    parser.add_argument("--stall-rank", type=int, default=None, help="this rank stalls where --stall says")
    parser.add_argument(
        "--stall",
        action="append",
        default=[],
        metavar="PLACE:STEP:SECONDS",
        help=f"sleep in one of {', '.join(STALL_PLACES)} once STEP steps are done (repeatable)",
    )
    parser.add_argument("--nan-rank", type=int, default=None, help="this rank's loss turns NaN at --nan-step")
    parser.add_argument("--nan-step", type=int, default=3)
    parser.add_argument("--detect-anomaly", action="store_true", help="Trainer(detect_anomaly=True)")
    parser.add_argument("--save-on-exception", action="store_true", help="OnExceptionCheckpoint into OUT_DIR/ckpt")
    args = parser.parse_args()
    redirect_output(args.out_dir)
    as_from_a_terminal()
    # Imported once the output is redirected: what importing prints (warnings, errors) lands in this rank's log.
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
    from torch.utils.data import DataLoader

    from lightning_automodel import AutoModelParallelStrategy
    from lightning_automodel.testing.models import tiny_model
    from lightning_automodel.testing.trainer_parity import CausalLM, data

    stalls = Stalls(args.stall if global_rank() == args.stall_rank else [])

    class Progress(Callback):
        def on_train_start(self, trainer, pl_module):
            (args.out_dir / f"rank{trainer.global_rank}.pid").write_text(str(os.getpid()))
            stalls.install(trainer)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            (args.out_dir / f"rank{trainer.global_rank}.step").write_text(str(trainer.global_step))

    class NaNLoss(CausalLM):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            nan = self.global_rank == args.nan_rank and self.global_step == args.nan_step
            return loss * float("nan") if nan else loss

    callbacks = [Progress()]
    if args.save_every:
        every = ModelCheckpoint(
            args.out_dir / "ckpt", every_n_train_steps=args.save_every, save_top_k=0, save_last=True
        )
        callbacks.append(every)
    if args.save_on_exception:
        callbacks.append(OnExceptionCheckpoint(args.out_dir / "ckpt"))
    if args.in_save is not None and global_rank() == args.in_save:
        kill_midway_through_second_save()
    if args.in_swap and global_rank() == 0:
        kill_between_the_renames_of_a_swap()
    if args.slow_save:
        slow_down_saves(args.slow_save)

    options = {} if args.timeout is None else {"timeout": timedelta(seconds=args.timeout)}
    strategy = AutoModelParallelStrategy(tp=2, **options)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.nodes,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=bool(args.save_every) or args.save_on_exception,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        detect_anomaly=args.detect_anomaly,
    )
    atexit.register(record_exit_codes_of_started_ranks, trainer, args.out_dir)
    loader = data(args.devices * args.nodes // 2)
    loader = DataLoader(StallingDataset(loader.dataset, stalls), batch_size=loader.batch_size)
    trainer.fit(NaNLoss(tiny_model()), loader)


STALL_PLACES = ("loader", "forward", "backward", "optimizer")


class Stalls:
    """Sleeps of this rank inside a training step, as a hung read, a stuck kernel or a deadlock would block it: each
    ``PLACE:STEP:SECONDS`` sleeps once, in a function of its own (named in what the ranks print), when the Trainer
    has done STEP steps."""

    def __init__(self, specs: list[str]) -> None:
        self._due = {place: (int(step), float(seconds)) for place, step, seconds in (s.split(":") for s in specs)}
        unknown = set(self._due) - set(STALL_PLACES)
        assert not unknown, f"--stall places are {STALL_PLACES}, not {unknown}"
        self._trainer = None

    def install(self, trainer) -> None:
        """Hooks in the model's forward and backward and before the optimizer's step (the loader asks itself)."""
        self._trainer = trainer
        norm = trainer.lightning_module.model.model.norm
        norm.register_forward_hook(self.stall_in_forward)
        norm.register_forward_hook(self.hook_backward)
        trainer.optimizers[0].register_step_pre_hook(self.stall_in_optimizer_step)

    def stall_in_forward(self, module, inputs, output) -> None:
        self.sleep_if_due("forward")

    def hook_backward(self, module, inputs, output) -> None:
        output.register_hook(self.stall_in_backward)

    def stall_in_backward(self, gradient) -> None:
        self.sleep_if_due("backward")

    def stall_in_optimizer_step(self, optimizer, args, kwargs) -> None:
        self.sleep_if_due("optimizer")

    def sleep_if_due(self, place: str) -> None:
        step, seconds = self._due.get(place, (None, 0.0))
        if self._trainer is not None and self._trainer.global_step == step:
            del self._due[place]
            time.sleep(seconds)


class StallingDataset:
    """A map-style data set whose reads stall where ``stalls`` says ("loader")."""

    def __init__(self, dataset, stalls: Stalls) -> None:
        self._dataset, self._stalls = dataset, stalls

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index):
        self._stalls.sleep_if_due("loader")
        return self._dataset[index]


def record_exit_codes_of_started_ranks(trainer, out_dir: Path) -> None:
    """Lightning's launcher signals the ranks it started on its way out, and signalling first reaps those that have
    exited: their exit codes are then known only here."""
    for offset, process in enumerate(getattr(trainer.strategy.launcher, "procs", ()), start=1):
        if process.returncode is not None:
            (out_dir / f"rank{trainer.global_rank + offset}.exit").write_text(str(process.returncode))


def kill_midway_through_second_save() -> None:
    """SIGKILL this process once it has written the first of its files of the second checkpoint save: a job killed
    in the middle of a save (the first save stays whole; the second finds it in place)."""
    import torch.distributed.checkpoint.filesystem as filesystem

    write = filesystem._write_files_from_queue
    saves = []

    def write_then_die(*args, **kwargs):
        saves.append(None)
        result = write(*args, **kwargs)
        if len(saves) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    filesystem._write_files_from_queue = write_then_die


SLOW_WRITE = "fault_train: writing a shard slowly"


def slow_down_saves(seconds: float) -> None:
    """Each rank's shard of a save takes ``seconds`` to write, as on a slow file system; each write says so, for a
    test to count the saves."""
    import torch.distributed.checkpoint.filesystem as filesystem

    write = filesystem._write_files_from_queue

    def write_slowly(*args, **kwargs):
        print(SLOW_WRITE, flush=True)
        time.sleep(seconds)
        return write(*args, **kwargs)

    filesystem._write_files_from_queue = write_slowly


def kill_between_the_renames_of_a_swap() -> None:
    """SIGKILL this process once a checkpoint swap has set the previous last.ckpt aside, before the new one moves in:
    a job killed in the window of a slow rename on a network file system."""
    rename = Path.rename

    def rename_then_die(self, target):
        result = rename(self, target)
        if Path(target).name == "last.old.ckpt":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    Path.rename = rename_then_die


if __name__ == "__main__":
    main()
