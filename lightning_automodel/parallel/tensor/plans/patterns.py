"""Plan keys: fully qualified module names in which ``*`` stands for one path component, and one key for a module
at its place in every block."""

from __future__ import annotations

import fnmatch
import re
from collections import Counter, defaultdict

from torch.distributed.tensor.parallel import ParallelStyle


def pattern_matches(pattern: str, name: str) -> bool:
    """Whether module ``name`` matches plan key ``pattern`` (``*`` stands for one path component)."""
    parts, name_parts = pattern.split("."), name.split(".")
    if len(parts) != len(name_parts):
        return False
    return all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, name_parts, strict=True))


def matches_inside(pattern: str, regions: list[str], *, names: list[str]) -> bool:
    """Whether ``pattern`` matches a module inside one of the modules named in ``regions``."""
    return any(pattern_matches(pattern, name) for region in regions for name in names if name.startswith(f"{region}."))


def keyed_by_position(plan: dict[str, ParallelStyle], *, names: list[str]) -> dict[str, ParallelStyle]:
    """One key per position in the blocks (``transformer.h.*.attn.c_attn``), as the family plans write them, where
    every module at that position gets the same style; exact names elsewhere. Logs and plan reports stay short."""
    groups: dict[str, list[tuple[str, ParallelStyle]]] = defaultdict(list)
    for name, style in plan.items():
        groups[block_position(name)].append((name, style))
    modules_at = Counter(block_position(name) for name in names)
    merged: dict[str, ParallelStyle] = {}
    for position, members in groups.items():
        same = len({_described(style) for _, style in members}) == 1 and len(members) == modules_at[position]
        merged.update({position: members[0][1]} if same else dict(members))
    return merged


def block_position(name: str) -> str:
    """The plan key for ``name`` at its place in every block (or for every block): its first index replaced by ``*``."""
    return re.sub(r"\.\d+(\.|$)", r".*\1", name, count=1)


def _described(style: ParallelStyle) -> tuple:
    return type(style), tuple(sorted((key, repr(value)) for key, value in vars(style).items()))
