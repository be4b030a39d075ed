"""Which rank failed, said by every rank, and no rank left waiting for one that is gone.

When one rank of a run fails, the others learn of it only through a collective that breaks (gloo: "Connection
reset by peer", naming no rank) or never returns (nccl waits for the process group's timeout, 30 minutes by
default). Each rank's :class:`FaultMonitor` shares what it knows in the c10d store the process group was set up
with, from a daemon thread whose every wait is bounded:

- when a stage starts, the rank's host and process id; then a heartbeat every ``INTERVAL`` seconds;
- how the rank leaves the stage: an error, a signal (SIGTERM, Ctrl-C), a collective that failed, or done.

A rank that leaves abnormally stops the stage for all. A rank that ends without a word is found by its neighbour
(rank r watches rank r + 1, so a whole failed node is seen by the rank before it): on the same host at once, its
process being gone; on another host when its heartbeat has been silent for ``silent_after`` (at most 60 s, and half
the process group's timeout, so that it comes before a collective's timeout). Every rank then names the failed
ranks, the most telling first, and a rank still blocked in a collective gets ``GRACE`` seconds to fail on its own
(and leave through Lightning's own exception handling) before the monitor ends its process.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed.checkpoint import CheckpointException

from lightning_automodel.strategy.faults.processes import FROZEN, GONE, machine, process_state
from lightning_automodel.strategy.faults.stragglers import Stragglers

INTERVAL = 1.0  # seconds between heartbeats
GONE_AFTER = 3.0  # once a failure is known, a rank without a heartbeat for this long is gone
SILENT_AFTER = 60.0  # a rank without a heartbeat for this long has stopped, even if nothing failed yet
GRACE = 5.0  # a rank blocked when the stage stops gets this long to fail on its own before its process is ended
EXIT_CODE = 1

# How a rank leaves a stage, and the order in which a report names them: a rank's own error explains the others'
# failures, a rank that vanished explains the collectives that broke, and signals explain why ranks left.
ERROR, SIGNAL, COLLECTIVE, DONE = "error", "signal", "collective", "done"
_ORDER = (ERROR, GONE, FROZEN, SIGNAL, COLLECTIVE)
_STOPS = (ERROR, GONE, FROZEN, COLLECTIVE)  # notes that stop the stage for all at once


@dataclass(frozen=True)
class Note:
    rank: int
    kind: str
    text: str


class FaultMonitor:
    """One stage of one rank: ``start()`` when the process group exists, ``report(kind, text)`` when the stage
    fails on this rank, ``note_signal(name)`` from a signal handler, ``stop()`` when the stage ends."""

    def __init__(self, *, rank: int, world_size: int, generation: str, timeout: timedelta | None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.silent_after = SILENT_AFTER if timeout is None else min(SILENT_AFTER, timeout.total_seconds() / 2)
        # A connection of its own, so that the main thread's use of the store never waits for this one's.
        store = dist.distributed_c10d._get_default_store().clone()
        self._store = dist.PrefixStore(f"lightning_automodel/faults/{generation}/", store)
        self._pending: list[Note] = []  # notes not yet published (a signal handler may add one)
        self._handling = False  # the main thread is reporting a failure of its own: never end the process
        self._signalled = False  # this rank received a signal: it stops at the end of its step, on its own
        self._stopping_since: float | None = None
        self._verdict: str | None = None
        self._verdict_ready = threading.Event()
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._seen: dict[int, tuple[int, float, float]] = {}  # rank -> (heartbeat, when it changed, first look)
        self._who: dict[int, dict[str, str]] = {}
        self._thread = threading.Thread(target=self._run, name="lightning-automodel-faults", daemon=True)
        after = self.silent_after / 2  # between reports of the rank the others wait for: 30 s at most
        self.stragglers = Stragglers(rank=rank, world_size=world_size, after=after, tick=INTERVAL, whois=self._whois)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """The stage ended on this rank: peers must not take its silence for a failure."""
        self._pending.append(Note(self.rank, DONE, ""))
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=2 * INTERVAL)

    def note_signal(self, name: str) -> None:
        """Record that this rank received signal ``name``; safe in a signal handler (it only appends). Peers go on:
        Lightning stops this rank at the end of its step, and every rank at once when rank 0 was signalled (which
        lets ``on_exception`` callbacks save a checkpoint together); the stage stops for all when this rank leaves."""
        self._signalled = True
        self._pending.append(Note(self.rank, SIGNAL, name))

    def report(self, kind: str | None, text: str = "") -> None:
        """Record how the stage failed on this rank (``kind`` None: it stops because another rank did, or after a
        signal already noted), wait (bounded) until it is known which ranks failed, and print that. Nothing once
        the stage has ended (a later stage that fails before it is set up)."""
        if self._stopped.is_set():
            return
        self._handling = True
        if kind is not None:
            self._pending.append(Note(self.rank, kind, text))
        self._wake.set()
        if not self._verdict_ready.wait(timeout=GONE_AFTER + 2 * INTERVAL):
            self._announce(
                f"{_store_owner(self._whois(0, ask=False))} could not be reached to learn which rank failed: it may be"
                " frozen or its host down."
            )

    # Everything below runs in the monitor's thread.

    def _run(self) -> None:
        try:
            self._introduce()
            while not self._stopped.is_set():
                self._tick()
                self._wake.wait(INTERVAL / 2 if self._stopping_since is not None else INTERVAL)
                self._wake.clear()
            self._publish()
        except Exception as error:  # the store is gone with its host
            owner = _store_owner(self._whois(0, ask=False))
            self._lost(f"{owner} is gone ({type(error).__name__}: {error}): killed, crashed, or gone with its host.")

    def _lost(self, verdict: str) -> None:
        """Nothing more can be learnt. Say so if the stage fails here or does not end here within ``GRACE`` (a
        store host that exits first, after the last collective, is no failure), then end as for a stopped stage."""
        self._stopping_since = self._stopping_since or time.monotonic()
        while not self._stopped.wait(INTERVAL / 2):
            late = time.monotonic() - self._stopping_since >= GRACE
            if not self._verdict_ready.is_set() and (self._handling or late):
                self._announce(verdict)
            self._end_if_blocked()

    def _introduce(self) -> None:
        self._store.set(f"who/{self.rank}", f"{socket.gethostname()}|{machine()}|{os.getpid()}")
        self._store.append("notes", "")
        self.stragglers.introduce(self._store, time.monotonic())

    def _tick(self) -> None:
        self._publish()
        self._store.add(f"beat/{self.rank}", 1)
        self._identity(0)  # known beforehand, in case the store goes with rank 0
        if self._stopping_since is None:
            if self._handling or self._store.add("stop", 0) > 0:
                self._stopping_since = time.monotonic()
            elif self.world_size > 1:
                self._watch((self.rank + 1) % self.world_size)
                self.stragglers.tick(self._store, time.monotonic())
        if self._stopping_since is not None:
            if not self._verdict_ready.is_set():
                verdict = self._roll_call(time.monotonic())
                if verdict is not None:
                    self._announce(verdict)
            self._end_if_blocked()

    def _publish(self) -> None:
        """Publish the pending notes; stop the stage for all on a failure, or when a rank that failed or was
        signalled leaves."""
        while self._pending:
            note = self._pending.pop(0)
            self._store.append("notes", f"{note.rank}\t{note.kind}\t{' '.join(note.text.split())}\n")
            if note.kind in _STOPS or (note.kind == DONE and (self._handling or self._signalled)):
                self._store.add("stop", 1)

    def _watch(self, rank: int) -> None:
        """Stop the stage, saying why, if ``rank`` is gone or silent without having said that it is done."""
        quiet = self._quiet(rank, time.monotonic())
        gone = self._process_state(rank) == GONE
        if not gone and quiet < self.silent_after:
            return
        note = self._notes().get(rank)
        if note is None:
            self._pending.append(Note(rank, GONE, "") if gone else _silent(rank, quiet))
            self._publish()
        elif note.kind != DONE:  # it said why, then left
            self._store.add("stop", 1)

    def _end_if_blocked(self) -> None:
        """End this process if its main thread has not reached a failure of its own ``GRACE`` seconds after the
        stage stopped: it waits in a collective that will not return, or is the rank the others waited for."""
        assert self._stopping_since is not None
        if self._handling or time.monotonic() - self._stopping_since < GRACE:
            return
        try:
            ending = f"[rank {self.rank}] lightning-automodel: ending this process, {self._ending()}."
            print(ending, file=sys.stderr, flush=True)
        finally:  # whatever the message meets, the process ends
            os._exit(EXIT_CODE)

    def _ending(self) -> str:
        """What this rank was doing, as its stragglers' last look saw it; a plain word if that cannot be said."""
        try:
            return self.stragglers.ending()
        except Exception as error:
            return f"which was blocked when the run stopped (where could not be said: {type(error).__name__}: {error})"

    def _roll_call(self, now: float) -> str | None:
        """Which ranks failed and how, once each rank without a note has been seen running, gone or stopped (on
        this machine, at once) or watched for ``GONE_AFTER`` (elsewhere)."""
        notes = self._notes()
        found = [note for note in notes.values() if note.kind != DONE]
        undecided = False
        for rank in sorted(set(range(self.world_size)) - set(notes)):
            state, quiet = self._process_state(rank), self._quiet(rank, now)
            if state == GONE:
                found.append(Note(rank, GONE, ""))
            elif state == FROZEN:
                found.append(Note(rank, FROZEN, "stopped by a signal or a debugger"))
            elif state is None and quiet >= GONE_AFTER:
                found.append(_silent(rank, quiet))
            elif state is None and now - self._seen[rank][2] < GONE_AFTER:
                undecided = True
        if undecided and not any(note.kind in (ERROR, GONE, FROZEN) for note in found):
            return None
        assert self._stopping_since is not None
        if not found and now - self._stopping_since < GONE_AFTER:
            return None  # ranks that stop together after a signal: its note comes with the signalled rank's next tick
        return self._describe(found)

    def _announce(self, verdict: str) -> None:
        self._verdict = f"[rank {self.rank}] lightning-automodel: the run stopped because {verdict}"
        print(self._verdict, file=sys.stderr, flush=True)
        self._verdict_ready.set()

    def _describe(self, found: list[Note]) -> str:
        """The notes of the most telling kind, ranks with the same text together."""
        kind = next((kind for kind in _ORDER if any(note.kind == kind for note in found)), None)
        cause = self.stragglers.cause(self._store)  # the rank the others waited for, unless it is named already
        cause = "" if {each.rank for each in self.stragglers.missed} <= {note.rank for note in found} else cause
        if kind is None:
            return f"{cause}." if cause else "no rank said why."
        texts: dict[str, list[int]] = {}
        for note in found:
            if note.kind == kind:
                texts.setdefault(note.text, []).append(note.rank)
        explained = [self._explain(kind, text, ranks, cause=cause) for text, ranks in list(texts.items())[:3]]
        return "; ".join([*explained, cause] if cause else explained).rstrip(".") + "."

    def _explain(self, kind: str, text: str, ranks: list[int], *, cause: str) -> str:
        who = self._name(ranks)
        if kind == ERROR:
            return f"{who} failed: {text}"
        if kind == GONE:
            return (
                f"{who} exited without reporting an error: killed (SIGKILL, the out-of-memory killer) or crashed in"
                " native code; see its output and the host's kernel log"
            )
        if kind == FROZEN:
            return f"{who} stopped responding ({text}): stopped, frozen, or gone with its host"
        if kind == SIGNAL:
            return f"{who} received {text}"
        if cause:
            return f"{who} had a collective fail ({text[:300]})"
        return (
            f"{who} had a collective fail ({text[:300]}) and no rank reported a cause: a rank may have skipped a"
            " collective or called them in another order"
        )

    def _name(self, ranks: list[int]) -> str:
        """ "rank 1 (host, pid 12)", or "ranks 1, 2, 3 and 5 more (host-a, host-b)"."""
        if len(ranks) == 1:
            return f"rank {ranks[0]} ({self._whois(ranks[0])})"
        ranks = sorted(ranks)
        shown = ", ".join(map(str, ranks[:3])) + (f" and {len(ranks) - 3} more" if len(ranks) > 3 else "")
        hosts = dict.fromkeys(who["host"] if (who := self._identity(rank)) else "host unknown" for rank in ranks)
        return f"ranks {shown} ({', '.join(hosts)})"

    def _notes(self) -> dict[int, Note]:
        """Each rank's first note of this stage."""
        notes: dict[int, Note] = {}
        for line in self._store.get("notes").decode().splitlines():
            rank, kind, text = line.split("\t", 2)
            notes.setdefault(int(rank), Note(int(rank), kind, text))
        return notes

    def _quiet(self, rank: int, now: float) -> float:
        """Seconds since ``rank``'s heartbeat last changed, as seen from here (no clocks are compared)."""
        beat = int(self._store.add(f"beat/{rank}", 0))
        previous = self._seen.get(rank)
        if previous is None or previous[0] != beat:
            self._seen[rank] = (beat, now, previous[2] if previous else now)
            return 0.0
        return now - previous[1]

    def _process_state(self, rank: int) -> str | None:
        """GONE, FROZEN (stopped by a signal) or "running", where this process can see ``rank``'s (same machine and
        pid namespace); None elsewhere."""
        who = self._identity(rank)
        if who is None or who["machine"] != machine():
            return None
        return process_state(int(who["pid"]))

    def _identity(self, rank: int) -> dict[str, str] | None:
        if rank not in self._who and self._store.check([f"who/{rank}"]):
            host, machine, pid = self._store.get(f"who/{rank}").decode().split("|")
            self._who[rank] = {"host": host, "machine": machine, "pid": pid}
        return self._who.get(rank)

    def _whois(self, rank: int, *, ask: bool = True) -> str:
        """ "host, pid 12" of ``rank``; ``ask=False``: only if already known (the store may be gone)."""
        who = self._identity(rank) if ask else self._who.get(rank)
        return f"{who['host']}, pid {who['pid']}" if who else "host unknown"


