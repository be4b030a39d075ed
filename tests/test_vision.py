"""Vision-language models against one process at tp=2 + sp x dp_shard=2 (one launch of four ranks)."""

import re
from functools import partial

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.distributed.tensor.parallel import ColwiseParallel
from vision_checks import (
    check_imageless_ranks,
    check_vision_bf16,
    check_vision_float8,
    check_vision_layout,
    check_vision_training,
)
from vision_cp_checks import check_vision_cp_training, check_vision_rows_split_over_cp
from vision_lora_checks import DORA_ON_PACKED_QKV, check_vision_lora, lora_vision_model

from lightning_automodel import AutoModelParallelStrategy, ParallelDims
from lightning_automodel.hf.decoder_layers import multimodal_units, named_decoder_layers, named_multimodal_parts
from lightning_automodel.hf.freezing import freeze
from lightning_automodel.hf.vision.image_inputs import image_inputs, image_token_count, takes_any_image_size
from lightning_automodel.parallel.context_parallel import context_parallel_problem
from lightning_automodel.parallel.context_parallel import problems as cp_problems
from lightning_automodel.parallel.options import ParallelOptions
from lightning_automodel.parallel.preflight import probe_unsharded
from lightning_automodel.parallel.tensor.plans import tower
from lightning_automodel.parallel.tensor.plans.tower import NO_PROJECTION, tower_styles
from lightning_automodel.parallel.tensor.styles.projections import PackedColwiseParallel
from lightning_automodel.planning.report import plan_report
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.models import tiny_model
from lightning_automodel.testing.vision.models import MOE_VISION_FAMILY, VISION_FAMILIES, tiny_vision_model


def test_vision_models_at_tp_sp_and_dp_shard():
    """LLaVA, Qwen2-VL and Gemma 3 with images at tp=2 + sp x dp_shard=2: loss, logits and every gradient, the
    tower's included; Qwen3-VL-MoE at tp=2 x ep=2 (its tower split too); ranks without images (LLaVA); AdamW steps
    through the Trainer (LLaVA) with the tower frozen; LoRA on Qwen2-VL's language model, tower (its packed qkv and
    patch convolution) and projector. The variants (activation checkpointing, HSDP, the Trainer with nothing frozen
    and on LoRA's adapters among them): ``-m sweep``."""
    checks = [partial(check_vision_layout, family, 2, True) for family in VISION_FAMILIES]
    checks += [partial(check_vision_layout, MOE_VISION_FAMILY, 2, False, ep=2)]
    checks += [partial(check_imageless_ranks, "llava", 2, True, (1,))]
    checks += [partial(check_vision_training, "llava", 2, True, ("vision_tower",))]
    checks += [partial(check_vision_lora, "qwen2_vl", 2, True)]
    _print(run_checks(4, checks, timeout=600))


def test_vision_models_under_context_parallel():
    """cp=2: LLaVA, Qwen2-VL and Gemma 3 on rows holding 2, 0, 1 and 1 images whose placeholders straddle the ranks'
    shares (Gemma 3's image tokens seeing each other both ways across them), against one process, each rank's tower
    encoding its share of the images; under parallelize (FSDP2 over cp) with one image, the rank without one
    encoding a stand-in; AdamW steps through the Trainer. tp=2 + sp x cp=2 and cp=2 x dp_shard=2: ``-m sweep``."""
    checks = [partial(check_vision_rows_split_over_cp, family) for family in VISION_FAMILIES]
    checks += [partial(check_vision_rows_split_over_cp, family, (0, 0, 1, 0), fsdp=True) for family in VISION_FAMILIES]
    checks += [partial(check_vision_cp_training, family, 2) for family in VISION_FAMILIES]
    _print(run_checks(2, checks, timeout=600))


