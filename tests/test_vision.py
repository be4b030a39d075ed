"""Vision-language models against one process at tp=2 + sp x dp_shard=2 (one launch of four ranks)."""

from functools import partial

from vision_checks import check_vision_layout

from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.vision_models import VISION_FAMILIES


def test_vision_models_at_tp_sp_and_dp_shard():
    """LLaVA, Qwen2-VL and Gemma 3 with images: loss, logits and every gradient, the tower's included."""
    run_checks(4, [partial(check_vision_layout, family, 2, True) for family in VISION_FAMILIES], timeout=600)
