"""Where this process's main thread is, in one line, read from another thread.

A stack of a training step is some 60 frames deep, most of them Lightning's, torch's and transformers'. What tells a
user where a rank is stuck is the innermost frame (what it is doing) and their own frames around it (which of their
hooks, data sets or steps it is in): frames outside the Python installation and its installed packages.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
import threading
import traceback
from functools import cache
from pathlib import Path

FRAMES = 3  # frames shown: the innermost, then the user's nearest to it


def main_thread_place() -> str:
    """The main thread's innermost frame and the user's frames nearest to it, innermost first; "..." where frames
    are left out: "hook (train.py:12) <- ... <- training_step (model.py:40)"."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "an unknown place"
    stack = traceback.extract_stack(frame)[::-1]
    users = [index for index, each in enumerate(stack) if index > 0 and _is_users(each.filename)]
    shown = [0, *users][:FRAMES] if users else list(range(min(FRAMES, len(stack))))
    parts, previous = [], 0
    for index in shown:
        parts += ["..."] if index > previous + 1 else []
        parts.append(f"{stack[index].name} ({Path(stack[index].filename).name}:{stack[index].lineno})")
        previous = index
    return " <- ".join(parts)


def _is_users(filename: str) -> bool:
    return not filename.startswith("<") and not filename.startswith(_installed())


@cache
def _installed() -> tuple[str, ...]:
    """The directories of the standard library and of installed packages, as written and as resolved."""
    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    roots.update(site.getsitepackages())
    roots.update(str(Path(root).resolve()) for root in list(roots))
    return tuple(root.rstrip(os.sep) + os.sep for root in roots)
