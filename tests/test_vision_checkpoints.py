"""Vision-language weights in and out at tp=2 + sp x dp_shard=2 (one launch of four ranks): a pretrained directory
read shard by shard, checkpoints resumed exactly, with the tower frozen and into another layout, and LoRA adapters
of the tower merged into an exported model."""

from functools import partial

from vision_checkpoint_checks import (
    check_vision_exact_resume,
    check_vision_pretrained_trainer,
    check_vision_pretrained_weights,
)
from vision_lora_checks import check_vision_lora_merged_export

from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.vision_models import VISION_FAMILIES


def test_vision_pretrained_weights_and_checkpoints():
    checks = [partial(check_vision_pretrained_weights, family, 2, True) for family in VISION_FAMILIES]
    checks += [partial(check_vision_pretrained_trainer, "qwen2_vl", 2, ("vision_tower",))]
    checks += [partial(check_vision_exact_resume, "llava", 2, 2, ("vision_tower",))]
    checks += [partial(check_vision_exact_resume, "qwen2_vl", 2, 1)]
    checks += [partial(check_vision_exact_resume, "gemma3_vlm", 1, 2, ("projector",))]
    checks += [partial(check_vision_exact_resume, "qwen2_vl", 2, 2, ("vision_tower",), True)]
    checks += [partial(check_vision_lora_merged_export, family, 2, True) for family in ("llava", "qwen2_vl")]
    results = run_checks(4, checks, timeout=600)
    for name, ranks in results.items():
        print(name, {key: f"{max(rank[key] for rank in ranks):.1e}" for key in ranks[0]})
