"""Parity checks run inside gloo workers: a parallel layout against a single-process run of the same model.

Every check builds the reference model and the parallel model from the same seed, feeds the reference the
global batch and each data-parallel rank its slice, and compares loss, logits and every gradient (as full
tensors). Errors are relative to the largest reference magnitude of each tensor; each check returns them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from models import batch, tiny_model
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lightning_automodel import ParallelDims, parallelize
from lightning_automodel.parallel.mesh import data_mesh
from lightning_automodel.planning.verify import loss_and_logits as loss_of  # verify_plan's loss is the checks' too

# fp32: TP and FSDP change only the order of reductions; measured errors are ~1e-6 (see the closing notes).
FP32_TOLERANCE = 2e-5

STEPS = 3
LR = 1e-2
# AdamW scales every element's step to about lr whatever the gradient's size, so reduction-order noise on a
# near-zero gradient element can move it by a fraction of lr: measured up to 6.3e-4 (Qwen3 classifier) after
# 3 steps of lr 1e-2. A gradient of the wrong direction moves weights by O(lr x steps) = 3e-2; one of the
# wrong scale barely moves them, which is why the gradients are compared at every step too.
WEIGHT_TOLERANCE = 2e-3
# The first loss and gradients are exact up to reduction order (FP32_TOLERANCE); later ones inherit the
# weights' AdamW noise (gradients measured up to 2e-3 relative). A gradient of the wrong scale is off by
# O(1) at every step, the first included.
TRAINED_LOSS_TOLERANCE = 1e-4
TRAINED_GRAD_TOLERANCE = 1e-2

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def relative_error(actual: torch.Tensor, expected: torch.Tensor, *, floor: float = 1e-12) -> float:
    """Largest difference relative to the largest expected value, or to ``floor`` if that is smaller."""
    actual, expected = full(actual).float(), full(expected).float()
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(floor)).item()


def dims_for(world_size: int, tp: int, dp_replicate: int = 1, ep: int = 1) -> ParallelDims:
    return ParallelDims(tp=tp, dp_replicate=dp_replicate, ep=ep).resolve(world_size)


@dataclass
class Outputs:
    """What one forward and backward pass produced: the loss, the logits and every gradient, as full tensors."""

    loss: torch.Tensor
    logits: torch.Tensor
    grads: dict[str, torch.Tensor]


def single_process_outputs(reference: torch.nn.Module, *, batch_size: int = 4) -> Outputs:
    """The reference's loss, logits and gradients on the whole batch (gradients accumulate over calls)."""
    tokens, labels = batch(batch_size)
    loss, logits = loss_of(reference, tokens, labels)
    loss.backward()
    return Outputs(loss, logits, {name: p.grad for name, p in reference.named_parameters() if p.grad is not None})


def parallel_outputs(
    model: torch.nn.Module, dp: DeviceMesh | None, *, batch_size: int = 4, placed: bool = True
) -> Outputs:
    """This rank's logits (of its slice of the batch), the loss averaged over ``dp`` and every gradient, gathered.

    ``dp`` is the data-parallel mesh: each of its ranks gets a contiguous slice of the batch. None: no split.
    ``placed``: the gradients must be in their parameters' placements (as FSDP2 hands them; not so for a model
    parallelized by torch's ``parallelize_module`` alone).
    """
    tokens, labels = batch(batch_size)
    rank_slice = dp_slice(dp, batch_size)
    with loss_parallel():
        loss, logits = loss_of(model, tokens[rank_slice], labels[rank_slice])
        loss.backward()
    loss = full(loss).detach().clone()
    if dp is not None:
        dist.all_reduce(loss, group=dp.get_group())
        loss /= dp.size()
    if placed:
        assert_gradients_placed_as_parameters(model)
    grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    return Outputs(loss, full(logits), grads)


def assert_gradients_placed_as_parameters(model: torch.nn.Module) -> None:
    """What an optimizer and clipping read: each gradient in its parameter's placements, not a ``Partial`` sum a
    later op would complete (``full`` would hide one)."""
    misplaced = {
        name: (p.grad.placements, p.placements)
        for name, p in model.named_parameters()
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements
    }
    assert not misplaced, misplaced


