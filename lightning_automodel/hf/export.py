"""Exports of a parallelized PEFT model in Hugging Face formats: the adapter directory, or the merged model.

Every function here is collective: call it on every rank, in the same order (each sharded tensor is gathered
with the collectives of its mesh). Rank 0 writes; the directory appears whole or not at all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def export_peft_adapter(model: nn.Module, directory: str | os.PathLike) -> None:
    """Write a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) that
    ``PeftModel.from_pretrained(base_model, directory)`` loads in one process.

    Only what PEFT saves is gathered: the adapters and whatever else is trainable (biases with ``bias="all"``,
    ``modules_to_save``), never the frozen base.
    """
    _require_peft(model)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    state = gather_full_state_dict(model, keys=lambda name: name in trainable or "lora_" in name)
    with _written_whole(directory) as staging:
        if staging is not None:
            model.save_pretrained(staging, state_dict=state)


def export_merged(model: nn.Module, directory: str | os.PathLike) -> None:
    """Write the model with its adapters merged into the base weights, as a Hugging Face model directory that
    ``AutoModelForCausalLM.from_pretrained(directory)`` (or the model's class) loads without PEFT.

    PEFT's own merge runs on rank 0 over the gathered full weights (so DoRA and every other variant merge as
    PEFT defines them); rank 0 holds one full copy of the model in CPU memory meanwhile.
    """
    from peft import get_peft_model

    _require_peft(model)
    state = gather_full_state_dict(model)
    with _written_whole(directory) as staging:
        if staging is None:
            return
        base = model.get_base_model()
        with torch.device("meta"):
            skeleton = get_peft_model(type(base)(base.config), model.peft_config[model.active_adapter])
        skeleton.load_state_dict(state, assign=True, strict=False)
        skeleton.merge_and_unload().save_pretrained(staging)


def gather_full_state_dict(
    model: nn.Module, *, keys: Callable[[str], bool] | None = None, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """The model's state dict with every DTensor gathered to a full tensor, held by rank 0 only (other ranks get
    an empty dict). ``keys``: a predicate on names selecting what to gather (default: everything).

    Tensors are gathered one at a time and moved to ``device``, so no rank holds more than one full tensor on
    the accelerator.
    """
    select = keys or (lambda name: True)
    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    gathered = {}
    for name, tensor in model.state_dict().items():
        if not select(name):
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if is_writer:
            gathered[name] = full.detach().to(device, copy=True)
    return gathered


@contextmanager
def _written_whole(directory: str | os.PathLike) -> Generator[Path | None, None, None]:
    """Rank 0 gets a staging directory beside ``directory`` (others get None); on success it replaces
    ``directory``, on failure it is removed and ``directory`` is left as it was. Every rank learns the outcome:
    if rank 0 failed, the others raise too instead of going on as if the export existed."""
    target = Path(directory)
    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    staging = None
    written = False
    try:
        if is_writer:
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        yield staging
        if staging is not None:
            _replace(target, staging)
        written = True
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging)
        if dist.is_initialized() and not _everywhere(written) and written:
            raise RuntimeError(f"Rank 0 failed to write {target}; its error is in rank 0's log.")


def _everywhere(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank (a collective)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    count = torch.tensor(int(flag), device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    return bool(count.item())


def _replace(target: Path, staging: Path) -> None:
    """Swap ``staging`` in for ``target``: the old directory is removed only once the new one is in place."""
    if not target.exists():
        staging.rename(target)
        return
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    target.rename(old)
    staging.rename(target)
    shutil.rmtree(old)


def _require_peft(model: nn.Module) -> None:
    if not hasattr(model, "peft_config"):
        raise TypeError(f"{type(model).__name__} is not a PEFT model: pass the PeftModel (get_peft_model's result).")
