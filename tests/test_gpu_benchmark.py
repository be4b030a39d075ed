"""benchmarks/gpu.py's dry run: the GPU check's code (every section, tiny shapes, in one process) runs on CPU, so that
it cannot rot between one use of a GPU and the next; its cp=2 row is a parity check of its own, and layout="auto"
chooses and trains. It runs where the GPU check will: on torch 2.11, the GPU machines' build (`.ci/run`'s second
step, `-m sweep`), and with the sweeps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.sweep
def test_gpu_check_dry_run():
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run"]
    env = os.environ | {"PYTHONPATH": str(ROOT), "GPU_CHECK_PORT": "29611"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    table = done.stdout[done.stdout.index("CPU (dry run)") :]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for row in (
        "activations, checkpointing full",
        "activations, checkpointing off, attn dropout 0.1",
        'layout="auto"',
        "cp=2 sdpa",
        "compiled_float8",
        "lightning_expert",
        "3b_compiled",
    ):
        assert row in table, table
    cp = next(line for line in table.splitlines() if line.startswith("cp=2 sdpa"))
    loss, grads = (float(cp.split(word)[1].split()[0].rstrip(",")) for word in ("loss ", "gradients "))
    assert loss < 2e-5 and grads < 2e-5, cp
