"""The coverage report's launcher: checks in launches of ``WORLD_SIZE`` gloo processes, relaunched after whatever ends
a launch (a hang, a crash of some ranks or of a process, process groups that no longer answer after a failure).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist
from transformers.utils import logging as transformers_logging

from lightning_automodel.testing.coverage_report.check import (
    COLLECTIVE_TIMEOUT,
    LAYOUTS,
    WORLD_SIZE,
    coverage_check,
    layout_mesh,
)
from lightning_automodel.testing.coverage_report.verdicts import (
    CRASH,
    HANG,
    NO_IMAGE_INPUTS,
    NO_TINY_CONFIG,
    PASS,
    REFUSAL,
    WRONG,
    classify,
    error_line,
)
from lightning_automodel.testing.harness import init_worker, launch_store, worker_context

Job = tuple[str, str]  # (model type, layout)


Check = Callable[[str, str], dict[str, Any]]


STARTUP_TIMEOUT = 300.0  # spawning processes that import torch and transformers, on two busy cores


# How long the other ranks get to report once one has failed: on busy cores the ranks of a refusal reach it seconds
# apart (each builds the single-process reference first; 5 s judged muse_spark's and kosmos-2.5's refusals on both
# ranks crashes of one). A rank left waiting in a collective reports its timeout (COLLECTIVE_TIMEOUT, 30 s) by then.
GRACE = 45.0


POLL = 1.0  # how often the launcher looks whether a process died


# After these every rank went through the same collectives, and the launch goes on with the next check.
CONTINUABLE = (PASS, WRONG, REFUSAL, NO_TINY_CONFIG, NO_IMAGE_INPUTS)


def measure(
    jobs: Sequence[Job], *, job_timeout: float, check: Check = coverage_check
) -> Iterator[tuple[int, Job, dict[str, Any]]]:
    """Run ``check`` on every job (each one different) and yield (launch number, job, verdict) as each is known.

    A launch of ``WORLD_SIZE`` processes runs the jobs in order. A hang, a crash of some ranks or of a process, or
    process groups that no longer answer after a failure end it; the next launch starts at the following job.
    """
    pending, launches = list(jobs), 0
    while pending:
        launches += 1
        for job, verdict in _launch(list(pending), job_timeout=job_timeout, check=check):
            pending.remove(job)
            yield launches, job, verdict


def _launch(jobs: list[Job], *, job_timeout: float, check: Check) -> Iterator[tuple[Job, dict[str, Any]]]:
    context = worker_context()
    # One pipe per worker: a send is written before it returns, so a process that dies next loses no report.
    pipes = [context.Pipe(duplex=False) for _ in range(WORLD_SIZE)]
    with launch_store(COLLECTIVE_TIMEOUT.total_seconds()) as port:
        workers = [
            context.Process(target=_serve, args=(rank, port, jobs, pipes[rank][1], check), daemon=True)
            for rank in range(WORLD_SIZE)
        ]
        for worker in workers:
            worker.start()
        try:
            yield from _verdicts(jobs, [reader for reader, _ in pipes], workers, job_timeout=job_timeout)
        finally:
            for worker in workers:
                worker.kill()
                worker.join()


def _verdicts(jobs: list[Job], readers, workers, *, job_timeout: float) -> Iterator[tuple[Job, dict[str, Any]]]:
    """Classify each job once every rank reported it; end the launch when a job leaves it unusable."""
    outcomes: dict[Job, list[dict | None]] = {job: [None] * WORLD_SIZE for job in jobs}
    current, deadline = jobs[0], time.monotonic() + STARTUP_TIMEOUT + job_timeout
    while True:
        ready = multiprocessing.connection.wait(readers, timeout=min(max(deadline - time.monotonic(), 0), POLL))
        if not ready:
            if time.monotonic() < deadline and all(worker.is_alive() for worker in workers):
                continue
            yield current, _stalled(outcomes[current], workers, job_timeout)
            return
        try:
            rank, job, payload = ready[0].recv()
        except EOFError:  # the process died; what it sent before is read first
            readers = [reader for reader in readers if reader is not ready[0]]
            continue
        if payload is None:  # this rank's process groups no longer answer
            if not all(outcomes[job]):  # a peer died or hangs: judge the job now, or every launch would retry it
                yield job, _stalled(outcomes[job], workers, job_timeout)
            return
        outcomes[job][rank] = payload
        if all(outcomes[job]):
            verdict = classify(outcomes[job])
            yield job, verdict
            if job == jobs[-1] or not (verdict["verdict"] in CONTINUABLE or _same_failure(outcomes[job])):
                return
        elif payload["status"] != "ran":
            deadline = min(deadline, time.monotonic() + GRACE)
        unfinished = next(job for job in jobs if not all(outcomes[job]))
        if unfinished != current:
            current, deadline = unfinished, time.monotonic() + job_timeout


def _stalled(outcomes: list[dict | None], workers, job_timeout: float) -> dict[str, Any]:
    """The verdict on a check some rank never finished: a crash if a process died or another rank failed, else a
    hang."""
    dead = [(rank, worker.exitcode) for rank, worker in enumerate(workers) if not worker.is_alive()]
    if dead:
        rank, code = dead[0]
        return {"verdict": CRASH, "detail": f"the process of rank {rank} exited with code {code}"}
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o is not None and o["status"] == "raised"]
    if failed:
        rank, outcome = failed[0]
        return {
            "verdict": CRASH,
            "detail": f"raised on rank {rank} only, the others kept waiting: {error_line(outcome)}",
        }
    waiting = [rank for rank, o in enumerate(outcomes) if o is None]
    return {"verdict": HANG, "detail": f"rank(s) {waiting} gave no result within {job_timeout:.0f} s"}


def _same_failure(outcomes: Sequence[dict[str, Any]]) -> bool:
    """Every rank raised the same error (a crash the launch survives if the process groups still answer)."""
    return all(o["status"] == "raised" for o in outcomes) and len({(o["error"], o["message"]) for o in outcomes}) == 1


def _serve(
    rank: int, port: int, jobs: Sequence[Job], reports: multiprocessing.connection.Connection, check: Check
) -> None:
    """A worker: run the jobs in order, reporting each outcome; after a failure, go on only if the process groups
    still answer (a failure that left a collective half done would garble every later check)."""
    init_worker(rank, WORLD_SIZE, port, COLLECTIVE_TIMEOUT.total_seconds())
    _quiet()
    for job in jobs:
        outcome = check(*job)
        reports.send((rank, job, outcome))
        if outcome["status"] == "raised" and not _groups_answer(LAYOUTS[job[1]]["tp"]):
            reports.send((rank, job, None))
            return
    dist.destroy_process_group()


def _groups_answer(tp: int) -> bool:
    mesh = layout_mesh(tp)
    try:
        dist.barrier()
        for dim in range(mesh.ndim):
            dist.barrier(group=mesh.get_group(dim))
    except Exception:  # noqa: BLE001 - whatever the failure, the launch must end
        return False
    return True


def _quiet() -> None:
    """Tiny configs trip transformers' warnings about sizes (token ids past the vocabulary, rope lengths), and
    torch warns of every strided redistribution: noise in a sweep of hundreds of models."""
    transformers_logging.set_verbosity_error()
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
