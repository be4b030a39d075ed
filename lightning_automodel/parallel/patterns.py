"""Plan keys: fully qualified module names in which ``*`` stands for one path component."""

from __future__ import annotations

import fnmatch


def pattern_matches(pattern: str, name: str) -> bool:
    """Whether module ``name`` matches plan key ``pattern`` (``*`` stands for one path component)."""
    parts, name_parts = pattern.split("."), name.split(".")
    if len(parts) != len(name_parts):
        return False
    return all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, name_parts, strict=True))
