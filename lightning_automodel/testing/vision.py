"""Vision processors built in code (no download), for the tests and benchmarks/vision_data.py: LLaVA's and
Qwen2-VL's image processors (tiny by default: a few pixels; or at the models' own resolutions), the byte tokenizer
with their image tokens, and a chat template marking the answers."""

from __future__ import annotations

from transformers import LlavaProcessor, Qwen2VLProcessor
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from lightning_automodel.data.tokenizer import byte_tokenizer

# Each message under its role; an image part is the processor's placeholder, an answer inside {% generation %}.
TEMPLATE = (
    "{% for message in messages %}{{ '### ' + message['role'] + ':\\n' }}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% for part in parts %}{{ part['text'] }}{% endfor %}{{ eos_token }}{% endgeneration %}"
    "{% else %}{% for part in parts %}{% if part['type'] == 'image' %}{{ IMAGE }}{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant:\\n' }}{% endif %}"
)


def llava_processor(*, side: int = 8, patch: int = 4) -> LlavaProcessor:
    """Images resized and cropped to ``side`` x ``side``, patches of ``patch`` (and CLIP's class token, dropped): by
    default 4 image tokens an image; LLaVA-1.5's own is ``side=336, patch=14``, 576."""
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = LlavaImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    template = TEMPLATE.replace("IMAGE", "'<image>'")
    return LlavaProcessor(
        images,
        tokenizer,
        patch_size=patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=template,
    )


class _ImagesOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor without its video processor, which needs torchvision."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)


def qwen2_vl_processor(*, patch: int = 4, max_side: int = 64) -> Qwen2VLProcessor:
    """Patches of ``patch`` merged 2 x 2, images of at most ``max_side`` squared pixels: an image's tokens follow its
    size (by default 64 x 64 pixels: 64 tokens). Qwen2-VL's own patches are 14 pixels, ``max_side`` up to 1,003."""
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]}
    )
    images = Qwen2VLImageProcessorPil(
        size={"shortest_edge": (2 * patch) ** 2, "longest_edge": max_side**2},
        patch_size=patch,
        merge_size=2,
        temporal_patch_size=2,
    )
    template = TEMPLATE.replace("IMAGE", "'<|vision_start|><|image_pad|><|vision_end|>'")
    return _ImagesOnlyQwen2VLProcessor(images, tokenizer, chat_template=template)
