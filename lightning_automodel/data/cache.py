"""The token cache: a corpus tokenized once into a directory, reused across launches and ranks, keyed by what made it.

The key holds each file's path, size and modification time (a ``datasets.Dataset``'s fingerprint and rows), the
tokenizer (a digest of its vocabulary, special tokens and chat template) and the settings that change the tokens: a
change to any of them builds the cache again. One process per machine builds it (the local rank 0; on a shared
filesystem the machines race harmlessly: the first complete copy stays), into a hidden directory beside it that takes
its place once complete. The other ranks read the directory as soon as its ``meta.json`` carries their key, without any
collective, and wait as long as the build makes progress; a build that fails leaves its error beside the cache, and
every rank raises it; a builder announcing another key (a rank naming other files) is refused.

A cache directory holds the cache's files and nothing else: one that holds anything else (a user's files, a
subdirectory) is refused on every rank, and never written into or deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_automodel.data.sources.expand import Source
from lightning_automodel.data.sources.tables import DatasetSource
from lightning_automodel.data.store import STORE_FILES, TokenStore, open_store, read_meta

FORMAT = 2  # the layout of a cache directory; a change of it rebuilds every cache (2: a digest per source)
DEFAULT_ROOT = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "lightning-automodel" / "tokens"
_POLL_S = 0.2
_STARTED = time.time()  # about when this process started: notes beside a cache from before it are an earlier run's
_SLACK_S = 5.0
_HOST = socket.gethostname()


def cache_key(*, files: list[Source], tokenizer: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """What the cached tokens are a function of (see the module's docstring)."""
    return {
        "format": FORMAT,
        "files": [_file_entry(source) for source in files],
        "tokenizer": tokenizer_digest(tokenizer),
        **settings,
    }


def _file_entry(source: Source) -> list[Any]:
    """A file's path, size and modification time; a dataset's fingerprint (in its name) and rows."""
    if isinstance(source, DatasetSource):
        return [source.name, len(source.dataset), None]
    stat = os.stat(source)
    return [os.path.abspath(source), stat.st_size, stat.st_mtime_ns]


def tokenizer_digest(tokenizer: Any) -> str:
    """A digest of what makes the tokenizer's ids: not its padding and truncation settings, which a fast tokenizer's
    call changes (the cache pads and truncates nothing)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        serialized = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("padding", "truncation")}
    parts = [
        type(tokenizer).__name__,
        json.dumps(serialized if backend is not None else tokenizer.get_vocab(), sort_keys=True),
        json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str),
        str(getattr(tokenizer, "chat_template", None)),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def default_directory(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return DEFAULT_ROOT / digest


def cached_store(
    directory: Path, *, key: dict[str, Any], build: Callable[[Path], None], builder: bool, timeout_s: float
) -> TokenStore:
    """The store cached in ``directory`` for ``key``: read if there, else built by ``build(staging_directory)`` when
    ``builder``, else waited for (while no build makes progress, at most ``timeout_s``)."""
    refuse_foreign(directory)
    if builder:
        _write_note(_note(directory, "key"), {"key": key})
        if (meta := read_meta(directory)) is None or meta.get("key") != key:
            _build(directory, key=key, build=build)
            meta = read_meta(directory)
        if meta is None or meta.get("key") != key:
            raise ValueError(f"The token cache {directory} was replaced while it was built: by a run for other inputs.")
        return open_store(directory, meta)
    progress, since = None, time.monotonic()
    while (meta := read_meta(directory)) is None or meta.get("key") != key:
        _refuse_notes(directory, key)
        if (now := _progress(directory)) != progress:
            progress, since = now, time.monotonic()
        elif time.monotonic() - since > timeout_s:
            raise TimeoutError(
                f"Waited {timeout_s:.0f} s for the token cache {directory}, which the local rank 0 builds, with no"
                " progress. Look at that rank's output, or build the cache first (`lightning-automodel fit` on one"
                " process, with max_steps=0)."
            )
        time.sleep(_POLL_S)
    return open_store(directory, meta)


def refuse_foreign(directory: Path) -> None:
    """Refuse a cache directory that holds what a cache did not write: anything but the cache's files, or those
    names without a cache's ``meta.json``."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"The token cache {directory} is a file: name a directory (cache_dir).")
    entries = list(directory.iterdir()) if directory.is_dir() else []
    foreign = sorted(
        entry.name + ("/" if entry.is_dir() else "")
        for entry in entries
        if entry.name not in STORE_FILES or not entry.is_file()
    )
    meta = read_meta(directory)
    if not foreign and entries and not (isinstance(meta, dict) and isinstance(meta.get("key"), dict)):
        foreign = sorted(entry.name for entry in entries)  # the names, but no cache's meta.json: not ours
    if foreign:
        raise ValueError(
            f"The token cache directory {directory} holds files a token cache does not write ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}): it is left as it is. Name an empty or new directory as"
            " cache_dir."
        )


def _build(directory: Path, *, key: dict[str, Any], build: Callable[[Path], None]) -> None:
    failure = _note(directory, "failed")
    failure.unlink(missing_ok=True)
    directory.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_stagings(directory)
    staging = _note(directory, f"building-{_HOST}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        build(staging)
        _put_in_place(directory, staging, key=key)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(error, Exception):  # not an interruption: every rank raises it
            _write_note(failure, {"key": key, "error": str(error) or type(error).__name__})
        raise


def _put_in_place(directory: Path, staging: Path, *, key: dict[str, Any]) -> None:
    """Move the complete copy in; a copy for another key (stale) goes first, one for this key (another machine's,
    on a shared filesystem) stays and ours is dropped."""
    meta = read_meta(directory)
    if meta is not None and meta.get("key") == key:
        shutil.rmtree(staging)
        return
    old = _note(directory, f"old-{_HOST}-{os.getpid()}")
    try:
        if directory.exists():
            refuse_foreign(directory)
            os.rename(directory, old)
        os.rename(staging, directory)
    except OSError:  # another builder moved the stale copy aside, or its own copy in, first
        meta = read_meta(directory)
        if meta is None or meta.get("key") != key:
            raise
        shutil.rmtree(staging)
    shutil.rmtree(old, ignore_errors=True)


def _remove_dead_stagings(directory: Path) -> None:
    """Staging directories this machine's killed builds left (their process gone)."""
    for staging in directory.parent.glob(f".{directory.name}.building-{_HOST}-*"):
        pid = int(staging.name.rsplit("-", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(staging, ignore_errors=True)
        except PermissionError:  # another user's process
            pass


def _progress(directory: Path) -> int:
    """The bytes every build of ``directory`` has staged so far: a waiting rank waits as long as they grow."""
    stagings = directory.parent.glob(f".{directory.name}.building-*")
    return sum(entry.stat().st_size for staging in stagings for entry in staging.glob("*") if entry.is_file())


def _note(directory: Path, kind: str) -> Path:
    return directory.parent / f".{directory.name}.{kind}"


def _write_note(path: Path, content: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{_HOST}-{os.getpid()}")
    temporary.write_text(json.dumps(content))
    os.replace(temporary, path)


def _recent_note(path: Path) -> dict[str, Any] | None:
    """A note beside the cache written since this run started (an earlier run's is no news), or None."""
    try:
        if path.stat().st_mtime < _STARTED - _SLACK_S:
            return None
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _refuse_notes(directory: Path, key: dict[str, Any]) -> None:
    """Raise the builder's error, or refuse a builder announcing another key, as a waiting rank."""
    failure = _recent_note(_note(directory, "failed"))
    if failure is not None and failure.get("key") == key:  # the builder's own message: every rank refuses alike
        raise ValueError(failure["error"])
    announced = _recent_note(_note(directory, "key"))
    if announced is not None and announced.get("key") != key:
        raise ValueError(
            f"The local rank 0 builds the token cache {directory} for other inputs than this rank's (files, tokenizer"
            f" or settings: {_differences(announced['key'], key)}). Every rank must name the same files, tokenizer"
            " and settings."
        )


def _differences(built: dict[str, Any], wanted: dict[str, Any]) -> str:
    return ", ".join(sorted(name for name in built.keys() | wanted.keys() if built.get(name) != wanted.get(name)))
