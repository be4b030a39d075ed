"""The coverage report's verdicts: one per check, from every rank's outcome (pass, wrong, refusal, crash, hang or no
tiny config), and an error described as data (its type, first line, site, and whether it is a clear refusal of ours).
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning_automodel
from lightning_automodel.testing.parity import FP32_TOLERANCE

PASS, WRONG, REFUSAL, CRASH, HANG, NO_TINY_CONFIG = "pass", "wrong", "refusal", "crash", "hang", "no tiny config"
# An image-text-to-text type whose image inputs the builder (lightning_automodel/hf/vision/image_inputs.py) does not
# know: our limit, not the model's, and not measured.
NO_IMAGE_INPUTS = "no image inputs"


VERDICTS = (PASS, WRONG, REFUSAL, CRASH, HANG, NO_TINY_CONFIG)


# A refusal is one of these, raised by this package's code with the same message on every rank.
REFUSAL_TYPES = (ValueError, TypeError, NotImplementedError)


PACKAGE_DIR = Path(lightning_automodel.__file__).parent
TESTING_DIR = PACKAGE_DIR / "testing"


# Errors of a rank that only waited for a peer which failed or hung: the cause is elsewhere.
SECONDARY_FAILURES = ("timed out", "connection closed by peer", "connection reset by peer")


def classify(outcomes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One verdict from every rank's outcome of a check: pass, wrong, refusal, crash, hang or no tiny config,
    with a one-line detail and, for a pass, how much tensor parallelism sharded."""
    statuses = {outcome["status"] for outcome in outcomes}
    first = outcomes[0]
    if statuses in ({NO_TINY_CONFIG}, {NO_IMAGE_INPUTS}):
        return {"verdict": first["status"], "detail": first["reason"]}
    if statuses == {"ran"}:
        return _judge_numbers(outcomes)
    raised = [(rank, o) for rank, o in enumerate(outcomes) if o["status"] == "raised"]
    if len(raised) < len(outcomes):
        rank, outcome = raised[0]
        return {"verdict": CRASH, "detail": f"raised on rank {rank} only: {error_line(outcome)}"}
    if all(o["secondary"] == "timed out" for o in outcomes):
        return {"verdict": HANG, "detail": f"every rank timed out in a collective ({first['stage']})"}
    errors = {(o["error"], o["message"]) for o in outcomes}
    if len(errors) == 1 and first["ours"] and first["clear"]:
        detail = f"{first['error']}: {first['message']}"
        return {"verdict": REFUSAL, "detail": detail, "after_collectives": first["after_collectives"]}
    if len(errors) == 1:
        return {"verdict": CRASH, "detail": error_line(first)}
    rank, cause = next(((r, o) for r, o in raised if not o["secondary"]), raised[0])
    return {"verdict": CRASH, "detail": f"rank {rank}: {error_line(cause)}; the other ranks then failed too"}


def _judge_numbers(outcomes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Pass or wrong by the numbers; buffers the meta-device build left uninitialised are a note beside them (the
    numbers were taken with the reference's buffers copied in)."""
    first = outcomes[0]
    found = {key: first.get(key) for key in ("sharded", "embedding_sharded", "lm_head_sharded", "plan")}
    if first.get("loosened_limits"):
        found["loosened_limits"] = first["loosened_limits"]
    for key in ("build", "tower_sharded", "kept_whole"):
        if key in first:
            found[key] = first[key]
    if first["uninitialised_buffers"]:
        found["note"] = f"meta-device build leaves buffers uninitialised: {', '.join(first['uninitialised_buffers'])}"
    mismatch = next((o["mismatch"] for o in outcomes if "mismatch" in o), None)
    if mismatch is not None:
        return {"verdict": WRONG, "detail": mismatch, **found}
    worst = next((o for o in outcomes if not o["grads_within_limits"]), outcomes[0])
    errors = {key: max(o["errors"][key] for o in outcomes) for key in worst["errors"]}
    problems = [f"{key} {errors[key]:.1e}" for key in ("loss", "logits") if not errors[key] < FP32_TOLERANCE]  # NaN too
    if not all(o["grads_within_limits"] for o in outcomes):
        problems.append(f"grad {errors['grad']:.1e} ({worst['worst_grad']})")
    return {"verdict": WRONG if problems else PASS, "detail": ", ".join(problems), "errors": errors, **found}


def describe_error(error: BaseException) -> dict[str, Any]:
    """The error as data: its type, first line, where it was raised, and whether it is a clear refusal of ours."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    site = Path(frame.filename)
    ours = PACKAGE_DIR in site.parents and TESTING_DIR not in site.parents  # the harness's own errors are crashes
    shown = site.relative_to(PACKAGE_DIR.parent) if PACKAGE_DIR in site.parents else Path(*site.parts[-3:])
    message = first_line(error)
    return {
        "error": type(error).__name__,
        "message": message,
        "site": f"{shown}:{frame.lineno}",
        "ours": ours,
        "clear": isinstance(error, REFUSAL_TYPES),
        "secondary": next((what for what in SECONDARY_FAILURES if what in message.lower()), None),
    }


def error_line(outcome: dict[str, Any]) -> str:
    return f"{outcome['error']}: {outcome['message']} (in {outcome['stage']}, at {outcome['site']})"


def first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else ""
