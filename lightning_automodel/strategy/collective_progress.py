"""How far this rank is in each process group's collectives, and which rank the others wait for.

torch's flight recorder keeps, for every process group of a process (gloo and nccl alike), how many collectives
this rank has entered (``last_enqueued_collective``: the host called it) and how many have completed; point-to-point
sends and receives are counted apart. A collective completes only once every member of its group has entered it, so
the first collective of a group that has not completed everywhere is one that some members have entered and others
have not reached. A rank that has not reached one, and has entered none that waits for another rank, is the one
the others wait for: stuck in its forward, its backward, its data loader, or anywhere between two collectives.

The recorder names its groups by a number local to each process; the group's name, the same on all its members, is
in the recorder's entries, read once for each group it has not seen (a dump of its buffer, about 0.1 s for 2000
entries, off the main thread). Where torch has no flight recorder, or it was turned off (``TORCH_FR_BUFFER_SIZE=0``),
nothing is known and nothing is reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

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


class CollectiveProgress:
    """This rank's progress in each of its process groups, keyed by the group's name (for the monitor's thread)."""

    def __init__(self) -> None:
        c10d = torch._C._distributed_c10d
        names = [CPU_RECORDER] + ([NCCL_RECORDER] if "nccl" in str(dist.get_backend()) else [])
        self._recorders = {name: getattr(c10d, name) for name in names if hasattr(c10d, name)}
        self._groups: dict[tuple[str, str], tuple[str, str] | None] = {}  # (recorder, its number) -> (name, desc)

    def read(self) -> dict[str, GroupProgress]:
        progress = {}
        for recorder, dump in self._recorders.items():
            statuses = json.loads(dump(False, False)).get("pg_status", {})
            if any((recorder, number) not in self._groups for number in statuses):
                self._learn(recorder, statuses)
            for number, status in statuses.items():
                if (group := self._groups[recorder, number]) is not None:
                    entered, completed = (
                        int(status["last_enqueued_collective"]),
                        int(status["last_completed_collective"]),
                    )
                    progress[group[0]] = GroupProgress(group[1], entered, completed)
        return progress

    def operations(self, wanted: dict[str, int]) -> dict[str, str | None]:
        """What each group's collective of the given number is ("gloo:all_reduce"), while it is in the recorder."""
        found: dict[str, str | None] = dict.fromkeys(wanted)
        for dump in self._recorders.values():
            for entry in json.loads(dump(True, False)).get("entries", []):
                group = entry["process_group"][0]
                if wanted.get(group) == entry["collective_seq_id"] and not entry["is_p2p"]:
                    found[group] = entry["profiling_name"]
        return found

    def _learn(self, recorder: str, statuses: dict[str, Any]) -> None:
        """The name and description of each group the recorder numbers (None where its entries are gone)."""
        for entry in json.loads(self._recorders[recorder](True, False)).get("entries", []):
            self._groups[recorder, str(entry["pg_id"])] = tuple(entry["process_group"])
        for number in statuses:
            self._groups.setdefault((recorder, number), None)


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
