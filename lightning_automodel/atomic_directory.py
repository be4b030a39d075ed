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
    staging = [None]
    if _rank() == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = [tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent)]
    if dist.is_initialized():
        dist.broadcast_object_list(staging, src=0)
    path = Path(staging[0])
    succeeded = False
    try:
        yield path
        succeeded = True
    finally:
        everywhere = _everywhere(succeeded)
        if _rank() == 0:
            if everywhere:
                _replace(target, path)
            else:
                shutil.rmtree(path, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()
        if succeeded and not everywhere:
            raise RuntimeError(f"Another rank failed to write {target}; it was left as it was. See that rank's error.")


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
    staging.rename(target)
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
