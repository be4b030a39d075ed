"""Vision-language models (LLaVA, Qwen2-VL, Gemma 3) against one process inside gloo workers: loss, logits and every
gradient (the vision tower's and projector's included) of ``parallelize``, then AdamW steps through a real Trainer."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._composable.contract import _get_registry
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.data import DataLoader, StackDataset

from lightning_automodel import AutoModelParallelStrategy, parallelize
from lightning_automodel.hf.decoder_layers import multimodal_units, named_decoder_layers
from lightning_automodel.hf.freezing import freeze
from lightning_automodel.parallel.float8 import Float8Layers, convert_to_float8, float8_options
from lightning_automodel.parallel.mesh import data_mesh
from lightning_automodel.planning.replica_comparison import ZERO_GRADIENT, fp64_copy, gradient_limits
from lightning_automodel.testing.parity import (
    BF16,
    FP32_TOLERANCE,
    Outputs,
    assert_gradients_placed_as_parameters,
    dims_for,
    dp_slice,
    full,
    gradient_errors,
    relative_error,
    within_bf16_noise,
)
from lightning_automodel.testing.trainer_checks import fresh_dynamo
from lightning_automodel.testing.trainer_parity import (
    GLOBAL_BATCH,
    CausalLM,
    assert_experts_distributed,
    compare_training,
    reference_run,
    trainer,
)
from lightning_automodel.testing.vision.models import (
    IMAGE_TOKEN,
    model_inputs,
    rows_slice,
    tiny_vision_model,
    vision_batch,
    vision_loss_and_logits,
)


def _outputs(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> Outputs:
    loss, logits = vision_loss_and_logits(model, rows)
    loss.backward()
    grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    return Outputs(full(loss).detach().clone(), full(logits), grads)


def _parallel_outputs(model: torch.nn.Module, rows: dict, mesh: Any) -> tuple[Any, slice]:
    """The parallelized model's outputs on this data-parallel rank's rows, its loss averaged over the data-parallel
    ranks (as the one process's over the whole batch), and the rows' slice."""
    dp = data_mesh(mesh)
    part = dp_slice(dp, len(rows["input_ids"]))
    with loss_parallel():
        outputs = _outputs(model, rows_slice(rows, part))
    dist.all_reduce(outputs.loss, group=dp.get_group())
    outputs.loss /= dp.size()
    return outputs, part


def check_vision_layout(
    family: str,
    tp: int,
    sp: bool,
    activation_checkpointing: bool = False,
    *,
    ep: int = 1,
    dp_replicate: int = 1,
    tower_whole: bool = False,
    **options: Any,
) -> dict[str, float]:
    """fp32 parity of one step with images; dp_shard takes the rest of the world after ``dp_replicate`` (``ep`` of it
    holding the text model's experts apart); ``options``: more of parallelize's (``compile``). Every rank builds its
    model from another seed: parallelize must make them all rank 0's. At tp > 1 the tower's and projector's Linears
    are split, or with ``tower_whole`` (a model whose probe cannot run its images) none is."""
    mesh = dims_for(dist.get_world_size(), tp, dp_replicate=dp_replicate, ep=ep).build_mesh("cpu")
    if options.get("compile"):
        fresh_dynamo()  # graphs another check's mesh guarded
    reference, model = tiny_vision_model(family), tiny_vision_model(family, seed=dist.get_rank())
    parallelize(model, mesh, sp=sp, activation_checkpointing=activation_checkpointing, **options)
    if ep > 1:
        assert_experts_distributed(model, ep=ep)
    rows = vision_batch(family)
    expected = _outputs(reference, rows)
    outputs, part = _parallel_outputs(model, rows, mesh)
    assert_gradients_placed_as_parameters(model)
    _assert_units(model, activation_checkpointing=activation_checkpointing)
    if tp > 1:
        _assert_tower_split(model, whole=tower_whole)
    errors = _errors(outputs, expected, part, limits=gradient_limits(_fp32_rounding(reference, rows)))
    assert max(value for key, value in errors.items() if key != "rounding_limited") < FP32_TOLERANCE, errors
    return errors


def check_imageless_ranks(family: str, tp: int, sp: bool, imageless: tuple[int, ...]) -> dict[str, float]:
    """Data-parallel ranks ``imageless`` read rows without images, the others rows with: no rank hangs, and one step
    matches one process whose loss is the mean of the ranks' batches' losses (an evaluation forward too)."""
    mesh = dims_for(dist.get_world_size(), tp).build_mesh("cpu")
    dp = data_mesh(mesh)
    rows = vision_batch(family)
    parts = [dp_slice_of(rank, dp.size(), len(rows["input_ids"])) for rank in range(dp.size())]
    batches = [
        _without_images(rows_slice(rows, p)) if r in imageless else rows_slice(rows, p) for r, p in enumerate(parts)
    ]
    reference = tiny_vision_model(family)
    losses, logits = zip(*(vision_loss_and_logits(reference, batch) for batch in batches), strict=True)
    (sum(losses) / len(losses)).backward()
    grads = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    expected = Outputs((sum(losses) / len(losses)).detach(), torch.cat(logits).detach(), grads)
    model = tiny_vision_model(family, seed=dist.get_rank())
    parallelize(model, mesh, sp=sp)
    mine = batches[dp.get_local_rank()]
    with loss_parallel():
        outputs = _outputs(model, mine)
        with torch.no_grad():
            model(**model_inputs(mine), use_cache=False)
    dist.all_reduce(outputs.loss, group=dp.get_group())
    outputs.loss /= dp.size()
    assert set(outputs.grads) == set(expected.grads), set(outputs.grads) ^ set(expected.grads)
    limits = gradient_limits(_fp32_rounding(tiny_vision_model(family), batches[0]))
    errors = _errors(outputs, expected, parts[dp.get_local_rank()], limits=limits)
    assert max(value for key, value in errors.items() if key != "rounding_limited") < FP32_TOLERANCE, errors
    return errors


def _without_images(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rows as text alone: each placeholder another token, no pixels, no image token types."""
    text = {name: value for name, value in rows.items() if name not in ("pixel_values", "image_grid_thw")}
    text["input_ids"] = torch.where(rows["input_ids"] == IMAGE_TOKEN, IMAGE_TOKEN - 1, rows["input_ids"])
    for name in {"token_type_ids", "mm_token_type_ids"} & set(text):
        text[name] = torch.zeros_like(text[name])
    return text


def check_vision_bf16(family: str) -> dict[str, float]:
    """bf16 mixed precision at tp=2 + sp x dp_shard: as close to the fp32 result as one bf16 process is (see
    ``parallelize_checks.check_bf16_layout``), each part's gradients apart."""
    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    model = tiny_vision_model(family)
    parallelize(model, mesh, sp=True, mp_policy=BF16)
    rows = vision_batch(family)
    expected = _outputs(tiny_vision_model(family), rows)
    outputs, part = _parallel_outputs(model, rows, mesh)
    limits = gradient_limits(_fp32_rounding(tiny_vision_model(family), rows))
    single = _outputs(tiny_vision_model(family).to(torch.bfloat16), rows)
    noise = _errors(single, expected, slice(None), limits=limits, enforced=False)
    return within_bf16_noise(_errors(outputs, expected, part, limits=limits, enforced=False), noise)


def _fp32_rounding(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each gradient's error in one fp32 process against fp64's (see ``replica_comparison.gradient_limits``), from
    ``model``'s weights (it is left as it was)."""
    runs = [_outputs(copy.deepcopy(model), rows), _outputs(fp64_copy(model), rows)]
    exact = Outputs(runs[1].loss, runs[1].logits, {name: grad.float() for name, grad in runs[1].grads.items()})
    return gradient_errors(runs[0], exact, floor=ZERO_GRADIENT)


def _errors(
    outputs: Outputs, expected: Outputs, part: slice, *, limits: dict[str, float], enforced: bool = True
) -> dict[str, float]:
    """The loss's, this rank's logits' and the worst gradient's errors, each part's (tower, projector, language
    model) apart. A gradient that rounds more than the tolerance allows for in one process (a key bias's, zero in
    exact arithmetic: softmax ignores it) is held to its own fp32 limit instead (``limits``; not ``enforced`` in bf16,
    where it is noise alone) and counted apart."""
    grads = gradient_errors(outputs, expected, floor=ZERO_GRADIENT)
    beyond = {name: grads[name] for name in limits if grads[name] >= limits[name] and enforced}
    assert not beyond, f"gradients beyond the single process's own rounding: {beyond} (limits {limits})"
    silent = {_part(name) for name in grads} - {_part(name) for name, grad in expected.grads.items() if grad.any()}
    assert not silent, f"no gradient reaches the {silent} in one process: nothing to compare"
    errors = {
        "loss": relative_error(outputs.loss, expected.loss),
        "logits": relative_error(outputs.logits, expected.logits[part]),
    }
    for name, error in grads.items():
        key = f"grad_{_part(name)}"
        errors[key] = max(errors.get(key, 0.0), error if name not in limits else 0.0)
    return {**errors, "rounding_limited": float(len(limits))}


def _part(name: str) -> str:
    """Which part of the model a parameter belongs to."""
    parts = {
        "vision_tower": "tower",
        "visual.merger": "projector",
        "visual": "tower",
        "multi_modal_projector": "projector",
    }
    return next((part for key, part in parts.items() if f".{key}." in f".{name}"), "language")


def _assert_units(model: torch.nn.Module, *, activation_checkpointing: bool) -> None:
    """Every block, the tower's too, and the tower and projector are FSDP units; checkpointing reaches every block."""
    blocks = named_decoder_layers(model)
    assert any("language" not in name for name, _ in blocks), blocks
    not_units = [name for name, module in blocks if not isinstance(module, FSDPModule)]
    not_units += [type(unit).__name__ for unit in multimodal_units(model) if not isinstance(unit, FSDPModule)]
    assert not not_units, f"not FSDP units: {not_units}"
    if activation_checkpointing:
        plain = [name for name, module in blocks if "checkpoint" not in (_get_registry(module) or {})]
        assert not plain, f"blocks without activation checkpointing: {plain}"


def _assert_tower_split(model: torch.nn.Module, *, whole: bool = False) -> None:
    """Every Linear of the tower's blocks and of the projector holds a tp shard of its weight (``whole``: none)."""
    blocks = [name for name, _ in named_decoder_layers(model) if _part(f"{name}.") == "tower"]
    linears = {
        name: module.weight
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and (name.startswith(tuple(f"{block}." for block in blocks)) or _part(name) == "projector")
    }
    split = [name for name, weight in linears.items() if _split_over_tp(weight)]
    if whole:
        assert linears and not split, f"tower and projector Linears split over tp: {split or 'no Linear found'}"
        return
    kept = sorted(set(linears) - set(split))
    assert linears and not kept, f"tower and projector Linears not split over tp: {kept or 'none found'}"


def _split_over_tp(weight: torch.Tensor) -> bool:
    names = weight.device_mesh.mesh_dim_names or () if isinstance(weight, DTensor) else ()
    return "tp" in names and isinstance(weight.placements[names.index("tp")], Shard | _StridedShard)


class VisionLM(CausalLM):
    """What a user writes for a vision-language model: rows of tokens and images, its own cross-entropy."""

    def training_step(self, batch, batch_idx):
        loss, _ = vision_loss_and_logits(self.model, batch)
        self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
        return loss


def check_vision_training(
    family: str, tp: int, sp: bool, frozen: tuple[str, ...] = (), *, build: Callable = tiny_vision_model
) -> dict[str, float]:
    """AdamW steps through a real Trainer (dp_shard takes the rest of the world) against one process: every step's
    loss and gradients (the tower's and projector's), then the weights. Every rank starts from other weights.
    ``frozen``: parts frozen in both (:func:`~lightning_automodel.hf.freezing.freeze`), which must get no gradient,
    no optimizer state and no change; so must a PEFT model's base (``build(family, seed=...)`` makes the models)."""
    model = build(family, seed=dist.get_rank())
    freeze(model, *frozen)
    names = [name for name, param in model.named_parameters() if not param.requires_grad]
    module = VisionLM(model)
    strategy = AutoModelParallelStrategy(tp=tp, sp=sp)
    dp = dist.get_world_size() // tp
    rows = vision_batch(family, GLOBAL_BATCH)
    fit = trainer(strategy, limit_val_batches=0)
    fit.fit(module, DataLoader(StackDataset(**rows), batch_size=GLOBAL_BATCH // dp))
    reference = build(family)
    freeze(reference, *frozen)
    steps = reference_run(
        reference, loss=lambda model, rows, _: vision_loss_and_logits(model, rows)[0], data=(rows, None)
    )
    limits = gradient_limits(_fp32_rounding(build(family), rows))
    result = compare_training(module, reference, steps, zero_gradient=ZERO_GRADIENT, rounding_limits=limits)
    params = dict(module.model.named_parameters())
    stateful = [name for name in names if params[name] in fit.optimizers[0].state]
    assert not stateful and not any(params[name].requires_grad for name in names), stateful
    return {**result, "frozen": float(len(names))}


def check_vision_float8(family: str, tp: int, sp: bool, recipe: str) -> dict[str, float]:
    """float8 (torchao's emulation) on the language model's blocks, the tower's in high precision, dp_shard taking the
    rest of the world: one step against one process whose same layers are converted, each data-parallel rank's rows
    forwarded apart (float8's scales are those of what one matmul sees); and farther from the unconverted model."""
    options = float8_options({"recipe": recipe, "emulate": True})
    mesh = dims_for(dist.get_world_size(), tp).build_mesh("cpu")
    model = tiny_vision_model(family, seed=dist.get_rank())
    parallelize(model, mesh, sp=sp, float8=options)
    converted = [name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"]
    assert converted and not any(_part(name) != "language" for name in converted), converted
    rows, dp = vision_batch(family), data_mesh(mesh)
    parts = [dp_slice_of(rank, dp.size(), len(rows["input_ids"])) for rank in range(dp.size())]
    outputs, part = _parallel_outputs(model, rows, mesh)
    limits = gradient_limits(_fp32_rounding(tiny_vision_model(family), rows))
    errors = {}
    for convert in (True, False):
        reference = tiny_vision_model(family)
        if convert:
            convert_to_float8(reference, Float8Layers(converted, {}), options, fsdp_sharded=False)
        losses, logits = zip(*(vision_loss_and_logits(reference, rows_slice(rows, p)) for p in parts), strict=True)
        (sum(losses) / len(losses)).backward()
        grads = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
        expected = Outputs((sum(losses) / len(losses)).detach(), torch.cat(logits).detach(), grads)
        errors[convert] = _errors(outputs, expected, part, limits=limits, enforced=convert)
    worst = max(value for key, value in errors[True].items() if key != "rounding_limited")
    assert worst < FP32_TOLERANCE, errors[True]
    assert errors[False]["grad_language"] > 5 * errors[True]["grad_language"], errors  # float8 made a difference
    return {**errors[True], "unconverted_grad_language": errors[False]["grad_language"], "converted": len(converted)}


def dp_slice_of(rank: int, ranks: int, rows: int) -> slice:
    return slice(rank * rows // ranks, (rank + 1) * rows // ranks)
