"""The model types the sweeps over transformers go through (scripts/coverage.py, scripts/pipeline_split_check.py),
those they skip, the tiny configs the coverage report checks, and the revision of the code they measure."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import CONFIG_MAPPING, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

import lightning_automodel
from lightning_automodel.hf.shrink import tiny_config

# The checkout whose lightning_automodel/ the sweeps measure.
ROOT = Path(lightning_automodel.__file__).resolve().parent.parent

# Not decoder-only text models, though the causal-LM mapping lists them.
SKIP_REASONS = {
    "musicgen": "an audio-codebook decoder: input_ids are (batch x codebooks, length) audio codes",
    "musicgen_melody": "an audio-codebook decoder: input_ids are (batch x codebooks, length) audio codes",
}

_ENCODER_DECODER = "an encoder-decoder: the image and the prompt are encoded, a decoder of its own generates"
# Not image-and-text-to-text decoders, though the image-text-to-text mapping lists them.
IMAGE_SKIP_REASONS = {
    "diffusion_gemma": "a block-diffusion model: it denoises blocks of tokens, not a next-token decoder",
    "evolla": "a protein-text model: its inputs are protein sequences, not images",
    "florence2": _ENCODER_DECODER,
    "mistral4": "a text-only causal LM: Mistral4ForCausalLM takes no images (measured in coverage.md)",
    "pi0": "a robot policy: it generates actions from images and a prompt, not text",
    "pix2struct": _ENCODER_DECODER,
    "pp_formulanet": _ENCODER_DECODER,
    "t5gemma2": _ENCODER_DECODER,
    "udop": _ENCODER_DECODER,
    "vision-encoder-decoder": _ENCODER_DECODER,
}


# Tiny configs the coverage report checks beside each type's own (hf/shrink.py), each a row named "type:what": configs
# found failing where the type's own passed, by type and the arguments of its config class.
EXTRA_TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # Local attention only, 64 positions of which its axial position embeddings tile 16: Reformer trains on those 16
    # tokens alone, a length the meta-device probe must find to see its reversible layers (its own config's 16
    # positions are the length it tries second).
    "reformer:local_64_positions": (
        "reformer",
        dict(
            attention_head_size=16, attn_layers=["local", "local"], axial_pos_embds=True, axial_pos_shape=[4, 4],
            axial_pos_embds_dim=[32, 32], feed_forward_size=128, hidden_act="relu", hidden_dropout_prob=0.0,
            hidden_size=64, is_decoder=True, local_attn_chunk_length=8, lsh_attn_chunk_length=8,
            local_num_chunks_before=1, local_num_chunks_after=0, lsh_num_chunks_before=1, lsh_num_chunks_after=0,
            max_position_embeddings=64, num_attention_heads=4, num_hashes=1, vocab_size=128, num_hidden_layers=2,
            chunk_size_lm_head=0, tie_word_embeddings=False, use_cache=False, local_attention_probs_dropout_prob=0.0,
            lsh_attention_probs_dropout_prob=0.0,
        ),
    ),
}  # fmt: skip


def causal_lm_types() -> dict[str, str]:
    """Every model type of the installed transformers' causal-LM mapping, with the class it builds."""
    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def image_text_types() -> dict[str, str]:
    """Every model type of the installed transformers' image-text-to-text mapping, with the class it builds."""
    return dict(sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()))


def coverage_types() -> dict[str, str]:
    """What the coverage report checks, by name, with the class each builds: every causal-LM type and the extra tiny
    configs."""
    types = causal_lm_types()
    extra = {name: types[model_type] for name, (model_type, _) in EXTRA_TINY_CONFIGS.items()}
    return dict(sorted({**types, **extra}.items()))


def coverage_config(name: str) -> Any:
    """The tiny config the coverage report checks under ``name``: an extra one, or the type's own."""
    if name in EXTRA_TINY_CONFIGS:
        model_type, arguments = EXTRA_TINY_CONFIGS[name]
        return CONFIG_MAPPING[model_type](**arguments)
    return tiny_config(name)


def coverage_model(name: str, **overrides: Any) -> nn.Module:
    """A model of the tiny config the coverage report checks under ``name`` (:func:`coverage_config`), with
    ``overrides`` set on the config, its weights drawn from seed 0."""
    torch.manual_seed(0)
    config = coverage_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_config(config)


def library_revision() -> str:
    """The commit of the code measured, marked when lightning_automodel/ has uncommitted changes."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "lightning_automodel")
    return git("rev-parse", "--short", "HEAD") + (" with uncommitted changes" if dirty else "")
