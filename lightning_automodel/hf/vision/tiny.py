"""A tiny config of an image-text-to-text model type: :func:`~lightning_automodel.hf.shrink.tiny_config` (which
shrinks the text and vision sub-configs' widths and layers alike), then the image made tiny too and the special
tokens moved into the tiny vocabulary.

* images of ``IMAGE_SIZE`` pixels a side in patches of ``PATCH_SIZE`` (16 patches an image before any merge);
* a projection to the language model's width sized as that width (``projection_dim``, ``out_hidden_size``, ...);
* pooled token counts (``mm_tokens_per_image``) and query counts that must fit the smaller grid, and the learned
  queries of a Q-Former or resampler (``num_query_tokens``, ``latent_query_num``): as few image tokens;
* every ``*_token_id`` / ``*_token_index`` past the vocabulary moved to its top ids, one each, in order, and an image
  or video placeholder the config leaves unset (BLIP-2's ``image_token_index``: a checkpoint's sets it) given one.
"""

from __future__ import annotations

from typing import Any

from lightning_automodel.hf.shrink import VOCAB, merged, shrink, tiny_values
from lightning_automodel.hf.vision.rope_sections import default_sections
from lightning_automodel.hf.vision.vq_vocabulary import CODES, VQ_SIZES, vocabulary_map

IMAGE_SIZE = 16
PATCH_SIZE = 4
# The text's own token ids stay below these: the special tokens moved into the vocabulary take the ids above.
SPECIAL_IDS_FROM = VOCAB - 24
# Widths of a tower's output that the projector (or the language model) reads as the text width.
TEXT_WIDTHS = (
    "projection_dim", "out_hidden_size", "text_hidden_size", "output_dim", "projector_output_dim", "adapter_in_dim",
    "adapter_out_dim",
    "adapter_input_size",
)  # fmt: skip
# Pooled image tokens: a square number whose side divides the grid's (16 patches: 4 a side).
POOLED_TOKENS = {"mm_tokens_per_image": 4, "image_seq_length": 4, "num_query_tokens": 4, "latent_query_num": 4}
TOWER_LAYERS = 2
# Tower layer indices (whose hidden states feed the projector; MiniCPM-V's merger's): kept within the tiny tower's.
FEATURE_LAYERS = ("vision_feature_layer", "vision_feature_layers", "insert_layer_id")


def tiny_image_text_config(model_type: str) -> Any:
    """The type's config class, shrunk (text and vision), with tiny images and its special tokens in the vocabulary."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    values = tiny_values(model_type)
    return with_tiny_images(config_class, {**values, **_optional_tower(config_class, values)}, model_type=model_type)


def _optional_tower(config_class: type, values: dict[str, Any]) -> dict[str, Any]:
    """The vision sub-config of a class that leaves it unset by default (Gemma 4's optional tower: a model built
    without it takes no image), from its own class's defaults, shrunk."""
    spec = getattr(config_class, "sub_configs_defaults", {}).get("vision_config")
    if values.get("vision_config") is not None or spec is None or not hasattr(spec.config_class, "model_type"):
        return {}
    return {"vision_config": shrink(spec.config_class(**spec.init_kwargs).to_dict())}


def with_tiny_images(config_class: type, values: dict[str, Any], *, model_type: str) -> Any:
    """A config of ``config_class`` from shrunk ``values`` (:mod:`~lightning_automodel.hf.shrink`) of an
    image-text-to-text model, with tiny images and its special tokens in the vocabulary: a type's tiny config, or a
    shrunk replica of a real model's."""
    from transformers import CONFIG_MAPPING

    text = values.get("text_config") if isinstance(values.get("text_config"), dict) else values
    vision = values.get("vision_config") if isinstance(values.get("vision_config"), dict) else {}
    tower_layers = _layer_count(vision) if vision else None
    values = _tiny_images(values, text_width=_width(text), tower_layers=tower_layers)
    values = merged(values, _family_overrides(model_type, values))
    values.update(_special_tokens_in_vocabulary(values, aliased=_aliased_token_fields(config_class)))
    values.update(_code_ranges(values))
    if values.get("image_token_id") is not None:
        taken = {id_ for name, id_ in values.items() if _is_token_field(name) and _is_id(id_)}
        free = [id_ for id_ in range(SPECIAL_IDS_FROM, VOCAB) if id_ not in taken]
        values.update(vocabulary_map(model_type, image_token_id=values["image_token_id"], free_ids=free))
    text_class = CONFIG_MAPPING[text["model_type"]] if text is not values else config_class
    if isinstance(values.get("text_config"), dict):
        values["text_config"] = _mrope_fitted(values["text_config"], default=default_sections(text_class))
    else:
        values = _mrope_fitted(values, default=default_sections(text_class))
    return config_class(**values)


