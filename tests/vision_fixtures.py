"""Tiny vision processors built in code (no download): LLaVA's and Qwen2-VL's image processors at a few pixels,
the byte tokenizer with their image tokens, and a chat template marking the answers."""

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


def tiny_llava_processor() -> LlavaProcessor:
    """Images resized and cropped to 8 x 8, patches of 4 (and CLIP's class token, dropped): 4 image tokens an image."""
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = LlavaImageProcessorPil(size={"shortest_edge": 8}, crop_size={"height": 8, "width": 8})
    template = TEMPLATE.replace("IMAGE", "'<image>'")
    return LlavaProcessor(
        images,
        tokenizer,
        patch_size=4,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=template,
    )


class _ImagesOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor without its video processor, which needs torchvision."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template, **kwargs)


def tiny_qwen2_vl_processor() -> Qwen2VLProcessor:
    """Patches of 4, merged 2 x 2: an image's tokens follow its size (64 x 64 pixels: 64 tokens)."""
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]}
    )
    images = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 8 * 8, "longest_edge": 64 * 64}, patch_size=4, merge_size=2, temporal_patch_size=2
    )
    template = TEMPLATE.replace("IMAGE", "'<|vision_start|><|image_pad|><|vision_end|>'")
    return _ImagesOnlyQwen2VLProcessor(images, tokenizer, chat_template=template)
