"""LoRA on a vision-language model's language model, vision tower and projector (inside gloo workers) against one
PEFT process with images: one step's loss, logits and every adapter gradient, AdamW steps through the Trainer, and
the merged export."""

from __future__ import annotations

import shutil

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from vision_checks import (
    _assert_tower_split,
    _errors,
    _fp32_rounding,
    _outputs,
    _parallel_outputs,
    _part,
    _split_over_tp,
)

from lightning_automodel import parallelize
from lightning_automodel.hf.peft import is_lora_layer
from lightning_automodel.io.hf_export import export_merged
from lightning_automodel.planning.replica_comparison import gradient_limits
from lightning_automodel.testing.harness import shared_directory
from lightning_automodel.testing.parity import FP32_TOLERANCE, LR, assert_gradients_placed_as_parameters, dims_for, full
from lightning_automodel.testing.vision.models import model_inputs, tiny_vision_model, vision_batch

# Attention and MLP projections of the language model and the tower, and the projector's Linears; Qwen2-VL's "proj"
# also names its tower's patch convolution (a LoRA Conv3d, kept whole like its base).
TARGETS = {
    "llava": ("q_proj", "v_proj", "fc1", "linear_1", "linear_2"),
    "qwen2_vl": ("q_proj", "v_proj", "qkv", "proj", "fc1", "mlp.0", "mlp.2"),
}

# DoRA (its magnitude one scale per output row) on Qwen2-VL's packed qkv, which no style shards.
DORA_ON_PACKED_QKV = dict(target_modules=["q_proj", "v_proj", "qkv", "fc1", "mlp.0", "mlp.2"], use_dora=True)


def lora_vision_model(family: str, seed: int = 0, **lora: object) -> torch.nn.Module:
    """A tiny vision-language model with LoRA on :data:`TARGETS`; both adapter matrices random (PEFT's zero ``B``
    would leave ``A`` without a gradient at the first step, and hide a wrong one)."""
    model = tiny_vision_model(family, seed=seed)
    torch.manual_seed(seed)
    options = dict(target_modules=list(TARGETS[family]), r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(model, LoraConfig(**options | lora))


def check_vision_lora(family: str, tp: int, sp: bool, *, tower_whole: bool = False, **lora: object) -> dict[str, float]:
    """fp32 parity of one step with images; dp_shard takes the rest of the world. Only the adapters are trainable,
    every part holds some, and at tp > 1 each adapter beside a split projection is split too (``A`` of a row-, ``B``
    of a column-parallel one), or with ``tower_whole`` (an adapter no style shards: DoRA on a packed qkv) the tower
    and projector are kept whole, adapters and all. ``lora``: ``LoraConfig`` arguments over the defaults."""
    mesh = dims_for(dist.get_world_size(), tp).build_mesh("cpu")
    reference, model = lora_vision_model(family, **lora), lora_vision_model(family, seed=dist.get_rank(), **lora)
    parallelize(model, mesh, sp=sp)
    counts = _assert_adapters(model, split=tp > 1 and not tower_whole)
    if tower_whole:
        _assert_tower_split(model, whole=True)
    rows = vision_batch(family)
    expected = _outputs(reference, rows)
    outputs, part = _parallel_outputs(model, rows, mesh)
    assert_gradients_placed_as_parameters(model)
    errors = _errors(outputs, expected, part, limits=gradient_limits(_fp32_rounding(reference, rows)))
    assert max(value for key, value in errors.items() if key != "rounding_limited") < FP32_TOLERANCE, errors
    return {**errors, **counts}


def _assert_adapters(model: torch.nn.Module, *, split: bool) -> dict[str, float]:
    """Only adapters train; the tower, projector and language model each hold LoRA layers; with ``split``, each
    layer's base weight and one of its adapters are split over tp. The number of LoRA layers in each part."""
    trainable = [name for name, p in model.named_parameters() if p.requires_grad and "lora_" not in name]
    assert not trainable, f"trainable beyond the adapters: {trainable}"
    layers = {name: module for name, module in model.named_modules() if is_lora_layer(module)}
    counts = {f"lora_{part}": 0.0 for part in ("tower", "projector", "language")}
    for name in layers:
        counts[f"lora_{_part(f'{name}.')}"] += 1
    assert all(counts.values()), counts
    if split:
        adapters = lambda layer: (*layer.lora_A.values(), *layer.lora_B.values())  # noqa: E731
        whole = [
            name
            for name, layer in layers.items()
            if isinstance(layer.base_layer, torch.nn.Linear)
            and not (_split_over_tp(layer.base_layer.weight) and any(_split_over_tp(a.weight) for a in adapters(layer)))
        ]
        assert not whole, f"LoRA layers not split over tp like their projections: {whole}"
    counts["lora_on_convolutions"] = float(
        sum(isinstance(layer.base_layer, torch.nn.Conv3d) for layer in layers.values())
    )
    return counts


def check_vision_lora_merged_export(family: str, tp: int, sp: bool) -> dict[str, float]:
    """After an AdamW step, the merged export (tower adapters folded into its weights) loads into the model's class
    without PEFT and gives the parallel model's logits with images."""
    mesh = dims_for(dist.get_world_size(), tp).build_mesh("cpu")
    model = lora_vision_model(family, seed=dist.get_rank())
    parallelize(model, mesh, sp=sp)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    rows = vision_batch(family)
    _parallel_outputs(model, rows, mesh)
    optimizer.step()
    with torch.no_grad():
        logits = full(model(**model_inputs(rows), use_cache=False).logits)
    directory = shared_directory()
    export_merged(model, directory / "merged")
    result = {}
    if dist.get_rank() == 0:
        merged = type(tiny_vision_model(family)).from_pretrained(directory / "merged")
        assert not any("lora_" in name or "base_layer" in name for name in merged.state_dict())
        with torch.no_grad():
            exported = merged(**model_inputs(rows), use_cache=False).logits
        result["merged_logits"] = ((exported - logits).norm() / logits.norm()).item()
        before = tiny_vision_model(family)(**model_inputs(rows), use_cache=False).logits
        result["adapters_moved_logits"] = ((before - logits).norm() / logits.norm()).item()
        assert result["merged_logits"] < FP32_TOLERANCE < result["adapters_moved_logits"], result
    shared = [result]
    dist.broadcast_object_list(shared)
    if dist.get_rank() == 0:
        shutil.rmtree(directory)
    return shared[0]