def _silent(rank: int, quiet: float) -> Note:
    return Note(rank, FROZEN, f"no heartbeat for {quiet:.0f} s")


def _store_owner(rank_zero: str) -> str:
    """Who serves the c10d store: torchrun's agent, or rank 0's process (env:// and tcp:// rendezvous)."""
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return f"the torchrun agent of the first node, which served the c10d store at {address},"
    return f"rank 0 ({rank_zero}), whose process served the c10d store at {address},"


def exception_kind(exception: BaseException) -> tuple[str, str]:
    """How a stage failed on this rank: a signal, a collective broken by another rank, or an error of its own."""
    if isinstance(exception, KeyboardInterrupt):
        return SIGNAL, "Ctrl-C (SIGINT)"
    if isinstance(exception, CheckpointException):  # each rank gets every rank's failure: name the first
        rank, (failure, _) = min(exception.failures.items())
        return ERROR, f"{exception_kind(failure)[1]} (on rank {rank}, in torch's distributed checkpoint)"
    chain: BaseException | None = exception
    while chain is not None:
        if isinstance(chain, dist.DistError) or "/gloo/" in str(chain):
            return COLLECTIVE, str(chain).splitlines()[0] if str(chain) else type(chain).__name__
        chain = chain.__cause__ or chain.__context__
    text = str(exception).strip().splitlines()
    return ERROR, f"{type(exception).__name__}: {text[0]}" if text else type(exception).__name__


