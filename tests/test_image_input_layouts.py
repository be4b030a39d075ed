"""The image-input builder's layouts beyond one image a row of pixels (lightning_automodel/hf/vision/): each read off
what a model's config and forward say, checked on meta-device builds of the tiny configs, in process."""

from functools import partial

import pytest
import torch
from packed_image_checks import check_packed_imageless_rank, check_packed_rows_split_over_cp, check_views_differ_by_rank
from transformers import CONFIG_MAPPING, AutoModelForImageTextToText

from lightning_automodel.hf.vision.image_inputs import image_inputs, image_token_count, model_pixels
from lightning_automodel.hf.vision.rope_sections import QWEN_SECTIONS, default_sections
from lightning_automodel.hf.vision.tiles import cross_attention_mask, padded_tiles
from lightning_automodel.hf.vision.tiny import tiny_image_text_config
from lightning_automodel.testing.harness import run_checks

# Per type: each image input's shape for 2 images (flattened patches: a 1 x 3 grid of merged blocks an image).
LAYOUTS = {
    # a second, high-resolution tower beside the low-resolution one
    "deepseek_vl_hybrid": {"pixel_values": (2, 3, 16, 16), "high_res_pixel_values": (2, 3, 16, 16)},
    # a mask of real tiles (its tower takes no patch mask), not Idefics' of real pixels
    "granite_docling": {"pixel_values": (2, 1, 3, 16, 16), "pixel_attention_mask": (2, 1)},
    # patches unflattened (a 2-D patch embedding): 2 images x 2 x 6 patches of (3, 4, 4)
    "paddleocr_vl": {"pixel_values": (24, 3, 4, 4), "image_grid_thw": (2, 3)},
    # flattened, though a 2-D patch embedding too: the tower documents (and reshapes) flattened patches
    "hy_v4_vl": {"pixel_values": (24, 48), "image_grid_thw": (2, 3)},
    # each token's 2 x 2 patches as one 8 x 8 block of pixels, channels last; grids counted in tokens
    "inkling2": {"pixel_values": (6, 8, 8, 3), "image_grid_thw": (2, 3)},
    # no merge in the config: each image's merge size (1, as its processor gives an image)
    "video_llama_3": {"pixel_values": (6, 48), "image_grid_thw": (2, 3), "image_merge_sizes": (2,)},
    # tiles padded to the config's 4, one real
    "mllama": {"pixel_values": (2, 1, 4, 3, 16, 16), "aspect_ratio_ids": (2, 1), "aspect_ratio_mask": (2, 1, 4)},
    # one token a patch of (frames, patch, patch, channels), no grid: 2 x 2 patches an image
    "inkling_mm_model": {"pixel_values": (8, 2, 4, 4, 3)},
    # a global view and a local crop an image, the crops' counts a tensor
    "deepseek_ocr2": {"pixel_values": (2, 3, 16, 16), "pixel_values_local": (2, 3, 16, 16), "num_local_patches": (2,)},
    # the same forward arguments, the counts a list only (no tensor a batch carries): global views alone
    "unlimited_ocr": {"pixel_values": (2, 3, 16, 16)},
}


def meta_model(model_type: str) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(tiny_image_text_config(model_type))


@pytest.mark.parametrize("model_type", sorted(LAYOUTS))
def test_each_layout_is_read_off_the_config_and_forward(model_type):
    pixels = model_pixels(meta_model(model_type), images=2)
    assert {name: tuple(value.shape) for name, value in pixels.items()} == LAYOUTS[model_type]


def test_a_cross_attention_model_has_one_token_an_image_and_a_mask_of_the_tokens_after_it():
    """Mllama: the text reads the image's tiles by cross-attention from its one token on, the real tile only."""
    assert image_token_count(meta_model("mllama")) == 1
    input_ids = torch.tensor([[5, 9, 5, 5], [9, 5, 5, 0]])
    mask = cross_attention_mask(input_ids, image_token=9, tiles=3)
    assert mask.shape == (2, 4, 1, 3)
    assert mask[..., 0, 0].tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]] and not mask[..., 1:].any()
    with pytest.raises(ValueError, match="every row must hold its image's token"):
        cross_attention_mask(input_ids, image_token=7, tiles=3)
    tiles = padded_tiles(CONFIG_MAPPING["mllama"]().vision_config, torch.ones(2, 3, 4, 4))
    assert tiles["pixel_values"][:, 0, 0].eq(1).all() and not tiles["pixel_values"][:, 0, 1:].any()


