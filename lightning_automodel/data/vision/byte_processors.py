"""A vision-language processor built in code, no download: LLaVA's image processor, the byte tokenizer with an
image token, and a chat template marking the answers. The vision demo trains with it; the tests build it too."""

from __future__ import annotations

from transformers import LlavaProcessor
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

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
