"""Multi-node training without GPUs: two launchers on this machine stand for two nodes of 2 processes.

With torchrun, they meet in a c10d rendezvous, as launchers on real nodes do, and each runs multinode_train.py: a
real ``Trainer(num_nodes=2, devices=2)`` with dp_replicate=2 x tp=2 for 3 AdamW steps, in parity with a single
process. With Lightning's own launcher, each is the README's ``lightning-automodel fit`` command with its
NODE_RANK, and Lightning starts the node's second process itself. Every rank writes what it measured to a JSON
file; the tests cross-check the files against which launcher each rank really ran under, which Lightning never
sees.
"""

from __future__ import annotations

import csv
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback
from multinode_train import group_ranks

from lightning_automodel.testing.harness import free_port
from lightning_automodel.testing.parity import WEIGHT_TOLERANCE

TESTS = Path(__file__).parent
SCRIPT = TESTS / "multinode_train.py"
DEMO = TESTS.parent / "examples" / "demo.yaml"
LAUNCHERS = 2
PROCESSES_PER_LAUNCHER = 2
WORLD = LAUNCHERS * PROCESSES_PER_LAUNCHER
TIMEOUT = 240  # seconds for both launchers; a run takes ~20 s on 2 cores
GRACE = 15  # seconds the processes of stopped launchers get to exit before they are killed

Start = Callable[[int, int, Path], subprocess.Popen]  # (launcher, port, log) -> the launcher's process


def start(command: list[str], log: Path, launcher: int, cwd: Path | None = None, **env: str) -> subprocess.Popen:
    """A launcher in a session of its own, writing to ``log``: stop() can then signal it with every process it
    started, by its process group. Unbuffered: what a process printed before it hung reaches the log, though it
    is killed. MULTINODE_LAUNCHER tells every process below it which launcher it runs under."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MULTINODE_LAUNCHER": str(launcher), **env}
    with log.open("wb") as output:
        return subprocess.Popen(
            command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )


def torchrun(out_dir: Path, launcher: int, port: int, log: Path) -> subprocess.Popen:
    """One "node": a torchrun agent (the interpreter running pytest, so the same environment) and its workers.

    ``--node-rank`` is left out: the c10d rendezvous ignores it (torchrun warns) and numbers the nodes itself, in
    the order of the agents' (address, pid), so the launcher started first need not be node 0.
    ``--local-addr``: the agent that becomes node 0 publishes this address as MASTER_ADDR for every worker; by
    default it publishes ``socket.getfqdn()``, which a CI container's hostname may not resolve to. Gloo needs no
    GLOO_SOCKET_IFNAME here: it binds to the address the hostname resolves to, or to loopback if that fails,
    and either one reaches this same machine.
    Both agents take the loopback endpoint for their own address, so both try to host the rendezvous store: one
    binds the port, the other fails to and joins it as a client, which torch's c10d backend allows for.
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={LAUNCHERS}",
        f"--nproc-per-node={PROCESSES_PER_LAUNCHER}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=lam-multinode-{port}",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
        str(SCRIPT),
        str(out_dir),
    ]
    return start(command, log, launcher)


def lightning_cli(work_dir: Path, launcher: int, port: int, log: Path) -> subprocess.Popen:
    """One "node" as the README's "Lightning's own launcher" recipe (examples/launch/lightning.sh) runs it: the
    CLI with the node's NODE_RANK and node 0's MASTER_ADDR/MASTER_PORT. Lightning's LightningEnvironment reads
    them, and its subprocess launcher starts the node's other process by running the same command again.

    The demo at dp_replicate=2 x tp=2 with sequence parallel, cut to 4 steps on a corpus of 200 documents;
    validation and the checkpoint at the last step. RecordLayout (below, importable through PYTHONPATH) writes
    each rank's view to ``work_dir``, the working directory of both "nodes": their shared file system.
    The strategy's timeout bounds a collective that waits for a rank that is gone, so its error reaches the log.
    """
    command = [
        sys.executable,
        "-m",
        "lightning_automodel.cli",
        "fit",
        f"--config={DEMO}",
        f"--trainer.num_nodes={LAUNCHERS}",
        f"--trainer.devices={PROCESSES_PER_LAUNCHER}",
        f"--trainer.strategy.init_args.dp_replicate={LAUNCHERS}",
        f"--trainer.strategy.init_args.tp={PROCESSES_PER_LAUNCHER}",
        "--trainer.strategy.init_args.sp=true",
        "--trainer.strategy.init_args.timeout=0:01:00",  # jsonargparse reads a timedelta as h:m:s
        "--trainer.max_steps=4",
        "--trainer.val_check_interval=4",
        "--trainer.num_sanity_val_steps=0",
        "--data.init_args.num_documents=200",
        "--data.init_args.val_documents=20",
        f"--trainer.callbacks+={__name__}.RecordLayout",
    ]
    python_path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    environment = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(launcher)}
    return start(command, log, launcher, cwd=work_dir, PYTHONPATH=python_path, **environment)


