"""The Hugging Face model a :class:`~lightning_automodel.lm.CausalLMModule` trains: its config (a pretrained
model's, or a new one completed from the data's tokenizer and processor), its transformers class (a causal LM, or
an image-text-to-text model where the config has a vision tower), and what a checkpoint keeps of the processor."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

_VOCAB_MULTIPLE = 64  # a vocabulary sized from a tokenizer is rounded up so that tp = 2, 4, ..., 64 divide it


def reads_images(config: Any) -> bool:
    """Whether the config describes a vision-language model (one with a vision tower's config)."""
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config: Any) -> Any:
    """``AutoModelForImageTextToText`` for a vision-language config (LLaVA, Qwen2-VL, ...), else
    ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if reads_images(config) else AutoModelForCausalLM


def architectures(model: Any) -> list[str]:
    """The model's transformers class, as ``save_pretrained`` records it in the config (FSDP2 makes a class of its
    own, ``FSDPLlamaForCausalLM``, whose base it is); none for a class from elsewhere."""
    bases = [cls.__name__ for cls in type(model).__mro__ if cls.__module__.startswith("transformers.models.")]
    return bases[:1]


def new_model_config(overrides: dict[str, Any], tokenizer: Any = None, processor: Any = None) -> Any:
    """The config of a new model: ``overrides`` (with their ``model_type``) completed from the data. A missing
    ``vocab_size`` is the tokenizer's rounded up to a multiple of 64, missing special token ids are the tokenizer's
    (:func:`special_token_ids`), both in the ``text_config`` of a vision-language model, whose missing
    ``image_token_id`` is the processor's."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    overrides = dict(overrides)
    composite = "text_config" in getattr(CONFIG_MAPPING[overrides["model_type"]], "sub_configs", {})
    text = dict(overrides.get("text_config") or {}) if composite else overrides
    if tokenizer is not None:
        text |= {**special_token_ids(tokenizer), **text}
    if "vocab_size" not in text:
        if tokenizer is None:
            where = "config.text_config.vocab_size" if composite else "config.vocab_size"
            raise ValueError(
                f"The config has no vocab_size and there is no tokenizer to take it from: set {where}, or use a"
                " data module with a `tokenizer` attribute."
            )
        text["vocab_size"] = -(-len(tokenizer) // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE
    if composite:
        overrides["text_config"] = text
        if getattr(processor, "image_token_id", None) is not None:
            overrides.setdefault("image_token_id", processor.image_token_id)
    return AutoConfig.for_model(**(overrides if composite else text))


def special_token_ids(tokenizer: Any) -> dict[str, int | None]:
    """The tokenizer's BOS, EOS and padding ids, for a new model's config (and so its generation config, and what
    `export` writes): ``generate`` stops at the EOS the model was trained to end with, not at the config class's
    default. A padding id that stands in for EOS (a tokenizer without a pad token of its own) is left out: the
    embedding of a config's ``pad_token_id`` is kept at zero and not trained, and EOS is a token the model reads."""
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        ids["pad_token_id"] = tokenizer.pad_token_id
    return ids


def tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    """The files ``save_pretrained`` writes for ``tokenizer``, or a processor (its tokenizer's, its image
    processor's settings, its chat template), as relative path -> bytes: plain data, kept in a checkpoint's metadata
    and written out again beside an export, where ``AutoTokenizer`` or ``AutoProcessor`` loads them."""
    with tempfile.TemporaryDirectory() as directory:
        tokenizer.save_pretrained(directory)
        root = Path(directory)
        return {str(path.relative_to(root)): path.read_bytes() for path in root.rglob("*") if path.is_file()}
