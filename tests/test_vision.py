"""Vision-language models against one process at tp=2 + sp x dp_shard=2 (one launch of four ranks)."""

from functools import partial

import pytest
import torch
from vision_checks import check_vision_bf16, check_vision_layout, check_vision_training

from lightning_automodel import AutoModelParallelStrategy, ParallelDims
from lightning_automodel.hf.decoder_layers import multimodal_units, named_multimodal_parts
from lightning_automodel.hf.freezing import freeze
from lightning_automodel.parallel.options import ParallelOptions
from lightning_automodel.planning.report import plan_report
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.models import tiny_model
from lightning_automodel.testing.vision_models import VISION_FAMILIES, tiny_vision_model


def test_vision_models_at_tp_sp_and_dp_shard():
    """LLaVA, Qwen2-VL and Gemma 3 with images: loss, logits and every gradient, the tower's included, with and
    without activation checkpointing (and at tp=2 without sp, and at dp_shard=4); then AdamW steps through the
    Trainer, with parts frozen too."""
    checks = [partial(check_vision_layout, family, 2, True, ac) for family in VISION_FAMILIES for ac in (False, True)]
    checks += [partial(check_vision_layout, family, tp, False) for family in VISION_FAMILIES for tp in (2, 1)]
    checks += [partial(check_vision_bf16, family) for family in VISION_FAMILIES]
    checks += [partial(check_vision_training, family, 2, True) for family in VISION_FAMILIES]
    checks += [partial(check_vision_training, "llava", 2, True, ("vision_tower",))]
    checks += [partial(check_vision_training, "qwen2_vl", 2, True, ("language_model", "model.visual.merger.*"))]
    results = run_checks(4, checks, timeout=600)
    for name, ranks in results.items():
        print(name, {key: f"{max(rank[key] for rank in ranks):.1e}" for key in ranks[0]})


def test_the_plan_report_states_what_the_tower_gets():
    """The tower and projector, their parameters and blocks, and why tp keeps them whole; no line for a text model."""
    with torch.device("meta"):
        model = tiny_vision_model("llava")
    report = str(plan_report(model, ParallelDims(tp=2).resolve(4), sp=True))
    assert "vision tower and projector: model.vision_tower (23,552), model.multi_modal_projector (6,272)" in report
    assert "24.8% of the parameters; FSDP2 units of their own (2 blocks" in report
    assert "kept whole on every tp rank: the plans are checked by a text-only probe step" in report
    with torch.device("meta"):
        assert "vision tower" not in str(plan_report(tiny_model(), ParallelDims(tp=2).resolve(4)))


def test_the_parts_beside_the_language_model_and_their_units():
    """Units of a part that is a model of its own are its children (transformers records outputs by its class)."""
    units = {family: multimodal_units(tiny_vision_model(family)) for family in VISION_FAMILIES}
    assert [type(unit).__name__ for unit in units["llava"]] == [
        "CLIPVisionEmbeddings",
        "LayerNorm",
        "LayerNorm",
        "LlavaMultiModalProjector",
    ]
    assert [type(unit).__name__ for unit in units["qwen2_vl"]] == ["PatchEmbed", "PatchMerger"]
    assert [name for name, _ in named_multimodal_parts(tiny_vision_model("gemma3_vlm"))] == [
        "model.vision_tower",
        "model.multi_modal_projector",
    ]
    assert named_multimodal_parts(tiny_model()) == []


def test_freezing_names_parts_or_patterns_and_refuses_what_names_nothing():
    model = tiny_vision_model("llava")
    frozen = freeze(model, "vision_tower", "projector")
    assert frozen and all(name.startswith(("model.vision_tower.", "model.multi_modal_projector.")) for name in frozen)
    assert all(p.requires_grad != (name in frozen) for name, p in model.named_parameters())
    language = freeze(tiny_vision_model("gemma3_vlm"), "language_model")
    assert "lm_head.weight" not in language and "model.language_model.embed_tokens.weight" in language
    assert not any(name.startswith("model.vision_tower.") for name in language)
    with pytest.raises(ValueError, match=r"'projector' names no parameter of Qwen2VL.*model.visual \(vision_tower\)"):
        freeze(tiny_vision_model("qwen2_vl"), "projector")


def test_freeze_is_an_option_of_parallelize_and_the_strategy():
    """A name or a list becomes a tuple; anything but names is refused when the options are built."""
    assert ParallelOptions.from_keywords(freeze="vision_tower").freeze == ("vision_tower",)
    assert AutoModelParallelStrategy(tp=2, freeze=["projector", "model.lm_head.*"]).options.parallel.freeze == (
        "projector",
        "model.lm_head.*",
    )
    with pytest.raises(ValueError, match="a tuple of part names or patterns"):
        ParallelOptions(freeze=("vision_tower", 3))
