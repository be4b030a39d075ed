"""The image-input builder's layouts beyond one image a row of pixels (lightning_automodel/hf/vision/): each read off
what a model's config and forward say, checked on meta-device builds of the tiny configs, in process."""

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForImageTextToText

from lightning_automodel.hf.vision.image_inputs import image_token_count, model_pixels
from lightning_automodel.hf.vision.rope_sections import QWEN_SECTIONS, default_sections
from lightning_automodel.hf.vision.tiles import cross_attention_mask, padded_tiles
from lightning_automodel.hf.vision.tiny import tiny_image_text_config

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
        # image arguments its get_image_features requires that the builder does not make, named
        ("molmo2", "NoImageInputs", "requires image_token_pooling, image_grids, which the image-input builder"),
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
