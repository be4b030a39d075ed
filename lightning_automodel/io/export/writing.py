"""A Hugging Face model directory written shard by shard from a checkpoint: each shard's tensors read in batches of
at most ``_READ_BYTES`` (or one tensor, when larger), written at their places in the shard's file and freed, so the
process holds one batch however large the model or its shards."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

from lightning_automodel.io.export.safetensors_file import SafetensorsFile
from lightning_automodel.io.export.shards import INDEX_NAME, WEIGHTS_NAME, ShardPlan, as_stored, plan_shards
from lightning_automodel.io.export.source import CheckpointModel

_READ_BYTES = 512 * 2**20


def write_model(source: CheckpointModel, directory: Path, *, max_shard_size: int | str) -> None:
    """The files ``save_pretrained`` writes for ``source.model`` with the checkpoint's weights: shards (their index
    when several), ``config.json`` and, for a model that generates, ``generation_config.json``."""
    from tqdm.auto import tqdm

    model = source.model
    plan = plan_shards(model, max_shard_size)
    shards = tqdm(plan.files.items(), desc="Writing shards", unit="shard", disable=not sys.stderr.isatty())
    for filename, stored_names in shards:
        _write_shard(source, plan, directory / filename, stored_names)
    if plan.index is not None:
        (directory / INDEX_NAME).write_text(json.dumps(plan.index, indent=2, sort_keys=True) + "\n")
    else:
        assert list(plan.files) == [WEIGHTS_NAME], list(plan.files)
    model.config.dtype = str(model.dtype).split(".")[1]  # as save_pretrained records them
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)


def _write_shard(source: CheckpointModel, plan: ShardPlan, path: Path, stored_names: list[str]) -> None:
    shard = SafetensorsFile(path, {name: plan.specs[name] for name in stored_names}, metadata={"format": "pt"})
    wanted = set(stored_names)
    try:
        for batch in _batches(source, list(dict.fromkeys(plan.sources[name] for name in stored_names))):
            for name, whole in source.read(batch).items():
                for stored, tensor in as_stored(source.model, name, whole).items():
                    if stored in wanted:
                        shard.write(stored, tensor)
    finally:
        shard.file.close()
    shard.close()


def _batches(source: CheckpointModel, names: list[str]) -> Iterator[list[str]]:
    """``names`` in order, in groups of at most ``_READ_BYTES`` (a larger tensor alone)."""
    state = source.model.state_dict()
    batch: list[str] = []
    size = 0
    for name in names:
        nbytes = state[name].nbytes
        if batch and size + nbytes > _READ_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(name)
        size += nbytes
    if batch:
        yield batch


def write_adapter(source: CheckpointModel, directory: Path) -> None:
    """A PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``) that
    ``PeftModel.from_pretrained(base_model, directory)`` loads: what PEFT saves (the adapters, and whatever else was
    trained), read from the checkpoint, never the frozen base."""
    peft = source.peft
    if peft is None:
        raise ValueError(f"{source.checkpoint} records no LoRA: there is no adapter to write (export the model).")
    names = [name for name, p in peft.named_parameters() if p.requires_grad or "lora_" in name]
    peft.save_pretrained(directory, state_dict=source.read_trained(names))
