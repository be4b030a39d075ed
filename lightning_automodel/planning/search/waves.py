"""Searching the layouts for the fastest that fits, in waves of estimates spread over workers.

The throughput model ranks every candidate (layout and checkpointing setting) before any memory is measured, so the
answer to "the fastest that fits" is the first candidate in that order whose memory fits: the search measures
candidates from the top, a wave of as many as there are workers at a time (a pp candidate counting one a pp rank,
whose stages are measured side by side), and stops once a candidate fits and every
one ranked above it is measured. Estimates within :data:`TIE` of each other are a tie, which the throughput model is
too coarse to break: of the fits tied with the first, the least recomputing is chosen, then the smallest
(:func:`tie_ordered`), so the search measures those too. Layouts are pruned as soon as they cannot fit: the plan
refuses them, their state alone exceeds the budget, or full checkpointing (which keeps the least) does not fit.

:func:`search_layout` finds that one (``layout="auto"``); :func:`search_every_layout` resolves every layout to its
least recomputing fit (``plan --fit``'s table). Both take an :data:`Evaluate`: in this process, in child processes
(:mod:`.workers`), or spread over the ranks of a job (the strategy's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_automodel.parallel.activation_checkpointing import AC_MODES
from lightning_automodel.planning.search.layouts import Candidate, Outcome

# The outcomes of a wave of candidates, in order: an Outcome, or the first line of the refusal.
Evaluate = Callable[[list[Candidate]], list["Outcome | str"]]
# Estimated throughputs within 1% of each other tie: the model's own error is larger (it ranked the 70B example's
# runner-up 0.006% behind the first), so recomputing less, then holding less, decides between them.
TIE = 0.01


@dataclass
class SearchRecord:
    """What a search measured: each candidate's outcome, in the throughput order."""

    budget: float
    ranked: list[Candidate]
    outcomes: dict[int, Outcome | str] = field(default_factory=dict)  # index in ranked -> outcome
    waves: list[list[int]] = field(default_factory=list)  # the indices each wave measured

    def fits(self, index: int) -> bool:
        outcome = self.outcomes.get(index)
        return isinstance(outcome, Outcome) and outcome.memory_bytes <= self.budget

    def out_of_reach(self, index: int) -> bool:
        """Whether candidate ``index`` cannot fit, from what was measured: its layout refused; or a candidate that
        needs no more memory than it (itself, or a twin whose data-parallel ranks form fewer replicas of a larger
        shard group) too large, with the same setting or with full checkpointing (which keeps the least), or by its
        state alone."""
        candidate = self.ranked[index]
        for measured, outcome in self.outcomes.items():
            other = self.ranked[measured]
            if isinstance(outcome, str):
                if other.dims == candidate.dims:
                    return True
            elif outcome.memory_bytes > self.budget and _needs_no_more(other, than=candidate):
                if outcome.activation_bytes is None or other.checkpointing in ("full", candidate.checkpointing):
                    return True
        return False

    def undecided(self, index: int, *, fit: int) -> bool:
        """Whether candidate ``index``, tied with ``fit`` (which fits), could still win the tie: not measured, not out
        of reach, and not a setting recomputing as much of a layout needing no less memory than ``fit``'s."""
        if index in self.outcomes or self.out_of_reach(index):
            return False
        candidate, chosen = self.ranked[index], self.ranked[fit]
        recomputes_as_much = AC_MODES.index(candidate.checkpointing) >= AC_MODES.index(chosen.checkpointing)
        return not (recomputes_as_much and _needs_no_more(chosen, than=candidate))

    def measured(self) -> list[tuple[Candidate, Outcome | str]]:
        return [(self.ranked[index], self.outcomes[index]) for index in sorted(self.outcomes)]


def _needs_no_more(other: Candidate, *, than: Candidate) -> bool:
    """Whether ``other`` needs no more memory per GPU than ``than`` at the same setting: the same layout, or one that
    differs only in holding the data-parallel ranks as fewer replicas of a larger shard group (each rank's step is the
    same; its share of the state is smaller)."""
    a, b = other.dims, than.dims
    same_step = (a.pp, a.tp, a.cp, a.ep, other.sp, other.pipeline) == (b.pp, b.tp, b.cp, b.ep, than.sp, than.pipeline)
    return same_step and b.dp_shard <= a.dp_shard


def run_waves(record: SearchRecord, *, next_wave: Callable[[int], list[int]], evaluate: Evaluate, workers: int) -> None:
    """Evaluate the waves ``next_wave(workers)`` asks for until it asks for none."""
    while wave := next_wave(workers):
        outcomes = evaluate([record.ranked[index] for index in wave])
        record.outcomes.update(zip(wave, outcomes, strict=True))
        record.waves.append(wave)


