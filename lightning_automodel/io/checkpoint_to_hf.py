"""A Lightning sharded checkpoint to a Hugging Face model directory (``lightning-automodel export``).

Runs in one process, without GPUs or a process group: it reads the checkpoint's shards, assembles the model's
weights (only those: optimizer state is left on disk), and writes them with the config and tokenizer as
``save_pretrained`` does. The whole model is held in CPU memory once.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_automodel.hf.packed_weights import packed_block_keys
from lightning_automodel.hf.peft import with_lora
from lightning_automodel.io.atomic_directory import atomic_directory, readable_path
from lightning_automodel.io.hf_export import not_model_files

_WEIGHTS = "state_dict."
_METADATA = "meta.pt"  # Lightning's: everything of the checkpoint but the model and optimizer states


def export_checkpoint(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    config: str | os.PathLike | None = None,
    model_class: str = "",
) -> None:
    """Write the model weights of ``checkpoint`` (a directory ``trainer.save_checkpoint`` wrote) as a Hugging Face
    model directory ``output``.

    Args:
        config: a Hugging Face model directory describing the model (its tokenizer is copied too). Not needed for
            checkpoints of :class:`~lightning_automodel.lm.CausalLMModule`, which record their config, tokenizer
            and LoRA settings. Recorded LoRA adapters are merged into the weights.
        model_class: a transformers class name (default: the config's first architecture).
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
    cls = getattr(transformers, model_class or (hf_config.architectures or ["AutoModelForCausalLM"])[0])
    with torch.device("meta"):
        model = cls.from_config(hf_config) if cls.__name__.startswith("Auto") else cls(hf_config)
    lora = (metadata.get("hyper_parameters") or {}).get("lora")  # recorded by CausalLMModule
    if lora is not None:
        model = with_lora(model, lora)
    _load_weights(model, checkpoint)
    if lora is not None:
        model = model.merge_and_unload()
    with atomic_directory(output, unowned=not_model_files) as staging:
        model.save_pretrained(staging)
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


def _load_weights(model: nn.Module, checkpoint: Path) -> None:
    """Fill ``model`` (on the meta device) from the checkpoint; a weight the checkpoint lacks is an error."""
    missing, _ = model.load_state_dict(_weights_for(model, checkpoint), strict=False, assign=True)
    model.tie_weights()
    absent = [name for name in missing if model.get_parameter(name).is_meta]
    if absent:
        raise ValueError(
            f"{checkpoint} lacks weights of {type(model).__name__}: {absent[:5]}. A checkpoint saved with"
            " save_trainable_only=True holds the adapters only: export them with export_peft_adapter instead."
        )


def _weights_for(model: torch.nn.Module, checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors for ``model``'s state dict, found under the LightningModule attribute that held it.
    Packed weights, stored block by block (see :func:`.lightning_checkpoint.split_packed`), are joined."""
    stored = {
        key[len(_WEIGHTS) :]: meta
        for key, meta in FileSystemReader(checkpoint).read_metadata().state_dict_metadata.items()
        if key.startswith(_WEIGHTS) and isinstance(meta, TensorStorageMetadata)
    }
    wanted = list(model.state_dict())
    prefix = next((key[: -len(wanted[0])] for key in stored if key.endswith(wanted[0])), None)
    if prefix is None:
        raise ValueError(f"{checkpoint} holds no weights of this model (no key ends with {wanted[0]}).")
    blocks = packed_block_keys(stored)
    parts = {name: [prefix + name] if prefix + name in stored else blocks.get(prefix + name, []) for name in wanted}
    state = {
        _WEIGHTS + key: torch.empty(stored[key].size, dtype=stored[key].properties.dtype)
        for keys in parts.values()
        for key in keys
    }
    with warnings.catch_warnings():  # torch warns that it loads in one process even when told to: it is the intent
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    return {name: torch.cat([state[_WEIGHTS + key] for key in keys]) for name, keys in parts.items() if keys}
