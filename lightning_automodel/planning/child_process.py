"""Planning jobs in fresh interpreters: inside distributed training a process group exists, and the fake worlds and
simulated ranks of planning need one of their own. A :class:`ChildProcess` runs one job after another (the layout
search sends it a wave's share at a time, paying the interpreter's start once); :func:`in_child_process` runs one.
Every rank of a job can then reach the same verdict with no collective on the job's groups."""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

_LENGTH = struct.Struct("<Q")  # each message: its length, then its pickle


class ChildProcess:
    """A fresh interpreter that runs ``function(**job)`` for each :meth:`submit`, in order; :meth:`result` returns
    the outcome of the oldest job submitted, or raises what it raised. Started with ``-c`` rather than
    multiprocessing's spawn, which would re-run an unguarded training script; ``threads``: torch's intra-op threads
    there (its default where None). Its output goes to a file, whose end a crash's error quotes."""

    def __init__(self, *, purpose: str, threads: int | None = None) -> None:
        self.purpose = purpose
        self._output = tempfile.TemporaryFile()
        code = "import sys; from lightning_automodel.planning.child_process import _serve; _serve(*sys.argv[1:])"
        command = [sys.executable, "-c", code, *([str(threads)] if threads else [])]
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._output,
            env=_child_environment(),
        )

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def replies(self) -> IO[bytes]:
        """Where the outcomes arrive: readable once the oldest job is done (for a selector over several children)."""
        return self._process.stdout

    def submit(self, function: Callable[..., Any], job: dict[str, Any]) -> None:
        try:
            _send(self._process.stdin, (function, job))
        except BrokenPipeError:
            raise self._failure() from None

    def result(self) -> Any:
        outcome = _receive(self._process.stdout)
        if outcome is None:
            raise self._failure()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._output.close()

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def _failure(self) -> RuntimeError:
        code = self._process.wait()
        self._output.seek(0)
        output = self._output.read().decode(errors="replace")[-4000:]
        return RuntimeError(f"{self.purpose}'s child process failed (exit {code}):\n{output}")


def in_child_process(function: Callable[..., Any], job: dict[str, Any], *, purpose: str = "verify_plan") -> Any:
    """``function(**job)`` in a fresh interpreter (both must pickle); what it raises is raised here."""
    with ChildProcess(purpose=purpose) as child:
        child.submit(function, job)
        return child.result()


def _child_environment() -> dict[str, str]:
    """This process's environment, with its import path: the child must import the code this process runs (this
    copy of the package, the module a ``tp_plan`` import path names) from where this process found it."""
    path = [str(Path(entry).resolve()) for entry in sys.path if entry]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    """The next message, or None where the stream ended first."""
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(header)
    data = stream.read(length)
    return pickle.loads(data) if len(data) == length else None


def _serve(threads: str | None = None) -> None:
    """The child of :class:`ChildProcess`: each job's outcome (or what it raised), until its input ends. Messages
    leave on the stdout it started with; what the jobs print goes to its stderr."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    if threads is not None:
        torch.set_num_threads(int(threads))
    while (job := _receive(sys.stdin.buffer)) is not None:
        function, keywords = job
        try:
            outcome: Any = function(**keywords)
        except Exception as error:  # noqa: BLE001 - a refusal is an outcome, raised again in the parent
            outcome = error
        try:
            _send(replies, outcome)
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            _send(replies, RuntimeError(f"{type(outcome).__name__} that does not pickle: {outcome!r} ({error})"))