def special_token_ids(config: Any) -> set[int]:
    """Every special token id of ``config`` and its sub-configs (image placeholders, image starts and ends, ...),
    which a batch's text must not hold."""
    found: set[int] = set()

    def visit(values: dict[str, Any]) -> None:
        for name, value in values.items():
            if isinstance(value, dict):
                visit(value)
            elif isinstance(name, str) and _is_token_field(name):
                found.update(v for v in (value if isinstance(value, list) else [value]) if _is_id(v))

    visit(config.to_dict())
    return found


def _tiny_images(values: dict[str, Any], *, text_width: int | None, tower_layers: int | None) -> dict[str, Any]:
    tiny = dict(values)
    for name, value in values.items():
        if isinstance(value, dict) and name.endswith("_config") and name != "text_config":
            tiny[name] = _tiny_images(value, text_width=text_width, tower_layers=tower_layers)
        elif name == "image_size":
            tiny[name] = _sized_like(value, IMAGE_SIZE)
        elif name == "patch_size":
            tiny[name] = _sized_like(value, PATCH_SIZE)
        elif name in POOLED_TOKENS and isinstance(value, int):
            tiny[name] = POOLED_TOKENS[name]
        elif _is_text_width(name, values) and isinstance(value, int) and text_width is not None:
            tiny[name] = text_width
        elif name == "image_grid_pinpoints" and isinstance(value, list):
            tiny[name] = [[IMAGE_SIZE, IMAGE_SIZE]]  # one tile beside the base image (LLaVA-NeXT's "anyres")
        elif name in FEATURE_LAYERS:
            tiny[name] = _layers_within(value, layers=_layer_count(values) or tower_layers)
        elif name in VQ_SIZES and isinstance(value, int):
            tiny[name] = min(value, VQ_SIZES[name])
        elif name == "resolution" and isinstance(value, int):  # the image side a VQ-GAN is built for
            tiny[name] = IMAGE_SIZE
    if isinstance(values.get("depth"), int):  # a tower's layer count that the text rules do not know
        tiny.update(_fewer_tower_layers(tiny))
    levels = values.get("channel_multiplier")
    if isinstance(values.get("hidden_size"), int) and isinstance(levels, list) and "base_channels" in tiny:
        tiny["hidden_size"] = tiny["base_channels"] * levels[-1]  # a VQ-GAN attending at its last level (Emu3's)
    return tiny


def _is_text_width(name: str, values: dict[str, Any]) -> bool:
    """Whether field ``name`` of ``values`` is a width the language model reads a tower's output at: one of
    ``TEXT_WIDTHS``, or the ``hidden_size`` of a tower whose own width is ``embed_dim`` (Qwen2-VL's merger output)."""
    return name in TEXT_WIDTHS or (name == "hidden_size" and isinstance(values.get("embed_dim"), int))


def _fewer_tower_layers(values: dict[str, Any]) -> dict[str, Any]:
    """``TOWER_LAYERS`` layers, and the lists of layer indices (full-attention blocks, deepstack taps) pointing at
    the last of them where they pointed past it."""
    last = TOWER_LAYERS - 1
    lists = {
        name: sorted({min(v, last) for v in value})
        for name, value in values.items()
        if name.endswith(("_indexes", "_indices"))
        and isinstance(value, list)
        and value
        and all(isinstance(v, int) and v >= 0 for v in value)
    }
    return {"depth": min(values["depth"], TOWER_LAYERS), **lists}


