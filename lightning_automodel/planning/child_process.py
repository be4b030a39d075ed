"""verify_plan's job in a fresh interpreter: inside distributed training a process group exists, and the simulated
ranks need one of their own; every rank then gets the same verdict with no collective on the job's groups."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def in_child_process(function: Callable[..., Any], job: dict[str, Any]) -> Any:
    """``function(**job)`` in a fresh interpreter (both must pickle); what it raises is raised here. Started with
    ``-c`` rather than multiprocessing's spawn, which would re-run an unguarded training script."""
    with tempfile.TemporaryDirectory() as directory:
        job_file, outcome_file = Path(directory, "job.pickle"), Path(directory, "outcome.pickle")
        job_file.write_bytes(pickle.dumps((function, job)))
        code = "import sys; from lightning_automodel.planning.child_process import _serve; _serve(*sys.argv[1:])"
        command = [sys.executable, "-c", code, str(job_file), str(outcome_file)]
        done = subprocess.run(command, env=_child_environment(), capture_output=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"verify_plan's child process failed:\n{done.stderr.decode(errors='replace')[-4000:]}")
        outcome = pickle.loads(outcome_file.read_bytes())
    if isinstance(outcome, BaseException):
        raise outcome
    return outcome


def _child_environment() -> dict[str, str]:
    """This process's environment, with its import path: the child must import the code this process runs (this
    copy of the package, the module a ``tp_plan`` import path names) from where this process found it."""
    path = [str(Path(entry).resolve()) for entry in sys.path if entry]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _serve(job_file: str, outcome_file: str) -> None:
    """The child of :func:`in_child_process`: the job's outcome (or its refusal), pickled to a file."""
    function, job = pickle.loads(Path(job_file).read_bytes())
    try:
        outcome: Any = function(**job)
    except Exception as error:  # noqa: BLE001 - a refusal is an outcome, raised again in the parent
        outcome = error
    Path(outcome_file).write_bytes(pickle.dumps(outcome))
