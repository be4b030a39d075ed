"""Run checks on N gloo processes in one launch, each launch bounded by a timeout.

Starting a process group and importing transformers costs seconds per launch on 2 cores, so a test passes a
list of checks: they run one after another in the same processes, and every rank's failure is reported with
the check's name. A launch that outlives its timeout is killed and fails the test instead of blocking CI.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import queue
import random
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

Check = Callable[[], Any]
STACKS_SIGNAL = signal.SIGUSR1


class ChecksFailed(AssertionError):
    """A launch's failure: a check failed on some rank, a rank crashed, or the launch timed out (an assertion, so
    that pytest reports it as a test's failure; the harness itself needs no pytest, which benchmarks run without)."""


# What every worker imports, once per test session: workers fork from a server process that imported these (a
# spawned worker imports them anew, about 4 seconds of a core each on 2 cores, which the hundreds of launches repeat).
PRELOADED = ("torch", "torch.distributed", "transformers", "peft", "lightning", "lightning_automodel")


def worker_context() -> multiprocessing.context.BaseContext:
    """Processes started from a fork server that has imported :data:`PRELOADED`: each starts in a fresh process
    image, as a spawned one does (nothing of the test process's state but its environment when the server
    started: workers set theirs in :func:`init_worker`)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))
    return context


def free_port() -> int:
    """A free port for a launcher that binds it later (torchrun, Lightning's launcher), drawn below the range the OS
    hands out to binds of port 0: between this check and the launcher's bind, no other launch's sockets (gloo's pairs,
    a store's) are given it unasked."""
    ports = Path("/proc/sys/net/ipv4/ip_local_port_range")
    lowest_ephemeral = int(ports.read_text().split()[0]) if ports.exists() else 32768  # Linux's default elsewhere
    # A random source of its own: checks seed Python's, and two workers seeded alike would draw the same ports.
    for port in random.SystemRandom().sample(range(10_000, lowest_ephemeral), 100):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port among 100 drawn from 10000-{lowest_ephemeral - 1}")


@contextmanager
def launch_store(pg_timeout: float) -> Iterator[int]:
    """The port of a c10d store this process serves to a launch's ranks while the launch lasts. The OS picks the port
    and the store holds it from the start: a port found free, released and then bound by a rank could be taken in
    between by another launch (two pytest workers launch at once)."""
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=pg_timeout))
    try:
        yield store.port
    finally:
        del store


def init_worker(rank: int, world_size: int, port: int, pg_timeout: float) -> None:
    """Make this spawned process rank ``rank`` of a gloo world, with one thread, whose collectives time out, on the
    store the launcher serves at ``port`` (:func:`launch_store`)."""
    # A LightningCLI run in the pytest process (seed_everything) exports a global seed that every Trainer here would
    # re-seed from, overriding the seeds the checks set: the workers start without it.
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        os.environ.pop(name, None)
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "NODE_RANK": "0",
            "OMP_NUM_THREADS": "1",
        }
    )
    torch.set_num_threads(1)
    timeout = timedelta(seconds=pg_timeout)
    store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timeout)  # the launcher's
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


def _worker(rank: int, world_size: int, port: int, checks: Sequence[Check], results: Any, pg_timeout: float) -> None:
    try:
        init_worker(rank, world_size, port, pg_timeout)
    except BaseException:  # reported at once, rather than left to the launch's timeout
        results.put((rank, "init_worker", "failed", traceback.format_exc()))
        return
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # a launch that times out prints where each rank is
    faulthandler.enable(all_threads=True)  # a rank that crashes (a signal such as SIGSEGV) prints where it was
    try:
        for check in checks:
            name = check_name(check)
            try:
                results.put((rank, name, "ok", check()))
            except BaseException:  # report and stop: the other ranks will time out of their next collective
                results.put((rank, name, "failed", traceback.format_exc()))
                return
    finally:
        dist.destroy_process_group()


def run_checks(
    world_size: int,
    checks: Sequence[Check],
    *,
    timeout: float = 240,
    pg_timeout: float = 60,
    fresh_interpreters: bool = False,
) -> dict:
    """Run ``checks`` in order on ``world_size`` gloo ranks; return {check name: [result of rank 0, 1, ...]}.

    The whole launch must report within ``timeout`` seconds; ``pg_timeout`` bounds each collective.
    ``fresh_interpreters``: spawn each rank as launchers do, with a hash seed of its own (ranks forked from one server
    share the server's, and iterate sets alike: a rank order that differs between ranks would go unseen).

    Checks must be picklable (module-level functions or functools.partial of them).
    """
    context = multiprocessing.get_context("spawn") if fresh_interpreters else worker_context()
    with launch_store(pg_timeout) as port:
        results = context.Queue()
        processes = [
            context.Process(target=_worker, args=(rank, world_size, port, checks, results, pg_timeout), daemon=True)
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        collected: dict[str, list[Any]] = {}
        failures: list[str] = []
        expected = world_size * len(checks)
        received = 0
        deadline = time.monotonic() + timeout
        finished = False
        try:
            while received < expected and not failures:
                try:
                    rank, name, status, value = results.get(timeout=max(deadline - time.monotonic(), 0.01))
                except queue.Empty:
                    _print_stacks(processes)
                    message = f"distributed checks timed out after {timeout}s; results so far: {sorted(collected)}"
                    raise ChecksFailed(f"{message} (each rank's threads are printed above)") from None
                received += 1
                if status == "failed":
                    failures.append(f"rank {rank}, check {name}:\n{value}")
                collected.setdefault(name, [None] * world_size)[rank] = value
            finished = not failures
            if failures:
                failures += _later_failures(results)
        finally:
            # After a failure or a timeout the other ranks may sit in a collective: don't wait for them.
            grace = 60 if finished else 0.5
            for process in processes:
                process.join(timeout=grace)
                if process.is_alive():
                    process.kill()
        if failures:
            exit_codes = [process.exitcode for process in processes]
            raise ChecksFailed("\n".join(failures) + f"\nexit codes of ranks 0..{world_size - 1}: {exit_codes}")
        crashed = [p.exitcode for p in processes if p.exitcode not in (0, -signal.SIGKILL)]
        if crashed:
            raise ChecksFailed(f"ranks exited with codes {crashed} after reporting their results")
        return collected


def _print_stacks(processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
    """Every live rank's Python threads on its stderr: where a launch hangs (a collective one rank never reached)."""
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, STACKS_SIGNAL)
    time.sleep(2)


def _later_failures(results: Any, wait: float = 3.0) -> list[str]:
    """Failures other ranks report just after the first: the first received is often a peer's "connection closed"
    rather than the rank that caused it."""
    failures, deadline = [], time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            rank, name, status, value = results.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            break
        if status == "failed":
            failures.append(f"rank {rank}, check {name}:\n{value}")
    return failures


def shared_directory() -> Path:
    """Inside a worker: a fresh temporary directory, the same path on every rank."""
    path = [tempfile.mkdtemp(prefix="lam-test-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return Path(path[0])


def check_name(check: Check) -> str:
    """A name that is the same in every process (a partial's repr, or a function argument's, holds an address)."""
    func = getattr(check, "func", check)
    args = ", ".join(
        [
            *map(_show, getattr(check, "args", ())),
            *(f"{k}={_show(v)}" for k, v in getattr(check, "keywords", {}).items()),
        ]
    )
    return f"{func.__name__}({args})"


def _show(value: Any) -> str:
    return value.__name__ if callable(value) and hasattr(value, "__name__") else repr(value)
