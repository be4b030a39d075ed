"""A vision-language model's own image inputs, built from its config: rows of token ids holding the
placeholders of an image (or several) each, and the pixels (and image metadata) the model's forward takes for them.
The probe steps a meta-device copy with them, so that the vision tower's blocks run and a tensor-parallel plan for
them is checked; the activation estimate steps the planned model with them, so that it counts the tower's
activations and the image tokens.

Config fields read (of the model's config, then of its ``vision_config``):

* the placeholder: ``image_token_id`` (or ``image_token_index``);
* placeholders per image: ``mm_tokens_per_image`` where given (Gemma 3's pooled tokens), else a grid merged by
  ``spatial_merge_size`` (Qwen2-VL), else ``(image_size // patch_size) ** 2``, one more where
  ``vision_feature_select_strategy`` is ``"full"`` (LLaVA keeps the class token then);
* pixels: ``num_channels`` (or ``in_channels``), ``image_size`` and ``patch_size``: (images, channels, image_size,
  image_size); with ``spatial_merge_size``, flattened patches of ``channels x temporal_patch_size x patch_size ** 2``
  and ``image_grid_thw`` (one frame of ``merge x 3 merge`` patches: three tokens an image, an odd count); the other
  layouts of patches of any size in :mod:`~lightning_automodel.hf.vision.patches`, of padded tiles (and a
  cross-attention mask) in :mod:`~lightning_automodel.hf.vision.tiles`, of a batch's images packed in one tensor
  (MiniCPM-V's, Molmo2's) in :mod:`~lightning_automodel.hf.vision.packed_images`.

Token types are passed where the forward takes them (``token_type_ids``, ``mm_token_type_ids``: 1 at an image's
placeholders). Images no placeholder token marks, and what some models take beside the pixels (a Q-Former's
instruction, masks): :mod:`~lightning_automodel.hf.vision.beside_pixels`; towers that take sequences of flattened
patches (NaFlex, Gemma 4, Kosmos-2.5, Fuyu): :mod:`~lightning_automodel.hf.vision.patch_sequences`.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_automodel.hf.vision.beside_pixels import beside_pixels, unmarked_token_count
from lightning_automodel.hf.vision.beside_pixels import forward_arguments as _forward_arguments
from lightning_automodel.hf.vision.local_views import local_views, takes_local_views
from lightning_automodel.hf.vision.packed_images import packed_layout, packed_pixels, packed_token_count
from lightning_automodel.hf.vision.patch_sequences import (
    FLATTENED,
    NAFLEX,
    PATCH_STREAM,
    PIXELS,
    POSITIONED,
    as_patch_sequences,
    image_side,
    image_tower_config,
    sequence_layout,
    sequence_token_count,
    tower_config,
)
from lightning_automodel.hf.vision.patches import (
    GRID_HW,
    MERGE_SIZES,
    PATCH_TOKEN_GRID,
    PATCH_TOKENS,
    UNFLATTENED,
    channel_count,
    merge_size,
    patch_layout,
    patch_pixels,
    patch_token_pixels,
    random_pixels,
    side,
)
from lightning_automodel.hf.vision.tiles import cross_attention_mask, padded_tiles, tile_count

IMAGE_START = 1  # each row's placeholders follow one text token
# The forward argument of a language model that reads images by cross-attention, not in placeholders' embeddings.
CROSS_ATTENTION = "cross_attention_mask"


def image_token_count(model: nn.Module) -> int | None:
    """Placeholders per image of ``model``'s builder inputs, or None for a model whose config gives no image
    placeholder and pixel sizes (a text model, or one this builder does not know)."""
    config = getattr(model, "config", None)
    vision = tower_config(config)
    if vision is None or not _forward_arguments(model) & set(PIXELS):
        return None
    if packed_layout(model) is not None:
        return packed_token_count(model)
    if image_token(config) is None:
        return unmarked_token_count(model)
    if CROSS_ATTENTION in _forward_arguments(model):
        return 1  # one token an image, whose tiles the text reads by cross-attention (Mllama)
    if sequence_layout(model) is not None:
        return sequence_token_count(model)
    if merge_size(vision, accepted=image_arguments(model)) is not None:
        return _GRID[1] * _GRID[2]  # the merged grid's tokens
    if PATCH_TOKENS in image_arguments(model):
        return PATCH_TOKEN_GRID[0] * PATCH_TOKEN_GRID[1]
    pooled = [getattr(config, name, None) for name in ("mm_tokens_per_image", "num_query_tokens")]
    if any(isinstance(count, int) for count in pooled):
        return next(count for count in pooled if isinstance(count, int))
    image_size, patch_size = side(getattr(vision, "image_size", None)), side(getattr(vision, "patch_size", None))
    if not (isinstance(image_size, int) and isinstance(patch_size, int)):
        return None
    full = getattr(config, "vision_feature_select_strategy", None) == "full"
    return (image_size // patch_size) ** 2 + full


def builds_images(model: nn.Module) -> bool:
    """Whether this builder makes ``model``'s image inputs: of a count its config gives (:func:`image_token_count`),
    or of global and local views whose placeholders only the model's code counts (measured: DeepSeek-OCR 2's)."""
    return image_token_count(model) is not None or takes_local_views(model)


def image_inputs(
    model: nn.Module,
    *,
    rows: int,
    tokens: int,
    images_per_row: int = 1,
    image_tokens: int | None = None,
    pixels_device: Any = "cpu",
    count: int | None = None,
    text: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The forward's arguments for ``rows`` rows of ``tokens`` token ids (``text``, else zeros), ``images_per_row``
    images each: the first image's placeholders at positions ``IMAGE_START`` on (``count`` of them, else
    :func:`image_token_count`'s), each further image's after one more text token (M-RoPE reads consecutive
    placeholders as one image). ``image_tokens``: the placeholders of an image for a tower that takes images of any
    size (Qwen2-VL's merged grid, :func:`image_grid`; default :data:`_GRID`'s), refused for one whose config fixes
    them. Pixels are random (zeros on the meta device) on ``pixels_device``; the token ids and image metadata stay on
    the CPU, where the model's code reads their values. Raises a ValueError for a model :func:`image_token_count`
    knows no count for, or rows too short to hold their images' placeholders."""
    count = count if count is not None else image_token_count(model)
    if count is None:
        raise ValueError(f"{type(model).__name__}: no image placeholder and pixel sizes in its config")
    config, vision = model.config, tower_config(model.config)
    grid = _sized_grid(model, image_tokens=image_tokens)
    count = grid[1] * grid[2] if grid is not None else count
    needed = IMAGE_START + images_per_row * (count + 1) - 1
    if tokens < needed:
        raise ValueError(
            f"rows of {tokens} tokens cannot hold {images_per_row} image(s) of {count} placeholders ({needed} tokens)"
        )
    input_ids = text.clone() if text is not None else torch.zeros(rows, tokens, dtype=torch.long)
    starts = [IMAGE_START + image * (count + 1) for image in range(images_per_row)]
    placeholders = torch.zeros(rows, tokens, dtype=torch.bool)
    for start in starts:
        placeholders[:, start : start + count] = True
    if image_token(config) is not None:
        input_ids[placeholders] = image_token(config)
    if (opening := _opening_token(model)) is not None:
        input_ids[:, [start - 1 for start in starts]] = opening
    images = rows * images_per_row
    inputs = {
        "input_ids": input_ids,
        **model_pixels(model, images=images, device=pixels_device, grid=grid or _GRID),
        **beside_pixels(model, placeholders=placeholders, starts=starts, images=images),
    }
    accepted = _forward_arguments(model)
    if CROSS_ATTENTION in accepted:
        tiles = tile_count(vision)
        inputs[CROSS_ATTENTION] = cross_attention_mask(input_ids, image_token=image_token(config), tiles=tiles)
    for name in ("token_type_ids", "mm_token_type_ids"):
        if name in accepted:
            inputs[name] = placeholders.long()
    return inputs


