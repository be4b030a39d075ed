"""How every rank ends when one fails: exit codes, seconds from the fault to each survivor's exit, what it printed.

    .venv/bin/python benchmarks/faults.py                      # every fault, default and 30 s timeouts (~20 min)
    .venv/bin/python benchmarks/faults.py --timeouts 30 --cases "SIGKILL rank 1" "SIGTERM rank 1"

Each case launches testing/faults/fault_train.py as users do (Lightning's launcher, torchrun with one or
two agents, or each rank as srun starts it in a SLURM job step), the tiny Llama at tp=2 x dp_shard=2 on 4 CPU
processes over gloo, and injects the fault once every rank has trained 2 steps (see
lightning_automodel/testing/faults/launch.py). A survivor still running ``--wait`` seconds after the fault is reported
as such and killed. Run it against another checkout with PYTHONPATH=that/checkout.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
from pathlib import Path

from lightning_automodel.testing.faults.launch import Fault, Outcome, launch

KILL, TERM, INT, STOP, USR1 = signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGSTOP, signal.SIGUSR1

# name -> (launcher, nodes, fault, fault_train.py arguments, the rank that failed)
CASES = {
    "SIGKILL rank 1": ("lightning", 1, Fault(KILL, 1), (), 1),
    "SIGKILL rank 0 (launcher, store host)": ("lightning", 1, Fault(KILL, 0), (), 0),
    "SIGTERM rank 1": ("lightning", 1, Fault(TERM, 1), (), 1),
    "SIGTERM launcher": ("lightning", 1, Fault(TERM, "launcher"), (), 0),
    "Ctrl-C": ("lightning", 1, Fault(INT, "group"), (), 0),
    "SIGSTOP rank 1 (frozen)": ("lightning", 1, Fault(STOP, 1), (), 1),
    "SIGSTOP rank 0 (frozen store host)": ("lightning", 1, Fault(STOP, 0), (), 0),
    "NaN on rank 1, detect_anomaly": ("lightning", 1, None, ("--nan-rank=1", "--detect-anomaly"), 1),
    "SIGKILL rank 1 mid-save": ("lightning", 1, None, ("--save-every=2", "--in-save=1"), 1),
    "torchrun: SIGKILL rank 1": ("torchrun", 1, Fault(KILL, 1), (), 1),
    "torchrun: SIGKILL agent": ("torchrun", 1, Fault(KILL, "launcher"), (), None),
    "torchrun: SIGTERM agent": ("torchrun", 1, Fault(TERM, "launcher"), (), None),
    "torchrun: Ctrl-C": ("torchrun", 1, Fault(INT, "group"), (), None),
    "torchrun 2 nodes: SIGKILL rank 3": ("torchrun", 2, Fault(KILL, 3), (), 3),
    "torchrun 2 nodes: SIGSTOP rank 3": ("torchrun", 2, Fault(STOP, 3), (), 3),
    "SLURM: SIGUSR1 (requeue) to rank 1": ("slurm", 1, Fault(USR1, 1), ("--save-every=1000",), None),
    "SLURM: SIGTERM to all in a 5 s save": ("slurm", 1, Fault(TERM, "all"), ("--save-every=2", "--slow-save=5"), None),
}


def summary(outcome: Outcome, failed: int | None) -> str:
    """Survivors' exit codes and seconds after the fault (or after the failed rank's exit, for faults the run
    injects itself), then the first survivor's message."""
    start = 0.0
    if outcome.fault is None and failed is not None:
        start = outcome.ranks[failed].seconds or 0.0
    ends = {rank: end for rank, end in outcome.ranks.items() if rank != failed}
    codes = ", ".join(str(end.code) for end in ends.values())
    times = [end.seconds - start for end in ends.values() if end.seconds is not None]
    running = sum(end.seconds is None for end in ends.values())
    span = f"{min(times):.1f}-{max(times):.1f} s" if times else "-"
    span += f", {running} still running" if running else ""
    said = [
        line.split("lightning-automodel: ", 1)[1]
        for end in ends.values()
        for line in end.output.splitlines()
        if "lightning-automodel: the run stopped" in line
    ]
    last = [end.output.strip().splitlines()[-1] if end.output.strip() else "" for end in ends.values()]
    message = said[0] if said else (last[0] if last else "")
    return f"exit codes {codes} | {span} | {message[:240]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--timeouts", nargs="*", default=["default", "30"], help="seconds, or 'default'")
    parser.add_argument("--wait", type=float, default=120, help="seconds to wait for the survivors")
    args = parser.parse_args()
    for timeout in args.timeouts:
        for name in args.cases:
            launcher, nodes, fault, options, failed = CASES[name]
            with tempfile.TemporaryDirectory(prefix="lam-faults-") as directory:
                try:
                    outcome = launch(
                        Path(directory),
                        fault,
                        launcher=launcher,
                        nodes=nodes,
                        timeout=None if timeout == "default" else float(timeout),
                        wait=args.wait,
                        args=options,
                    )
                except RuntimeError as error:  # the run failed before the fault (an older checkout)
                    result = f"failed before the fault: {str(error).strip().splitlines()[-1][:200]}"
                else:
                    result = summary(outcome, failed)
                if "--in-save=1" in options and (Path(directory) / "ckpt").is_dir():
                    result += f" | left in ckpt/: {sorted(p.name for p in (Path(directory) / 'ckpt').iterdir())}"
            print(f"{name:38} timeout {timeout:>7} | {result}", flush=True)


if __name__ == "__main__":
    main()
