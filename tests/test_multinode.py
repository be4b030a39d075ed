"""Multi-node training without GPUs: two torchrun launchers on this machine stand for two nodes of 2 processes.

They meet in a c10d rendezvous, as launchers on real nodes do, and each runs multinode_train.py: a real
``Trainer(num_nodes=2, devices=2)`` with dp_replicate=2 x tp=2 for 3 AdamW steps, in parity with a single process.
Every rank writes what it measured to a JSON file; this test cross-checks the files against which launcher each
rank really ran under, which Lightning never sees.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import free_port
from parity import WEIGHT_TOLERANCE

SCRIPT = Path(__file__).with_name("multinode_train.py")
LAUNCHERS = 2
PROCESSES_PER_LAUNCHER = 2
WORLD = LAUNCHERS * PROCESSES_PER_LAUNCHER
TIMEOUT = 240  # seconds for both launchers; a run takes ~20 s on 2 cores


def torchrun(launcher: int, port: int, out_dir: Path, log: Path) -> subprocess.Popen:
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
    # Unbuffered: what a worker printed before it hung reaches the log, though it is killed.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MULTINODE_LAUNCHER": str(launcher)}
    with log.open("wb") as output:
        return subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)


def wait(launchers: list[subprocess.Popen], timeout: float) -> bool:
    """Until every launcher has exited or one has failed (the other would wait for it): False if time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [launcher.poll() for launcher in launchers]
        if None not in codes or any(code not in (None, 0) for code in codes):
            return True
        time.sleep(0.2)
    return False


def stop(launchers: list[subprocess.Popen]) -> None:
    """SIGTERM first: torchrun forwards it to its workers, which run in sessions of their own and would outlive a
    killed agent. SIGKILL whatever is left after a grace period."""
    for launcher in launchers:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
    for launcher in launchers:
        try:
            launcher.wait(timeout=15)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()


def launch(out_dir: Path) -> None:
    """Run both launchers; fail with both outputs unless both exit 0 in time."""
    port = free_port()
    logs = [out_dir / f"launcher{i}.log" for i in range(LAUNCHERS)]
    launchers = [torchrun(i, port, out_dir, log) for i, log in enumerate(logs)]
    try:
        finished = wait(launchers, TIMEOUT)
    finally:
        stop(launchers)
    codes = [launcher.returncode for launcher in launchers]
    if not finished or codes != [0] * LAUNCHERS:
        outputs = "\n".join(
            f"===== launcher {i} (exit code {code}) =====\n{log.read_text(errors='replace')}"
            for i, (code, log) in enumerate(zip(codes, logs, strict=True))
        )
        what = f"exited with {codes}" if finished else f"were still running after {TIMEOUT}s and were stopped"
        pytest.fail(f"torchrun launchers {what}\n{outputs}")


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


def test_two_nodes_train_like_one_process(tmp_path):
    start = time.monotonic()
    launch(tmp_path)
    results = {r["global_rank"]: r for r in (json.loads(path.read_text()) for path in tmp_path.glob("rank*.json"))}
    print(f"{LAUNCHERS} launchers of {PROCESSES_PER_LAUNCHER} processes: {time.monotonic() - start:.1f}s")
    for rank, r in sorted(results.items()):
        print(
            f"rank {rank}: launcher {r['launcher']}, node {r['node_rank']}, groups {r['groups']},"
            f" initial weights {r['initial_difference']:.3g} from rank 0's; errors against one process {r['errors']}"
        )
    assert sorted(results) == list(range(WORLD)), f"results of ranks {sorted(results)} only"
    check_nodes_are_launchers(results)
    check_rank_zero_weights_won(results)