def _opening_token(model: nn.Module) -> int | None:
    """The config's ``vision_start_token_id`` where the model's rope index finds images by the token that opens them
    (the Qwen omni thinkers'), not by token types (Qwen2-VL's takes ``mm_token_type_ids``); None otherwise."""
    rope_index = getattr(model, "get_rope_index", None) or getattr(model.base_model, "get_rope_index", None)
    opening = getattr(model.config, "vision_start_token_id", None)
    if rope_index is None or not isinstance(opening, int):
        return None
    return None if "mm_token_type_ids" in inspect.signature(rope_index).parameters else opening


def image_grid(image_tokens: int) -> tuple[int, int, int]:
    """A one-frame grid of ``image_tokens`` merged blocks, as square as they factor (Qwen2-VL's ``image_grid_thw``
    over the merge size)."""
    if image_tokens < 1:
        raise ValueError(f"image_tokens={image_tokens}: an image holds at least one token")
    height = max(side for side in range(1, math.isqrt(image_tokens) + 1) if image_tokens % side == 0)
    return 1, height, image_tokens // height


def takes_any_image_size(model: nn.Module) -> bool:
    """Whether ``model``'s tower takes images of any size (merged patches, Qwen2-VL's), its placeholders an image
    following the image's grid rather than its config."""
    return merge_size(model.config.vision_config, accepted=image_arguments(model)) is not None


