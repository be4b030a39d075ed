"""Launch fault_train.py as users do, inject a fault mid-step, and record how every rank ended.

Launchers: Lightning's own (``python fault_train.py``; Lightning starts ranks 1-3 as children of rank 0), torchrun
(one agent, or several on this machine standing for nodes), and SLURM as srun starts a job step (each rank a process
of its own, with SLURM's variables; a stand-in ``scontrol`` on the PATH records its arguments in ``scontrol.log``).
Faults: a signal to one rank, to every rank, to a launcher, or to a launcher's whole process group (what Ctrl-C in its
terminal does). For each rank: its exit code, the seconds from the fault to its exit, and what it printed
(fault_train.py gives each rank a log of its own).

Exit codes of processes that are not this one's children: this process becomes a "child subreaper" (Linux), so
that ranks orphaned by a dead launcher are reparented to it and reaped here; a rank that exits while its parent
lives is read as a zombie from /proc, or from torchrun's failure summary once its agent reaped it, or from the
``rank<r>.exit`` that Lightning's rank 0 writes for the ranks it reaped.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from lightning_automodel.testing.harness import free_port

SCRIPT = Path(__file__).parent / "fault_train.py"
PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class Fault:
    signal: signal.Signals
    # A global rank, "launcher" (the first one), "group" (its process group, as Ctrl-C), or "all" ranks (as srun).
    target: int | str


@dataclass
class RankEnd:
    code: int | None  # None: unknown (reaped by a parent that did not report it)
    seconds: float | None  # from the fault to the exit; None: still running when the driver gave up
    output: str


@dataclass
class Outcome:
    fault: Fault | None
    ranks: dict[int, RankEnd]
    launchers: list[str] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"fault {self.fault}:"]
        for rank, end in sorted(self.ranks.items()):
            lines.append(f"  rank {rank}: exit code {end.code}, after {end.seconds} s")
        for rank, end in sorted(self.ranks.items()):
            lines.append(f"===== rank {rank} =====\n{end.output[-4000:]}")
        for index, output in enumerate(self.launchers):
            lines.append(f"===== launcher {index} =====\n{output[-3000:]}")
        return "\n".join(lines)


def launch(
    out_dir: Path,
    fault: Fault | None,
    *,
    launcher: str = "lightning",
    world: int = 4,
    nodes: int = 1,
    timeout: float | None = 30.0,
    after_step: int = 2,
    wait: float = 60.0,
    args: tuple[str, ...] = (),
) -> Outcome:
    """Start a run of ``world`` ranks on ``nodes`` launchers, inject ``fault`` once every rank has finished
    ``after_step`` steps (None: none; the run ends by itself), and wait up to ``wait`` seconds for every rank to
    exit (but one that ``fault`` stopped). ``timeout``: the strategy's (None: its default)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    options = [str(out_dir), f"--devices={world // nodes}", f"--nodes={nodes}", *args]
    options += [] if timeout is None else [f"--timeout={timeout}"]
    libc = ctypes.CDLL(None)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    processes = _start(out_dir, launcher, world, nodes, options)
    try:
        pids = _wait_for_training(out_dir, processes, world, after_step)
        begin = time.monotonic()
        if fault is not None:
            _inject(fault, pids, processes)
        watched = {
            rank: pid
            for rank, pid in pids.items()
            if fault is None or fault.signal != signal.SIGSTOP or rank != fault.target
        }
        ended = _watch(watched, processes, begin, wait)
    finally:
        _stop(processes, out_dir, world)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    launchers = [(out_dir / f"launcher{i}.log").read_text(errors="replace") for i in range(len(processes))]
    codes = _torchrun_codes("\n".join(launchers))
    ranks = {}
    for rank, pid in pids.items():
        code, seconds = ended.get(rank, (None, None))
        output = (out_dir / f"rank{rank}.log").read_text(errors="replace")
        if code is None:
            code = codes.get(pid, _read_int(out_dir / f"rank{rank}.exit"))
        ranks[rank] = RankEnd(code, seconds, output)
    return Outcome(fault, ranks, launchers)


