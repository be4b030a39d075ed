"""The model types the sweeps over transformers go through (scripts/coverage.py, scripts/pipeline_split_check.py),
those they skip, and the revision of the code they measure."""

from __future__ import annotations

import subprocess
from pathlib import Path

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import lightning_automodel

# The checkout whose lightning_automodel/ the sweeps measure.
ROOT = Path(lightning_automodel.__file__).resolve().parent.parent

# Not decoder-only text models, though the causal-LM mapping lists them.
SKIP_REASONS = {
    "musicgen": "an audio-codebook decoder: input_ids are (batch x codebooks, length) audio codes",
    "musicgen_melody": "an audio-codebook decoder: input_ids are (batch x codebooks, length) audio codes",
}


def causal_lm_types() -> dict[str, str]:
    """Every model type of the installed transformers' causal-LM mapping, with the class it builds."""
    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def library_revision() -> str:
    """The commit of the code measured, marked when lightning_automodel/ has uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "lightning_automodel")
    return git("rev-parse", "--short", "HEAD") + (" with uncommitted changes" if dirty else "")