def check_image_tokens(model: nn.Module, image_tokens: int | None) -> None:
    """Refuse ``image_tokens`` for a tower whose config fixes an image's placeholders to another count."""
    count = image_token_count(model)
    if image_tokens is not None and not takes_any_image_size(model) and image_tokens != count:
        raise ValueError(
            f"image_tokens={image_tokens}: {type(model).__name__}'s images are {count} tokens each (its config's image"
            " and patch sizes); leave image_tokens unset."
        )


def _sized_grid(model: nn.Module, *, image_tokens: int | None) -> tuple[int, int, int] | None:
    """The grid of ``image_tokens`` for a tower of merged patches (None: the builder's own); None for a tower whose
    config fixes an image's placeholders."""
    check_image_tokens(model, image_tokens)
    return image_grid(image_tokens) if image_tokens is not None and takes_any_image_size(model) else None


def measured_token_count(model: nn.Module, *, images: int = 1) -> int | None:
    """Placeholders per image as ``model`` (on the meta device or real) makes features of its builder pixels: the
    elements of ``get_image_features``'s output over the language model's width; None where that does not run."""
    get_features = image_features_method(model)
    vision = image_tower_config(model.config)
    if get_features is None or vision is None or image_token(model.config) is None:  # no placeholder to count
        return None
    taken = set(inspect.signature(get_features).parameters)
    try:
        device = next(
            model.parameters()
        ).device  # on meta, pixels of values on the CPU (see parallel/probe/meta_values.py)
        device = "cpu" if device.type == "meta" else device
        pixels = model_pixels(model, images=images, device=device)
        with torch.no_grad():
            output = get_features(**{name: value for name, value in pixels.items() if name in taken})
    except Exception:  # noqa: BLE001 - a tower this builder's pixels do not fit, a config it cannot read
        return None
    features = _features_of(output)
    leaves = [leaf for leaf in tree_flatten(features)[0] if torch.is_tensor(leaf)]
    width = model.config.get_text_config().hidden_size
    elements = sum(leaf.numel() for leaf in leaves)
    return elements // width // images if elements and elements % (width * images) == 0 else None