def test_m_rope_sections_default_to_what_the_model_code_takes():
    """Ernie 4.5-VL's code needs height and width sections equal (22 : 22 : 20), PaddleOCR-VL's takes 16, 24, 24
    though its config class does not list them; a text model without M-RoPE takes none."""
    assert default_sections(CONFIG_MAPPING["ernie4_5_vl_moe_text"]) == [22, 22, 20]
    assert default_sections(CONFIG_MAPPING["paddleocr_vl_text"]) == [16, 24, 24]
    assert default_sections(CONFIG_MAPPING["qwen2_vl_text"]) == QWEN_SECTIONS
    assert default_sections(CONFIG_MAPPING["llama"]) is None
    sections = tiny_image_text_config("ernie4_5_vl_moe").text_config.rope_parameters["mrope_section"]
    assert sections[0] == sections[1] and sum(sections) == 8, sections  # the tiny head's 8 rotary pairs


def test_a_vision_start_token_opens_each_image():
    """Qwen2.5-Omni's thinker finds an image by the token before its placeholders (its config lacks the id, which
    the tiny config adds)."""
    from lightning_automodel.hf.vision.image_inputs import image_inputs

    model = meta_model("qwen2_5_omni_thinker")
    inputs = image_inputs(model, rows=2, tokens=8, images_per_row=1)
    assert inputs["input_ids"][:, 0].eq(model.config.vision_start_token_id).all()
    assert inputs["input_ids"][:, 1:4].eq(model.config.image_token_id).all()


@pytest.mark.parametrize(
    ("model_type", "verdict", "reason"),
    [
        # transformers' forward fails on text alone too: not the input builder's limit
        ("llama4", "NoTinyConfig", "single-process step on text alone: AttributeError"),
    ],
)
def test_a_type_the_builder_cannot_feed_is_named_for_what_fails(model_type, verdict, reason):
    from lightning_automodel.testing.coverage_report.check import single_process_reference

    with pytest.raises(Exception, match=reason) as raised:
        single_process_reference(model_type, "image-text-to-text")
    assert type(raised.value).__name__ == verdict


def test_rows_get_their_own_positions_where_the_model_numbers_images_across_the_batch():
    """HunYuan-VL's get_rope_index counts images over the whole batch (its last axis): each row gets the positions
    it has alone, so that a data-parallel rank's rows give the logits they give in the whole batch."""
    from lightning_automodel.testing.coverage_report.check import single_process_reference

    positions = single_process_reference("hunyuan_vl", "image-text-to-text").rows["position_ids"]
    assert positions.shape[:2] == (3, 4)
    assert positions.eq(positions[:, :1]).all()  # every row's image the first of its row, as alone


# A batch's images packed in one tensor: MiniCPM-V's patches side by side along the last dimension (two tokens of
# 4 x 4 patches an image; 4.7's layout is 4.6's, with token types, measured by the coverage report), Molmo2's crops
# whose pooling indices point into the whole batch's patches.
PACKED_LAYOUTS = {
    "minicpmv4_6": {"pixel_values": (1, 3, 4, 512), "target_sizes": (4, 2)},
    "molmo2": {
        "pixel_values": (8, 729, 48),
        "image_token_pooling": (16, 365),
        "image_grids": (4, 4),
        "image_num_crops": (4,),
        "mm_token_type_ids": (4, 22),
    },
}