class RecordLayout(Callback):
    """Every rank's view of the world, for the test to cross-check: ``rank<global rank>.json`` in the working
    directory. The CLI prints rank 0's view only, and a callback is the one way into its processes from the
    command line (``--trainer.callbacks+=test_multinode.RecordLayout``). Written when fit starts, before the
    collectives of training: every rank's file is complete by the time both launchers have exited."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        record = {
            "launcher": int(os.environ["MULTINODE_LAUNCHER"]),
            "node_rank": trainer.node_rank,
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "environment": type(strategy.cluster_environment).__name__,
            "pid": os.getpid(),
            "parent_pid": os.getppid(),
            "groups": {dim: group_ranks(strategy, dim) for dim in ("dp_replicate", "tp")},
        }
        Path(f"rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))


def wait(launchers: list[subprocess.Popen], timeout: float) -> bool:
    """Until every launcher has exited or one has failed (the other would wait for it): False if time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [launcher.poll() for launcher in launchers]
        if None not in codes or any(code not in (None, 0) for code in codes):
            return True
        time.sleep(0.2)
    return False


def signal_group(launcher: subprocess.Popen, signum: int) -> None:
    """Signal every process left in the launcher's session (start() made it the group's leader)."""
    try:
        os.killpg(launcher.pid, signum)
    except ProcessLookupError:  # all have exited
        pass


def stop(launchers: list[subprocess.Popen]) -> None:
    """SIGTERM first, to each launcher still running: torchrun forwards it to its workers, which run in sessions
    of their own and would outlive a killed agent. SIGKILL whatever is left after a grace period, in each
    launcher's process group: Lightning's launcher kills the processes it started only on Ctrl-C, so when its
    own process fails they live on, waiting in collectives for as long as the process-group timeout."""
    for launcher in launchers:
        if launcher.poll() is None:
            signal_group(launcher, signal.SIGTERM)
    deadline = time.monotonic() + GRACE
    for launcher in launchers:
        try:
            launcher.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            pass
        signal_group(launcher, signal.SIGKILL)
        launcher.wait()


def launch(out_dir: Path, start_launcher: Start, name: str) -> tuple[list[int], list[str]]:
    """Run both launchers, each logging to ``out_dir``; fail with both outputs unless both exit 0 in time.
    The launchers' process ids and outputs."""
    port = free_port()
    logs = [out_dir / f"launcher{i}.log" for i in range(LAUNCHERS)]
    launchers = [start_launcher(i, port, log) for i, log in enumerate(logs)]
    try:
        finished = wait(launchers, TIMEOUT)
    finally:
        stop(launchers)
    codes = [launcher.returncode for launcher in launchers]
    outputs = [log.read_text(errors="replace") for log in logs]
    if not finished or codes != [0] * LAUNCHERS:
        report = "\n".join(
            f"===== launcher {i} (exit code {code}) =====\n{output}"
            for i, (code, output) in enumerate(zip(codes, outputs, strict=True))
        )
        what = f"exited with {codes}" if finished else f"were still running after {TIMEOUT}s and were stopped"
        pytest.fail(f"{name} launchers {what}\n{report}")
    return [launcher.pid for launcher in launchers], outputs


def read_results(out_dir: Path) -> dict[int, dict]:
    """The JSON files of every rank, by global rank; fail unless each of the world's ranks wrote one."""
    results = {r["global_rank"]: r for r in (json.loads(path.read_text()) for path in out_dir.glob("rank*.json"))}
    assert sorted(results) == list(range(WORLD)), f"results of ranks {sorted(results)} only"
    return results


def check_nodes_are_launchers(results: dict[int, dict]) -> None:
    """Lightning's node ranks and the mesh groups, against the launcher each rank really ran under."""
    launcher_of = {rank: r["launcher"] for rank, r in results.items()}
    launchers = sorted(set(launcher_of.values()))
    nodes = {
        launcher: sorted({r["node_rank"] for r in results.values() if r["launcher"] == launcher})
        for launcher in launchers
    }
    assert sorted(nodes.values()) == [[node] for node in range(LAUNCHERS)], f"node ranks of each launcher: {nodes}"
    for rank, r in results.items():
        replicas = sorted(launcher_of[peer] for peer in r["groups"]["dp_replicate"])
        assert replicas == launchers, f"rank {rank}: dp_replicate group {r['groups']} must take one rank per node"
        tp_peers = {launcher_of[peer] for peer in r["groups"]["tp"]}
        assert len(tp_peers) == 1, f"rank {rank}: tp group {r['groups']} must stay within one node"