def _features_of(output: Any) -> Any:
    """The image features in ``get_image_features``'s output: a model output's pooled features, else its last hidden
    state where it pools none (Llama 4's pixel-shuffled adapter output), else the features of the first of the
    (language layer, features) pairs a model adds at its layers (Granite 4 Vision's, the first at the placeholders),
    else the tensors themselves."""
    for name in ("pooler_output", "last_hidden_state"):
        if getattr(output, name, None) is not None:
            return getattr(output, name)
    by_layer = getattr(output, "deepstack_features", None)
    return by_layer[0][1] if isinstance(by_layer, list) and by_layer else output


# A pixel_attention_mask of real tiles, (images, tiles), for a tower that takes no patch mask (Granite Docling's);
# Idefics' is of real pixels.
TILE_MASK = "tile_mask"
# Qwen2-VL's grid of an image, in merged blocks: one temporal patch, 1 x 3 blocks (x spatial_merge_size in patches).
_GRID = (1, 1, 3)


def model_pixels(
    model: nn.Module, *, images: int, device: Any = "cpu", grid: tuple[int, int, int] = _GRID
) -> dict[str, torch.Tensor]:
    """:func:`pixel_inputs` of ``model``'s vision tower, and the images of each further tower its forward takes them
    for: ``<name>_pixel_values`` for a ``<name>_vision_config`` (DeepSeek-VL-Hybrid's high-resolution SAM tower),
    one image of that config's size per image; the layouts packed across the batch of
    :mod:`~lightning_automodel.hf.vision.packed_images`; local crops beside each image
    (:mod:`~lightning_automodel.hf.vision.local_views`)."""
    if packed_layout(model) is not None:
        return packed_pixels(model, images=images, device=device)
    pixels = pixel_inputs(
        tower_config(model.config), images=images, device=device, grid=grid, accepted=image_arguments(model)
    )
    for name in sorted(_forward_arguments(model)):
        tower = getattr(model.config, name.replace("_pixel_values", "_vision_config"), None)
        if name.endswith("_pixel_values") and tower is not None:
            pixels[name] = pixel_inputs(tower, images=images, device=device)["pixel_values"]
    if takes_local_views(model):
        pixels.update(local_views(model, pixels["pixel_values"]))
    return pixels


