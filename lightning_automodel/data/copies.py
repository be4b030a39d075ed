"""Every machine's copy of the files, compared once at setup.

Each machine reads its own copy of the files: its local rank 0 builds its own cache from them, or its ranks stream
them. Copies that differ (a file edited on one machine, a partial rsync) give the machines other rows, or another
number of them: the epoch's end or the next collective then hangs, or the ranks train on mismatched data without a
word. So every rank describes each file set it set up, and one all-gather of a digest of each description compares
the machines; copies that differ are refused on every rank alike, naming the machines and the files.

A description lists, file by file, what determines the rows: the file's name as the user gave it (after glob
expansion; a relative path stays relative, the machines may hold the files in other directories), its size, a
digest of what it gave (the cache's tokens, hashed as they were written) and its documents and tokens; and what
made the tokens besides the files (a digest of the tokenizer, the settings). Not the files' modification times or
absolute paths, which differ between faithful copies. A stream has no cache: its files are compared by size and a
digest of their first and last 64 KiB, so an edit in place that keeps a file's size and touches only its middle
goes unseen there. Other sources (another file format, a dataset object) describe themselves as entries too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.utils.data import ConcatDataset, Dataset

from lightning_automodel.data.cache import tokenizer_digest
from lightning_automodel.data.mixture import MixedStream
from lightning_automodel.data.sources.expand import Source
from lightning_automodel.data.sources.tables import DatasetSource
from lightning_automodel.data.store import TokenStore
from lightning_automodel.data.streaming.stream import StreamedRows

ENDS = 64 << 10  # the bytes of each end of a streamed file that its digest covers
SHOWN = 5  # differences listed per group of machines; the rest are counted
FIX = (
    "Sync the copies (e.g. `rsync -a -c --delete` from one machine to the others), then remove the token caches built"
    " from them (cache_dir, or ~/.cache/lightning-automodel/tokens), so that each machine builds its cache again."
)


@dataclass(frozen=True)
class Entry:
    """One source of a file set, as it determines the rows (``None``: not known, e.g. a stream's documents)."""

    name: str
    size: int | None
    digest: str
    documents: int | None = None
    tokens: int | None = None


@dataclass(frozen=True)
class Description:
    """A file set as it determines the rows: its entries, in order, and what made the tokens besides them."""

    made_by: dict[str, Any]
    entries: tuple[Entry, ...]

    def digest(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Machine:
    host: str
    node_rank: int
    ranks: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.host} (node {self.node_rank})"

    def named(self) -> str:
        return f"{self.host} (node {self.node_rank}; {_ranks(self.ranks)})"


def describe(rows: Dataset) -> Description:
    """The description of a split's rows: a stream's files, or the store its rows are cut from; a mixture's, each
    source's in turn."""
    if isinstance(rows, ConcatDataset | MixedStream):
        parts = [describe(part) for part in (rows.datasets if isinstance(rows, ConcatDataset) else rows.streams)]
        return Description({"sources": [part.made_by for part in parts]}, tuple(e for p in parts for e in p.entries))
    if isinstance(rows, StreamedRows):
        made_by = {"tokenizer": tokenizer_digest(rows.encoder.tokenizer), "text_field": rows.encoder.text_field}
        return describe_files(rows.sources, made_by=made_by)
    return describe_store(rows.store)


def describe_store(store: TokenStore) -> Description:
    """A store's sources with their digests, sized where they are files; what made it: the cache's key but its
    files (absolute paths and modification times)."""
    made_by = {name: value for name, value in (store.key or {}).items() if name != "files"}
    entries = (
        Entry(source.name, _size(source.name), source.digest, source.documents, source.tokens)
        for source in store.sources
    )
    return Description(made_by, tuple(entries))


def describe_files(files: list[Source], *, made_by: dict[str, Any]) -> Description:
    """Sources read as they are (a stream's): each file's size and a digest of its first and last :data:`ENDS` bytes
    (a Parquet file's footer, its row groups' sizes and statistics, included); a dataset's rows and fingerprint."""
    return Description(made_by, tuple(_file_entry(source) for source in files))


def _file_entry(source: Source) -> Entry:
    if isinstance(source, DatasetSource):
        return Entry(source.name, len(source.dataset), source.name)
    return Entry(source, os.path.getsize(source), _ends_digest(source))


def refuse_other_copies(rows: dict[str, Dataset], *, node_rank: int, failure: Exception | None = None) -> None:
    """Refuse, on every rank alike, machines whose copies of the splits' files differ (see the module's docstring).

    Called on every rank with the splits it set up, whose node is ``node_rank``, and the error its set-up raised, if
    any (a file missing on one machine): that rank raises it, and every other rank an error naming it, rather than
    waiting in the gather for a rank that is gone. A no-op outside a distributed run, but for raising ``failure``.
    One all-gather of a digest a split (about 110 bytes a rank); only where the digests differ, a second one of the
    descriptions, one for each distinct copy."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        if failure is not None:
            raise failure
        return
    described = {split: describe(split_rows) for split, split_rows in rows.items()} if failure is None else {}
    own = {split: d.digest() for split, d in described.items()}
    digests = _all_gather((socket.gethostname(), node_rank, own, None if failure is None else str(failure)))
    if failure is not None:
        raise failure
    if failed := [(rank, entry) for rank, entry in enumerate(digests) if entry[3] is not None]:
        rank, (host, node, _, message) = failed[0]
        raise ValueError(f"Rank {rank} on {host} (node {node}) could not set up the data: {message}")
    digests = [(host, node, splits) for host, node, splits, _ in digests]
    senders = _senders(digests)
    if not senders:
        return
    me = dist.get_rank()
    sent = _all_gather({split: described[split] for split, rank in senders if rank == me})
    by_digest = {each.digest(): each for gathered in sent for each in gathered.values()}
    # Each rank's splits as the senders described them: those whose machines agree are left out, alike everywhere.
    full = [
        (host, node, {s: by_digest[d] for s, d in splits.items() if d in by_digest}) for host, node, splits in digests
    ]
    if (message := compare(full)) is not None:
        raise ValueError(message)


def compare(ranks: list[tuple[str, int, dict[str, Description]]]) -> str | None:
    """The refusal, or None where every machine describes each split alike: ``ranks[r]`` is global rank ``r``'s host,
    node rank and description of each split it set up (one rank a machine is compared: they share the files)."""
    machines = _machines([(host, node) for host, node, _ in ranks])
    blocks = []
    for split in _splits(ranks, machines):
        groups: dict[str | None, tuple[Description | None, list[Machine]]] = {}
        for machine in machines:
            description = ranks[machine.ranks[0]][2].get(split)
            key = description.digest() if description is not None else None
            groups.setdefault(key, (description, []))[1].append(machine)
        if len(groups) > 1:
            blocks.append(_split_message(split, list(groups.values())))
    return "\n".join([*blocks, FIX]) if blocks else None


def _senders(digests: list[tuple[str, int, dict[str, str]]]) -> list[tuple[str, int]]:
    """For each split whose machines differ, the first rank holding each distinct description: it sends it."""
    machines = _machines([(host, node) for host, node, _ in digests])
    senders = []
    for split in _splits(digests, machines):
        found: dict[str | None, int] = {}
        for machine in machines:
            found.setdefault(digests[machine.ranks[0]][2].get(split), machine.ranks[0])
        if len(found) > 1:
            senders += [(split, rank) for digest, rank in found.items() if digest is not None]
    return senders


def _split_message(split: str, groups: list[tuple[Description | None, list[Machine]]]) -> str:
    """The first group (with global rank 0) against each other: its machines, then what differs, file by file."""
    (reference, ours), lines = groups[0], []
    here = _label(ours)
    lines.append(
        f"The machines hold different copies of the {split} split's files: their ranks would read other rows, and"
        " the run would hang at an epoch's end or train on mismatched data."
    )
    for description, theirs in groups[1:]:
        there = _label(theirs)
        lines.append(f"  {_names(theirs)} against {_names(ours)}:")
        differences = _differences(reference, description, here=here, there=there)
        lines += [f"    {line}" for line in differences[:SHOWN]]
        if len(differences) > SHOWN:
            lines.append(f"    and {len(differences) - SHOWN} more files")
    return "\n".join(lines)


def _differences(ours: Description | None, theirs: Description | None, *, here: str, there: str) -> list[str]:
    if ours is None or theirs is None:
        return [f"the split has no rows on {there if theirs is None else here}: every document there is empty"]
    lines = [_made_by(name, ours.made_by, theirs.made_by, here=here, there=there) for name in _union(ours, theirs)]
    lines = [line for line in lines if line]
    mine, yours = ({entry.name: entry for entry in d.entries} for d in (ours, theirs))
    for name in list(mine) + [name for name in yours if name not in mine]:
        if name not in yours or name not in mine:
            lines.append(f"{name}: only on {here if name in mine else there}")
        elif (line := _entry(mine[name], yours[name], here=here, there=there)) is not None:
            lines.append(f"{name}: {line}")
    return lines or ["the same files, in another order"]


def _union(ours: Description, theirs: Description) -> list[str]:
    return sorted(ours.made_by.keys() | theirs.made_by.keys())


def _made_by(name: str, ours: dict, theirs: dict, *, here: str, there: str) -> str | None:
    if ours.get(name) == theirs.get(name):
        return None
    if name == "tokenizer":
        return f"the tokenizer differs (its vocabulary, special tokens or chat template) between {here} and {there}"
    return f"{name}: {ours.get(name)!r} on {here}, {theirs.get(name)!r} on {there}"


def _entry(ours: Entry, theirs: Entry, *, here: str, there: str) -> str | None:
    if ours.size != theirs.size:
        return f"{_count(ours.size, 'bytes')} on {here}, {_count(theirs.size, 'bytes')} on {there}"
    if ours.digest != theirs.digest:
        return "same size, other content" if ours.size is not None else "other content"
    if (ours.documents, ours.tokens) != (theirs.documents, theirs.tokens):
        counts = [f"{_count(e.documents, 'documents')} and {_count(e.tokens, 'tokens')}" for e in (ours, theirs)]
        return f"{counts[0]} on {here}, {counts[1]} on {there}"
    return None


def _machines(places: list[tuple[str, int]]) -> list[Machine]:
    """The machines (host and node rank: simulated nodes share a host) with their global ranks, by first rank."""
    ranks: dict[tuple[str, int], list[int]] = {}
    for rank, place in enumerate(places):
        ranks.setdefault(place, []).append(rank)
    return [Machine(host, node, tuple(held)) for (host, node), held in ranks.items()]


def _splits(ranks: list[tuple[str, int, dict]], machines: list[Machine]) -> list[str]:
    """Every split some machine set up, in the order the machines name them."""
    return list(dict.fromkeys(split for machine in machines for split in ranks[machine.ranks[0]][2]))


def _label(machines: list[Machine]) -> str:
    return str(machines[0]) + (f" and {len(machines) - 1} more" if len(machines) > 1 else "")


def _names(machines: list[Machine]) -> str:
    shown = ", ".join(machine.named() for machine in machines[:3])
    return shown + (f" and {len(machines) - 3} more machines" if len(machines) > 3 else "")


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks[:4])) + (f" and {len(ranks) - 4} more" if len(ranks) > 4 else "")


def _count(value: int | None, unit: str) -> str:
    return f"{value:,} {unit}" if value is not None else f"unknown {unit}"


def _size(name: str) -> int | None:
    return os.path.getsize(name) if os.path.isfile(name) else None


def _ends_digest(path: str) -> str:
    hashed = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as file:
        hashed.update(file.read(ENDS))
        file.seek(max(os.path.getsize(path) - ENDS, 0))
        hashed.update(file.read(ENDS))
    return hashed.hexdigest()


def _all_gather(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
