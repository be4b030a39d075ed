"""Vision-language models under context parallel against one process, inside gloo workers: rows whose images
straddle the ranks' shares, counts differing per row."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader, StackDataset

from lightning_automodel import AutoModelParallelStrategy, ParallelDims, parallelize
from lightning_automodel.parallel.context_parallel import context_parallel_model, context_parallel_of, token_indices
from lightning_automodel.planning.replica_comparison import ZERO_GRADIENT, fp64_copy, gradient_limits
from lightning_automodel.testing.parity import FP32_TOLERANCE, Outputs, full, gradient_errors, relative_error
from lightning_automodel.testing.trainer_parity import (
    GLOBAL_BATCH,
    CausalLM,
    compare_training,
    reference_run,
    trainer,
)
from lightning_automodel.testing.vision.models import (
    IMAGE_TOKEN,
    IMAGE_TOKENS,
    model_inputs,
    tiny_vision_model,
    vision_batch,
)

SECOND_IMAGE = 9  # a row's second image's first placeholder (its first's: 1)
VARIED = (2, 0, 1, 1)  # images a row


def rows_with_images(family: str, counts: tuple[int, ...]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The model's arguments for rows of :func:`vision_batch` holding ``counts`` images (at most two a row:
    placeholders at 1-4 and 9-12), each image its own pixels; and the labels a Hugging Face model takes."""
    tokens = vision_batch(family, len(counts))["input_ids"]
    pixels = vision_batch(family, max(sum(counts), 1), seed=2)
    for row, count in enumerate(counts):
        tokens[row, 1 : 1 + IMAGE_TOKENS] = IMAGE_TOKEN if count else 5
        if count == 2:
            tokens[row, SECOND_IMAGE : SECOND_IMAGE + IMAGE_TOKENS] = IMAGE_TOKEN
    images = {name: pixels[name][: sum(counts)] for name in ("pixel_values", "image_grid_thw") if name in pixels}
    inputs = model_inputs({"input_ids": tokens, **images})
    for name in ("token_type_ids", "mm_token_type_ids"):
        if name in pixels:
            inputs[name] = (tokens == IMAGE_TOKEN).long()
    return inputs, hf_labels(tokens)


def check_vision_rows_split_over_cp(
    family: str, counts: tuple[int, ...] = VARIED, fsdp: bool = False, tp: int = 1
) -> dict[str, float]:
    """The model's call at cp = world size on rows holding ``counts`` images whose placeholders straddle the ranks'
    shares (Gemma 3's image tokens seeing each other both ways across them): the loss, each rank's logits and every
    gradient (the tower's and projector's included) against one process on the whole rows. Each rank's tower
    encodes its share of the images, once, or a stand-in where its share is empty (``fsdp``: under ``parallelize``,
    whose FSDP2 units every rank must run; at ``tp`` > 1 with sequence parallel too)."""
    cp = dist.get_world_size() // tp
    mesh = ParallelDims(cp=cp, tp=tp).resolve(cp * tp).build_mesh("cpu")
    model, reference = tiny_vision_model(family), tiny_vision_model(family)
    inputs, labels = rows_with_images(family, counts)
    limits = gradient_limits(_fp32_rounding(reference, inputs, labels))
    if fsdp:
        parallelize(model, mesh, sp=tp > 1)
    context = context_parallel_of(model) if fsdp else context_parallel_model(model, mesh)
    encoded = _count_tower_calls(model)
    with loss_parallel() if tp > 1 else contextlib.nullcontext():
        outputs = _outputs(model, inputs, labels)
    expected = _outputs(reference, inputs, labels)
    dist.all_reduce(outputs.loss, group=mesh["cp"].get_group())
    if not fsdp:  # each rank's share of the gradient, as FSDP's reduction over dp_shard x cp sums
        for grad in outputs.grads.values():
            dist.all_reduce(grad)
    scale = 1 if fsdp else cp
    outputs = Outputs(outputs.loss / cp, outputs.logits, {name: g / scale for name, g in outputs.grads.items()})
    held = token_indices(context.padded_length(labels.size(1)), cp, context.rank)
    real = held < labels.size(1)
    real[real.clone()] = inputs["attention_mask"][0, held[real]].bool()  # not the rows' padding (noise there)
    grads = gradient_errors(outputs, expected, floor=ZERO_GRADIENT)
    beyond = {name: grads[name] for name in limits if grads[name] >= limits[name]}
    assert not beyond, f"gradients beyond the single process's own rounding: {beyond} (limits {limits})"
    result = {
        "loss": relative_error(outputs.loss, expected.loss),
        "logits": relative_error(full(outputs.logits)[:, real], expected.logits[:, held[real]]),
        "grads": max(error for name, error in grads.items() if name not in limits),
        "tower_grads": max(error for name, error in grads.items() if _in_tower(name) and name not in limits),
        "rounding_limited": float(len(limits)),
    }
    share = sum(counts) * (context.rank + 1) // cp - sum(counts) * context.rank // cp
    assert encoded == [share or 1], (encoded, share)  # one call: this rank's share, or a stand-in
    assert max(value for key, value in result.items() if key != "rounding_limited") < FP32_TOLERANCE, result
    return result


