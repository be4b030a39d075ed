"""Vision-language weights in and out at tp=2 + sp x dp_shard=2 (one launch of four ranks): a pretrained directory
read shard by shard, checkpoints resumed exactly, with the tower frozen and into another layout, and LoRA adapters
of the tower merged into an exported model."""

from functools import partial

import pytest
from vision_checkpoint_checks import (
    check_vision_exact_resume,
    check_vision_pretrained_trainer,
    check_vision_pretrained_weights,
)
from vision_lora_checks import check_vision_lora_merged_export

from lightning_automodel.testing.harness import run_checks


def test_vision_pretrained_weights_and_checkpoints():
    """Qwen2-VL's pretrained weights read rank by rank; a Trainer from pretrained weights with the tower frozen; exact
    resume into another layout, and with a frozen tower of the trainable parameters only; LoRA's merged export.
    Gemma 3's and LLaVA's (its weights, its resume with the tower frozen): ``-m sweep``."""
    checks = [partial(check_vision_pretrained_weights, "qwen2_vl", 2, True)]
    checks += [partial(check_vision_pretrained_trainer, "qwen2_vl", 2, ("vision_tower",))]
    checks += [partial(check_vision_exact_resume, "qwen2_vl", 2, 1)]
    checks += [partial(check_vision_exact_resume, "qwen2_vl", 2, 2, ("vision_tower",), True)]
    checks += [partial(check_vision_lora_merged_export, "qwen2_vl", 2, True)]
    _print(run_checks(4, checks, timeout=600))


@pytest.mark.sweep
def test_vision_checkpoint_variants():
    checks = [partial(check_vision_pretrained_weights, family, 2, True) for family in ("llava", "gemma3_vlm")]
    checks += [partial(check_vision_exact_resume, "llava", 2, 2, ("vision_tower",))]
    checks += [partial(check_vision_exact_resume, "gemma3_vlm", 1, 2, ("projector",))]
    checks += [partial(check_vision_lora_merged_export, "llava", 2, True)]
    _print(run_checks(4, checks, timeout=600))


def _print(results: dict) -> None:
    for name, ranks in results.items():
        print(name, {key: f"{max(rank[key] for rank in ranks):.1e}" for key in ranks[0]})
