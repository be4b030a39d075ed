"""Who measures a search's candidates: this process, or child processes of its own, one job each per wave.

A candidate's measurement runs the code in a fake world of its own, so candidates are measured in separate processes
side by side; the strategy spreads them over the ranks of the job (each rank's child measures one job a wave, and the
ranks exchange the outcomes), ``lightning-automodel plan`` over ``--workers`` children of its own. A job is a
candidate's measurement, or under pp one pp rank's (:func:`jobs_of`): each pp rank's stages step apart, and a wave of
pp candidates lasts as long as its slowest stage rather than its slowest pipeline.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import time
from contextlib import ExitStack
from typing import Any

from torch import nn

from lightning_automodel.parallel.probe.remembered import probes_remembered
from lightning_automodel.planning.child_process import ChildProcess
from lightning_automodel.planning.memory.step_options import StepOptions
from lightning_automodel.planning.search.layouts import Candidate, Outcome, layout_memory

# The probes of the models this process measured: every candidate's copies of one model share them.
_PROBES: dict = {}


def measure_candidate(
    *,
    model: nn.Module,
    candidate: Candidate,
    batch_shape: tuple[int, int],
    budget: float,
    step: StepOptions,
    temporaries: dict[tuple, int] | None = None,
    pp_rank: int | None = None,
) -> Outcome | str:
    """``candidate``'s memory and the CPU time measuring it took, or the first line of its refusal (a layout the
    plan or the step refuses); ``temporaries`` and ``pp_rank``: :func:`~.layouts.layout_memory`'s."""
    started = time.process_time()
    try:
        with probes_remembered(_PROBES):
            outcome = layout_memory(
                model,
                candidate,
                batch_shape=batch_shape,
                budget=budget,
                step=step,
                temporaries=temporaries,
                pp_rank=pp_rank,
            )
    except ValueError as refusal:
        return str(refusal).splitlines()[0]
    return dataclasses.replace(outcome, seconds=time.process_time() - started)


# A wave's job: the candidate's index in the wave, and the pp rank whose stages it steps (None: every one).
Job = tuple[int, "int | None"]


def jobs_of(wave: list[Candidate]) -> list[Job]:
    """The jobs measuring ``wave``: a candidate without pp is one, a pp candidate one a pp rank."""
    return [(index, rank if c.dims.pp > 1 else None) for index, c in enumerate(wave) for rank in range(c.dims.pp)]


def combined(wave: list[Candidate], jobs: list[Job], outcomes: list[Outcome | str]) -> list[Outcome | str]:
    """Each candidate's outcome from its jobs': the first refusal, else the pp rank whose memory is the largest,
    measured in the time of the slowest job (the jobs run side by side)."""
    by_candidate: list[list[Outcome | str]] = [[] for _ in wave]
    for (index, _), outcome in zip(jobs, outcomes, strict=True):
        by_candidate[index].append(outcome)
    results: list[Outcome | str] = []
    for found in by_candidate:
        refusals = [outcome for outcome in found if isinstance(outcome, str)]
        if refusals:
            results.append(refusals[0])
            continue
        largest = max(found, key=lambda outcome: outcome.memory_bytes)
        results.append(dataclasses.replace(largest, seconds=max(outcome.seconds for outcome in found)))
    return results


class Measurements:
    """How every worker measures a candidate: :func:`measure_candidate`'s arguments but the candidate."""

    def __init__(self, model: nn.Module, *, batch_shape: tuple[int, int], budget: float, step: StepOptions) -> None:
        self.job = dict(model=model, batch_shape=batch_shape, budget=budget, step=step)
        self._temporaries: dict[tuple, int] = {}  # the optimizer step's, of the layouts measured here

    def here(self, wave: list[Candidate]) -> list[Outcome | str]:
        """The wave measured in this process, one after another (outside any process group), each layout's optimizer
        step once for all its checkpointing settings."""
        return [measure_candidate(candidate=c, temporaries=self._temporaries, **self.job) for c in wave]

    def submit(self, child: ChildProcess, candidate: Candidate, *, pp_rank: int | None = None) -> None:
        child.submit(measure_candidate, {**self.job, "candidate": candidate, "pp_rank": pp_rank})


class ChildWorkers:
    """``count`` child processes, each measuring one job of a wave at a time; as a context manager, they end with
    it."""

    def __init__(self, measurements: Measurements, *, count: int, purpose: str = "the layout search") -> None:
        self.measurements, self.count = measurements, count
        threads = max(1, (os.cpu_count() or 1) // count)
        self._stack = ExitStack()
        self._children = [
            self._stack.enter_context(ChildProcess(purpose=purpose, threads=threads)) for _ in range(count)
        ]

    def __call__(self, wave: list[Candidate]) -> list[Outcome | str]:
        """The wave's outcomes, in its order; each child takes the next job as soon as it is done."""
        jobs = jobs_of(wave)
        outcomes: dict[int, Outcome | str] = {}
        pending = list(enumerate(jobs))
        busy: dict[ChildProcess, int] = {}
        with selectors.DefaultSelector() as ready:
            for child in self._children:
                ready.register(child.replies, selectors.EVENT_READ, child)
            while pending or busy:
                for child in self._children:
                    if child not in busy and pending:
                        index, (candidate, pp_rank) = pending.pop(0)
                        self.measurements.submit(child, wave[candidate], pp_rank=pp_rank)
                        busy[child] = index
                for key, _ in ready.select():
                    child = key.data
                    if child in busy:
                        outcomes[busy.pop(child)] = child.result()
        return combined(wave, jobs, [outcomes[index] for index in range(len(jobs))])

    @property
    def pids(self) -> list[int]:
        return [child.pid for child in self._children]

    def __enter__(self) -> ChildWorkers:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stack.close()