@pytest.mark.parametrize("model_type", sorted(PACKED_LAYOUTS))
def test_a_packed_batch_splits_into_each_ranks_rows_images(model_type):
    """Each set of rows gets its images re-packed (Molmo2's pooling indices re-based on the crops it keeps): its
    logits are the whole batch's rows' (as a data-parallel rank's must be), its images change them, and a rank
    without images runs the tower on a stand-in of the same layout."""
    from lightning_automodel.parallel.fsdp.imageless_ranks import stand_in_pixels
    from lightning_automodel.testing.coverage_report.kinds import image_loss, image_rows, rows_part

    config = tiny_image_text_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    rows = image_rows(model)
    assert {name: tuple(value.shape) for name, value in rows.items() if name not in ("input_ids", "labels")} == (
        PACKED_LAYOUTS[model_type]
    )
    with torch.no_grad():
        whole = image_loss(model, rows)[1]
        for part in (slice(1, 3), slice(3, 4)):  # the builder checks each half (image_rows)
            mine = rows_part(rows, part, model=model)
            alone = image_loss(model, mine)[1]
            assert torch.allclose(alone, whole[part], atol=1e-5, rtol=1e-5), (part, (alone - whole[part]).abs().max())
        stand_in = stand_in_pixels(model)
        assert stand_in and model.get_image_features(**stand_in).pooler_output is not None


def test_a_packed_batch_whose_images_do_not_add_up_is_refused_naming_the_input():
    from lightning_automodel.hf.vision.image_rows import image_rows
    from lightning_automodel.hf.vision.packed_images import packed_pixels

    model = meta_model("minicpmv4_6")
    images = packed_pixels(model, images=2)
    input_ids = torch.full((2, 2), model.config.image_token_id)  # an image's two placeholders a row
    found = image_rows(model, input_ids, images=images, tokens_per_image=0)
    assert found.of_rows(torch.tensor([1]))["pixel_values"].shape == (1, 3, 4, 128)
    images["pixel_values"] = images["pixel_values"][..., :-4]
    with pytest.raises(ValueError, match="pixel_values: 256 entries along dimension -1 expected, 252 given"):
        image_rows(model, input_ids, images=images, tokens_per_image=0)


def test_packed_images_over_two_ranks():
    """dp_shard=2, one rank's rows without images (MiniCPM-V, Molmo2, Inkling; DeepSeek-OCR 2's stand-in has a crop):
    the step matches one process; DeepSeek-OCR 2 with crops on one rank only (its tower runs once a view) too. Molmo2
    at cp=2, a row's two images on the two ranks (its image tokens seeing each other both ways across them), and
    under parallelize with one image (the rank whose share is empty encodes a stand-in): the call matches one
    process."""
    checks = [partial(check_packed_imageless_rank, name) for name in ("minicpmv4_6", "molmo2", "inkling_mm_model")]
    checks += [partial(check_views_differ_by_rank, "deepseek_ocr2")]
    checks += [partial(check_packed_rows_split_over_cp, "molmo2", fsdp=fsdp) for fsdp in (False, True)]
    print(run_checks(2, checks, timeout=400))


def test_a_block_called_once_an_image_is_held_by_the_root():
    """MiniCPM-V's merger runs its block once an image (the probe's step: an image a row): as a unit of its own, ranks
    with other numbers of images would gather it other numbers of times. LLaVA's tower calls each block once;
    DeepSeek-OCR 2's runs once a view (a global view, then a crop)."""
    from lightning_automodel.parallel.preflight import blocks_called_per_image, probe_unsharded

    for model_type, held in [("minicpmv4_6", ("model.merger.mlp.0",)), ("llava", ())]:
        model = meta_model(model_type)
        assert blocks_called_per_image(model, probe_unsharded(model, tp=1)) == held, model_type
    model = meta_model("deepseek_ocr2")  # its tower, and the units beside its blocks, once a view
    held = set(blocks_called_per_image(model, probe_unsharded(model, tp=1)))
    assert {"model.vision_tower.sam_encoder.layers.0", "model.vision_tower.sam_encoder.patch_embed"} <= held
    assert "model.multi_modal_projector" in held and "model.language_model.layers.0" not in held


