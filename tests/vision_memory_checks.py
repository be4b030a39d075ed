"""Checks run on every rank for test_vision_memory.py: the memory a real training step of a vision-language model
takes on CPU, its rows holding images, to hold the fake-tensor estimate of planning/memory/activations.py against."""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from transformers import (
    CLIPVisionConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

from lightning_automodel import ParallelDims
from lightning_automodel.parallel.parallelizer import parallelize
from lightning_automodel.planning.memory.activations import training_step
from lightning_automodel.planning.memory.step_images import step_images
from lightning_automodel.testing.models import tiny_config
from lightning_automodel.testing.peak_memory import peak_above_held

ROWS, TOKENS = 4, 256
# A tower as wide as the language model and images of 64 tokens (Qwen2-VL's of 256 patches, merged 2 x 2): the
# images add a quarter to a half of a step's peak, so that leaving them out shows.
_TEXT = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
IMAGE_TOKEN = 511
IMAGES = {"llava": dict(images_per_row=2), "qwen2_vl": dict(images_per_row=1, image_tokens=64)}


def memory_vision_model(family: str, *, meta: bool = False) -> torch.nn.Module:
    """A LLaVA (CLIP tower on 64 x 64 pixels, patches of 8: 64 tokens an image) or a Qwen2-VL (its tower of merged
    patches of 4) over a Llama-like decoder 128 wide, with SDPA; on the meta device if ``meta``."""
    torch.manual_seed(0)
    text = tiny_config("llama", **_TEXT)
    if family == "llava":
        tower = CLIPVisionConfig(
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=64,
            patch_size=8,
        )
        config = LlavaConfig(vision_config=tower, text_config=text, image_token_id=IMAGE_TOKEN, vision_feature_layer=-1)
        build = LlavaForConditionalGeneration
    else:
        text_dict = {**text.to_dict(), "rope_parameters": {"rope_type": "default", "mrope_section": [4, 6, 6]}}
        tower = dict(depth=2, embed_dim=128, hidden_size=128, num_heads=4, patch_size=4, spatial_merge_size=2)
        config = Qwen2VLConfig(text_config=text_dict, vision_config=tower, image_token_id=IMAGE_TOKEN)
        build = Qwen2VLForConditionalGeneration
    with torch.device("meta" if meta else "cpu"):
        model = build(config)
    model.config.get_text_config()._attn_implementation = "sdpa"
    return model


def measured_vision_activation_bytes(family: str, dims: ParallelDims, **options) -> int:
    """The bytes one training step of ``family``'s model, its rows holding :data:`IMAGES`, allocates on this rank at
    its peak above the parameters and gradients it held before (a step ran first): torch's count of the live tensors,
    as the estimate counts its fake ones."""
    model = memory_vision_model(family)
    images = step_images(model, **IMAGES[family])
    inputs = images.inputs(model, rows=ROWS, tokens=TOKENS)
    inputs["pixel_values"] = torch.randn(inputs["pixel_values"].shape, generator=torch.Generator().manual_seed(0))
    mesh = dims.resolve(dist.get_world_size()).build_mesh("cpu")
    parallelize(model, mesh, **options)
    step = partial(training_step, model, input_ids=inputs.pop("input_ids"), mesh=mesh, images=inputs)
    step()
    return peak_above_held(step, model)
