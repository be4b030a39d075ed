"""Which rank the others wait for, said by every rank while they wait, and again when the wait times out.

A rank that is alive but stuck (in its forward, its backward, its optimizer step, its data loader; a hung read, a
deadlock in user code) leaves the others in a collective until the process group's timeout, 30 minutes by default.
Each rank's fault monitor thread publishes in the c10d store, at every heartbeat, how far the rank is in each process
group's collectives (collective_progress.py, from torch's flight recorder) and, once that has not moved for a quarter
of the report interval ``after``, where its main thread is (main_thread.py) and what collective it waits in. A rank
whose collectives have not moved for ``after`` (a quarter of the timeout, 30 s at most) reads every rank's progress
and prints which rank has not reached the collective the others wait in and where that rank is, and again every
``after``. A stage that stops on a failed collective names that rank too, and the rank, ended, says it was the one.

On GPUs, torch's NCCL flight recorder (the last collectives of every rank, dumped at a timeout) is pointed at the
run's directory, beside the logs: :func:`point_flight_recorder`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from lightning_automodel.strategy.faults.collective_progress import (
    CollectiveProgress,
    Counts,
    GroupProgress,
    Missed,
    find_missed,
)
from lightning_automodel.strategy.faults.main_thread import main_thread_place

RANKS_SHOWN = 3  # ranks a list names before "and N more"
# What a store that is gone (its host down, its process killed) raises: torch's DistError (a RuntimeError), the
# RuntimeError of older paths, or a socket's OSError.
STORE_ERRORS = (RuntimeError, OSError)
Read = TypeVar("Read")


class StoreGone(Exception):
    """A read of the store failed: the monitor's heartbeat fails next, and its report says why."""


class Stragglers:
    """One stage of one rank, driven by its fault monitor's thread (``introduce`` once, ``tick`` every ``tick``
    seconds). ``whois(rank)`` names a rank ("host, pid 12")."""

    def __init__(self, *, rank: int, world_size: int, after: float, tick: float, whois: Callable[[int], str]) -> None:
        self.rank = rank
        self.world_size = world_size
        self.after = after
        # Stillness is seen at heartbeats, up to ``tick`` late: the first report comes within ``after`` of a wait.
        self._first_report = max(after / 2, after - 2 * tick)
        self._whois = whois
        self._progress: CollectiveProgress | None = None
        self._counts: Counts | None = None  # this rank's progress
        self._changed = 0.0  # when it last moved
        self._named: dict[str, GroupProgress] | None = None  # ... in the groups it has named, as published
        self._waits: dict[str, list] | None = None  # group -> [collective, what it is] of those this rank waits in
        self._reported = -math.inf
        self._failed = False
        self.missed: list[Missed] = []  # what the last look found: the ranks the others wait for

    def introduce(self, store: dist.Store, now: float) -> None:
        """Publish this rank's first progress. A failure on this side, here as in every step (torch's private
        recorder API differing on another torch, a dump that fails), ends its reports, said once, and never the
        monitor: only the monitor's own use of the store may end the monitor's thread."""
        self._guarded(self._publish_progress, store, now)

    def tick(self, store: dist.Store, now: float) -> None:
        """Publish this rank's progress, and where it is once that has stood still; report the ranks the others
        wait for once it has stood still for ``after`` (again every ``after``)."""
        self._guarded(self._tick, store, now)

    def cause(self, store: dist.Store) -> str:
        """Which rank the others wait for, in which collective, and where it is; "" if none, if the store is gone
        (the monitor's report says so), or if this side fails (said once)."""
        try:
            everyone = self._everyone(store)
            self.missed = find_missed(everyone)
            return self._describe(store, everyone) if self.missed else ""
        except StoreGone:
            return ""
        except Exception as error:
            self._fail(error)
            return ""

    def ending(self) -> str:
        """What this rank was doing when its monitor ends it, as the last look saw it."""
        mine = [each for each in self.missed if each.rank == self.rank]
        if not mine:
            return f"which was waiting for ranks that stopped, in {main_thread_place()}"
        return (
            f"which had not reached the collective that {_ranks(mine[0].waiting)} waited in ({_collective(mine[0])}),"
            f" in {main_thread_place()}"
        )

    def _guarded(self, step: Callable[[dist.Store, float], None], store: dist.Store, now: float) -> None:
        """``step(store, now)`` until this side fails; whatever it raises stops the reports, not the monitor."""
        if self._failed:
            return
        try:
            step(store, now)
        except Exception as error:
            self._fail(error)

    def _fail(self, error: Exception) -> None:
        """Stop the reports, saying why, once."""
        if not self._failed:
            self._failed = True
            print(
                f"[rank {self.rank}] lightning-automodel: no more reports of the rank the others wait for"
                f" ({type(error).__name__}: {error}).",
                file=sys.stderr,
                flush=True,
            )

    def _tick(self, store: dist.Store, now: float) -> None:
        self._publish_progress(store, now)
        still = now - self._changed
        if still >= self.after / 4:
            assert self._progress is not None and self._counts is not None and self._named is not None
            if self._waits is None:  # once a wait: name the groups, and what this rank waits in
                self._waits = self._progress.look(self._counts)
                self._publish_named(store)
            where = {"at": _stamp(self._named), "place": main_thread_place(), "still": still, "waits": self._waits}
            store.set(f"where/{self.rank}", json.dumps(where))
        if still >= self._first_report and now - self._reported >= self.after:
            self._reported = now
            cause = self.cause(store)
            if cause:
                print(f"[rank {self.rank}] lightning-automodel: {cause}.", file=sys.stderr, flush=True)

    def _publish_progress(self, store: dist.Store, now: float) -> None:
        self._progress = self._progress or CollectiveProgress()
        counts = self._progress.read()
        if counts != self._counts:
            self._counts, self._changed, self._waits = counts, now, None
            self._publish_named(store)

    def _publish_named(self, store: dist.Store) -> None:
        assert self._progress is not None and self._counts is not None
        named = self._progress.named(self._counts)
        if named != self._named:
            self._named = named
            published = {group: [each.desc, each.entered, each.completed] for group, each in named.items()}
            store.set(f"progress/{self.rank}", json.dumps(published))

    def _everyone(self, store: dist.Store) -> dict[int, dict[str, GroupProgress]]:
        """Every rank's progress; {} until every rank has published it."""
        keys = [f"progress/{rank}" for rank in range(self.world_size)]
        if not _read(store.check, keys):
            return {}
        return {
            rank: {group: GroupProgress(*values) for group, values in json.loads(value).items()}
            for rank, value in enumerate(_read(store.multi_get, keys))
        }

    def _describe(self, store: dist.Store, everyone: dict[int, dict[str, GroupProgress]]) -> str:
        first = self.missed[0]
        stuck = sorted({each.rank for each in self.missed})
        waiting = sorted({rank for each in self.missed if each.rank == first.rank for rank in each.waiting})
        wheres = {rank: _where(store, rank, everyone[rank]) for rank in (first.rank, *waiting)}
        first, operation, waited = _as_the_waiting_say(first, wheres, everyone)
        who = f"rank {first.rank} ({self._whois(first.rank)})"
        who += f" and {len(stuck) - 1} more" if len(stuck) > 1 else ""
        how_long = f" for {waited:.0f} s" if waited is not None else ""
        what = f"{operation}, " if operation else ""
        place = wheres[first.rank]["place"] if wheres[first.rank] else "a place it has not published"
        return (
            f"{who} {'has' if len(stuck) == 1 else 'have'} not reached the collective that {_ranks(first.waiting)}"
            f" {'has' if len(first.waiting) == 1 else 'have'} waited in{how_long} ({what}{_collective(first)});"
            f" rank {first.rank} is in {place}"
        )


