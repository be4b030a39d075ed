"""Directories written by all ranks that appear whole or not at all, and never at the cost of a user's files.

A save replaces what stands at its path only when that is a previous save of the same kind (a checkpoint, a
Hugging Face model directory): a path that holds anything else (a user's notes, a dataset, an experiment folder)
is refused on every rank before anything is written, and a failed save leaves the previous one as it was.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

# What stands at an existing path that no previous save of this kind wrote (file or directory names).
Unowned = Callable[[Path], list[str]]
T = TypeVar("T")


@contextmanager
def atomic_directory(directory: str | os.PathLike, *, unowned: Unowned) -> Generator[Path, None, None]:
    """Every rank gets the same staging directory beside ``directory`` to write into; collective.

    What stands at ``directory`` must be nothing or a previous save of this kind: ``unowned`` names what is not
    (checked on rank 0 before anything is written and again before the swap; every rank raises otherwise). When
    every rank's block succeeded, the staging directory replaces ``directory`` (the old one is removed only once
    the new one is in place). When any rank's block failed, the staging directory is removed, ``directory`` is
    left as it was, and every rank raises, so none goes on as if the save had happened.
    """
    target = Path(directory)
    path = Path(_from_rank_zero(lambda: _make_staging(target, unowned=unowned)))
    succeeded = False
    try:
        yield path
        succeeded = True
    finally:
        everywhere = _everywhere(succeeded)
        swap_error = None
        if _rank() == 0:
            try:
                if everywhere:
                    refuse_unowned(target, unowned=unowned)  # nothing of the user's appeared there while we wrote
                    _replace(target, path)
            except OSError as error:
                swap_error = error
            shutil.rmtree(path, ignore_errors=True)  # left over only if not swapped in
        swapped = _everywhere(swap_error is None)
        if swap_error is not None:
            raise swap_error
        if not swapped:
            raise RuntimeError(f"Rank 0 failed to put {target} in place; see its error.")
        if succeeded and not everywhere:
            raise RuntimeError(f"Another rank failed to write {target}; it was left as it was. See that rank's error.")


def unowned_entries(path: Path, *, owned: Callable[[Path], bool]) -> list[str]:
    """The entries of directory ``path`` that ``owned`` rejects (subdirectories never count as owned), or ``path``
    itself if it is a file or a link; nothing if it is absent."""
    if path.is_dir() and not path.is_symlink():
        return sorted(
            entry.name + ("/" if entry.is_dir() else "")
            for entry in path.iterdir()
            if entry.is_dir() or entry.is_symlink() or not owned(entry)
        )
    return [path.name] if path.exists() or path.is_symlink() else []


def check_save_path(target: Path, *, unowned: Unowned) -> None:
    """Refuse, on every rank, a save to ``target`` that would destroy what no earlier save there wrote; collective."""
    _from_rank_zero(lambda: refuse_unowned(target, unowned=unowned))


def refuse_unowned(target: Path, *, unowned: Unowned) -> None:
    """Raise ``FileExistsError`` on what stands at ``target`` that a save there would destroy."""
    found = unowned(target)
    if found:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise FileExistsError(
            f"Saving to {target} would delete what no earlier save there wrote ({shown}). Choose another path,"
            " or move those files away."
        )


def _make_staging(target: Path, *, unowned: Unowned) -> str:
    """A fresh directory beside ``target``, with the permissions a plain ``mkdir`` would give it. What a save killed
    midway left there (its staging directory) is removed first."""
    refuse_unowned(target, unowned=unowned)
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}.staging-"
    for leftover in target.parent.glob(f"{glob.escape(prefix)}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    staging = tempfile.mkdtemp(prefix=prefix, dir=target.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)
    return staging


def _from_rank_zero(action: Callable[[], T]) -> T:
    """What ``action()`` returns on rank 0, on every rank (it runs on rank 0 alone: a shared file system needs one
    writer); an ``OSError`` it raises is raised on every rank, so none goes on alone. Collective."""
    outcome: list[Any] = [None, None]
    if _rank() == 0:
        try:
            outcome[0] = action()
        except OSError as error:
            outcome[1] = error
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _everywhere(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (a collective)."""
    if not dist.is_initialized():
        return flag
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    count = torch.tensor(int(flag), device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return bool(count.item())


def _replace(target: Path, staging: Path) -> None:
    if not target.exists():
        staging.rename(target)
        return
    old = target.with_name(f".{target.name}.old")
    _remove(old)
    target.rename(old)
    try:
        staging.rename(target)
    except OSError:
        old.rename(target)  # put the previous one back
        raise
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