# What the strategy calls, at the points of Lightning's stage where they belong.


def watch_stage(strategy: ModelParallelStrategy) -> FaultMonitor | None:
    """Start a monitor for the stage that ``strategy`` sets up (collective: the ranks agree on a fresh key space)."""
    if strategy.world_size == 1 or not dist.is_initialized():  # nothing to watch, or no store to watch it with
        return None
    monitor = FaultMonitor(
        rank=strategy.global_rank,
        world_size=strategy.world_size,
        generation=strategy.broadcast(uuid.uuid4().hex),
        timeout=strategy._timeout,
    )
    monitor.start()
    return monitor


def report_failure(monitor: FaultMonitor | None, exception: BaseException) -> None:
    """Say on this rank which rank made the stage fail. A stop on SIGTERM exits with 128 + 15, as Lightning after
    2.6 does (2.6 exits with 0, as if the run had finished)."""
    if isinstance(exception, SIGTERMException) and not exception.code:
        exception.code = 128 + signal.SIGTERM
    if monitor is None:
        return
    if isinstance(exception, SIGTERMException):  # on the signalled rank (noted already) and those stopped with it
        monitor.report(None)
    else:
        monitor.report(*exception_kind(exception))


def stop_watching(monitor: FaultMonitor | None) -> None:
    """The stage ended on this rank."""
    if monitor is not None:
        monitor.stop()