def pixel_inputs(
    vision: Any,
    *,
    images: int,
    device: Any = "cpu",
    grid: tuple[int, int, int] = _GRID,
    accepted: set[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """The pixels (and image metadata) of ``images`` images for a tower of config ``vision``, laid out as
    :func:`image_arguments` ``accepted`` says: flattened patches and grids (Qwen2-VL; ``grid``: each image's, in
    merged blocks), else one image of (channels, size, size) each; with ``aspect_ratio_ids`` (Mllama) padded tiles;
    with ``pixel_attention_mask`` (Idefics, SmolVLM) one image a row in a list of images; with
    ``image_grid_pinpoints`` (LLaVA-NeXT) a base image and a tile, and their sizes; with ``image_sizes`` (Pixtral's
    tower) the sizes."""
    merge = merge_size(vision, accepted=accepted)
    if merge is not None:
        return patch_pixels(vision, images=images, merge=merge, grid=grid, device=device, accepted=accepted)
    if PATCH_TOKENS in accepted:
        return patch_token_pixels(vision, images=images, device=device)
    size = _image_side(vision)
    pixels = random_pixels((images, channel_count(vision), size, size), device=device)
    layout = accepted & {NAFLEX, POSITIONED, FLATTENED, PATCH_STREAM}
    if layout:
        return as_patch_sequences(pixels, vision=vision, layout=layout.pop())
    if "aspect_ratio_ids" in accepted:  # (rows, images, tiles, ...): one real tile, padded to the config's count
        return padded_tiles(vision, pixels)
    if accepted & {"image_attention_mask", "video_frames"}:  # (rows, images or frames, ...): one a row
        return {"pixel_values": pixels[:, None]}
    if "pixel_attention_mask" in accepted:  # of each pixel; of each tile where the tower takes no patch mask
        mask = (images, 1) if TILE_MASK in accepted else (images, 1, size, size)
        return {"pixel_values": pixels[:, None], "pixel_attention_mask": torch.ones(mask, dtype=torch.bool)}
    if "image_grid_pinpoints" in accepted:  # LLaVA-NeXT's "anyres": the base image and one tile of the same size
        return {"pixel_values": torch.stack([pixels, pixels], 1), "image_sizes": torch.tensor([[size, size]] * images)}
    if "image_sizes" in accepted:  # a tower of images of any size (Pixtral)
        return {"pixel_values": pixels, "image_sizes": torch.tensor([[size, size]] * images)}
    return {"pixel_values": pixels}


def _image_side(vision: Any) -> int:
    """The side of the builder's images: the tower's image size, else that of the first of its own sub-configs giving
    one (a tower of towers: Unlimited-OCR's SAM and encoder configs), else :func:`image_side`'s."""
    parts = [getattr(vision, name) for name in getattr(vision, "sub_configs", {}) if getattr(vision, name, None)]
    found = next((part.image_size for part in parts if getattr(part, "image_size", None) is not None), None)
    return side(found) if getattr(vision, "image_size", None) is None and found is not None else image_side(vision)


def image_arguments(model: nn.Module) -> set[str]:
    """What decides the layout of ``model``'s image inputs: the image arguments its forward takes, and
    ``image_grid_pinpoints`` where its config tiles images (LLaVA-NeXT), ``image_sizes`` where its tower takes them
    (Pixtral's)."""
    tiles = {"image_grid_pinpoints"} if getattr(model.config, "image_grid_pinpoints", None) else set()
    vision = getattr(model.config, "vision_config", None)
    tower = next((module for module in model.modules() if getattr(module, "config", None) is vision), None)
    tower_sizes = tower is not None and "image_sizes" in _forward_arguments(tower)
    sizes = {"image_sizes"} if tower_sizes or "image_sizes" in _features_arguments(model) else set()
    patches = patch_layout(tower) if tower is not None else set()
    if getattr(vision, "merge_kernel_size", None) is not None:  # a merge kernel's tower (Kimi-K2.5) convolves
        patches.add(UNFLATTENED)  # each patch as an image of its own
    tower_takes = _forward_arguments(tower) if tower is not None else {"patch_attention_mask"}
    tile_mask = set() if "patch_attention_mask" in tower_takes else {TILE_MASK}
    laid_out = {"aspect_ratio_ids", "pixel_attention_mask", "image_attention_mask", MERGE_SIZES, GRID_HW}
    videos = {"video_frames"} if image_token(model.config) not in (None, _image_placeholder(model.config)) else set()
    sequences = {sequence_layout(model)} - {None}
    return (_forward_arguments(model) & laid_out) | tiles | sizes | patches | tile_mask | videos | sequences


def image_features_method(model: nn.Module) -> Any:
    """``model``'s ``get_image_features``, else its base model's (Emu3's head model has none of its own)."""
    found = getattr(model, "get_image_features", None)
    return found if found is not None else getattr(getattr(model, "base_model", None), "get_image_features", None)


def _features_arguments(model: nn.Module) -> set[str]:
    """The arguments ``get_image_features`` requires (Emu3's VQ-GAN crops its codes to ``image_sizes``)."""
    get_features = image_features_method(model)
    if get_features is None:
        return set()
    taken = inspect.signature(get_features).parameters.values()
    return {parameter.name for parameter in taken if parameter.default is inspect.Parameter.empty}


def image_token(config: Any) -> int | None:
    """The placeholder token id of an image, from the config (None where it names none): of a video model without
    one (InstructBLIP-Video), the video placeholder, an image being a video of one frame."""
    found = _image_placeholder(config)
    video = next(
        (getattr(config, name) for name in ("video_token_id", "video_token_index") if hasattr(config, name)), None
    )
    return found if found is not None or not isinstance(video, int) else video


def _image_placeholder(config: Any) -> int | None:
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None
