"""Faults, measured: a rank killed, stopped or signalled mid-step under Lightning's launcher and under torchrun,
a job killed in the middle of a checkpoint save, a full disk, damaged checkpoints, NaN losses.

Every surviving rank must exit non-zero within the strategy's timeout and say which rank failed. Runs here use a
30 s timeout: shorter ones do not leave 2 busy cores time to start 4 processes (the timeout also bounds the
rendezvous). benchmarks/faults.py measures the same faults with the default timeout too.
"""

from __future__ import annotations

import signal
from functools import partial

import pytest
import torch
from fault_checks import (
    check_asynchronous_save_failure,
    check_damaged_checkpoints,
    check_full_disk,
    check_nan_loss_trains_on,
    check_nan_stops_every_rank,
    check_resume_after_killed_save,
    check_resume_after_killed_swap,
    check_resume_after_requeue,
)

from lightning_automodel.io.lightning_checkpoint import check_checkpoint
from lightning_automodel.strategy.stragglers import flight_recorder_environment
from lightning_automodel.testing.fault_launch import Fault, Outcome, launch
from lightning_automodel.testing.harness import run_checks

TIMEOUT = 30.0
GONE = "exited without reporting an error"


def assert_named(outcome: Outcome, failed: int, reason: str, *, since: float = 0.0) -> None:
    """Every rank but ``failed`` exited non-zero within the timeout of ``since`` (seconds after the fault), and
    printed that ``failed`` stopped the run for ``reason``."""
    for rank, end in outcome.ranks.items():
        if rank == failed:
            continue
        assert end.seconds is not None and end.seconds - since <= TIMEOUT, outcome.describe()
        assert end.code not in (0, None), outcome.describe()
        said = [
            line for line in end.output.splitlines() if f"[rank {rank}] lightning-automodel: the run stopped" in line
        ]
        assert said and f"rank {failed} (" in said[0] and reason in said[0], outcome.describe()


def test_rank_killed_mid_save_then_checkpoint_faults(tmp_path):
    """Rank 1 SIGKILLs itself halfway through writing its shard of the second last.ckpt (tp=2 under Lightning's
    launcher): rank 0 exits naming it. Rank 0 SIGKILLs itself between the two renames of that save's swap. Then, in
    one gloo launch: the resumes from what each left equal the uninterrupted run; a full disk on one rank and on
    both; damaged, foreign and missing checkpoints; NaN losses."""
    killed = launch(tmp_path / "run", None, world=2, timeout=TIMEOUT, args=("--save-every=2", "--in-save=1"))
    assert killed.ranks[1].code == -signal.SIGKILL, killed.describe()
    assert_named(killed, 1, GONE, since=killed.ranks[1].seconds)
    swapping = launch(tmp_path / "swap", None, world=2, timeout=TIMEOUT, args=("--save-every=2", "--in-swap"))
    assert swapping.ranks[0].code == -signal.SIGKILL, swapping.describe()
    checks = [
        partial(check_resume_after_killed_save, str(tmp_path / "run")),
        partial(check_resume_after_killed_swap, str(tmp_path / "swap")),
        partial(check_full_disk, str(tmp_path), (1,), 100_000),
        partial(check_full_disk, str(tmp_path), (0, 1), None),
        partial(check_asynchronous_save_failure, str(tmp_path)),
        partial(check_damaged_checkpoints, str(tmp_path)),
        check_nan_stops_every_rank,
        check_nan_loss_trains_on,
    ]
    for name, results in run_checks(2, checks).items():
        print(name, results[0])


def test_sigterm_to_one_rank(tmp_path):
    """Lightning's SIGTERM handler broadcasts from inside the handler, which on rank 1 met another collective of
    rank 0's: every rank waited until the timeout. Now rank 1 stops at the end of its step with 143, and the
    others exit naming it."""
    outcome = launch(tmp_path, Fault(signal.SIGTERM, 1), world=2, timeout=TIMEOUT)
    assert outcome.ranks[1].code == 128 + signal.SIGTERM, outcome.describe()
    assert_named(outcome, 1, "received SIGTERM")


def test_sigterm_to_the_launcher(tmp_path):
    """SIGTERM to Lightning's launcher, which forwards it: the ranks stop at the end of a step together, the
    ``OnExceptionCheckpoint`` callback writes a whole checkpoint, and every rank exits with 143 (Lightning 2.6: 0)."""
    outcome = launch(
        tmp_path, Fault(signal.SIGTERM, "launcher"), world=2, timeout=TIMEOUT, args=("--save-on-exception",)
    )
    assert [end.code for end in outcome.ranks.values()] == [128 + signal.SIGTERM] * 2, outcome.describe()
    assert all("received SIGTERM" in end.output for end in outcome.ranks.values()), outcome.describe()
    check_checkpoint(tmp_path / "ckpt" / "on_exception.ckpt")


@pytest.mark.sweep  # 34 s of waiting; test_a_stalled_rank_is_named_while_the_others_wait names a silent rank too
def test_frozen_rank(tmp_path):
    """A rank that stops responding (SIGSTOP: what a hung host or a dead nccl peer looks like to the others): its
    heartbeat goes silent, and the others exit naming it within half the timeout (plus a 5 s grace)."""
    outcome = launch(tmp_path, Fault(signal.SIGSTOP, 1), world=2, timeout=TIMEOUT)
    assert_named(outcome, 1, "stopped responding")


