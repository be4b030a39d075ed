"""Directories written by all ranks that appear whole or not at all: nothing saved before is lost to a failed save."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist


@contextmanager
def atomic_directory(directory: str | os.PathLike) -> Generator[Path, None, None]:
    """Every rank gets the same staging directory beside ``directory`` to write into; collective.

    When every rank's block succeeded, the staging directory replaces ``directory`` (the old one is removed only
    once the new one is in place). When any rank's block failed, the staging directory is removed, ``directory``
    is left as it was, and every rank raises, so none goes on as if the save had happened.
    """
    target = Path(directory)
    created: list[str | None] = [None, None]  # the staging path, or rank 0's error
    if _rank() == 0:
        try:
            created[0] = _make_staging(target)
        except OSError as error:
            created[1] = repr(error)
    if dist.is_initialized():
        dist.broadcast_object_list(created, src=0)
    if created[1] is not None:
        raise OSError(f"Rank 0 could not create a staging directory beside {target}: {created[1]}")
    path = Path(created[0])
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


def _make_staging(target: Path) -> str:
    """A fresh directory beside ``target``, with the permissions a plain ``mkdir`` would give it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)
    return staging


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
