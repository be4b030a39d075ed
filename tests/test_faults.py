"""Faults, measured: a rank killed, stopped or signalled mid-step under Lightning's launcher and under torchrun,
a job killed in the middle of a checkpoint save, a full disk, damaged checkpoints, NaN losses.

Every surviving rank must exit non-zero within the strategy's timeout and say which rank failed. Runs here use a
30 s timeout: shorter ones do not leave 2 busy cores time to start 4 processes (the timeout also bounds the
rendezvous). benchmarks/faults.py measures the same faults with the default timeout too.
"""

from __future__ import annotations

import json
import re
import signal
import time
from datetime import timedelta
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
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
from lightning_automodel.strategy.faults import monitor as faults
from lightning_automodel.strategy.faults import stragglers
from lightning_automodel.strategy.faults.collective_progress import GroupProgress, find_missed
from lightning_automodel.strategy.faults.processes import FROZEN, state_of
from lightning_automodel.strategy.faults.processes import GONE as PROCESS_GONE
from lightning_automodel.strategy.faults.stragglers import Stragglers, _as_the_waiting_say, flight_recorder_environment
from lightning_automodel.testing.faults.fault_train import SLOW_WRITE
from lightning_automodel.testing.faults.launch import Fault, Outcome, launch
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


@pytest.mark.sweep  # 22 s; SIGTERM to a rank, Ctrl-C to the launcher's group and a SLURM step's SIGTERM in the suite
def test_sigterm_to_the_launcher(tmp_path):
    """SIGTERM to Lightning's launcher, which forwards it: the ranks stop at the end of a step together, the
    ``OnExceptionCheckpoint`` callback writes a whole checkpoint, and every rank exits with 143 (Lightning 2.6: 0)."""
    outcome = launch(
        tmp_path, Fault(signal.SIGTERM, "launcher"), world=2, timeout=TIMEOUT, args=("--save-on-exception",)
    )
    assert [end.code for end in outcome.ranks.values()] == [128 + signal.SIGTERM] * 2, outcome.describe()
    assert all("received SIGTERM" in end.output for end in outcome.ranks.values()), outcome.describe()
    check_checkpoint(tmp_path / "ckpt" / "on_exception.ckpt")


@pytest.mark.sweep  # 34 s of waiting; test_a_rank_stuck_inside_a_step_is_named_while_the_others_wait names one too
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


@pytest.mark.sweep  # 38 s: two runs; a SLURM step's SIGTERM during a save is in the suite
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
    writes = [end.output.count(SLOW_WRITE) for end in outcome.ranks.values()]
    assert writes == [1, 1], outcome.describe()  # one save, not two
    last = tmp_path / "ckpt" / "last.ckpt"
    check_checkpoint(last)
    assert torch.load(last / "meta.pt", weights_only=False)["global_step"] == 3
    print([end.seconds for end in outcome.ranks.values()])


# Where rank 1 stalls (once the Trainer has done STEP steps), for how long, and the function it is then in.
STALLS = (("loader", 2, 5, "__getitem__"), ("backward", 3, 5, "stall_in_backward"))
STALLS += (("optimizer", 4, 5, "stall_in_optimizer_step"), ("forward", 5, 40, "stall_in_forward"))
REPORT = re.compile(
    r"\[rank (\d)\] lightning-automodel: rank 1 \(.*\) has not reached the collective that rank 0 has waited in"
    r" for (\d+) s \((.*)\); rank 1 is in (.*)\.$"
)


def test_a_rank_stuck_inside_a_step_is_named_while_the_others_wait(tmp_path):
    """Rank 1 stalls inside its steps, as a hung read or a stuck kernel would hold it, at a 15 s timeout (a report
    every 3.75 s): 5 s in its data loader's read, in its backward, before its optimizer step, then 40 s in its
    forward. During each, both ranks print within the interval that rank 1 has not reached the collective that rank
    0 waits in, and the function rank 1 is in. When rank 0's collective times out, both ranks say that the run
    stopped, naming rank 1 and its forward hook, and rank 1, ended, says it had not reached the collective."""
    timeout = TIMEOUT / 2
    stalls = [f"--stall={place}:{step}:{seconds}" for place, step, seconds, _ in STALLS]
    args = ("--stall-rank=1", *stalls, "--steps=8")
    outcome = launch(tmp_path, None, launcher="slurm", world=2, timeout=timeout, wait=120, args=args)
    for rank, end in outcome.ranks.items():
        assert end.code not in (0, None), outcome.describe()
        reports = [match for line in end.output.splitlines() if (match := REPORT.search(line))]
        for _, _, _, function in STALLS:
            during = [match for match in reports if f"{function} (fault_train.py:" in match[4]]
            assert during and int(during[0][2]) <= timeout / 4 + 1, (function, outcome.describe())
            assert during[0][3].startswith("gloo:") and " of group mesh_tp, ranks 0 and 1" in during[0][3], during[0][0]
            print(during[0][0])
        stopped = [
            line for line in end.output.splitlines() if f"[rank {rank}] lightning-automodel: the run stopped" in line
        ]
        assert stopped and "rank 1 (" in stopped[0] and "has not reached the collective" in stopped[0], (
            outcome.describe()
        )
        assert "stall_in_forward (fault_train.py:" in stopped[0], outcome.describe()
        print(stopped[0])
    ended = [
        line for line in outcome.ranks[1].output.splitlines() if "lightning-automodel: ending this process" in line
    ]
    assert ended and "which had not reached the collective that rank 0 waited in" in ended[0], outcome.describe()
    assert "stall_in_forward (fault_train.py:" in ended[0], outcome.describe()
    print(ended[0])