def test_nan_under_detect_anomaly(tmp_path):
    """``Trainer(detect_anomaly=True)``: rank 1's loss turns NaN, its backward raises, the others name its error."""
    outcome = launch(tmp_path, None, world=2, timeout=TIMEOUT, args=("--nan-rank=1", "--detect-anomaly"))
    assert outcome.ranks[1].code == 1, outcome.describe()
    assert_named(outcome, 1, "returned nan values", since=outcome.ranks[1].seconds)


def test_ctrl_c(tmp_path):
    """Ctrl-C in the launcher's terminal (SIGINT to its process group): every rank exits non-zero."""
    outcome = launch(tmp_path, Fault(signal.SIGINT, "group"), world=2, timeout=TIMEOUT)
    assert all(end.code not in (0, None) for end in outcome.ranks.values()), outcome.describe()
    assert "received Ctrl-C (SIGINT)" in outcome.ranks[0].output, outcome.describe()


def test_requeue_signal_under_slurm(tmp_path):
    """SLURM's requeue signal (``sbatch --signal=USR1@120``) to rank 1 alone of a job step: every rank stops after
    the same step, last.ckpt is saved, rank 0 runs ``scontrol requeue`` (a stand-in records it) and every rank exits
    0. The requeued job, run with ``ckpt_path="last"``, continues as the uninterrupted run."""
    args = ("--save-every=1000",)  # a ModelCheckpoint whose last.ckpt only the requeue writes
    outcome = launch(tmp_path, Fault(signal.SIGUSR1, 1), launcher="slurm", world=2, timeout=TIMEOUT, args=args)
    assert [end.code for end in outcome.ranks.values()] == [0, 0], outcome.describe()
    assert max(end.seconds for end in outcome.ranks.values()) < TIMEOUT, outcome.describe()
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    assert "saved last.ckpt after step" in outcome.ranks[0].output, outcome.describe()
    print({rank: end.seconds for rank, end in outcome.ranks.items()})
    print(run_checks(2, [partial(check_resume_after_requeue, str(tmp_path))]))


def test_sigterm_during_a_save_under_slurm(tmp_path):
    """SIGTERM to every rank (what ``scancel`` does through srun) while each writes its shard of last.ckpt at step
    3, which takes 5 s: the save completes, every rank stops after that step and exits 143 once it is written (not
    saving it again), and last.ckpt is the whole save of step 3."""
    slow = 5.0
    args = ("--save-every=3", f"--slow-save={slow}")
    fault = Fault(signal.SIGTERM, "all")
    outcome = launch(tmp_path, fault, launcher="slurm", world=2, timeout=TIMEOUT, after_step=3, args=args)
    assert [end.code for end in outcome.ranks.values()] == [143, 143], outcome.describe()
    seconds = [end.seconds for end in outcome.ranks.values()]
    assert max(seconds) < 2 * slow, outcome.describe()  # one save's time, not two
    last = tmp_path / "ckpt" / "last.ckpt"
    check_checkpoint(last)
    assert torch.load(last / "meta.pt", weights_only=False)["global_step"] == 3
    print(seconds)


def test_a_stalled_rank_is_named_while_the_others_wait(tmp_path):
    """Rank 1 stalls before its third batch (a slow data loader; 40 s, past the 15 s timeout): rank 0, waiting in
    batch 3, says after a quarter of the timeout which rank it waits for, at which batch and where that rank is;
    when the collective times out, rank 0 names rank 1 as the one behind, and rank 1, ended, says where it was."""
    args = ("--stall-rank=1", "--stall-step=2", "--stall-seconds=40", "--steps=4")
    outcome = launch(tmp_path, None, world=2, timeout=TIMEOUT / 2, args=args)
    rank_zero = outcome.ranks[0].output
    waited = [line for line in rank_zero.splitlines() if "lightning-automodel: batch 3 has waited" in line]
    assert waited and "for rank 1 (" in waited[0] and "still at batch 2, in on_train_batch_start" in waited[0], (
        rank_zero
    )
    stopped = [line for line in rank_zero.splitlines() if "lightning-automodel: the run stopped" in line]
    assert stopped and "the others were waiting for rank 1 (" in stopped[0], outcome.describe()
    assert "on_train_batch_start (fault_train.py" in outcome.ranks[1].output, outcome.describe()
    assert all(end.code not in (0, None) for end in outcome.ranks.values()), outcome.describe()
    print(waited[0], stopped[0], sep="\n")


def test_the_nccl_flight_recorder_dumps_beside_the_run_unless_told_otherwise(tmp_path, monkeypatch):
    """On GPUs the strategy points torch's NCCL flight recorder at the run's directory; a user's own settings stay."""
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "500")
    environment = flight_recorder_environment(tmp_path)
    assert environment["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "nccl_flight_recorder" / "rank_")
    assert environment["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "500"
    assert environment["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def test_torchrun_node_loses_a_rank(tmp_path):
    """Two torchrun agents as two nodes of one rank each: rank 1 is SIGKILLed, and rank 0, which only its own
    agent watches, exits on its own, naming rank 1 (benchmarks/faults.py runs 2 nodes of 2)."""
    outcome = launch(tmp_path, Fault(signal.SIGKILL, 1), launcher="torchrun", world=2, nodes=2, timeout=TIMEOUT)
    assert_named(outcome, 1, GONE)
