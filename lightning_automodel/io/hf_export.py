"""Exports of a parallelized model in Hugging Face formats: the model, a PEFT adapter, or a merged PEFT model.

Every function here is collective: call it on every rank, in the same order (each sharded tensor is gathered
with the collectives of its mesh). Rank 0 writes; the directory appears whole or not at all.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from lightning_automodel.hf.conversion import split_as_stored
from lightning_automodel.hf.loading import checkpoint_layout
from lightning_automodel.io.atomic_directory import atomic_directory, unowned_entries
from lightning_automodel.parallel.full_tensor import full_tensor

# Files of a Hugging Face model directory besides the weights: what save_pretrained writes for a model, its
# generation config, a PEFT adapter (with its model card), the common tokenizers and processors.
_MODEL_DIRECTORY_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "adapter_config.json",
        "README.md",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "tokenizer.model",
        "chat_template.jinja",
        "chat_template.json",
        "processor_config.json",
        "preprocessor_config.json",
    }
)
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


def not_model_files(path: Path) -> list[str]:
    """What stands at ``path`` that is not a Hugging Face model directory's, so an export there must not replace it."""
    return unowned_entries(
        path, owned=lambda entry: entry.name in _MODEL_DIRECTORY_FILES or entry.name.endswith(_WEIGHT_SUFFIXES)
    )


def export_peft_adapter(model: nn.Module, directory: str | os.PathLike) -> None:
    """Write a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) that
    ``PeftModel.from_pretrained(base_model, directory)`` loads in one process.

    Only what PEFT saves is gathered: the adapters and whatever else is trainable (biases with ``bias="all"``,
    ``modules_to_save``), never the frozen base.
    """
    _require_peft(model)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    with atomic_directory(directory, unowned=not_model_files) as staging:
        state = gather_full_state_dict(model, keys=lambda name: name in trainable or "lora_" in name)
        if _is_writer():
            model.save_pretrained(staging, state_dict=state)


def export_merged(model: nn.Module, directory: str | os.PathLike) -> None:
    """Write the model with its adapters merged into the base weights, as a Hugging Face model directory that
    ``AutoModelForCausalLM.from_pretrained(directory)`` (or the model's class) loads without PEFT.

    PEFT's own merge runs on rank 0 over the gathered full weights (so DoRA and every other variant merge as
    PEFT defines them); rank 0 holds one full copy of the model in CPU memory meanwhile.
    """
    from peft import get_peft_model

    _require_peft(model)
    with atomic_directory(directory, unowned=not_model_files) as staging:
        state = gather_full_state_dict(model)
        if not _is_writer():
            return
        base = model.get_base_model()
        with torch.device("meta"):
            skeleton = get_peft_model(type(base)(base.config), model.peft_config[model.active_adapter])
        skeleton.load_state_dict(state, assign=True, strict=False)
        skeleton.tie_weights()  # assigning gave tied modules separate tensors
        skeleton.merge_and_unload().save_pretrained(staging)


def export_hf(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    tokenizer: Any = None,
    max_shard_size: int = 5 * 2**30,
) -> None:
    """Write a parallelized Hugging Face model as a directory that ``from_pretrained`` loads in one process:
    ``config.json``, ``generation_config.json``, safetensors shards of at most ``max_shard_size`` bytes with their
    index (one ``model.safetensors`` if it fits), and the tokenizer's files when one is given.

    Tensors are gathered one at a time, and rank 0 holds at most one shard: the whole model is never on one rank.
    Names are those transformers' ``save_pretrained`` writes; a tied weight is written once.
    """
    if hasattr(model, "peft_config"):
        raise TypeError("A PEFT model is exported with export_merged (one model) or export_peft_adapter (adapters).")
    layout = checkpoint_layout(model)
    with atomic_directory(directory, unowned=not_model_files) as staging:
        shards = _ShardWriter(staging, max_shard_size) if _is_writer() else None
        failure = None
        for name, full in _full_tensors(model, select=layout.__contains__):
            if shards is not None and failure is None:
                try:  # a failed write must not leave the other ranks waiting in the next gather
                    for stored_name, tensor in split_as_stored(model, name, full, layout[name]).items():
                        shards.add(stored_name, tensor.contiguous())
                except OSError as error:
                    failure = error
        if failure is not None:
            raise failure
        if shards is None:
            return
        shards.close()
        model.config.save_pretrained(staging)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)


class _ShardWriter:
    """Safetensors shards named as transformers names them, written as each fills up."""

    def __init__(self, directory: Path, max_shard_size: int) -> None:
        self.directory, self.max_shard_size = directory, max_shard_size
        self.current: dict[str, torch.Tensor] = {}
        self.current_size = self.total_size = 0
        self.written: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.current and self.current_size + size > self.max_shard_size:
            self._flush()
        self.current[name] = tensor
        self.current_size += size
        self.total_size += size

    def _flush(self) -> None:
        path = self.directory / f"shard-{len(self.written)}.tmp"
        save_file(self.current, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.current)))
        self.current, self.current_size = {}, 0

    def close(self) -> None:
        if self.current:
            self._flush()
        if len(self.written) == 1:
            self.written[0][0].rename(self.directory / "model.safetensors")
            return
        weight_map = {}
        for index, (path, names) in enumerate(self.written, start=1):
            final = f"model-{index:05d}-of-{len(self.written):05d}.safetensors"
            path.rename(self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        index_file = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2))


def gather_full_state_dict(model: nn.Module, *, keys: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict with every DTensor gathered to a full CPU tensor, held by rank 0 only (other ranks
    get an empty dict); collective. ``keys``: a predicate on names selecting what to gather (default: all)."""
    return dict(_full_tensors(model, select=keys or (lambda name: True)))


def _full_tensors(model: nn.Module, *, select: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full CPU tensor)`` for the selected state-dict entries, gathered one at a time on every rank and
    yielded on rank 0 only, so no rank holds more than one full tensor on the accelerator."""
    for name, tensor in model.state_dict().items():
        if not select(name):
            continue
        full = full_tensor(tensor)
        if _is_writer():
            yield name, full.detach().to("cpu", copy=True)


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _require_peft(model: nn.Module) -> None:
    if not hasattr(model, "peft_config"):
        raise TypeError(f"{type(model).__name__} is not a PEFT model: pass the PeftModel (get_peft_model's result).")