def dp_slice(dp: DeviceMesh | None, batch_size: int) -> slice:
    """The rows of the batch this data-parallel rank reads."""
    dp_rank, dp_size = (dp.get_local_rank(), dp.size()) if dp is not None else (0, 1)
    return slice(dp_rank * batch_size // dp_size, (dp_rank + 1) * batch_size // dp_size)


def gradient_errors(outputs: Outputs, expected: Outputs, *, floor: float = 0.0) -> dict[str, float]:
    """Relative error of every parameter's gradient; the same parameters must get one.

    ``floor``: a share of the largest gradient of the model below which a gradient counts as zero. A gradient that
    is zero in exact arithmetic (a key bias before a softmax without rotary embeddings) holds rounding noise only,
    which relative to itself is of order 1 whatever the layout.
    """
    assert outputs.grads.keys() == expected.grads.keys(), (
        f"gradients differ in which parameters get one: {sorted(outputs.grads.keys() ^ expected.grads.keys())}"
    )
    smallest = floor * max((g.abs().max().item() for g in expected.grads.values()), default=0.0)
    return {
        name: relative_error(grad, expected.grads[name], floor=max(smallest, 1e-12))
        for name, grad in outputs.grads.items()
    }


def output_errors(outputs: Outputs, expected: Outputs, rank_slice: slice) -> dict[str, float]:
    """Max relative errors of the loss, this rank's logits and every gradient."""
    return {
        "loss": relative_error(outputs.loss, expected.loss),
        "logits": relative_error(outputs.logits, expected.logits[rank_slice]),
        "grad": max(gradient_errors(outputs, expected).values()),
    }


def forward_backward_errors(
    model, reference, dp: DeviceMesh | None, *, batch_size: int = 4, placed: bool = True
) -> dict[str, float]:
    """Max relative errors of the dp-averaged loss, this rank's logits and every gradient against ``reference``,
    which runs the whole batch."""
    expected = single_process_outputs(reference, batch_size=batch_size)
    outputs = parallel_outputs(model, dp, batch_size=batch_size, placed=placed)
    return output_errors(outputs, expected, dp_slice(dp, batch_size))


def weight_error(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """Largest absolute difference of any weight (AdamW steps are of size lr, whatever the weight's scale)."""
    ref_params = dict(reference.named_parameters())
    return max((full(p) - ref_params[name]).abs().max().item() for name, p in model.named_parameters())


def check_training(model, reference, dp: DeviceMesh | None, *, steps: int = STEPS) -> dict[str, float]:
    """AdamW steps on both models: every step's loss, logits and gradients, then the weights."""
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (model, reference)]
    per_step = []
    for _ in range(steps):
        per_step.append(forward_backward_errors(model, reference, dp))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    first, later = per_step[0], {key: max(step[key] for step in per_step[1:]) for key in per_step[0]}
    result = {**{f"first_{k}": v for k, v in first.items()}, **{f"later_{k}": v for k, v in later.items()}}
    result[f"weights_after_{steps}_steps"] = weight_error(model, reference)
    assert max(first.values()) < FP32_TOLERANCE, result
    assert later["loss"] < TRAINED_LOSS_TOLERANCE and max(later.values()) < TRAINED_GRAD_TOLERANCE, result
    assert result[f"weights_after_{steps}_steps"] < WEIGHT_TOLERANCE, result
    return result


def check_layout(tp: int, sp: bool, activation_checkpointing: bool | str, dp_replicate: int = 1) -> dict[str, float]:
    """fp32 parity of one layout; dp_shard takes the rest of the world.

    Every rank builds its model from a different seed: parallelize must make them all rank 0's.
    """
    mesh = dims_for(dist.get_world_size(), tp, dp_replicate).build_mesh("cpu")
    reference, model = tiny_model(), tiny_model(seed=dist.get_rank())
    parallelize(model, mesh, sp=sp, activation_checkpointing=activation_checkpointing)
    errors = forward_backward_errors(model, reference, data_mesh(mesh))
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors


def check_bf16_layout(tp: int, sp: bool) -> dict[str, float]:
    """bf16 mixed precision: as close to the exact (fp32) result as a single-process bf16 run is.

    bf16 keeps 8 bits of mantissa, so no fixed tolerance is meaningful across quantities. The yardstick is the
    error of a single-process bf16 run of the same model against fp32: the parallel bf16 run reorders the same
    bf16 operations (TP partial sums are reduced in bf16, FSDP gradients in fp32), so its error against fp32
    must be of the same size; we allow twice it. A sharding bug gives errors of order 1, far above.
    """
    mesh = dims_for(dist.get_world_size(), tp).build_mesh("cpu")
    model = tiny_model()
    parallelize(model, mesh, sp=sp, mp_policy=BF16)
    errors = forward_backward_errors(model, tiny_model(), data_mesh(mesh))
    noise = forward_backward_errors(tiny_model().to(torch.bfloat16), tiny_model(), None)
    return within_bf16_noise(errors, noise)


def within_bf16_noise(errors: dict[str, float], noise: dict[str, float]) -> dict[str, float]:
    """Errors against fp32 of a parallel bf16 run, at most twice those of a single-process bf16 run (``noise``)."""
    for key, value in errors.items():
        assert value <= 2 * noise[key] + 1e-4, (
            f"{key}: parallel bf16 error {value:.2e} > 2 x single-process bf16 error {noise[key]:.2e}"
        )
    return {**errors, **{f"single_process_bf16_{k}": v for k, v in noise.items()}}


def check_tied_embeddings(sp: bool) -> dict[str, float]:
    """tie_word_embeddings: one Parameter after sharding, and its gradient sums both uses."""
    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    reference, model = tiny_model(tie_word_embeddings=True), tiny_model(tie_word_embeddings=True)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    parallelize(model, mesh, sp=sp)
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tensor parallel untied lm_head"
    errors = forward_backward_errors(model, reference, data_mesh(mesh))
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors


def check_frozen_stays_frozen(sp: bool, family: str = "llama") -> dict[str, int]:
    """Styles must not flip requires_grad: frozen embeddings and norms stay frozen, trainable ones trainable."""
    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    model = tiny_model(family)
    for name, param in model.named_parameters():
        param.requires_grad_(not ("norm" in name or "embed" in name or "qkv" in name))
    expected = {name: p.requires_grad for name, p in model.named_parameters()}
    parallelize(model, mesh, sp=sp)
    actual = {name: p.requires_grad for name, p in model.named_parameters()}
    assert actual == expected, {name for name in expected if actual[name] != expected[name]}
    return {"frozen": sum(not v for v in actual.values()), "trainable": sum(actual.values())}


def check_family(family: str, sp: bool) -> dict[str, float]:
    """fp32 parity of a family's registered plan at tp=2 (dp_shard takes the rest of the world)."""
    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    reference, model = tiny_model(family), tiny_model(family)
    tied = _embeddings_tied(model)
    parallelize(model, mesh, sp=sp)
    assert _embeddings_tied(model) == tied, "tensor parallel changed whether lm_head is tied to the embedding"
    errors = forward_backward_errors(model, reference, data_mesh(mesh))
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors


def check_naive_plan_is_wrong(family: str, replace: dict[str, object]) -> dict[str, float]:
    """The family plan with some styles replaced by what the reference uses: it runs, and the check says how
    wrong it is (the test asserts the errors are large, so our styles are what makes the family right)."""
    from lightning_automodel.parallel.tensor.plans import select_tp_plan

    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    reference, model = tiny_model(family), tiny_model(family)
    plan = select_tp_plan(model, sp=False).plan
    plan.update(replace)
    parallelize(model, mesh, tp_plan=plan)
    return forward_backward_errors(model, reference, data_mesh(mesh))


def check_plan_alone_is_wrong(model_type: str, plan: str) -> dict[str, float]:
    """A plan applied by torch's ``parallelize_module`` alone, as the reference applies it: per-head norms and other
    modules computing on sharded activations stay plain. It runs; the test asserts how wrong it is, so that the
    probe's styles (what ``parallelize`` adds) are what makes these models right."""
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_automodel.parallel.mesh import tp_mesh
    from lightning_automodel.parallel.tensor.plans import select_tp_plan

    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    reference, model = any_model(model_type), any_model(model_type)
    styles = LLAMA_NAMES_PLAN if plan == "llama names" else select_tp_plan(model, sp=False).plan
    parallelize_module(model, tp_mesh(mesh), styles)
    return forward_backward_errors(model, reference, data_mesh(mesh), placed=False)


def check_plan_of_any_model(model_type: str, plan: str, sp: bool = False) -> dict[str, float]:
    """fp32 parity of a model type of the coverage report (tiny config: lightning_automodel.hf.shrink) at tp=2 with
    ``plan``: "chosen" (what parallelize picks) or "llama names" (a user plan naming the Llama projections only)."""
    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    reference, model = any_model(model_type), any_model(model_type, seed=dist.get_rank())
    parallelize(model, mesh, sp=sp, tp_plan=LLAMA_NAMES_PLAN if plan == "llama names" else None)
    errors = forward_backward_errors(model, reference, data_mesh(mesh))
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors


def any_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A model of any type of the coverage report, from its tiny config, with the sdpa attention the tests use."""
    from transformers import AutoModelForCausalLM

    from lightning_automodel.hf.shrink import tiny_config as coverage_config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(coverage_config(model_type), attn_implementation="sdpa")


def check_refusal_before_any_collective() -> dict[str, int]:
    """A model with real weights and a plan that leaves its MLPs whole: refused on every rank before any collective
    (the broadcast that makes real weights identical comes after every check)."""
    from coverage_checks import CollectiveCount
    from torch.distributed.tensor.parallel import ColwiseParallel

    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    model = tiny_model(seed=dist.get_rank())
    attention_only = {f"model.layers.*.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    counter = CollectiveCount()
    try:
        with counter:
            parallelize(model, mesh, tp_plan=attention_only)
    except ValueError as error:
        assert "leaves large weights of LlamaForCausalLM's decoder blocks unsharded" in str(error), error
    else:
        raise AssertionError("the plan was not refused")
    assert counter.count == 0, f"{counter.count} collectives ran before the refusal"
    return {"collectives": counter.count}


def user_plan(model: torch.nn.Module, sp: bool) -> dict:
    """A plan as a user writes it for Llama, with torch's styles only: logits gathered, no sequence parallel."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    layer = "model.layers.*"
    plan = {f"{layer}.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan |= {f"{layer}.mlp.{p}_proj": ColwiseParallel() for p in ("gate", "up")}
    plan |= {f"{layer}.self_attn.o_proj": RowwiseParallel(), f"{layer}.mlp.down_proj": RowwiseParallel()}
    plan |= {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate())}
    plan |= {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    return plan


def naive_fused_plan(model: torch.nn.Module, sp: bool) -> dict:
    """Phi3's family plan with its fused gate_up_proj split by torch's plain ColwiseParallel, which gives each rank
    gate or up rather than half of each: it runs, and trains wrong (what verify_plan must catch)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from lightning_automodel.parallel.tensor.plans import select_tp_plan

    return {**select_tp_plan(model, sp=sp).plan, "model.layers.*.mlp.gate_up_proj": ColwiseParallel()}


USER_PLAN = user_plan(None, False)
# The Llama projections by name, and nothing else: per-head norms under other names (HunYuan's query_layernorm) are
# left to the probe.
LLAMA_NAMES_PLAN = {pattern: style for pattern, style in USER_PLAN.items() if "layers" in pattern}


def check_user_plan(spec: str) -> dict[str, float]:
    """tp_plan given as a dict, an import path to a dict, an import path to a function, or the function."""
    specs = {
        "dict": USER_PLAN,
        "dict path": "parity.USER_PLAN",
        "function path": "parity.user_plan",
        "function": user_plan,
    }
    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    reference, model = tiny_model(), tiny_model()
    parallelize(model, mesh, tp_plan=specs[spec])
    errors = forward_backward_errors(model, reference, data_mesh(mesh))
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors


def check_clip_grad_norm(tp: int, sp: bool) -> dict[str, float]:
    """The global gradient norm over parameters on different meshes equals the single-process one, and so do
    the clipped gradients."""
    from lightning_automodel.parallel.grad_norm import clip_grad_norm_

    mesh = dims_for(dist.get_world_size(), tp).build_mesh("cpu")
    reference, model = tiny_model(), tiny_model()
    parallelize(model, mesh, sp=sp)
    forward_backward_errors(model, reference, data_mesh(mesh))
    norm = clip_grad_norm_(model.parameters(), max_norm=0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.1)
    assert ref_norm > 0.1, "the test must clip"
    ref_grads = dict(reference.named_parameters())
    errors = {
        "norm": relative_error(norm, ref_norm),
        "clipped_grad": max(relative_error(p.grad, ref_grads[name].grad) for name, p in model.named_parameters()),
    }
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors


def _embeddings_tied(model: torch.nn.Module) -> bool:
    output = model.get_output_embeddings()
    return output is not None and output.weight is model.get_input_embeddings().weight


def check_phi3_attention_kept_whole() -> dict[str, float]:
    """A user plan may leave Phi3's attention replicated (the reference's layout): head counts stay global."""
    from lightning_automodel.parallel.tensor.plans import select_tp_plan

    mesh = dims_for(dist.get_world_size(), 2).build_mesh("cpu")
    reference, model = tiny_model("phi3_gqa"), tiny_model("phi3_gqa")
    plan = select_tp_plan(model, sp=False).plan
    del plan["model.layers.*.self_attn.qkv_proj"], plan["model.layers.*.self_attn.o_proj"]
    parallelize(model, mesh, tp_plan=plan, allow_unsharded_linears=True)
    errors = forward_backward_errors(model, reference, data_mesh(mesh))
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors


def check_fsdp_schedule(reshard_after_forward: bool | None, forward_prefetch: int, backward_prefetch: int) -> dict:
    """The reshard and prefetch options set what they say on every unit, and leave the results exact."""
    from lightning_automodel.parallel import decoder_layers

    mesh = dims_for(dist.get_world_size(), 1).build_mesh("cpu")
    reference, model = tiny_model(num_hidden_layers=4), tiny_model(num_hidden_layers=4)
    parallelize(
        model,
        mesh,
        reshard_after_forward=reshard_after_forward,
        forward_prefetch=forward_prefetch,
        backward_prefetch=backward_prefetch,
    )
    layers = decoder_layers(model)
    states = [unit._get_fsdp_state() for unit in (*layers, model)]
    reshards = [state._fsdp_param_group.post_forward_mesh_info is not None for state in states]
    if reshard_after_forward is None:
        assert reshards == [True, True, True, False, False], reshards  # every layer but the last; not the root
    else:
        assert reshards == [reshard_after_forward] * 5, reshards
    index = {id(layer): i for i, layer in enumerate(layers)}
    forward = [[index[id(s._modules[0])] for s in state._states_to_forward_prefetch] for state in states[:4]]
    backward = [[index[id(s._modules[0])] for s in state._states_to_backward_prefetch] for state in states[:4]]
    ahead = [list(range(i + 1, min(4, i + 1 + forward_prefetch))) for i in range(4)]
    behind = (
        [list(range(i - 1, max(-1, i - 1 - backward_prefetch), -1)) for i in range(4)]
        if backward_prefetch > 1
        else [[]] * 4
    )
    assert forward == ahead and backward == behind, (forward, backward)
    errors = forward_backward_errors(model, reference, data_mesh(mesh))
    errors.update(forward_backward_errors(model, reference, data_mesh(mesh)))  # a second pass, after resharding
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return errors
