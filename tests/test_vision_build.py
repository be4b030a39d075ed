"""Tiny configs of image-text-to-text types that the generic shrinking broke or left unbuildable, and what the
strategy and the coverage harness needed to step them (see docs/vision.md, "Types built tiny"): in process, on
tiny or toy models."""

import torch
from torch import nn
from transformers import AutoModelForImageTextToText

from lightning_automodel.hf.decoder_layers import named_decoder_layers
from lightning_automodel.hf.initialization import _mark_unset, _unset_buffers
from lightning_automodel.hf.shrink import DEFAULT_ROPE, tiny_config
from lightning_automodel.hf.vision.image_inputs import _features_of
from lightning_automodel.hf.vision.tiny import SPECIAL_IDS_FROM, tiny_image_text_config
from lightning_automodel.hf.vision.vq_vocabulary import CODES


def test_a_rope_the_defaults_leave_empty_is_given_for_each_layer_type():
    """Cohere Compass reads its rope by layer type and its defaults give none: the default rope for each type, and
    (its vision-language config) M-RoPE's sections fitted in each to the tiny head's 8 rotary pairs."""
    assert tiny_config("cohere_compass_text").rope_parameters == {"full_attention": DEFAULT_ROPE}
    rope = tiny_image_text_config("cohere_compass").text_config.rope_parameters
    assert set(rope) == {"full_attention"} and sum(rope["full_attention"]["mrope_section"]) == 8


def test_an_adapter_output_is_sized_as_the_text_width():
    """Dots3 Note's validator: its vision and audio adapters' outputs are the text's width."""
    config = tiny_image_text_config("dots3_note")
    width = config.text_config.hidden_size
    assert config.vision_config.adapter_out_dim == config.audio_config.adapter_out_dim == width


def test_a_vq_gan_model_gets_a_vocabulary_map_of_its_codes_above_the_text():
    """Chameleon reads an image as its VQ-GAN's codes, each a token its vocabulary map names; the tiny map names the
    placeholder and each of the tiny codebook's codes, at special ids (its head never predicts a code)."""
    config = tiny_image_text_config("chameleon")
    vocabulary = config.vocabulary_map
    codes = [id_ for name, id_ in vocabulary.items() if name.startswith("IMGIMG")]
    assert vocabulary["<image>"] == config.image_token_id
    assert len(set(codes)) == CODES == config.vq_config.num_embeddings and min(codes) >= SPECIAL_IDS_FROM
    assert config.vq_config.resolution == 16


def test_code_ranges_and_a_width_of_the_hidden_size_keep_their_invariants():
    """Apertus 1.5's validators: its visual codes end where its audio codes start, both inside the vocabulary;
    WavTokenizer's ``codebook_dim`` is its ``hidden_size`` (512 both by default)."""
    config = tiny_image_text_config("apertus1p5")
    assert config.image_token_offset + config.vision_config.codebook_size == config.audio_token_offset
    assert config.audio_token_offset + config.audio_config.codebook_size <= SPECIAL_IDS_FROM
    assert config.audio_config.codebook_dim == config.audio_config.hidden_size == 64


def test_emu3_images_are_sized_for_its_vq_gan():
    """Emu3's VQ-GAN gives no image size (two codes a side: 16 pixels for its 3 halvings) and attends at its last
    level's width; its head model's get_image_features is its base model's, which requires ``image_sizes``."""
    from lightning_automodel.hf.vision.image_inputs import measured_token_count, model_pixels

    config = tiny_image_text_config("emu3")
    assert config.vq_config.hidden_size == config.vq_config.base_channels * config.vq_config.channel_multiplier[-1]
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    pixels = model_pixels(model, images=2)
    assert {name: tuple(value.shape) for name, value in pixels.items()} == {
        "pixel_values": (2, 3, 16, 16),
        "image_sizes": (2, 2),
    }
    assert measured_token_count(model) == 2 * 3  # 2 rows of 2 codes, each row ended by its end-of-line token


def test_the_originals_of_a_weight_norm_are_made_from_the_modules_weight():
    """WavTokenizer's weight-normed convolutions: their originals are made from the convolution's own weight."""
    from lightning_automodel.hf.initialization import _parametrized_weights

    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Conv1d(2, 2, 3)))
    names = [name for name, _ in model.named_parameters()]
    assert names == ["0.bias", "0.parametrizations.weight.original0", "0.parametrizations.weight.original1"]
    assert _parametrized_weights(model, names) == {(nn.Conv1d, "weight")}


def test_granite4_vision_adds_its_tower_at_tiny_language_layers():
    config = tiny_image_text_config("granite4_vision")
    layers = config.text_config.num_hidden_layers
    targets = [*(llm for _, llm in config.deepstack_layer_map), *config.spatial_target_layers]
    assert len(set(targets)) == len(targets) and max(targets) < layers  # each set of features a layer of its own


def test_features_added_at_language_layers_are_counted_by_the_first_set():
    """Granite 4 Vision's features come as (language layer, features) pairs, the first at the placeholders."""

    class Output:
        deepstack_features = [(0, [torch.zeros(3, 8)]), (1, [torch.zeros(3, 8)])]

    assert _features_of(Output())[0].shape == (3, 8)


def test_a_forward_less_container_in_a_list_gives_its_lists_items_as_blocks():
    """Chameleon's VQ-GAN indexes its levels' blocks (``down[i].block[j](x)``) and never calls a level: a level as
    an FSDP unit would never gather its weights."""

    class Level(nn.Module):  # no forward
        def __init__(self):
            super().__init__()
            self.block = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    class Tower(nn.Module):
        def __init__(self):
            super().__init__()
            self.down = nn.ModuleList([Level(), Level()])

    assert [name for name, _ in named_decoder_layers(Tower())] == [
        "down.0.block.0",
        "down.0.block.1",
        "down.1.block.0",
        "down.1.block.1",
    ]


def test_a_complex_buffer_is_marked_and_found_unset():
    """Llama 4's vision rotary frequencies are complex: marked with NaN as floating-point buffers are."""
    module = nn.Module()
    module.register_buffer("freqs", torch.ones(3, dtype=torch.complex64))
    _mark_unset(module)
    assert _unset_buffers(module) == ["freqs"]