# Images of any number of crops (DeepSeek-OCR 2: 144 queries a view and a separator) or of patches (Inkling: one token
# each), a row's images: their placeholders (and each image's crops); the last row holds none.
UNEVEN = {
    "deepseek_ocr2": ([[2 * 144 + 1], [144 + 1], []], {"num_local_patches": [1, 0]}),
    "inkling_mm_model": ([[6, 2], [3], []], {}),
}


def _uneven_batch(model: torch.nn.Module, placeholders: list[list[int]], crops: list[int]) -> dict[str, torch.Tensor]:
    """Rows of text holding images of ``placeholders`` each, a text token before each, and their image inputs."""
    from lightning_automodel.hf.vision.tiny import SPECIAL_IDS_FROM, special_token_ids

    length = 2 + max(sum(count + 1 for count in row) for row in placeholders)
    input_ids = torch.randint(1, SPECIAL_IDS_FROM, (len(placeholders), length), generator=torch.Generator())
    input_ids[torch.isin(input_ids, torch.tensor(sorted(special_token_ids(model.config))))] = 3
    for row, counts in enumerate(placeholders):
        start = 1
        for count in counts:
            input_ids[row, start : start + count] = model.config.image_token_id
            start += count + 1
    images = sum(len(row) for row in placeholders)
    if crops:  # a global view an image, its crops after all of them
        vision = model.config.vision_config.sam_config
        view = (3, vision.image_size, vision.image_size)
        inputs = {"pixel_values": torch.randn(images, *view), "pixel_values_local": torch.randn(sum(crops), *view)}
        inputs["num_local_patches"] = torch.tensor(crops)
    else:
        vision = model.config.vision_config
        patch = (vision.temporal_patch_size, vision.patch_size, vision.patch_size, vision.num_channels)
        inputs = {"pixel_values": torch.randn(sum(map(sum, placeholders)), *patch)}
    labels = torch.where(input_ids == model.config.image_token_id, -100, input_ids)
    return {"input_ids": input_ids, **inputs, "labels": labels}


@pytest.mark.parametrize("model_type", sorted(UNEVEN))
def test_images_of_any_number_of_crops_or_patches_split_into_each_ranks_rows(model_type):
    """Each set of rows takes its images' crops (by num_local_patches) or patches, none where it holds none: its
    logits are the whole batch's rows', and a rank without images runs the tower on a stand-in of the same layout."""
    from lightning_automodel.hf.vision.image_inputs import builds_images
    from lightning_automodel.parallel.fsdp.imageless_ranks import stand_in_pixels
    from lightning_automodel.testing.coverage_report.kinds import image_loss, rows_part

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(tiny_image_text_config(model_type))
    placeholders, extra = UNEVEN[model_type]
    rows = _uneven_batch(model, placeholders, extra.get("num_local_patches", []))
    with torch.no_grad():
        whole = image_loss(model, rows)[1]
        for part in (slice(0, 1), slice(1, 3), slice(2, 3)):
            mine = rows_part(rows, part, model=model)
            alone = image_loss(model, mine)[1]
            assert torch.allclose(alone, whole[part], atol=1e-5, rtol=1e-5), (part, (alone - whole[part]).abs().max())
        assert "pixel_values" not in rows_part(rows, slice(2, 3), model=model)
        stand_in = stand_in_pixels(model)
        assert builds_images(model) and model.get_image_features(**stand_in).pooler_output is not None


def test_an_images_placeholders_are_one_run_or_one_run_a_view():
    """DeepSeek-OCR 2's processor writes an image's placeholders in one run; Step3p7's marks each view's run apart
    (a crop's, then the global view's)."""
    from lightning_automodel.hf.vision.local_views import view_placeholders

    input_ids = torch.tensor([[0, 9, 9, 9, 0, 9, 0], [9, 9, 0, 0, 0, 0, 0]])
    assert view_placeholders(input_ids, token=9, crops=torch.tensor([0, 0, 0])).tolist() == [3, 1, 2]
    assert view_placeholders(input_ids, token=9, crops=torch.tensor([1, 0])).tolist() == [4, 2]
    with pytest.raises(ValueError, match="lie in 3 runs, and its 2 images have 0 crops"):
        view_placeholders(input_ids, token=9, crops=torch.tensor([0, 0]))


