"""How far this rank is in each process group's collectives, and which rank the others wait for.

torch's flight recorder keeps, for every process group of a process (gloo and nccl alike), how many collectives
this rank has entered (``last_enqueued_collective``: the host called it) and how many have completed; point-to-point
sends and receives are counted apart. A collective completes only once every member of its group has entered it, so
the first collective of a group that has not completed everywhere is one that some members have entered and others
have not reached. A rank that has not reached one, and has entered none that waits for another rank, is the one
the others wait for: stuck in its forward, its backward, its data loader, or anywhere between two collectives.

The recorder numbers its groups locally to each process; the group's name, the same on all its members, is in the
recorder's entries, read (a dump of its buffer, about 0.1 s for 2000 entries, off the main thread) only once this
rank's progress stands still: a rank that never does names no group and is compared with none, at no cost. Where
torch has no flight recorder, or it was turned off (``TORCH_FR_BUFFER_SIZE=0``), nothing is known and nothing is
reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch's recorders: the one of the CPU backends (gloo), and NCCL's (CUDA builds).
CPU_RECORDER, NCCL_RECORDER = "_dump_fr_trace_json", "_dump_nccl_trace_json"


@dataclass(frozen=True)
class GroupProgress:
    desc: str  # what the group is for, e.g. "mesh_tp"
    entered: int  # collectives of the group this rank has entered
    completed: int  # ... of which this rank has seen complete


@dataclass(frozen=True)
class Missed:
    """``rank`` has not reached collective number ``collective`` of a group, which ``waiting`` have entered."""

    rank: int
    group: str
    desc: str
    members: tuple[int, ...]
    collective: int
    waiting: tuple[int, ...]


Counts = dict[tuple[str, str], tuple[int, int]]  # (recorder, its number for a group) -> (entered, completed)


class CollectiveProgress:
    """This rank's progress in each of its process groups, for the monitor's thread. Reading it is cheap; naming
    its groups (by the names all their members share) and saying what the collectives it waits in are take a read
    of the recorders' entries (:meth:`look`), which the monitor does once this rank's progress stands still."""

    def __init__(self) -> None:
        c10d = torch._C._distributed_c10d
        names = [CPU_RECORDER] + ([NCCL_RECORDER] if "nccl" in str(dist.get_backend()) else [])
        self._recorders = {name: getattr(c10d, name) for name in names if hasattr(c10d, name)}
        self._names: dict[tuple[str, str], tuple[str, str]] = {}  # (recorder, its number) -> (name, desc)

    def read(self) -> Counts:
        counts = {}
        for recorder, dump in self._recorders.items():
            for number, status in json.loads(dump(False, False)).get("pg_status", {}).items():
                entered, completed = status["last_enqueued_collective"], status["last_completed_collective"]
                counts[recorder, number] = (int(entered), int(completed))
        return counts

    def named(self, counts: Counts) -> dict[str, GroupProgress]:
        """The progress in each existing group named so far, by name; of groups that had a name in turn (one
        destroyed, another made), the newest."""
        existing = set(dist.distributed_c10d._world.pg_names.values())
        named = {}
        for key in sorted(counts, key=lambda key: int(key[1])):
            if key in self._names and self._names[key][0] in existing:
                name, desc = self._names[key]
                named[name] = GroupProgress(desc, *counts[key])
        return named

    def look(self, counts: Counts) -> dict[str, list]:
        """Name the groups of ``counts`` not named yet, and say what each collective this rank has entered and not
        seen complete is: {name: [number, "gloo:all_reduce"]}. A read of the recorders' entries (about 0.1 s for
        2000), when there is something to learn."""
        waiting = {key: done + 1 for key, (entered, done) in counts.items() if entered > done}
        if not waiting and all(key in self._names for key in counts):
            return {}
        said: dict[str, list] = {}
        for recorder, dump in self._recorders.items():
            for entry in json.loads(dump(True, False)).get("entries", []):
                key = (recorder, str(entry["pg_id"]))
                self._names.setdefault(key, tuple(entry["process_group"]))
                if waiting.get(key) == entry["collective_seq_id"] and not entry["is_p2p"]:
                    said[self._names[key][0]] = [entry["collective_seq_id"], entry["profiling_name"]]
        return said


def find_missed(progress: dict[int, dict[str, GroupProgress]]) -> list[Missed]:
    """The collectives that ranks have not reached while others of their group wait in them, for the ranks that
    wait in none themselves (those waiting for a waiting rank are not its cause). Empty when every rank has entered
    the collectives its groups wait in (nothing is stuck, or it is stuck inside one: a GPU kernel, the network), or
    when the waiting ranks wait for each other (collectives called in different orders)."""
    missed: list[Missed] = []
    waiting: set[int] = set()
    for group in sorted({group for groups in progress.values() for group in groups}):
        members = tuple(sorted(rank for rank, groups in progress.items() if group in groups))
        of = {rank: progress[rank][group] for rank in members}
        pending = min(each.completed for each in of.values()) + 1  # the first not complete everywhere
        entered = tuple(rank for rank in members if of[rank].entered >= pending)
        if len(entered) in (0, len(members)):
            continue
        waiting.update(entered)
        desc = of[entered[0]].desc
        missed += [Missed(rank, group, desc, members, pending, entered) for rank in members if rank not in entered]
    return [each for each in missed if each.rank not in waiting]