def _start(out_dir: Path, launcher: str, world: int, nodes: int, options: list[str]) -> list[subprocess.Popen]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if launcher == "slurm":
        return _start_slurm_job_step(out_dir, world, options, env)
    if launcher == "lightning":
        commands = [[sys.executable, str(SCRIPT), *options]]
    else:
        port = free_port()
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nodes}",
            f"--nproc-per-node={world // nodes}",
        ]
        torchrun += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=faults-{port}"]
        torchrun += ["--local-addr=127.0.0.1", "--max-restarts=0"]
        commands = [[*torchrun, str(SCRIPT), *options]] * nodes
    processes = []
    for index, command in enumerate(commands):
        with (out_dir / f"launcher{index}.log").open("wb") as log:
            processes.append(
                subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
        if launcher == "torchrun" and index == 0:
            _wait_for_rendezvous(port, processes[0], out_dir)
    return processes


SLURM_JOB_ID = "4242"
SCONTROL = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/../scontrol.log"
"""


def _start_slurm_job_step(out_dir: Path, world: int, options: list[str], env: dict) -> list[subprocess.Popen]:
    """Every rank as srun starts it on one node: a process of its own with SLURM's variables."""
    stand_ins = out_dir / "bin"
    stand_ins.mkdir(exist_ok=True)
    (stand_ins / "scontrol").write_text(SCONTROL)
    (stand_ins / "scontrol").chmod(0o755)
    slurm = {
        "SLURM_JOB_ID": SLURM_JOB_ID,
        "SLURM_JOB_NAME": "faults",
        "SLURM_NTASKS": str(world),
        "SLURM_NTASKS_PER_NODE": str(world),
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "127.0.0.1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PATH": f"{stand_ins}{os.pathsep}{env['PATH']}",
    }
    processes = []
    for rank in range(world):
        rank_env = {**env, **slurm, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}
        with (out_dir / f"launcher{rank}.log").open("wb") as log:
            command = [sys.executable, str(SCRIPT), *options]
            processes.append(
                subprocess.Popen(command, env=rank_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
    return processes


def _wait_for_rendezvous(port: int, agent: subprocess.Popen, out_dir: Path) -> None:
    """Until the first agent serves the rendezvous store: on a cluster, the node named by ``--rdzv-endpoint`` serves
    it. Agents started together on one machine would race for the port, and the store would sometimes live in the
    agent of the node that loses a rank, whose exit then breaks the other agent before it reports its rank's exit."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and agent.poll() is None:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the first torchrun agent did not serve its rendezvous in 60 s:\n{_logs(out_dir)}")


def _wait_for_training(out_dir: Path, processes: list, world: int, after_step: int) -> dict[int, int]:
    """Every rank's pid, once every rank has finished ``after_step`` steps."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        steps = [_read_int(out_dir / f"rank{rank}.step") for rank in range(world)]
        if all(step is not None and step >= after_step for step in steps):
            return {rank: _read_int(out_dir / f"rank{rank}.pid") for rank in range(world)}
        if any(process.poll() is not None for process in processes):
            raise RuntimeError(f"a launcher exited before training ran:\n{_logs(out_dir)}")
        time.sleep(0.1)
    raise TimeoutError(f"training did not reach step {after_step} in 180 s:\n{_logs(out_dir)}")


def _inject(fault: Fault, pids: dict[int, int], processes: list[subprocess.Popen]) -> None:
    if fault.target == "group":
        os.killpg(processes[0].pid, fault.signal)
    elif fault.target == "all":
        for pid in pids.values():
            os.kill(pid, fault.signal)
    elif fault.target == "launcher":
        os.kill(processes[0].pid, fault.signal)
    else:
        os.kill(pids[fault.target], fault.signal)


def _watch(pids: dict[int, int], processes: list, begin: float, wait: float) -> dict[int, tuple[int | None, float]]:
    """(exit code, seconds after ``begin``) of each rank that exits within ``wait`` seconds."""
    ended: dict[int, tuple[int | None, float]] = {}
    reaped: dict[int, int] = {}
    rank_of = {pid: rank for rank, pid in pids.items()}
    while len(ended) < len(pids) and time.monotonic() < begin + wait:
        reaped.update(_reap())
        now = time.monotonic() - begin
        for pid, rank in rank_of.items():
            if rank in ended:
                continue
            if pid in reaped:
                ended[rank] = (reaped[pid], now)
            else:
                state = _state(pid)
                if state is None or state[0] == "Z":
                    ended[rank] = (state[1] if state else None, now)
        time.sleep(0.05)
    for process in processes:  # launchers this process reaped itself
        if process.pid in reaped and process.returncode is None:
            process.returncode = reaped[process.pid]
    return ended


def _reap() -> dict[int, int]:
    """Exit codes of this process's children (launchers, and ranks orphaned by a launcher) that have exited."""
    codes = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return codes
        if pid == 0:
            return codes
        codes[pid] = os.waitstatus_to_exitcode(status)


def _state(pid: int) -> tuple[str, int] | None:
    """A process's state letter and, for a zombie, its exit code as waitpid would give it; None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], os.waitstatus_to_exitcode(int(fields[-1])) if fields[0] == "Z" else 0


def _stop(processes: list[subprocess.Popen], out_dir: Path, world: int, grace: float = 15) -> None:
    """Give the launchers ``grace`` seconds to exit (torchrun prints its failure summary), then kill what is left of
    each launcher's session, and every rank, and reap them."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(process.poll() is None for process in processes):
        time.sleep(0.1)
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for rank in range(world):
        pid = _read_int(out_dir / f"rank{rank}.pid")
        if pid is not None and _state(pid) is not None and _runs_the_script(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    time.sleep(0.2)
    _reap()


def _torchrun_codes(output: str) -> dict[int, int]:
    """pid -> exit code of each worker in torchrun's failure summary."""
    found = re.findall(r"exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)", output)
    return {int(pid): int(code) for code, pid in found}


def _runs_the_script(pid: int) -> bool:
    """Whether process ``pid`` is still a rank of :data:`SCRIPT`: a rank that has exited may have left its pid to
    another process (under a loaded suite, a data test's worker was killed this way)."""
    try:
        return SCRIPT.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _logs(out_dir: Path) -> str:
    return "\n".join(
        f"===== {path.name} =====\n{path.read_text(errors='replace')[-3000:]}" for path in sorted(out_dir.glob("*.log"))
    )