def test_crops_that_do_not_add_up_are_refused_naming_the_input():
    from lightning_automodel.hf.vision.image_rows import image_rows

    model = meta_model("deepseek_ocr2")
    images = model_pixels(model, images=2)
    images["num_local_patches"] = torch.tensor([2, 1])
    input_ids = torch.full((2, 3), model.config.image_token_id)
    with pytest.raises(ValueError, match="pixel_values_local: 3 entries along dimension 0 expected, 2 given"):
        image_rows(model, input_ids, images=images, tokens_per_image=0)


def test_a_child_whose_weights_its_parent_reads_uncalled_is_no_unit():
    """DeepSeek-OCR 2's tower reads its learned queries' weight without calling their embedding: as a unit of its own
    FSDP2 would never gather it."""
    from lightning_automodel.hf.decoder_layers import multimodal_units

    model = meta_model("deepseek_ocr2")
    units = {id(unit) for unit in multimodal_units(model)}
    tower = model.model.vision_tower
    assert id(tower.sam_encoder.patch_embed) in units and id(tower.query_768_resolution) not in units


@pytest.mark.parametrize("model_type", ["minicpmv4_7", "molmo2"])
def test_a_pipeline_gives_each_micro_batch_its_rows_packed_images_and_canvas_positions(model_type):
    """Under pp each micro-batch's first stage takes its rows' images re-packed, read off the inputs (the forward a
    pipeline puts before the model's names none), and every stage MiniCPM-V 4.7's canvas M-RoPE positions, found for
    the whole batch (a later stage, given none, would count text positions); a micro-batch without images runs the
    tower on a stand-in of the model's layout, built before the take-over."""
    from lightning_automodel.parallel.pipeline.images import StageImages
    from lightning_automodel.testing.coverage_report.kinds import rows_part

    model = meta_model(model_type)
    inputs = image_inputs(model, rows=4, tokens=24, images_per_row=2)
    halves = [rows_part(inputs, part, model=model) for part in (slice(0, 2), slice(2, 4))]
    stage_images = StageImages(model)
    model.forward = lambda input_ids=None, *args, labels=None, **given: None  # as a pipeline's take-over leaves it
    assert {"target_sizes", "image_token_pooling"} & set(stage_images._stand_in_pixels)  # found before the take-over
    _, row_inputs = stage_images.split(inputs["input_ids"], dict(inputs), microbatches=2)
    for rows, alone in zip(torch.arange(4).chunk(2), halves, strict=True):
        first, later = row_inputs(rows, first=True), row_inputs(rows, first=False)
        positions = getattr(model.base_model, "get_rope_index", None)
        if positions is not None:
            expected = positions(
                alone["input_ids"], mm_token_type_ids=alone["mm_token_type_ids"], target_sizes=alone["target_sizes"]
            )[0]
            assert torch.equal(later["position_ids"], expected) and torch.equal(first["position_ids"], expected)
        for name in set(alone) - {"input_ids"}:
            assert torch.equal(first[name], alone[name]), name


def test_context_parallel_splits_molmo2s_images_and_refuses_minicpm_v_with_the_reason():
    """Molmo2's images packed across the batch split over cp (its shrunk replica's logits split match whole);
    MiniCPM-V is refused before any collective (preflight's check, on every rank) for its linear-attention text
    model, naming the fix."""
    from lightning_automodel.parallel.context_parallel import context_parallel_problem
    from lightning_automodel.parallel.preflight import check_context_parallel

    torch.manual_seed(0)
    assert context_parallel_problem(AutoModelForImageTextToText.from_config(tiny_image_text_config("molmo2"))) is None
    model = AutoModelForImageTextToText.from_config(tiny_image_text_config("minicpmv4_6"))
    reason = "MiniCPMV4_6ForConditionalGeneration computes other logits with its sequences split than whole"
    with pytest.raises(ValueError, match=f"^cp=2 \\(context parallel\\): {reason}.*Use cp=1 for this model"):
        check_context_parallel(model, cp=2, pipeline=None)
