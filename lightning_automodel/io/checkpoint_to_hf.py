"""A Lightning sharded checkpoint to a Hugging Face model directory (``lightning-automodel export``).

Runs in one process, without GPUs or a process group. The model is built on the meta device only (its names, ties
and dtypes); the output is written shard by shard, each shard's tensors read from the checkpoint by key, so the
process holds a bounded batch of tensors, never the model (see :mod:`.export`). Optimizer state stays on disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_automodel.io.atomic_directory import atomic_directory, readable_path
from lightning_automodel.io.export.shards import DEFAULT_MAX_SHARD_SIZE
from lightning_automodel.io.export.source import CheckpointModel
from lightning_automodel.io.export.writing import write_adapter, write_model
from lightning_automodel.io.hf_export import not_model_files

_METADATA = "meta.pt"  # Lightning's: everything of the checkpoint but the model and optimizer states


def export_checkpoint(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    config: str | os.PathLike | None = None,
    model_class: str = "",
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    lora: Literal["merge", "adapter"] = "merge",
) -> None:
    """Write the model weights of ``checkpoint`` (a directory ``trainer.save_checkpoint`` wrote) as a Hugging Face
    model directory ``output``: the files, names and tensors ``save_pretrained`` writes for the same weights.

    Args:
        config: a Hugging Face model directory describing the model (its tokenizer is copied too). Not needed for
            checkpoints of :class:`~lightning_automodel.lm.CausalLMModule`, which record their config, tokenizer
            and LoRA settings.
        model_class: a transformers class name (default: the config's first architecture).
        max_shard_size: as ``save_pretrained`` takes it (bytes, or a string such as ``"5GB"``).
        lora: for a checkpoint with LoRA adapters, ``"merge"`` them into the weights (as PEFT's
            ``merge_and_unload``) or write a PEFT ``"adapter"`` directory.
    """
    import transformers

    checkpoint = readable_path(Path(checkpoint))
    metadata = _metadata(checkpoint)
    if config is not None:
        hf_config = transformers.AutoConfig.from_pretrained(config)
    elif metadata.get("hf_config"):
        recorded = dict(metadata["hf_config"])
        hf_config = transformers.AutoConfig.for_model(recorded.pop("model_type"), **recorded)
    else:
        raise ValueError(
            f"{checkpoint} does not record its model's config (it was not written by CausalLMModule): pass"
            " --config, the Hugging Face model directory the model was built from."
        )
    if lora not in ("merge", "adapter"):
        raise ValueError(f"lora={lora!r}: choose 'merge' (one model) or 'adapter' (a PEFT adapter directory).")
    cls = getattr(transformers, model_class or (hf_config.architectures or ["AutoModelForCausalLM"])[0])

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return cls.from_config(hf_config) if cls.__name__.startswith("Auto") else cls(hf_config)

    source = CheckpointModel(checkpoint, build, (metadata.get("hyper_parameters") or {}).get("lora"))
    with atomic_directory(output, unowned=not_model_files) as staging:
        if lora == "adapter":
            write_adapter(source, staging)
        else:
            write_model(source, staging, max_shard_size=max_shard_size)
        tokenizer_files = ("tokenizer.json", "tokenizer_config.json")
        if config is not None and any((Path(config) / name).is_file() for name in tokenizer_files):
            transformers.AutoTokenizer.from_pretrained(config).save_pretrained(staging)
        for name, content in (metadata.get("tokenizer_files") or {}).items():
            (Path(staging) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(staging) / name).write_bytes(content)


def _metadata(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / _METADATA
    if not path.is_file():
        raise ValueError(f"{checkpoint} is not a sharded Lightning checkpoint (no {_METADATA} in it).")
    return torch.load(path, map_location="cpu", weights_only=True)
