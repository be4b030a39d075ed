"""Directories written by all ranks that appear whole or not at all, and never at the cost of a user's files.

A save replaces what stands at its path only when that is a previous save of the same kind (a checkpoint, a
Hugging Face model directory): a path that holds anything else (a user's notes, a dataset, an experiment folder)
is refused on every rank before anything is written, and a failed save leaves the previous one as it was.

There is no moment at which the newest complete copy cannot be found, by Lightning's ``ckpt_path="last"`` (the
newest ``last*.ckpt`` by modification time) or by the path itself (:func:`readable_path`). A save writes into a
hidden staging directory; once every rank has written its part, the staging directory becomes ``last.new.ckpt``
(touched: the newest), the previous copy goes aside as ``last.old.ckpt``, and the new one moves in. A job killed
between these renames leaves complete copies under names both lookups find, and the next save finishes the swap
before it writes. A copy is deleted only once a newer one stands at the path, and renamed out of sight first.
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
    path = staging_directory(target, unowned=unowned)
    succeeded = False
    try:
        yield path
        succeeded = True
    finally:
        everywhere = _everywhere(succeeded)
        swap_error = None
        if _rank() == 0:
            try:
                put_in_place(target, path, unowned=unowned, written=everywhere)
            except OSError as error:
                swap_error = error
        swapped = _everywhere(swap_error is None)
        if swap_error is not None:
            raise swap_error
        if not swapped:
            raise RuntimeError(f"Rank 0 failed to put {target} in place; see its error.")
        if succeeded and not everywhere:
            raise RuntimeError(f"Another rank failed to write {target}; it was left as it was. See that rank's error.")


def staging_directory(target: Path, *, unowned: Unowned) -> Path:
    """The directory beside ``target`` that every rank writes a save into (made by rank 0); collective."""
    return Path(_from_rank_zero(lambda: _make_staging(target, unowned=unowned)))


def put_in_place(target: Path, staging: Path, *, unowned: Unowned, written: bool) -> None:
    """On rank 0 alone: once every rank has ``written`` its part, ``staging`` replaces ``target``; in any case no
    staging directory is left."""
    try:
        if written:
            refuse_unowned(target, unowned=unowned)  # nothing of the user's appeared there while we wrote
            _replace(target, staging, unowned=unowned)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # left over only if not swapped in


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


def readable_path(target: Path) -> Path:
    """The newest complete copy of ``target``: itself, unless a save was killed in the middle of its swap."""
    candidates = (_renamed(target, "new"), target, _renamed(target, "old"))
    return next((path for path in candidates if path.exists()), target)


def _renamed(target: Path, tag: str) -> Path:
    """``last.ckpt`` -> ``last.{tag}.ckpt``: a name that ``ckpt_path="last"`` still matches."""
    return target.with_name(f"{target.stem}.{tag}{target.suffix}")


def _make_staging(target: Path, *, unowned: Unowned) -> str:
    """A fresh directory beside ``target``, with the permissions a plain ``mkdir`` would give it. What a save killed
    midway left is dealt with first: a swap it began is finished, its staging directory and half-deleted copies
    are removed."""
    newest = readable_path(target)
    if newest != target:
        _move_in(target, newest, unowned=unowned)
    refuse_unowned(target, unowned=unowned)
    target.parent.mkdir(parents=True, exist_ok=True)
    for prefix in (_STAGING.format(target.name), _DELETING.format(_renamed(target, "old").name)):
        for leftover in target.parent.glob(f"{glob.escape(prefix)}*"):
            shutil.rmtree(leftover, ignore_errors=True)
    staging = tempfile.mkdtemp(prefix=_STAGING.format(target.name), dir=target.parent)
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


_STAGING = ".{}.staging-"
_DELETING = ".{}.deleting"


def _replace(target: Path, staging: Path, *, unowned: Unowned) -> None:
    """Put the complete ``staging`` at ``target``, under names that find it at every moment."""
    new = _renamed(target, "new")
    refuse_unowned(new, unowned=unowned)  # nothing is there but what an interrupted save left, finished beforehand
    staging.rename(new)
    os.utime(new)  # the newest copy by modification time, which ckpt_path="last" goes by
    _move_in(target, new, unowned=unowned)


def _move_in(target: Path, newest: Path, *, unowned: Unowned) -> None:
    """The renames that put ``newest`` at ``target`` (the previous copy aside until then), and the clean-up. The
    copies at ``newest`` and aside must be saves of this kind: a user's ``model.old`` is refused, never deleted."""
    aside = _renamed(target, "old")
    for path in {newest, aside}:
        refuse_unowned(path, unowned=unowned)
    if newest != aside:
        _delete(aside)  # stale: a newer copy exists
        if target.exists():
            target.rename(aside)
    newest.rename(target)
    _delete(aside)


def _delete(path: Path) -> None:
    """Remove ``path``, first renaming it out of sight, so that no lookup finds it half deleted."""
    if not path.exists():
        return
    hidden = path.with_name(_DELETING.format(path.name))
    _remove(hidden)
    path.rename(hidden)
    _remove(hidden)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
