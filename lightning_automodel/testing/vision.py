"""Vision processors built in code (no download), for the tests and benchmarks/vision_data.py: LLaVA's and
Qwen2-VL's image processors (tiny by default: a few pixels; or at the models' own resolutions), the byte tokenizer
with their image tokens, and a chat template marking the answers."""

from __future__ import annotations

from transformers import Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from lightning_automodel.data.byte_processors import TEMPLATE, llava_processor
from lightning_automodel.data.tokenizer import byte_tokenizer

__all__ = ["TEMPLATE", "llava_processor", "qwen2_vl_processor"]


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