@pytest.mark.sweep
def test_vision_variants():
    """The families with activation checkpointing, at tp=2 without sp, at dp_shard=4 and in bf16; Qwen2-VL under
    HSDP (tp=2 x dp_replicate=2); ranks without images at dp_shard=4 and Qwen2-VL's at tp=2 + sp; LLaVA and Qwen2-VL
    through the Trainer, Qwen2-VL with parts frozen and with AdamW steps on LoRA's adapters; LoRA on LLaVA; DoRA on
    Qwen2-VL's packed qkv, which keeps the tower whole. Under context parallel: tp=2 + sp x cp=2 and
    cp=2 x dp_shard=2. Compiled blocks at tp=2 + sp x dp_shard=2; LLaVA under HSDP at dp_replicate=2 x dp_shard=2;
    float8 at dp_shard=4 (tensorwise) and tp=2 + sp (rowwise); Gemma 3 through the Trainer and with ranks without
    images; Qwen3-VL-MoE at ep=2 x dp_shard=4."""
    checks = [partial(check_vision_layout, family, 2, True, True) for family in VISION_FAMILIES]
    checks += [partial(check_vision_layout, "qwen2_vl", 2, True, dp_replicate=2)]
    checks += [partial(check_vision_layout, family, 2, False) for family in VISION_FAMILIES]
    checks += [partial(check_vision_layout, family, 1, False) for family in VISION_FAMILIES]
    checks += [partial(check_vision_bf16, family) for family in VISION_FAMILIES]
    checks += [partial(check_imageless_ranks, "llava", 1, False, (0, 2, 3))]
    checks += [partial(check_imageless_ranks, "qwen2_vl", 2, True, (1,))]
    checks += [partial(check_vision_training, family, 2, True) for family in ("llava", "qwen2_vl")]
    checks += [partial(check_vision_training, "qwen2_vl", 2, True, build=lora_vision_model)]
    checks += [partial(check_vision_training, "qwen2_vl", 2, True, ("language_model", "model.visual.merger.*"))]
    checks += [partial(check_vision_lora, "llava", 2, True)]
    checks += [partial(check_vision_lora, "qwen2_vl", 2, False, tower_whole=True, **DORA_ON_PACKED_QKV)]
    checks += [partial(check_vision_float8, family, 1, False, "tensorwise") for family in VISION_FAMILIES]
    checks += [partial(check_vision_float8, family, 2, True, "rowwise") for family in VISION_FAMILIES]
    checks += [partial(check_vision_training, "gemma3_vlm", 2, True)]
    checks += [partial(check_vision_layout, MOE_VISION_FAMILY, 1, False, ep=2, tower_whole=True)]
    checks += [partial(check_imageless_ranks, "gemma3_vlm", 2, True, (1,))]
    checks += [partial(check_vision_rows_split_over_cp, family, fsdp=True, tp=2) for family in VISION_FAMILIES]
    checks += [partial(check_vision_cp_training, family, 2) for family in VISION_FAMILIES]
    _print(run_checks(4, checks, timeout=900))
    # Compiled blocks, the towers' too, in a launch of their own; LLaVA first: compiled after Qwen2-VL's tp blocks in
    # the same process, its tower's graph fails in inductor (device_mesh._get_submesh is not an OpOverload), not when
    # it is the process's first model, as in a training run.
    compiled = [partial(check_vision_layout, family, 2, True, compile=True) for family in VISION_FAMILIES]
    compiled += [partial(check_vision_layout, "llava", 1, False, dp_replicate=2)]
    _print(run_checks(4, compiled, timeout=900))


def _print(results: dict) -> None:
    for name, ranks in results.items():
        print(name, {key: f"{max(rank[key] for rank in ranks):.1e}" for key in ranks[0]})


def test_lora_in_the_tower_is_split_like_its_projections_or_the_tower_kept_whole():
    """A LoRA layer is a projection of the tower's plan when its base is a Linear; on the patch convolution it is kept
    whole like its base, not taken for a projection (which left every block whole, said to be unclosed). DoRA on the
    packed qkv, which no style shards, keeps the tower whole and the report names the layer and the fix."""
    with torch.device("meta"):
        model = get_peft_model(tiny_vision_model("qwen2_vl"), LoraConfig(target_modules=["qkv", "proj"]))
    report = str(plan_report(model.get_base_model(), ParallelDims(tp=2).resolve(4), sp=True))
    assert "tp splits 10 of their projections" in report
    assert "kept whole on every tp rank: model.visual.patch_embed (it holds no projection" in report
    with torch.device("meta"):
        model = get_peft_model(tiny_vision_model("qwen2_vl"), LoraConfig(**DORA_ON_PACKED_QKV))
    report = str(plan_report(model.get_base_model(), ParallelDims(tp=2).resolve(4)))
    assert "kept whole on every tp rank: model.visual (the plan for them fails" in report
    assert "cannot shard model.visual.blocks.0.attn.qkv (Linear): DoRA on a packed projection" in report