def _layers_within(value: Any, *, layers: int | None) -> Any:
    """Layer indices (an int or a list, negative from the end) clamped to the kept layers (indices of their outputs
    or of their hidden states, which count one more, alike)."""
    if layers is None:
        return value
    if isinstance(value, list):
        return [_layers_within(v, layers=layers) for v in value]
    return max(min(value, layers - 1), -layers) if isinstance(value, int) else value


def _layer_count(values: dict[str, Any]) -> int | None:
    """The layer count of a (tower's) config dict, or of its vision sub-config."""
    vision = values.get("vision_config")
    found = values.get("num_hidden_layers", values.get("depth"))
    if isinstance(found, int):
        return found
    return _layer_count(vision) if isinstance(vision, dict) else None


def _mrope_fitted(values: dict[str, Any], *, default: list[int] | None) -> dict[str, Any]:
    """M-RoPE's sections scaled to the tiny head's rotary pairs, in proportion: the config's, else the ``default``
    the model's code takes (:func:`~lightning_automodel.hf.vision.rope_sections.default_sections`; None: it takes
    none); in each layer type's rope where the rope is given by layer type (Cohere Compass's)."""
    rope = values.get("rope_parameters")
    if not isinstance(rope, dict):
        return values
    head = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    if rope and set(rope) <= set(values.get("layer_types") or ()):
        fitted = {
            kind: _sections_fitted(each, head=head, values=values, default=default) for kind, each in rope.items()
        }
    else:
        fitted = _sections_fitted(rope, head=head, values=values, default=default)
    return {**values, "rope_parameters": fitted}