def test_the_rank_the_others_wait_for_is_the_one_that_waits_for_none():
    """tp=2 x dp=2, rank 1 stuck between two collectives: rank 0 waits for it in their tp group, rank 3 in their dp
    group, and rank 2 for rank 3 in theirs. Rank 1 is named, once for each group; rank 3, waiting itself, is not.
    Ranks that have all entered a collective, or that wait for each other (collectives called in different orders),
    name none."""
    tp01, tp23, dp02, dp13 = "3", "4", "1", "2"

    def at(**groups: tuple[int, int]) -> dict[str, GroupProgress]:
        return {group: GroupProgress(f"mesh_{group}", *counts) for group, counts in groups.items()}

    progress = {
        0: {tp01: GroupProgress("mesh_tp", 9, 8), dp02: GroupProgress("mesh_dp", 4, 4)},
        1: {tp01: GroupProgress("mesh_tp", 8, 8), dp13: GroupProgress("mesh_dp", 3, 3)},
        2: {tp23: GroupProgress("mesh_tp", 9, 8), dp02: GroupProgress("mesh_dp", 4, 4)},
        3: {tp23: GroupProgress("mesh_tp", 8, 8), dp13: GroupProgress("mesh_dp", 4, 3)},
    }
    missed = find_missed(progress)
    assert [(each.rank, each.group, each.collective, each.waiting) for each in missed] == [
        (1, dp13, 4, (3,)),
        (1, tp01, 9, (0,)),
    ]
    progress[1][tp01] = GroupProgress("mesh_tp", 9, 8)
    progress[3][tp23] = GroupProgress("mesh_tp", 9, 8)
    progress[1][dp13] = GroupProgress("mesh_dp", 4, 3)
    assert find_missed(progress) == []  # every collective waited in is entered everywhere: stuck inside one
    crossed = {0: at(a=(5, 4), b=(2, 2)), 1: at(a=(4, 4), b=(3, 2))}
    assert find_missed(crossed) == []


def test_a_frozen_rank_is_said_to_miss_the_collective_the_others_say_they_wait_in():
    """A rank's published progress may lag (frozen, or its monitor starved, after it named its groups): by it, rank 0
    would wait in collective 37 of default_pg, which it completed; rank 0 says it waits in collective 88 of mesh_tp,
    and that is the one named."""
    everyone = {
        0: {"0": GroupProgress("default_pg", 38, 38), "9": GroupProgress("mesh_tp", 88, 87)},
        1: {"0": GroupProgress("default_pg", 36, 36), "9": GroupProgress("mesh_tp", 52, 51)},
    }
    [missed] = find_missed(everyone)
    assert (missed.group, missed.collective) == ("0", 37)
    wheres = {1: None, 0: {"place": "wait", "still": 6.0, "waits": {"9": [88, "gloo:all_reduce"]}}}
    said, operation, waited = _as_the_waiting_say(missed, wheres, everyone)
    assert (said.rank, said.desc, said.collective, said.waiting, said.members) == (1, "mesh_tp", 88, (0,), (0, 1))
    assert (operation, waited) == ("gloo:all_reduce", 6.0)


STOPPED_REPORTS = "lightning-automodel: no more reports of the rank the others wait for"


@pytest.fixture
def monitor(monkeypatch):
    """Rank 0 of 2's fault monitor on an in-process store, a heartbeat every 0.1 s, its process never ended: the
    calls of ``os._exit`` are recorded in ``monitor.ended``."""
    store = dist.HashStore()
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: SimpleNamespace(clone=lambda: store))
    monkeypatch.setattr(faults, "INTERVAL", 0.1)
    monitor = faults.FaultMonitor(rank=0, world_size=2, generation="test", timeout=timedelta(seconds=60))
    monitor.ended = []
    monkeypatch.setattr(faults.os, "_exit", monitor.ended.append)
    return monitor


class BrokenRecorder:
    """torch's flight recorder read through an API that differs (another torch's keys)."""

    def read(self):
        raise KeyError("last_enqueued_collective")


