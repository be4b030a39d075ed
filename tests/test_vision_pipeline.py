"""Vision-language models under pipeline parallel against one process (see ``vision_pipeline_checks``)."""

from functools import partial

from vision_pipeline_checks import check_vision_pipeline, check_vision_pipeline_training

from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.vision_models import VISION_FAMILIES


def test_vision_models_at_pp2():
    """LLaVA, Qwen2-VL and Gemma 3 at pp=2 over 4 micro-batches of rows holding two, one or no images (one
    micro-batch none): loss, logits and every gradient; AdamW steps through the Trainer."""
    checks = [partial(check_vision_pipeline, family) for family in VISION_FAMILIES]
    checks += [partial(check_vision_pipeline_training, family) for family in VISION_FAMILIES]
    _print(run_checks(2, checks, timeout=600))


def _print(results: dict) -> None:
    """The worst rank's errors (a stage's own gradients: the tower's on the first stage only)."""
    for name, ranks in results.items():
        keys = dict.fromkeys(key for rank in ranks for key in rank)
        print(name, {key: f"{max(rank[key] for rank in ranks if key in rank):.1e}" for key in keys})


def test_vision_models_at_pp2_dp_shard2():
    """LLaVA at pp=2 x dp_shard=2: in a micro-batch where one data-parallel rank's rows hold images and the other's
    none, the other runs the tower on a stand-in image (FSDP2's gathers of the tower otherwise go unmatched)."""
    checks = [partial(check_vision_pipeline, "llava"), partial(check_vision_pipeline_training, "llava")]
    _print(run_checks(4, checks, timeout=600))
