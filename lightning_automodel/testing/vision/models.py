"""Tiny vision-language models built from configs (no hub) and batches holding images, each model's own inputs: a
LLaVA (CLIP tower, projector, Llama), a Qwen2-VL (its tower of merged patches, M-RoPE, image grids) and a Gemma 3
(SigLIP tower, pooled image tokens, token types). Every tensor of a batch is laid out by rows, so that any split of
the rows (a data-parallel rank's, a DataLoader's) is a batch of its own; :func:`model_inputs` turns rows into the
model's arguments."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import (
    CLIPVisionConfig,
    Gemma3ForConditionalGeneration,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from lightning_automodel.testing.models import SEQ, VOCAB, batch, tiny_config

VISION_FAMILIES = ("llava", "qwen2_vl", "gemma3_vlm")
MOE_VISION_FAMILY = "qwen3_vl_moe"  # Qwen3-VL's tower (deepstack features into early layers), experts in its text
IMAGE_TOKEN = VOCAB - 1  # every tiny model's image placeholder
IMAGE_TOKENS = 4  # placeholders per image: one image per row, its tokens at positions 1-4
# Qwen2-VL: an image of 4 x 4 patches of 3 channels x 2 frames x 4 x 4 pixels, merged 2 x 2 into 4 tokens.
QWEN_GRID, QWEN_PATCH = (1, 4, 4), 3 * 2 * 4 * 4


def tiny_vision_config(family: str, text_layers: int = 2):
    text = tiny_config("gemma3_vlm" if family == "gemma3_vlm" else "llama", num_hidden_layers=text_layers)
    if family == "gemma3_vlm":
        text.image_token_index = IMAGE_TOKEN
        return text
    if family == "llava":
        tower = CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
        )
        # The last layer's features (the default, the second to last, would leave the last layer without a gradient).
        return LlavaConfig(vision_config=tower, text_config=text, image_token_id=IMAGE_TOKEN, vision_feature_layer=-1)
    if family == "qwen2_vl":
        text_dict = {**text.to_dict(), "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}}
        tower = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=4, spatial_merge_size=2)
        return Qwen2VLConfig(text_config=text_dict, vision_config=tower, image_token_id=IMAGE_TOKEN)
    if family == MOE_VISION_FAMILY:
        experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
        text_dict = {**text.to_dict(), **experts, "head_dim": 16, "rope_parameters": rope}
        tower = dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=text.hidden_size,
            deepstack_visual_indexes=[0],
            num_position_embeddings=16,
        )
        return Qwen3VLMoeConfig(text_config=text_dict, vision_config=tower, image_token_id=IMAGE_TOKEN)
    raise ValueError(f"no tiny vision-language model {family!r}: one of {(*VISION_FAMILIES, MOE_VISION_FAMILY)}")


def tiny_vision_model(family: str, seed: int = 0, text_layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = tiny_vision_config(family, text_layers)
    classes = {
        "llava": LlavaForConditionalGeneration,
        "qwen2_vl": Qwen2VLForConditionalGeneration,
        "gemma3_vlm": Gemma3ForConditionalGeneration,
        MOE_VISION_FAMILY: Qwen3VLMoeForConditionalGeneration,
    }
    model = classes[family](config)
    model.config.get_text_config()._attn_implementation = "sdpa"
    if family == "gemma3_vlm":  # initialised to zeros, which would leave the tower without a gradient until a step
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    return model


def vision_batch(family: str, batch_size: int = 4, seed: int = 1) -> dict[str, torch.Tensor]:
    """Rows of token ids, labels and one image each: the image's placeholders replace tokens 1-4 and are never
    predicted (label -100), as a chat template and its collator lay them out."""
    tokens, labels = batch(batch_size, seed=seed)
    tokens[tokens == IMAGE_TOKEN] = IMAGE_TOKEN - 1  # the text's own: an image's placeholders are those below
    tokens[:, 1 : 1 + IMAGE_TOKENS] = IMAGE_TOKEN
    labels[:, :IMAGE_TOKENS] = -100
    generator = torch.Generator().manual_seed(seed)
    rows = {"input_ids": tokens, "labels": labels}
    if family in ("qwen2_vl", MOE_VISION_FAMILY):  # the same patches and grids
        patches = QWEN_GRID[0] * QWEN_GRID[1] * QWEN_GRID[2]
        rows["pixel_values"] = torch.randn(batch_size, patches, QWEN_PATCH, generator=generator)
        rows["image_grid_thw"] = torch.tensor([QWEN_GRID] * batch_size)
        rows["mm_token_type_ids"] = (tokens == IMAGE_TOKEN).long()  # M-RoPE's: which tokens are an image's
    else:
        rows["pixel_values"] = torch.randn(batch_size, 3, 16, 16, generator=generator)
    if family == "gemma3_vlm":
        rows["token_type_ids"] = (tokens == IMAGE_TOKEN).long()
    return rows


def model_inputs(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's arguments from rows of :func:`vision_batch` (Qwen2-VL takes every image's patches in one list),
    with a padding mask; labels are not passed (the loss is the caller's)."""
    inputs = {name: value for name, value in rows.items() if name != "labels"}
    if "image_grid_thw" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].flatten(0, 1)
    inputs["attention_mask"] = (rows["input_ids"] != 0).long()
    return inputs


