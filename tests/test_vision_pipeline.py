"""Vision-language models under pipeline parallel against one process (see ``vision_pipeline_checks``)."""

from functools import partial

import pytest
import torch
from transformers import AutoModelForImageTextToText
from vision_pipeline_checks import (
    check_packed_pipeline,
    check_vision_demo_pipeline,
    check_vision_pipeline,
    check_vision_pipeline_training,
)

from lightning_automodel import ParallelDims
from lightning_automodel.hf.vision.image_rows import image_rows
from lightning_automodel.hf.vision.tiny import tiny_image_text_config
from lightning_automodel.parallel.pipeline import PipelineOptions, pipeline_problem
from lightning_automodel.parallel.pipeline.calls import MODEL_INPUTS, refuse_unknown_inputs
from lightning_automodel.parallel.pipeline.images import IMAGE_INPUTS, StageImages
from lightning_automodel.parallel.preflight import check_pipeline
from lightning_automodel.planning.report import plan_report
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.vision.models import (
    IMAGE_TOKEN,
    MOE_VISION_FAMILY,
    VISION_FAMILIES,
    collate_images,
    image_records,
    tiny_vision_model,
)


def test_vision_models_at_pp2():
    """LLaVA, Qwen2-VL and Gemma 3 at pp=2 over 4 micro-batches of rows holding two, one or no images (one whole
    micro-batch none): the tower and projector on the first stage only, the loss, the logits and every gradient; then
    AdamW steps through the Trainer (rows dealt by Lightning's sampler, GPipe over 4 micro-batches)."""
    checks = [partial(check_vision_pipeline, family) for family in VISION_FAMILIES]
    checks += [partial(check_vision_pipeline_training, family) for family in VISION_FAMILIES]
    _print(run_checks(2, checks, timeout=600))


def test_vision_models_at_pp2_with_dp_shard_and_tp():
    """At pp=2 x dp_shard=2, where one data-parallel rank's micro-batch holds images and the other's none, the other
    runs the tower on a stand-in image (FSDP2's gathers of the tower otherwise go unmatched): LLaVA, and through the
    Trainer; Qwen2-VL with two stages a rank (Interleaved1F1B); Gemma 3 at pp=2 x tp=2 + sp (its stream received
    split as its language model splits it)."""
    checks = [partial(check_vision_pipeline, "llava"), partial(check_vision_pipeline_training, "llava")]
    checks += [partial(check_vision_pipeline, "qwen2_vl", schedule="Interleaved1F1B", stages_per_rank=2)]
    checks += [partial(check_vision_pipeline, "gemma3_vlm", tp=2, sp=True)]
    _print(run_checks(4, checks, timeout=600))


@pytest.mark.sweep
def test_vision_pipeline_variants():
    """The other families at pp=2 x dp_shard=2 and through the Trainer there; each at pp=2 x tp=2 with and without
    sp; LLaVA and Gemma 3 (tied) with two stages a rank under Interleaved1F1B, LoopedBFS and InterleavedZeroBubble;
    Qwen2-VL at pp=2 x dp_replicate=2 (HSDP: the stand-ins agreed over the replicas)."""
    others = [family for family in VISION_FAMILIES if family != "llava"]
    checks = [partial(check_vision_pipeline, family) for family in others]
    checks += [partial(check_vision_pipeline_training, family) for family in others]
    tensor_parallel = [partial(check_vision_pipeline, tp=2, sp=sp) for sp in (False, True)]
    checks += [partial(check, family) for check in tensor_parallel for family in VISION_FAMILIES]
    schedules = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
    virtual = [partial(check_vision_pipeline, schedule=name, stages_per_rank=2) for name in schedules]
    checks += [partial(check, family) for check in virtual for family in ("llava", "gemma3_vlm")]
    checks += [partial(check_vision_pipeline, "qwen2_vl", dp_replicate=2)]
    _print(run_checks(4, checks, timeout=900))


@pytest.mark.sweep
def test_images_packed_across_the_batch_at_pp2():
    """MiniCPM-V 4.6 and 4.7 (patches side by side, 4.7's canvas M-RoPE found before the schedule) and Molmo2
    (pooling indices re-based on a micro-batch's crops) at pp=2 over 2 micro-batches of two images each, against one
    process; 4.7 and Molmo2 at pp=2 x dp_shard=2, one data-parallel rank's rows without images (a stand-in of the
    packed layout). The default suite checks the split in process (test_image_input_layouts.py)."""
    _print(run_checks(2, [partial(check_packed_pipeline, name) for name in ("minicpmv4_6", "minicpmv4_7", "molmo2")]))
    _print(run_checks(4, [partial(check_packed_pipeline, name) for name in ("minicpmv4_7", "molmo2")]))


