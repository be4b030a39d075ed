"""``lightning-automodel-convert``: a Lightning sharded checkpoint to a Hugging Face model directory.

    lightning-automodel-convert CHECKPOINT --config MODEL_DIR --output OUT_DIR

Runs in one process, without GPUs or a process group: it reads the checkpoint's shards, assembles the model's
weights (only those: optimizer state is left on disk), and writes them with the config (and tokenizer, when
``MODEL_DIR`` has one) as ``save_pretrained`` does. The whole model is held in CPU memory once.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_automodel.atomic_directory import atomic_directory
from lightning_automodel.parallel.styles import packed_block_keys

_WEIGHTS = "state_dict."


def convert(
    checkpoint: str | os.PathLike, config: str | os.PathLike, output: str | os.PathLike, *, model_class: str = ""
) -> None:
    """Write the model weights of ``checkpoint`` (a directory ``trainer.save_checkpoint`` wrote) as a Hugging Face
    model directory ``output``, for the model described by ``config`` (a Hugging Face model directory).

    ``model_class``: a transformers class name (default: the config's first architecture).
    """
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(config)
    cls = getattr(transformers, model_class or (hf_config.architectures or ["AutoModelForCausalLM"])[0])
    with torch.device("meta"):
        model = cls.from_config(hf_config) if cls.__name__.startswith("Auto") else cls(hf_config)
    state = _weights_for(model, Path(checkpoint))
    missing, _ = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    untied = [name for name in missing if model.get_parameter(name).is_meta]
    if untied:
        raise ValueError(f"{checkpoint} lacks weights of {cls.__name__}: {untied[:5]}.")
    with atomic_directory(output) as staging:
        model.save_pretrained(staging)
        if any((Path(config) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            transformers.AutoTokenizer.from_pretrained(config).save_pretrained(staging)


def _weights_for(model: torch.nn.Module, checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors for ``model``'s state dict, found under the LightningModule attribute that held it.
    Packed weights, stored block by block (see ``lightning_automodel.checkpoint.split_packed``), are joined."""
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
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    return {name: torch.cat([state[_WEIGHTS + key] for key in keys]) for name, keys in parts.items() if keys}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-automodel-convert", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="directory written by trainer.save_checkpoint / ModelCheckpoint")
    parser.add_argument("--config", required=True, help="Hugging Face model directory with the model's config.json")
    parser.add_argument("--output", required=True, help="directory to write (replaced only once complete)")
    parser.add_argument("--model-class", default="", help="transformers class (default: the config's architecture)")
    args = parser.parse_args(argv)
    convert(args.checkpoint, args.config, args.output, model_class=args.model_class)


if __name__ == "__main__":
    main()