def _in_tower(name: str) -> bool:
    return "vision" in name or "visual" in name


def _outputs(model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> Outputs:
    output = model(**inputs, labels=labels, use_cache=False)
    output.loss.backward()
    grads = {name: full(param.grad).clone() for name, param in model.named_parameters() if param.grad is not None}
    return Outputs(full(output.loss).detach().clone(), output.logits.detach(), grads)


def _fp32_rounding(model: torch.nn.Module, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> dict[str, float]:
    """Each gradient's error in one fp32 process against fp64's (see ``replica_comparison.gradient_limits``)."""
    single = _outputs(copy.deepcopy(model), inputs, labels)
    exact = _outputs(
        fp64_copy(model), {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}, labels
    )
    exact = Outputs(exact.loss, exact.logits, {name: grad.float() for name, grad in exact.grads.items()})
    return gradient_errors(single, exact, floor=ZERO_GRADIENT)


def _count_tower_calls(model: torch.nn.Module) -> list[int]:
    """The images each call of ``model.get_image_features`` encodes, appended as it is called."""
    calls: list[int] = []
    encode = model.get_image_features

    def counted(pixel_values, *args, **kwargs):
        grids = kwargs.get("image_grid_thw", args[0] if args else None)
        calls.append(len(grids) if grids is not None else len(pixel_values))
        return encode(pixel_values, *args, **kwargs)

    model.get_image_features = counted
    return calls


def hf_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """The labels a Hugging Face model takes for rows of :func:`vision_batch`: its token ids, images' placeholders
    and padding ignored."""
    return input_ids.masked_fill((input_ids == IMAGE_TOKEN) | (input_ids == 0), -100)


class VisionHFLoss(CausalLM):
    """What a user writes under cp for a vision-language model: the model's own loss, from labels."""

    def training_step(self, batch, batch_idx):
        loss = self.model(**model_inputs(batch), labels=hf_labels(batch["input_ids"])).loss
        self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
        return loss


def check_vision_cp_training(family: str, cp: int) -> dict[str, float]:
    """AdamW steps through a real Trainer at cp (dp_shard takes the rest of the world) against one process: every
    step's loss and gradients (the tower's and projector's), then the weights. Every rank starts from other
    weights."""
    module = VisionHFLoss(tiny_vision_model(family, seed=dist.get_rank()))
    dp = dist.get_world_size() // cp
    rows = vision_batch(family, GLOBAL_BATCH)
    fit = trainer(AutoModelParallelStrategy(cp=cp), limit_val_batches=0)
    fit.fit(module, DataLoader(StackDataset(**rows), batch_size=GLOBAL_BATCH // dp))
    inputs, labels = model_inputs(rows), hf_labels(rows["input_ids"])
    reference = tiny_vision_model(family)
    steps = reference_run(
        reference,
        loss=lambda model, inputs, labels: model(**inputs, labels=labels, use_cache=False).loss,
        data=(inputs, labels),
    )
    limits = gradient_limits(_fp32_rounding(tiny_vision_model(family), inputs, labels))
    return compare_training(module, reference, steps, zero_gradient=ZERO_GRADIENT, rounding_limits=limits)
