"""Vision processors built in code (no download), for the tests and benchmarks/vision_data.py: LLaVA's and
Qwen2-VL's image processors (tiny by default: a few pixels; or at the models' own resolutions), the byte tokenizer
with their image tokens, and a chat template marking the answers; and tiny models that read what they make."""

from __future__ import annotations

from transformers import (
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from lightning_automodel.data.tokenizer import EOS_ID, byte_tokenizer
from lightning_automodel.data.vision.byte_processors import TEMPLATE, llava_processor

__all__ = ["TEMPLATE", "llava_processor", "qwen2_vl_processor", "tiny_llava", "tiny_qwen2_vl"]


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


def _text_config(processor: LlavaProcessor | Qwen2VLProcessor, hidden: int, layers: int) -> dict:
    """A Llama-like decoder over the processor's vocabulary, heads of 16."""
    return dict(
        vocab_size=len(processor.tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 16,
        num_key_value_heads=1,
        eos_token_id=EOS_ID,
    )


def tiny_llava(processor: LlavaProcessor, *, hidden: int = 32, layers: int = 1) -> LlavaForConditionalGeneration:
    """A LLaVA reading :func:`llava_processor`'s default images (8 x 8 pixels, patches of 4), in eval mode."""
    text = {"model_type": "llama", **_text_config(processor, hidden, layers)}
    vision = dict(model_type="clip_vision_model", image_size=8, patch_size=4, hidden_size=16, intermediate_size=32)
    vision |= dict(num_hidden_layers=1, num_attention_heads=2)
    config = LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=processor.image_token_id,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    return LlavaForConditionalGeneration(config).eval()


def tiny_qwen2_vl(processor: Qwen2VLProcessor, *, hidden: int = 32, layers: int = 1) -> Qwen2VLForConditionalGeneration:
    """A Qwen2-VL reading :func:`qwen2_vl_processor`'s default images (patches of 4 merged 2 x 2), in eval mode."""
    tokens = processor.tokenizer.convert_tokens_to_ids
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    text = _text_config(processor, hidden, layers) | dict(rope_parameters=rope, bos_token_id=None)
    vision = dict(depth=1, embed_dim=16, hidden_size=hidden, num_heads=2, patch_size=4, spatial_merge_size=2)
    vision |= dict(temporal_patch_size=2, in_channels=3, mlp_ratio=2)
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=processor.image_token_id,
        video_token_id=tokens("<|video_pad|>"),
        vision_start_token_id=tokens("<|vision_start|>"),
    )
    return Qwen2VLForConditionalGeneration(config).eval()