def test_the_plan_report_states_what_the_tower_gets():
    """The tower and projector, their parameters and blocks, what tp splits of them and what it keeps whole and why;
    no line for a text model."""
    with torch.device("meta"):
        model = tiny_vision_model("llava")
    report = str(plan_report(model, ParallelDims(tp=2).resolve(4), sp=True))
    assert "vision tower and projector: model.vision_tower (23,552), model.multi_modal_projector (6,272)" in report
    assert "24.8% of the parameters; 9,200 per rank (28.9% of the rank's); FSDP2 units of their own (2 blocks" in report
    assert "model.vision_tower.encoder.layers.*.self_attn.q_proj" in report
    assert re.search(r"model\.multi_modal_projector\.linear_2 +OwnedOutputRowwiseParallel x1", report)
    assert "tp splits 14 of their projections (entries column-, exits row-parallel" in report
    assert (
        "kept whole on every tp rank: model.vision_tower.embeddings, model.vision_tower.pre_layrnorm,"
        " model.vision_tower.post_layernorm (it holds no projection" in report
    )
    assert "31,888 per rank (26.52%; ideal 1/4)" in report
    with torch.device("meta"):
        assert "vision tower" not in str(plan_report(tiny_model(), ParallelDims(tp=2).resolve(4)))


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_image_inputs_from_the_config_are_what_the_model_takes(family):
    """The builder's rows run the real model (it refuses placeholders that do not match its image features), one
    image a row or several (the planner's), of the size a tower taking any size is given; and the probe's step with
    them runs the tower's blocks and the projector."""
    model = tiny_vision_model(family)
    count = image_token_count(model)
    several = [
        image_inputs(model, rows=2, tokens=count + 3),
        image_inputs(model, rows=2, tokens=3 * (count + 1) + 2, images_per_row=3),
    ]
    if takes_any_image_size(model):  # Qwen2-VL: images of 2 x 3 merged blocks
        several.append(image_inputs(model, rows=2, tokens=14, images_per_row=2, image_tokens=6))
    for inputs in several:
        assert model(**inputs, use_cache=False).logits.shape[:2] == inputs["input_ids"].shape
    trace = probe_unsharded(model, tp=2)
    assert trace.images and not trace.images_failure
    assert all(trace.called(name) for name, _ in named_decoder_layers(model))
    assert all(trace.called(name) for name, _ in named_multimodal_parts(model))
    with pytest.raises(ValueError, match="cannot hold 1 image"):
        image_inputs(model, rows=2, tokens=image_token_count(model))
    assert image_token_count(tiny_model()) is None


def test_the_tower_plan_splits_qwen2_vl_fused_qkv_block_by_block():
    """Qwen2-VL's vision attention views its fused qkv as (tokens, 3, heads, head width) and unbinds the 3 after a
    permute: each rank needs its slice of q, k and v (split the plain way it would run, wrongly)."""
    model = tiny_vision_model("qwen2_vl")
    styles, kept = tower_styles(model, trace=probe_unsharded(model, tp=2))
    assert isinstance(styles["model.visual.blocks.0.attn.qkv"], PackedColwiseParallel)
    assert styles["model.visual.blocks.0.attn.qkv"].parts == 3
    assert type(styles["model.visual.merger.mlp.0"]) is ColwiseParallel
    assert kept == {"model.visual.patch_embed": NO_PROJECTION}


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


def test_a_tower_plan_the_probe_refuses_leaves_the_tower_whole(monkeypatch):
    """The language model's plan stands alone, and the report says why the tower is whole."""
    broken = {"model.visual.blocks.0.attn.proj": ColwiseParallel()}  # its split output met by the whole stream
    monkeypatch.setattr(tower, "tower_styles", lambda model, trace: (broken, {}))
    with torch.device("meta"):
        model = tiny_vision_model("qwen2_vl")
    report = str(plan_report(model, ParallelDims(tp=2).resolve(4), sp=True))
    assert "kept whole on every tp rank: model.visual (the plan for them fails the probe's step (" in report
    assert "model.visual.blocks.0.attn.proj" not in report.split("vision tower")[0]


def test_sequence_parallel_is_refused_where_the_model_indexes_the_stream_with_a_whole_mask():
    """Qwen3-VL-MoE adds its deepstack features to the stream at a mask of its image placeholders (the probe resolves
    the mask from the token ids: its tower is split like any); under sp the stream is split along the sequence and the
    whole mask cannot index it: sp is refused before any collective, naming the fix."""
    with torch.device("meta"):
        model = tiny_vision_model(MOE_VISION_FAMILY)
    with pytest.raises(ValueError, match=r"fails in model.language_model .*aten.index.Tensor.*Use sp=False"):
        plan_report(model, ParallelDims(tp=2).resolve(4), sp=True)
    assert "tp splits 12 of their projections" in str(plan_report(model, ParallelDims(tp=2).resolve(4)))


def test_context_parallel_checks_the_split_around_images_on_a_replica(monkeypatch):
    """cp splits LLaVA, Qwen2-VL (its tower's output width kept the language model's in the shrunk replica) and
    Gemma 3 around their images; Gemma 3 without its image blocks (each image's tokens seeing each other both ways) is
    refused, as is Qwen3-VL-MoE, whose deepstack features the split cannot hand its language model."""
    for family in VISION_FAMILIES:
        assert context_parallel_problem(tiny_vision_model(family)) is None, family
    refusal = context_parallel_problem(tiny_vision_model(MOE_VISION_FAMILY))
    assert "fails with its sequences split around images" in refusal and "deepstack" in refusal, refusal
    monkeypatch.setattr(cp_problems, "token_blocks", lambda tokens, *, images: None)
    refusal = context_parallel_problem(tiny_vision_model("gemma3_vlm"))
    assert "other logits with its sequences split around images" in refusal, refusal
