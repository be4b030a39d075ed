"""verify_plan against the coverage report: does the one-process check reach the 2-process check's verdict?

For every model type the report measured at a tensor-parallel layout (``docs/coverage.json``, written by
``scripts/coverage.py``), ``verify_plan`` runs on the type's tiny config in this process: a pass must pass, a wrong
plan must fail, a refusal must be refused. Disagreements are printed, and make the exit status 1.

    .venv/bin/python scripts/verify_coverage.py                              # tp2 and tp2_sp, every type
    .venv/bin/python scripts/verify_coverage.py --types qwen3,apertus --layouts tp2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

from lightning_automodel.hf.shrink import tiny_config
from lightning_automodel.planning.verify import verify_plan

ROOT = Path(__file__).resolve().parent.parent

SP = {"tp2": False, "tp2_sp": True}  # the report's tensor-parallel layouts, all at tp=2
# The report's verdicts verify_plan can reach (a crash or a hang is the report's own finding about a launch).
COMPARED = ("pass", "wrong", "refusal")


def main() -> None:
    args = parse_args()
    results = json.loads(args.results.read_text())["results"]
    disagreements, timings = 0, []
    for layout in args.layouts:
        jobs = {key.split("/")[0]: verdict["verdict"] for key, verdict in results.items() if key.endswith(f"/{layout}")}
        for model_type in args.types or sorted(jobs):
            if jobs.get(model_type) not in COMPARED:
                continue
            start = time.perf_counter()
            found = verdict_of(model_type, sp=SP[layout])
            timings.append(time.perf_counter() - start)
            if found != jobs[model_type]:
                disagreements += 1
                print(f"{model_type}/{layout}: the report says {jobs[model_type]}, verify_plan {found}", flush=True)
    print(f"{len(timings)} checks, {disagreements} disagreements, {sum(timings):.0f} s ({max(timings):.1f} s at most)")
    sys.exit(1 if disagreements else 0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", type=lambda text: text.split(","), help="comma-separated (default: all measured)")
    parser.add_argument("--layouts", type=lambda text: text.split(","), default=list(SP), help="of tp2, tp2_sp")
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "coverage.json")
    return parser.parse_args()


def verdict_of(model_type: str, *, sp: bool) -> str:
    """verify_plan's verdict on the type's tiny config, in the report's words; an unexpected error is a crash."""
    try:
        verification = verify_plan(tiny_config(model_type), tp=2, sp=sp, raise_on_failure=False)
    except ValueError:
        return "refusal"
    except Exception as error:  # noqa: BLE001 - reported as a disagreement, with what it was
        return f"crash ({type(error).__name__}: {str(error)[:200]})"
    return "pass" if verification.passed else "wrong"


if __name__ == "__main__":
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # tiny configs trip warnings about sizes, one per type
    warnings.filterwarnings("ignore")
    main()