def _as_the_waiting_say(
    missed: Missed, wheres: dict[int, dict[str, Any] | None], everyone: dict[int, dict[str, GroupProgress]]
) -> tuple[Missed, str | None, float | None]:
    """The first collective that ranks waiting for ``missed.rank`` say they wait in (what it is, and for how long),
    among those of its groups it has not entered; ``missed`` itself if none says (a frozen rank's published
    progress lags: what the waiting ranks wait in is what they say)."""
    said: dict[tuple[str, int], list[tuple[int, str | None, float]]] = {}
    mine = everyone[missed.rank]
    for rank, where in wheres.items():
        for group, (number, operation) in where["waits"].items() if where else ():
            if group in mine and mine[group].entered < number:
                said.setdefault((group, number), []).append((rank, operation, where["still"]))
    if not said:
        return missed, None, None
    (group, number), waits = next(iter(said.items()))
    members = tuple(rank for rank in sorted(everyone) if group in everyone[rank])
    waiting = tuple(rank for rank, _, _ in waits)
    waited = max(still for _, _, still in waits)
    return Missed(missed.rank, group, mine[group].desc, members, number, waiting), waits[0][1], waited


def _where(store: dist.Store, rank: int, progress: dict[str, GroupProgress]) -> dict[str, Any] | None:
    """Where ``rank`` is while its progress stands still at ``progress`` (None before it has said, or once it has
    moved on: what it said is of an earlier wait)."""
    key = f"where/{rank}"
    where = json.loads(_read(store.get, key)) if _read(store.check, [key]) else None
    return where if where is not None and where["at"] == _stamp(progress) else None


def _read(read: Callable[..., Read], *args: Any) -> Read:
    """``read(*args)``, a read of the store; its failure raised as :class:`StoreGone` (and only the store's: an
    error of this module's own is not taken for a store that is gone)."""
    try:
        return read(*args)
    except STORE_ERRORS as error:
        raise StoreGone(f"{type(error).__name__}: {error}") from error


def _stamp(progress: dict[str, GroupProgress]) -> int:
    """Changes whenever a rank enters or completes a collective."""
    return sum(each.entered + each.completed for each in progress.values())


def _collective(missed: Missed) -> str:
    return f"collective {missed.collective} of group {missed.desc}, {_ranks(missed.members)}"


def _ranks(ranks: tuple[int, ...] | list[int]) -> str:
    """ "rank 0", "ranks 0 and 2", "ranks 0, 2, 4 and 5 more"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) <= RANKS_SHOWN:
        return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"
    return f"ranks {', '.join(map(str, ranks[:RANKS_SHOWN]))} and {len(ranks) - RANKS_SHOWN} more"


def flight_recorder_environment(directory: str | os.PathLike) -> dict[str, str]:
    """The variables that make torch's NCCL flight recorder keep each rank's last collectives and dump them when a
    collective times out, into ``directory``/nccl_flight_recorder/rank_<r>; what the user set is kept."""
    dump = Path(directory) / "nccl_flight_recorder" / "rank_"
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(dump),
    }
    return {name: os.environ.get(name, value) for name, value in wanted.items()}


def point_flight_recorder(directory: str | os.PathLike) -> None:
    """Set the flight recorder's variables (before the process group exists) and make its dump directory."""
    environment = flight_recorder_environment(directory)
    Path(environment["TORCH_FR_DUMP_TEMP_FILE"]).parent.mkdir(parents=True, exist_ok=True)
    os.environ.update(environment)