def check_rank_zero_weights_won(results: dict[int, dict]) -> None:
    """Every rank started from weights of its own, far from rank 0's; yet each trained like a single process
    started from rank 0's (multinode_train.py asserts that): rank 0's weights reached every rank."""
    seeds = sorted(r["seed"] for r in results.values())
    assert seeds == list(range(WORLD)), f"ranks must be built from different seeds: {seeds}"
    differences = {rank: r["initial_difference"] for rank, r in results.items() if r["seed"] != 0}
    assert min(differences.values()) > 10 * WEIGHT_TOLERANCE, (
        f"ranks but 0 must start far from rank 0's weights: {differences}"
    )


def check_lightning_started_the_processes(results: dict[int, dict], pids: list[int]) -> None:
    """One world of the processes of both launchers, as Lightning's own environment and launcher set it up:
    each launcher's local rank 0 is the process the test started, the other one that process's child."""
    for rank, r in results.items():
        seen = (r["environment"], r["world_size"], r["num_nodes"])
        assert seen == ("LightningEnvironment", WORLD, LAUNCHERS), f"rank {rank}: (environment, world, nodes) {seen}"
    for launcher, pid in enumerate(pids):
        ranks = {r["local_rank"]: r for r in results.values() if r["launcher"] == launcher}
        assert sorted(ranks) == list(range(PROCESSES_PER_LAUNCHER)), f"launcher {launcher}: local ranks {ranks}"
        processes = {local: (r["pid"], r["parent_pid"]) for local, r in ranks.items()}
        assert processes[0][0] == pid, f"launcher {launcher} (pid {pid}): local rank 0 must be it, not {processes}"
        children = [parent for local, (_, parent) in processes.items() if local > 0]
        assert children == [pid] * (PROCESSES_PER_LAUNCHER - 1), f"launcher {launcher} (pid {pid}) {processes}"


def print_results(results: dict[int, dict], *keys: str) -> None:
    """Each rank's place, and ``keys`` of what it measured, in the test's output (``pytest -s``)."""
    for rank, r in sorted(results.items()):
        measured = "".join(f", {key} {r[key]}" for key in keys)
        print(f"rank {rank}: launcher {r['launcher']}, node {r['node_rank']}, groups {r['groups']}{measured}")


def test_two_nodes_train_like_one_process(tmp_path):
    begin = time.monotonic()
    launch(tmp_path, functools.partial(torchrun, tmp_path), "torchrun")
    print(f"{LAUNCHERS} torchrun launchers of {PROCESSES_PER_LAUNCHER} processes: {time.monotonic() - begin:.1f}s")
    results = read_results(tmp_path)
    print_results(results, "initial_difference", "errors")
    check_nodes_are_launchers(results)
    check_rank_zero_weights_won(results)


@pytest.mark.sweep
def test_lightning_launcher_on_two_nodes(tmp_path):
    """The README's "Lightning's own launcher" recipe on two "nodes" of this machine: both commands exit 0 in one
    world with the replicas across the nodes; global rank 0 alone prints the summary and writes the logs, and
    the ranks of both nodes write one checkpoint into the shared working directory."""
    begin = time.monotonic()
    pids, outputs = launch(tmp_path, functools.partial(lightning_cli, tmp_path), "lightning-automodel")
    print(f"{LAUNCHERS} Lightning launchers of {PROCESSES_PER_LAUNCHER} processes: {time.monotonic() - begin:.1f}s")
    results = read_results(tmp_path)
    print_results(results, "pid", "parent_pid")
    check_lightning_started_the_processes(results, pids)
    check_nodes_are_launchers(results)
    summaries = [output.count("Training summary") for output in outputs]
    first_node = results[0]["launcher"]
    assert summaries == [int(i == first_node) for i in range(LAUNCHERS)], f"summaries printed per launcher {summaries}"
    versions = list((tmp_path / "lightning_logs").iterdir())
    assert [v.name for v in versions] == ["version_0"], f"one logger over both nodes: {versions}"
    rows = list(csv.DictReader((versions[0] / "metrics.csv").read_text().splitlines()))
    assert any(row.get("val_loss") for row in rows), f"no val_loss in metrics.csv: {rows}"
    checkpoints = list((versions[0] / "checkpoints").iterdir())
    assert len(checkpoints) == 1 and (checkpoints[0] / ".metadata").is_file(), f"one checkpoint: {checkpoints}"