def search_layout(ranked: list[Candidate], *, budget: float, evaluate: Evaluate, workers: int = 1) -> SearchRecord:
    """Measure ``ranked`` (best first) until the first that fits and those tied with it are known: the record's
    :func:`chosen_fit`. A layout measured too large at one setting has its full checkpointing measured next, where
    that can rule out two or more of its settings still to measure (full keeps the least); the answer is the same, in
    fewer measurements."""
    record = SearchRecord(budget, ranked)
    full = {candidate.dims: index for index, candidate in enumerate(ranked) if candidate.checkpointing == "full"}

    def next_wave(size: int) -> list[int]:
        best = min((index for index in record.outcomes if record.fits(index)), default=None)  # those above, and tied
        pending = [
            i
            for i in range(len(ranked) if best is None else _ties_end(ranked, best))
            if (record.undecided(i, fit=best) if best is not None and i > best else i not in record.outcomes)
            and not record.out_of_reach(i)
        ]
        promoted = sorted(
            full[dims]
            for dims in {ranked[i].dims for i in record.outcomes if not record.fits(i)}
            if dims in full
            and full[dims] not in record.outcomes
            and not record.out_of_reach(full[dims])
            and sum(ranked[i].dims == dims and i != full[dims] for i in pending) >= 2
        )
        return _filling([*promoted, *(i for i in pending if i not in promoted)], ranked, size)

    run_waves(record, next_wave=next_wave, evaluate=evaluate, workers=workers)
    return record


def chosen_fit(record: SearchRecord) -> int | None:
    """The first of :func:`tie_ordered` of the fits tied with the best ranked one, once every candidate ranked above
    it or tied with it is measured or out of reach; None before, or where nothing fits."""
    for index in range(len(record.ranked)):
        if record.fits(index):
            break
        if index not in record.outcomes and not record.out_of_reach(index):
            return None
    else:
        return None
    tied = range(index, _ties_end(record.ranked, index))
    if any(record.undecided(i, fit=index) for i in tied):
        return None
    return tie_ordered(record, [i for i in tied if record.fits(i)])[0]


def tie_ordered(record: SearchRecord, indices: list[int]) -> list[int]:
    """``indices`` (measured candidates) best first: the next is, of those left tied with the best estimate left,
    the least recomputing, then the smallest, then the best ranked."""
    left, ordered = sorted(indices), []
    while left:
        tied = left[: _ties_end([record.ranked[i] for i in left], 0)]
        ordered.append(
            min(
                tied,
                key=lambda i: (
                    AC_MODES.index(record.ranked[i].checkpointing),
                    record.outcomes[i].memory_bytes,
                    i,
                ),
            )
        )
        left.remove(ordered[-1])
    return ordered


def _filling(indices: list[int], ranked: list[Candidate], size: int) -> list[int]:
    """The first of ``indices`` whose jobs fill at most ``size`` workers (at least one candidate): a pp candidate
    takes one a pp rank (see :func:`~.workers.jobs_of`)."""
    wave, jobs = [], 0
    for index in indices:
        jobs += ranked[index].dims.pp
        if wave and jobs > size:
            break
        wave.append(index)
    return wave


def _ties_end(ranked: list[Candidate], index: int) -> int:
    """The end of the candidates from ``index`` on whose estimates tie with its (``ranked`` is best first)."""
    floor = (1 - TIE) * ranked[index].tokens_per_second
    end = index + 1
    while end < len(ranked) and ranked[end].tokens_per_second >= floor:
        end += 1
    return end


def search_every_layout(
    ranked: list[Candidate], *, budget: float, evaluate: Evaluate, workers: int = 1
) -> SearchRecord:
    """Resolve every layout of ``ranked`` to its least recomputing setting that fits, or to "too large" (full
    checkpointing, measured first, does not fit), or to the plan's refusal: what ``plan --fit`` lists."""
    record = SearchRecord(budget, ranked)
    by_layout: dict = {}
    for index, candidate in enumerate(ranked):
        by_layout.setdefault(candidate.dims, []).append(index)
    for indices in by_layout.values():
        indices.sort(key=lambda index: AC_MODES.index(ranked[index].checkpointing))

    def needed(indices: list[int]) -> int | None:
        """The layout's next candidate to measure: full first, then from the least recomputing on; none once it is
        refused, too large by its state or with full checkpointing, or fits."""
        measured = [record.outcomes[index] for index in indices if index in record.outcomes]
        if any(isinstance(outcome, str) or outcome.activation_bytes is None for outcome in measured):
            return None
        full = indices[-1]
        if ranked[full].checkpointing == "full" and full not in record.outcomes:
            return full
        if ranked[full].checkpointing == "full" and not record.fits(full):
            return None
        for index in indices:
            if record.fits(index):
                return None
            if index not in record.outcomes:
                return index
        return None

    def next_wave(size: int) -> list[int]:
        wave = [index for indices in by_layout.values() if (index := needed(indices)) is not None]
        return _filling(sorted(wave), ranked, size)

    run_waves(record, next_wave=next_wave, evaluate=evaluate, workers=workers)
    return record


def least_recomputing_fits(record: SearchRecord) -> tuple[list[int], list[int], dict[str, str]]:
    """Of a resolved record, each layout's least recomputing fit (best first, as :func:`tie_ordered`), each
    too-large layout's least memory, and the refusals."""
    fits, too_large, refused = {}, {}, {}
    for index in sorted(record.outcomes, key=lambda index: AC_MODES.index(record.ranked[index].checkpointing)):
        candidate, outcome = record.ranked[index], record.outcomes[index]
        if isinstance(outcome, str):
            refused.setdefault(candidate.name, outcome)
        elif record.fits(index):
            fits.setdefault(candidate.dims, index)
    for index, outcome in record.outcomes.items():
        dims = record.ranked[index].dims
        if isinstance(outcome, Outcome) and dims not in fits:
            known = too_large.get(dims)
            if known is None or outcome.memory_bytes < record.outcomes[known].memory_bytes:
                too_large[dims] = index
    return tie_ordered(record, list(fits.values())), sorted(too_large.values()), refused