def _sections_fitted(
    rope: dict[str, Any] | None, *, head: int, values: dict[str, Any], default: list[int] | None
) -> dict[str, Any] | None:
    """One rope's sections scaled to the rotary pairs of a head ``head`` wide (None: a layer type without rope)."""
    if rope is None or not (default or "mrope_section" in rope):  # no sections read
        return rope
    pairs = int(head * rope.get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0))) // 2
    section = rope.get("mrope_section") or default
    scaled = [pairs * part // sum(section) for part in section]
    scaled[-1] += pairs - sum(scaled)
    return {**rope, "mrope_section": scaled}


def _family_overrides(model_type: str, values: dict[str, Any]) -> dict[str, Any]:
    """What the generic rules cannot know, sized from the shrunk config: widths a tower's output is read at."""
    vision = values.get("vision_config") or {}
    width = vision.get("hidden_size")
    by_type: dict[str, dict[str, Any]] = {
        "aria": {"projector_patch_to_query_dict": {(IMAGE_SIZE // PATCH_SIZE) ** 2: 4}},
        # A pixel-shuffled tower output (4 patches a token) projected to its own width, then the text's.
        "llama4": {
            "vision_config": {
                "intermediate_size": 4 * (width or 0),
                **dict.fromkeys(("projector_input_dim", "projector_output_dim", "vision_output_dim"), width),
            }
        },
        # The last layer's output concatenated with one intermediate layer's.
        "mllama": {"vision_config": {"intermediate_layers_indices": [0], "vision_output_dim": 2 * (width or 0)}},
        # SAM's last downsampling convolution feeds the encoder after it (CLIP's, Qwen2's) its patch embeddings, at
        # the encoder's width.
        **dict.fromkeys(
            ("unlimited_ocr", "deepseek_ocr2"),
            {"vision_config": {"sam_config": {"downsample_channels": [_clip_width(vision)] * 2}}},
        ),
        # The tower's width, which the projector reads, is a field of its own; no image token by default (the
        # checkpoint's config names it).
        "nemotron_h_omni": {"vision_hidden_size": width, "projector_hidden_size": width, "image_token_id": VOCAB},
        # Its text model builds a sliding-window mask whatever its layer types (all full by default), and its
        # default config gives no window: the tiny window, which no layer uses.
        "step3p7": {"text_config": {"sliding_window": 8}},
        # The thinker's rope index reads the token that opens an image, which only the talker's config defines.
        **dict.fromkeys(("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"), {"vision_start_token_id": 151652}),
        # Its window Q-Former's rate and the language layers its tower's features are added at: None by default (a
        # checkpoint's config gives them), and layers past the tiny model's; a layer of its own for each of them.
        "granite4_vision": {
            "downsample_rate": "1/2",
            "deepstack_layer_map": [[-1, 0]],
            "spatial_target_layers": [1, 2, 3, 4],
            "text_config": {"num_hidden_layers": 5},
        },
        # Gated cross-attention initialised shut (tanh(0)) leaves the logits blind to images; a checkpoint opens it.
        "idefics": {"alpha_initializer": "ones"},
        # The projector's norm reads the tower's width.
        "kimi_k25": {"projection_hidden_size": width},
        # The projector reads the tower's merged blocks: merge_size ** 2 patches of the tower's width a token.
        **dict.fromkeys(
            ("muse_glimmer", "muse_spark"), {"out_hidden_size": (width or 0) * vision.get("merge_size", 1) ** 2}
        ),
    }
    return by_type.get(model_type, {})


def _clip_width(vision: dict[str, Any]) -> int:
    """The width of a tower of towers' encoder (after SAM: Unlimited-OCR's CLIP, DeepSeek-OCR 2's), 0 where none."""
    return (vision.get("encoder_config") or {}).get("hidden_size", 0)


def _sized_like(value: Any, size: int) -> Any:
    """``size`` in the form of ``value``: an int, or a list of as many ints (height, width)."""
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return [size] * len(value)
    return size if isinstance(value, int) else value


def _aliased_token_fields(config_class: type) -> set[str]:
    """The fields a config class's ``attribute_map`` reads a token field from (Molmo2's ``image_patch_id``, its
    ``image_token_id``)."""
    return {field for alias, field in getattr(config_class, "attribute_map", {}).items() if _is_token_field(alias)}


def _code_ranges(values: dict[str, Any]) -> dict[str, int]:
    """The offsets of ranges of code tokens (``*_token_offset``: Apertus 1.5's visual codes, then its audio codes)
    moved into the vocabulary in their order, one after another, ``CODES`` each (the tiny codebooks' size) up to the
    special ids."""
    offsets = sorted(
        (value, name) for name, value in values.items() if name.endswith("_token_offset") and _is_id(value)
    )
    first = SPECIAL_IDS_FROM - CODES * len(offsets)
    return {name: first + CODES * index for index, (_, name) in enumerate(offsets)}


def _special_tokens_in_vocabulary(values: dict[str, Any], *, aliased: set[str]) -> dict[str, Any]:
    """The token fields past the vocabulary (of the config and of its text sub-config; ``aliased``: fields read as
    token fields), each moved to an id of its own from ``VOCAB - 1`` down, and the unset image and video
    placeholders given one (the model would scatter its features nowhere); a field repeated in both moves to the
    same id."""
    moved: dict[Any, int] = {}
    taken = {value for name, value in values.items() if _is_token_field(name) and _is_id(value)}
    free = (id_ for id_ in range(VOCAB - 1, SPECIAL_IDS_FROM - 1, -1) if id_ not in taken)

    def moved_in(fields: dict[str, Any]) -> dict[str, Any]:
        changed = {}
        for name, value in fields.items():
            unset = value is None and name.startswith(("image_", "video_"))
            if (_is_token_field(name) or name in aliased) and (unset or (_is_id(value) and value >= VOCAB)):
                moved.setdefault(value if value is not None else name, next(free))
                changed[name] = moved[value if value is not None else name]
        return changed

    changed = moved_in(values)
    text = values.get("text_config")
    if isinstance(text, dict):
        changed["text_config"] = {**text, **moved_in(text)}
    return changed


def _is_token_field(name: str) -> bool:
    return name.endswith(("_token_id", "_token_index", "_token_ids")) and name.lstrip("_") not in (
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
    )


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _width(values: dict[str, Any]) -> int | None:
    width = values.get("hidden_size", values.get("d_model"))
    return width if isinstance(width, int) else None
