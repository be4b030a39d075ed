"""Which model types split into pipeline stages: every type of the installed transformers' causal-LM mapping, built
from its tiny config on the meta device, through the checks ``pp > 1`` runs before any collective
(``pipeline_problem``, then ``stage_split_problem``: a shrunk replica split in two stages against whole). Writes
docs/pipeline_split.md.

    .venv/bin/python scripts/pipeline_split_check.py      # about 4 minutes on one CPU core, no processes

A type that passes trains under pp with the checks of tests/test_pipeline.py (those run Llama, Qwen3, Gemma 3 and a
PEFT model); one refused says why, as training would.
"""

from __future__ import annotations

import signal
import warnings
from collections import Counter
from pathlib import Path

import torch

from lightning_automodel.testing.coverage_report.model_types import SKIP_REASONS, causal_lm_types, library_revision

ROOT = Path(__file__).resolve().parent.parent

PER_TYPE_SECONDS = 60


def verdict(model_type: str) -> str:
    """ "splits", or why the type is refused (or could not be built from its tiny config, or its shrunk replica
    could not be built: the check's own failure)."""
    from transformers import AutoModelForCausalLM

    from lightning_automodel.hf.replica import ReplicaError
    from lightning_automodel.hf.shrink import tiny_config
    from lightning_automodel.parallel.pipeline import pipeline_problem, stage_split_problem

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    except Exception as error:  # noqa: BLE001 - recorded, as the coverage report records it
        return f"not built from its tiny config ({type(error).__name__}: {str(error)[:120]})"
    try:
        problem = pipeline_problem(model, pp=2) or stage_split_problem(model)
    except ReplicaError as error:
        cause = error.__cause__
        return f"check failed, its shrunk replica not built ({type(cause).__name__}: {str(cause)[:200]})"
    return "splits" if problem is None else f"refused: {problem[:240]}"


def main() -> None:
    warnings.filterwarnings("ignore")
    results = {}
    for model_type in causal_lm_types():
        if model_type in SKIP_REASONS:
            continue
        signal.alarm(PER_TYPE_SECONDS)
        try:
            results[model_type] = verdict(model_type)
        finally:
            signal.alarm(0)
        print(f"{model_type}: {results[model_type][:100]}", flush=True)
    counts = Counter("splits" if v == "splits" else v.split(" ")[0] for v in results.values())
    lines = [
        "# Pipeline split check",
        "",
        f"Written by `scripts/pipeline_split_check.py` at {library_revision()}, torch {torch.__version__}. Each type",
        "of transformers' causal-LM mapping, from its tiny config, through the checks `pp > 1` runs before any",
        "collective: one list of decoder blocks, a final norm beside it, a language-model head, and the logits of a",
        "shrunk replica split in two stages equal to its logits whole (relative 1e-5).",
        "",
        f"{counts['splits']} of {len(results)} types split; {counts['refused:']} are refused; "
        f"{counts['not']} could not be built from their tiny config; the check failed on {counts['check']} (its"
        " shrunk replica could not be built).",
        "",
        "| type | verdict |",
        "|---|---|",
        *(f"| {model_type} | {text.replace('|', '/')} |" for model_type, text in results.items()),
        "",
    ]
    (ROOT / "docs" / "pipeline_split.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