def test_a_failing_flight_recorder_stops_the_reports_never_the_monitor(monitor, monkeypatch, capfd):
    """The straggler side reads torch's private recorder API from the monitor's thread; when that fails (its keys
    differ on another torch, a dump fails), it says once that its reports stop, and the monitor beats on: it takes
    it for no store that is gone, and never ends the process (it would, at once, with no grace)."""
    monkeypatch.setattr(stragglers, "CollectiveProgress", BrokenRecorder)
    monkeypatch.setattr(faults, "GRACE", 0.0)
    monitor.start()
    deadline = time.monotonic() + 10
    while monitor._store.add("beat/0", 0) < 5 and time.monotonic() < deadline and monitor._verdict is None:
        time.sleep(0.05)
    beats = monitor._store.add("beat/0", 0)
    monitor.stop()
    said = capfd.readouterr().err.splitlines()
    assert monitor.ended == [] and monitor._verdict is None, said
    assert beats >= 5, said
    assert said == [f"[rank 0] {STOPPED_REPORTS} (KeyError: 'last_enqueued_collective')."]


def test_a_blocked_rank_is_ended_even_when_where_it_is_cannot_be_said(monitor, monkeypatch, capfd):
    """GRACE after the stage stopped, a blocked rank's monitor ends its process; a failure to say where the rank
    is (its stack, the site's directories) changes the words, not the end."""

    def unknown():
        raise OSError("site-packages unreadable")

    monkeypatch.setattr(monitor.stragglers, "ending", unknown)
    monitor._stopping_since = time.monotonic() - faults.GRACE
    monitor._end_if_blocked()
    assert monitor.ended == [faults.EXIT_CODE]
    assert capfd.readouterr().err.splitlines() == [
        "[rank 0] lightning-automodel: ending this process, which was blocked when the run stopped"
        " (where could not be said: OSError: site-packages unreadable)."
    ]


class GoneStore:
    """A store whose host is gone: every read fails as torch's store, or its socket, fails."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def check(self, keys):
        raise self.error


@pytest.mark.parametrize("error", [dist.DistNetworkError("Connection reset by peer"), ConnectionResetError(104)])
def test_the_cause_of_a_store_that_is_gone_is_left_to_the_monitor(error, capfd):
    """A store that is gone is the monitor's to report (its heartbeat fails next): no cause, and nothing said."""
    side = Stragglers(rank=0, world_size=2, after=4.0, tick=1.0, whois=str)
    assert side.cause(GoneStore(error)) == ""
    assert capfd.readouterr().err == ""


def test_a_failure_to_find_the_cause_is_said_not_taken_for_no_cause(monkeypatch, capfd):
    """An error of the straggler side's own (finding, describing) is said, once, rather than taken for a store
    that is gone: the timeout's line would otherwise say that no rank reported a cause, as if none were found."""
    store = dist.HashStore()
    progress = {"1": ["mesh_tp", 9, 8]}
    store.set("progress/0", json.dumps(progress))
    store.set("progress/1", json.dumps(progress))

    def broken(everyone):
        raise ValueError("a bug")

    monkeypatch.setattr(stragglers, "find_missed", broken)
    side = Stragglers(rank=0, world_size=2, after=4.0, tick=1.0, whois=str)
    assert side.cause(store) == "" and side.cause(store) == ""
    assert capfd.readouterr().err.splitlines() == [f"[rank 0] {STOPPED_REPORTS} (ValueError: a bug)."]


def test_the_nccl_flight_recorder_dumps_beside_the_run_unless_told_otherwise(tmp_path, monkeypatch):
    """On GPUs the strategy points torch's NCCL flight recorder at the run's directory; a user's own settings stay."""
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "500")
    environment = flight_recorder_environment(tmp_path)
    assert environment["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "nccl_flight_recorder" / "rank_")
    assert environment["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "500"
    assert environment["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


# 46 s: test_rank_killed_mid_save_then_checkpoint_faults names a SIGKILLed rank; test_multinode runs torchrun's nodes
@pytest.mark.sweep
def test_torchrun_node_loses_a_rank(tmp_path):
    """Two torchrun agents as two nodes of one rank each: rank 1 is SIGKILLed, and rank 0, which only its own
    agent watches, exits on its own, naming rank 1 (benchmarks/faults.py runs 2 nodes of 2)."""
    outcome = launch(tmp_path, Fault(signal.SIGKILL, 1), launcher="torchrun", world=2, nodes=2, timeout=TIMEOUT)
    assert_named(outcome, 1, GONE)


def test_a_process_tearing_itself_down_is_gone():
    """A SIGKILLed rank closes its sockets (its peers' collectives fail) before it becomes a zombie: while the kernel
    tears it down (PF_EXITING in its flags) it is gone, not running, or the roll call names no cause."""
    line = "1234 (python) {state} 1 1234 1234 0 -1 {flags} 0 0"
    assert state_of(line.format(state="R", flags=0x400000)) == "running"
    assert state_of(line.format(state="R", flags=0x400004)) == PROCESS_GONE
    assert state_of(line.format(state="D", flags=0x4)) == PROCESS_GONE
    assert state_of(line.format(state="Z", flags=0)) == PROCESS_GONE
    assert state_of(line.format(state="T", flags=0)) == FROZEN
    assert state_of("1 (a) b) R 1 1 1 0 -1 0 0 0") == "running"  # a name holding ")": the last one ends it