@pytest.mark.sweep
def test_the_vision_demo_at_pp2(tmp_path):
    """The demo's CausalLMModule and data module (a processor's batches) at pp=2 through the Trainer: the first
    stage's tower moves."""
    _print(run_checks(2, [partial(check_vision_demo_pipeline, str(tmp_path))], timeout=600))


def _print(results: dict) -> None:
    """The worst rank's errors (a stage's own gradients: the tower's on the first stage only)."""
    for name, ranks in results.items():
        keys = dict.fromkeys(key for rank in ranks for key in rank)
        print(name, {key: f"{max(rank[key] for rank in ranks if key in rank):.1e}" for key in keys})


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_a_micro_batch_gets_its_own_rows_images(family):
    """Rows holding two, none and one image: any set of rows gets exactly its images (Qwen2-VL: each image's patches
    and grid); a row ending inside an image's placeholders, and images that do not add up, are refused naming
    them."""
    model = tiny_vision_model(family)
    records = image_records(family, counts=(2, 0, 1, 0))
    rows = collate_images(records)
    split = partial(image_rows, model, tokens_per_image=4)
    images = {name: rows[name] for name in ("pixel_values", "image_grid_thw") if name in rows}
    found = split(rows["input_ids"], images=images)
    for chosen in ([0], [1], [2, 3], [1, 2], [0, 1, 2, 3]):
        expected = collate_images([records[row] for row in chosen])
        given = found.of_rows(torch.tensor(chosen))
        assert given.keys() == {"pixel_values", "image_grid_thw"} & expected.keys()
        assert all(torch.equal(given[name], expected[name]) for name in given), chosen
    cut = rows["input_ids"].clone()
    cut[0, 8] = 1  # row 0's second image loses a placeholder, row 2 takes one more
    cut[2, 11] = IMAGE_TOKEN
    with pytest.raises(ValueError, match="row 0 of the batch ends inside an image's placeholders"):
        split(cut, images=images)
    two_images = collate_images(records[:1])  # the pixels (and grids) of row 0's two images, for three
    with pytest.raises(ValueError, match="hold 12 image placeholders and its 2 images stand for 8"):
        split(rows["input_ids"], images={name: two_images[name] for name in images})


def test_what_pipeline_parallel_refuses_of_vision_language_models():
    """Refused before any collective, with the reason: a language model fed by the tower beyond its input embeddings
    (Qwen3-VL's deepstack features), images in crops only the model's code counts (DeepSeek-OCR 2), pp with cp; at
    the call, image inputs the split does not know, and pixels of a
    model whose config does not count a row's images."""
    problem = pipeline_problem(tiny_vision_model(MOE_VISION_FAMILY), pp=2)
    assert "takes deepstack_visual_embeds, visual_pos_masks from the parts beside it (model.visual)" in problem
    assert pipeline_problem(tiny_vision_model("llava"), pp=2) is None
    crops = AutoModelForImageTextToText.from_config(tiny_image_text_config("deepseek_ocr2"))  # counted by its code
    assert "takes its images in global views and crops" in pipeline_problem(crops, pp=2)
    with pytest.raises(ValueError, match="pp=2 .*reads images.*with cp=2"):
        check_pipeline(tiny_vision_model("llava"), PipelineOptions(), pp=2, ep=1, cp=2)
    with pytest.raises(ValueError, match=r"got 0 more positional arguments and \['image_sizes'\] keywords"):
        refuse_unknown_inputs({"image_sizes": torch.ones(1)}, accepted=MODEL_INPUTS + IMAGE_INPUTS)
    images = StageImages(tiny_vision_model("llava"))
    images._tokens_per_image = None  # as for a model whose config the row split cannot count images by
    rows = collate_images(image_records("llava", counts=(1, 0)))
    with pytest.raises(ValueError, match="gives no image placeholder token and size .* Use pp=1 for this model's"):
        images.split(rows["input_ids"], {"pixel_values": rows["pixel_values"]}, microbatches=2)


def test_the_plan_report_puts_the_tower_on_the_first_stage():
    """The language model's layers split over the stages, the tower and projector with the embedding (their
    parameters counted on the first stage's ranks alone)."""
    with torch.device("meta"):
        model = tiny_vision_model("llava")
    report = str(plan_report(model, ParallelDims(pp=2).resolve(4)))
    assert "stage 0 (ranks 0-1): embedding, vision tower and projector, layer 0; 37,520 parameters per rank" in report
    assert "stage 1 (ranks 2-3): layer 1, norm, head; 22,624 parameters per rank" in report
