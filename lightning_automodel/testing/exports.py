"""What ``lightning-automodel export`` is checked against: ``save_pretrained`` of the model loaded whole from the
same checkpoint (every key read at once, LoRA merged by PEFT's ``merge_and_unload``), and a comparison of two model
directories file by file and tensor by tensor. Also a Lightning sharded checkpoint written in one process."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_automodel.hf.packed_weights import packed_block_keys
from lightning_automodel.hf.peft import with_lora


def write_lightning_checkpoint(model: nn.Module, directory: Path, **metadata: Any) -> None:
    """``model``'s weights as Lightning's ModelParallelStrategy saves a LightningModule holding it as ``model``
    (``state_dict.model.<name>`` keys), with ``metadata`` in ``meta.pt`` (CausalLMModule's: ``hf_config``,
    ``hyper_parameters``)."""
    state = {"state_dict": {f"model.{name}": tensor for name, tensor in model.state_dict().items()}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(state, checkpoint_id=directory, no_dist=True)
    torch.save(metadata, directory / "meta.pt")


def save_pretrained_whole(
    checkpoint: Path, model: nn.Module, output: Path, *, lora: dict | None = None, max_shard_size: int | str = "50GB"
) -> None:
    """The peer: ``model`` (meta) filled with every weight of ``checkpoint`` (read at once, packed blocks joined),
    LoRA merged with ``merge_and_unload``, written by ``save_pretrained``."""
    if lora is not None:
        model = with_lora(model, lora)
    stored = {
        key: meta
        for key, meta in FileSystemReader(checkpoint).read_metadata().state_dict_metadata.items()
        if key.startswith("state_dict.") and isinstance(meta, TensorStorageMetadata)
    }
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in stored.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    names = list(model.state_dict())
    prefix = next(key[: -len(names[0])] for key in stored if key.endswith(names[0]))
    blocks = packed_block_keys(stored)
    weights = {
        name: state[prefix + name] if prefix + name in state else torch.cat([state[k] for k in blocks[prefix + name]])
        for name in names
        if prefix + name in state or prefix + name in blocks
    }
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    missing = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    assert not missing, f"{checkpoint} lacks {missing[:5]}"
    if lora is not None:
        model = model.merge_and_unload()
    model.save_pretrained(output, max_shard_size=max_shard_size)


def assert_exports_as_save_pretrained(checkpoint: Path, config: Any, directory: Path) -> dict:
    """``export_checkpoint`` of ``checkpoint`` (a model of ``config``, causal LM) in 40 kB shards into
    ``directory``, against :func:`save_pretrained_whole` of it: see :func:`assert_same_directory`."""
    from transformers import AutoModelForCausalLM

    from lightning_automodel.io.checkpoint_to_hf import export_checkpoint

    config.save_pretrained(directory / "config")
    export_checkpoint(checkpoint, directory / "export", config=directory / "config", max_shard_size=40_000)
    with torch.device("meta"):
        whole = AutoModelForCausalLM.from_config(config)
    save_pretrained_whole(checkpoint, whole, directory / "peer", max_shard_size=40_000)
    return assert_same_directory(directory / "export", directory / "peer")


def assert_same_directory(exported: Path, expected: Path) -> dict:
    """The same weight files, the same index (byte for byte), the same config, and every tensor equal (values and
    dtype) under the same name in the same file."""
    weight_files = sorted(p.name for p in expected.iterdir() if p.name.startswith("model"))
    found = sorted(p.name for p in exported.iterdir() if p.name.startswith("model"))
    assert found == weight_files, (found, weight_files)
    index = expected / "model.safetensors.index.json"
    if index.exists():
        assert (exported / index.name).read_text() == index.read_text(), "the index differs from save_pretrained's"
    for name in ("config.json", "generation_config.json"):
        if (expected / name).exists():
            assert json.loads((exported / name).read_text()) == json.loads((expected / name).read_text()), name
    tensors = 0
    for name in (n for n in weight_files if n.endswith(".safetensors")):
        with safe_open(exported / name, "pt") as ours, safe_open(expected / name, "pt") as theirs:
            assert set(ours.keys()) == set(theirs.keys()), (name, set(ours.keys()) ^ set(theirs.keys()))
            for key in theirs.keys():
                mine, reference = ours.get_tensor(key), theirs.get_tensor(key)
                assert mine.dtype == reference.dtype and torch.equal(mine, reference), (name, key)
                tensors += 1
    return {"files": len(weight_files), "tensors": tensors}
