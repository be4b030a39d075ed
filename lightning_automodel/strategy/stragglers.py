"""Which rank the others wait for, said while they wait.

A rank that is alive but stuck (a slow data loader, a deadlock in user code) leaves the others in a collective until
the process group's timeout, 30 minutes by default, and nothing in the log says why. Each rank counts the training
batches it has begun (:meth:`Stragglers.begin_batch`, from the main thread); its fault monitor's thread publishes
the count in the c10d store, and where its main thread is once a batch has lasted ``after / 2`` seconds. A rank
that has been in one batch for ``after`` seconds reads every rank's count: the ranks with the lowest count are
behind, and the lowest-numbered rank ahead of them says so, every ``after`` seconds, naming where the first of them
is. A stage that stops on a failed collective names them too, and a rank ended while stuck says where it was.

On GPUs, torch's NCCL flight recorder (the last collectives of every rank, dumped at a timeout) is pointed at the
run's directory, beside the logs: :func:`point_flight_recorder`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

FRAMES = 3  # innermost frames of a stuck rank's stack that a report shows


class Stragglers:
    """One stage of one rank. ``whois(rank)`` names a rank ("host, pid 12")."""

    def __init__(self, *, rank: int, world_size: int, after: float, whois: Callable[[int], str]) -> None:
        self.rank = rank
        self.world_size = world_size
        self.after = after
        self._whois = whois
        self._batch = 0  # training batches begun on this rank (written by the main thread only)
        self._since = time.monotonic()  # when the current one began
        self._published = -1
        self._placed = 0.0
        self._reported = 0.0
        self._failed = False

    def begin_batch(self) -> None:
        """The main thread begins a training batch (an attribute write: no store, no lock)."""
        self._since = time.monotonic()
        self._batch += 1

    def tick(self, store: dist.Store, now: float) -> None:
        """From the monitor's thread, every heartbeat: publish this rank's count, and report the ranks behind once
        this rank has waited ``after`` seconds (again every ``after`` seconds). A failure here ends the reports, not
        the monitor (a store that is gone fails the heartbeat next)."""
        if self._failed:
            return
        try:
            self._tick(store, now)
        except Exception as error:
            self._failed = True
            print(f"[rank {self.rank}] lightning-automodel: no more straggler reports: {error}", file=sys.stderr)

    def _tick(self, store: dist.Store, now: float) -> None:
        batch, since = self._batch, self._since
        if batch != self._published:
            store.set(f"batch/{self.rank}", str(batch))
            self._published = batch
        if now - since >= self.after / 2 and now - self._placed >= self.after / 2:  # before the others ask
            store.set(f"place/{self.rank}", self.place())
            self._placed = now
        if now - since < self.after or now - self._reported < self.after:
            return
        self._reported = now
        counts = self._counts(store)
        behind = [rank for rank, count in counts.items() if count == min(counts.values(), default=0)]
        ahead = [rank for rank in counts if rank not in behind]
        if ahead and min(ahead) == self.rank:
            print(
                f"[rank {self.rank}] lightning-automodel: batch {batch} has waited {now - since:.0f} s for"
                f" {self._describe(store, behind, counts)}.",
                file=sys.stderr,
                flush=True,
            )

    def behind(self, store: dist.Store) -> str:
        """The ranks behind the others (for the report of a stage stopped by a failed collective), or ""."""
        try:
            counts = self._counts(store)
            behind = [rank for rank, count in counts.items() if count == min(counts.values(), default=0)]
            if len(behind) == len(counts):
                return ""
            return f"the others were waiting for {self._describe(store, behind, counts)}"
        except Exception:  # the store is gone: the report says so
            return ""

    def place(self) -> str:
        """Where this rank's main thread is: its innermost frames, innermost first."""
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        if frame is None:
            return "an unknown place"
        frames = traceback.extract_stack(frame)[-FRAMES:]
        return " <- ".join(f"{frame.name} ({Path(frame.filename).name}:{frame.lineno})" for frame in reversed(frames))

    def introduce(self, store: dist.Store) -> None:
        store.set(f"batch/{self.rank}", "0")

    def _counts(self, store: dist.Store) -> dict[int, int]:
        """Every rank's count; {} until every rank has published one."""
        keys = [f"batch/{rank}" for rank in range(self.world_size)]
        if not store.check(keys):
            return {}
        return {rank: int(value) for rank, value in enumerate(store.multi_get(keys))}

    def _describe(self, store: dist.Store, behind: list[int], counts: dict[int, int]) -> str:
        first = behind[0]
        where = (
            store.get(f"place/{first}").decode() if store.check([f"place/{first}"]) else "a place it has not published"
        )
        others = f" and {len(behind) - 1} more" if len(behind) > 1 else ""
        return f"rank {first} ({self._whois(first)}){others}, still at batch {counts[first]}, in {where}"


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
