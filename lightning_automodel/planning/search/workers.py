"""Who measures a search's candidates: this process, or child processes of its own, one candidate each per wave.

A candidate's measurement runs the code in a fake world of its own, so candidates are measured in separate processes
side by side; the strategy spreads them over the ranks of the job (each rank's child measures one candidate a wave,
and the ranks exchange the outcomes), ``lightning-automodel plan`` over ``--workers`` children of its own.
"""

from __future__ import annotations

import dataclasses
import os
import selectors
import time
from contextlib import ExitStack
from typing import Any

from torch import nn

from lightning_automodel.planning.child_process import ChildProcess
from lightning_automodel.planning.memory.step_options import StepOptions
from lightning_automodel.planning.search.layouts import Candidate, Outcome, layout_memory


def measure_candidate(
    *,
    model: nn.Module,
    candidate: Candidate,
    batch_shape: tuple[int, int],
    budget: float,
    step: StepOptions,
    temporaries: dict[tuple, int] | None = None,
) -> Outcome | str:
    """``candidate``'s memory and the CPU time measuring it took, or the first line of its refusal (a layout the
    plan or the step refuses); ``temporaries``: :func:`~.layouts.layout_memory`'s."""
    started = time.process_time()
    try:
        outcome = layout_memory(
            model, candidate, batch_shape=batch_shape, budget=budget, step=step, temporaries=temporaries
        )
    except ValueError as refusal:
        return str(refusal).splitlines()[0]
    return dataclasses.replace(outcome, seconds=time.process_time() - started)


class Measurements:
    """How every worker measures a candidate: :func:`measure_candidate`'s arguments but the candidate."""

    def __init__(self, model: nn.Module, *, batch_shape: tuple[int, int], budget: float, step: StepOptions) -> None:
        self.job = dict(model=model, batch_shape=batch_shape, budget=budget, step=step)
        self._temporaries: dict[tuple, int] = {}  # the optimizer step's, of the layouts measured here

    def here(self, wave: list[Candidate]) -> list[Outcome | str]:
        """The wave measured in this process, one after another (outside any process group), each layout's optimizer
        step once for all its checkpointing settings."""
        return [measure_candidate(candidate=c, temporaries=self._temporaries, **self.job) for c in wave]

    def submit(self, child: ChildProcess, candidate: Candidate) -> None:
        child.submit(measure_candidate, {**self.job, "candidate": candidate})


class ChildWorkers:
    """``count`` child processes, each measuring one candidate of a wave; as a context manager, they end with it."""

    def __init__(self, measurements: Measurements, *, count: int, purpose: str = "the layout search") -> None:
        self.measurements, self.count = measurements, count
        threads = max(1, (os.cpu_count() or 1) // count)
        self._stack = ExitStack()
        self._children = [
            self._stack.enter_context(ChildProcess(purpose=purpose, threads=threads)) for _ in range(count)
        ]

    def __call__(self, wave: list[Candidate]) -> list[Outcome | str]:
        """The wave's outcomes, in its order; each child takes the next candidate as soon as it is done."""
        outcomes: dict[int, Outcome | str] = {}
        pending = list(enumerate(wave))
        busy: dict[ChildProcess, int] = {}
        with selectors.DefaultSelector() as ready:
            for child in self._children:
                ready.register(child.replies, selectors.EVENT_READ, child)
            while pending or busy:
                for child in self._children:
                    if child not in busy and pending:
                        index, candidate = pending.pop(0)
                        self.measurements.submit(child, candidate)
                        busy[child] = index
                for key, _ in ready.select():
                    child = key.data
                    if child in busy:
                        outcomes[busy.pop(child)] = child.result()
        return [outcomes[index] for index in range(len(wave))]

    @property
    def pids(self) -> list[int]:
        return [child.pid for child in self._children]

    def __enter__(self) -> ChildWorkers:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stack.close()