def vision_loss_and_logits(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy in fp32 over the text tokens, and the logits."""
    logits = model(**model_inputs(rows), use_cache=False).logits.float()
    return F.cross_entropy(logits.flatten(0, 1), rows["labels"].flatten()), logits


# Images a row of :func:`image_records`: two in a row, rows without, one; micro-batches of one or two rows without any.
IMAGES_PER_ROW = (2, 0, 1, 0, 0, 0, 1, 2)


def image_records(family: str, counts: tuple[int, ...] = IMAGES_PER_ROW, seed: int = 1) -> list[dict]:
    """One record a row, its own images (``counts[r]`` of them, at most two: placeholders at tokens 1-4 and 6-9),
    as a processor renders a sample: token ids, labels (-100 on placeholders), token types, and the images' pixels
    (Qwen2-VL: flattened patches and a grid each). :func:`collate_images` makes a batch of them."""
    tokens, labels = batch(len(counts), seed=seed)
    tokens[tokens == IMAGE_TOKEN] = IMAGE_TOKEN - 1
    generator = torch.Generator().manual_seed(seed)
    records = []
    for row, count in enumerate(counts):
        for image in range(count):
            start = 1 + image * (IMAGE_TOKENS + 1)
            tokens[row, start : start + IMAGE_TOKENS] = IMAGE_TOKEN
            labels[row, max(start - 1, 0) : start + IMAGE_TOKENS - 1] = -100
        record = {"input_ids": tokens[row], "labels": labels[row]}
        types = (tokens[row] == IMAGE_TOKEN).long()
        if family in ("qwen2_vl", MOE_VISION_FAMILY):
            patches = QWEN_GRID[0] * QWEN_GRID[1] * QWEN_GRID[2]
            record["pixel_values"] = torch.randn(count * patches, QWEN_PATCH, generator=generator)
            record["image_grid_thw"] = torch.tensor([QWEN_GRID] * count, dtype=torch.long).reshape(count, 3)
            record["mm_token_type_ids"] = types
        else:
            record["pixel_values"] = torch.randn(count, 3, 16, 16, generator=generator)
        if family == "gemma3_vlm":
            record["token_type_ids"] = types
        records.append(record)
    return records


def collate_images(records: list[dict]) -> dict[str, torch.Tensor]:
    """The model's arguments and labels for ``records`` (of :func:`image_records`): rows stacked, every image's pixels
    (and grid) one after another in the order of their placeholders, none given where no row holds an image."""
    images = ("pixel_values", "image_grid_thw")
    rows = {name: torch.stack([record[name] for record in records]) for name in records[0] if name not in images}
    rows["attention_mask"] = (rows["input_ids"] != 0).long()
    for name in images:
        if name in records[0] and sum(len(record[name]) for record in records):
            rows[name] = torch.cat([record[name] for record in records])
    return rows


def rows_slice(rows: dict[str, torch.Tensor], part: slice) -> dict[str, torch.Tensor]:
    return {name: value[part] for name, value in rows.items()}


__all__ = [
    "SEQ",
    "VISION_FAMILIES",
    "collate_images",
    "image_records",
    "model_inputs",
    "tiny_vision_model",
    "vision_batch",
    "vision_loss_and_logits",
]
