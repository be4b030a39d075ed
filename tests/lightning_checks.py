"""Checks that drive a real Lightning Trainer inside gloo workers (see harness.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import batch, tiny_config, tiny_model
from parity import (
    FP32_TOLERANCE,
    LR,
    STEPS,
    TRAINED_GRAD_TOLERANCE,
    TRAINED_LOSS_TOLERANCE,
    WEIGHT_TOLERANCE,
    full,
    loss_of,
    relative_error,
    weight_error,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

from lightning_automodel import AutoModelParallelStrategy, parallelize
from lightning_automodel.parallel import decoder_layers
from lightning_automodel.parallel.experts.expert_parallel import experts_modules
from lightning_automodel.parallel.fsdp.dtypes import keep_pinned_fp32, pinned_to_fp32
from lightning_automodel.parallel.parallelizer import fp32_pinned_names

GLOBAL_BATCH = 8


class CausalLM(L.LightningModule):
    """What a user writes: a Hugging Face model and a plain cross-entropy; no parallel code."""

    def __init__(
        self, model: torch.nn.Module | None = None, optimizer: type = torch.optim.AdamW, lr: float = LR
    ) -> None:
        super().__init__()
        self.model = model if model is not None else tiny_model()
        self.optimizer = optimizer
        self.lr = lr
        self.losses: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, optimizer) -> None:
        # Copies: a gradient replicated on every mesh dim hands back its own storage, which clipping then scales.
        self.grads.append(
            {name: full(p.grad).clone() for name, p in self.model.named_parameters() if p.grad is not None}
        )

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        loss, _ = loss_of(self.model, tokens, labels)
        self.log("train_loss", loss, sync_dist=True)
        self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = F.cross_entropy(self.model(tokens).logits.flatten(0, 1), labels.flatten())
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_loss_unsynced", loss)  # Lightning's default: no reduction, stored as given

    def configure_optimizers(self):
        return self.optimizer(self.parameters(), lr=self.lr)


class MetaInitCausalLM(CausalLM):
    """Builds the model in configure_model on the meta device (the way to build models too big for one rank)."""

    def __init__(self, family: str = "llama") -> None:
        super().__init__(model=torch.nn.Identity())
        self.family = family

    def configure_model(self) -> None:
        if not isinstance(self.model, torch.nn.Identity):
            return  # Lightning calls configure_model at every stage: build once
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(tiny_config(self.family))


class SelfParallelizedCausalLM(CausalLM):
    """Parallelizes itself in configure_model: the strategy must leave it alone."""

    def configure_model(self) -> None:
        parallelize(self.model, self.device_mesh)


def trainer(strategy: AutoModelParallelStrategy, **kwargs) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return L.Trainer(strategy=strategy, **options)


def data(dp: int) -> DataLoader:
    """Each step sees the whole global batch: Lightning's DistributedSampler deals it to the dp ranks."""
    tokens, labels = batch(GLOBAL_BATCH)
    return DataLoader(TensorDataset(tokens, labels), batch_size=GLOBAL_BATCH // dp)


class HFLossCausalLM(CausalLM):
    """What a user writes under pp or cp: the Hugging Face model's own loss, from labels."""

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = self.model(input_ids=tokens, labels=labels).loss
        self.log("train_loss", loss, sync_dist=True)
        self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, labels = batch
        self.log("val_loss", self.model(input_ids=tokens, labels=labels).loss, sync_dist=True)


def hf_loss(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One process's: the Hugging Face loss, without the cache (which would make transformers attend across packed
    documents)."""
    return model(input_ids=tokens, labels=labels, use_cache=False).loss


def fit_against_one_process(
    strategy: AutoModelParallelStrategy,
    family: str,
    config: dict,
    *,
    dp: int,
    loss: Callable = hf_loss,
    stages: bool = False,
    callbacks: Sequence[L.Callback] = (),
) -> tuple[HFLossCausalLM, dict]:
    """3 AdamW steps of :class:`HFLossCausalLM` through Trainer.fit at ``dp`` data-parallel ranks match one process
    (see :func:`compare_training`), and validate's loss too. Every rank starts from other weights: rank 0's must
    win."""
    module = HFLossCausalLM(tiny_model(family, seed=dist.get_rank(), **config))
    fit = trainer(strategy, limit_val_batches=1, callbacks=list(callbacks))
    fit.fit(module, data(dp), data(dp))
    reference = tiny_model(family, **config)
    result = compare_training(module, reference, reference_run(reference, loss=loss), stages=stages)
    tokens, labels = batch(GLOBAL_BATCH)
    with torch.no_grad():
        expected = loss(reference, tokens, labels).item()
    result["validation_loss"] = abs(fit.callback_metrics["val_loss"].item() - expected) / expected
    assert result["validation_loss"] < FP32_TOLERANCE, result
    return module, result


def reference_run(
    model: torch.nn.Module,
    *,
    optimizers: Callable[[torch.nn.Module], list[torch.optim.Optimizer]] | None = None,
    clip: float | None = None,
    loss: Callable | None = None,
    data: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Losses and (unclipped) gradients of each single-process step over the whole batch (default: AdamW, the
    cross-entropy of ``parity.loss_of``, ``batch(GLOBAL_BATCH)``)."""
    tokens, labels = data if data is not None else batch(GLOBAL_BATCH)
    steppers = optimizers(model) if optimizers else [torch.optim.AdamW(model.parameters(), lr=LR)]
    loss = loss or (lambda model, tokens, labels: loss_of(model, tokens, labels)[0])
    losses, grads = [], []
    for _ in range(STEPS):
        value = loss(model, tokens, labels)
        for optimizer in steppers:
            optimizer.zero_grad()
        value.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for optimizer in steppers:
            optimizer.step()
        losses.append(value.item())
    return losses, grads


def compare_training(
    module: CausalLM, reference: torch.nn.Module, reference_steps: tuple[list, list], *, stages: bool = False
) -> dict:
    """Per-step losses and gradients, then the weights after the last step.

    AdamW all but ignores a gradient's scale, so a gradient off by a constant factor would pass the weight
    comparison: the gradients Lightning hands the optimizer are compared too, at every step. With ``stages``
    (pipeline parallel) each rank compares the parameters its stage holds, and the stages together must hold every
    one of the reference's (a tied embedding's copy on two stages).
    """
    reference_losses, reference_grads = reference_steps
    names = set(module.grads[0])
    assert all(grads.keys() == names for grads in module.grads), "the gradients' names changed between steps"
    held = [names]
    if stages:
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, names)
    expected = set(reference_grads[0])
    assert set().union(*held) == expected, f"gradients held for {set().union(*held) ^ expected} are wrong"
    steps = zip(module.grads, reference_grads, strict=True)
    grad_errors = [max(relative_error(grads[name], ref[name]) for name in names) for grads, ref in steps]
    errors = [abs(a - b) / abs(b) for a, b in zip(module.losses, reference_losses, strict=True)]
    weights = weight_error(module.model, reference)
    result = {
        "first_loss": errors[0],
        "later_losses": max(errors[1:]),
        "first_grads": grad_errors[0],
        "later_grads": max(grad_errors[1:]),
        "weights_after_3_steps": weights,
    }
    assert errors[0] < FP32_TOLERANCE and max(errors[1:]) < TRAINED_LOSS_TOLERANCE, result
    assert grad_errors[0] < FP32_TOLERANCE and max(grad_errors[1:]) < TRAINED_GRAD_TOLERANCE, result
    assert weights < WEIGHT_TOLERANCE, result
    return result


def check_trainer_parity(
    tp: int,
    sp: bool,
    activation_checkpointing: bool | str,
    family: str = "llama",
    cpu_offload: bool = False,
    dp_replicate: int = 1,
    ep: int = 1,
) -> dict:
    """3 AdamW steps through Trainer.fit match a single-process run, loss for loss and weight for weight."""
    strategy = AutoModelParallelStrategy(
        tp=tp,
        sp=sp,
        dp_replicate=dp_replicate,
        ep=ep,
        activation_checkpointing=activation_checkpointing,
        cpu_offload=cpu_offload,
    )
    module = CausalLM(tiny_model(family, seed=dist.get_rank()))  # rank 0's weights must win
    trainer(strategy).fit(module, data(dist.get_world_size() // tp))
    assert strategy.device_mesh["dp_replicate"].size() == dp_replicate
    assert_experts_distributed(module.model, ep=ep)
    offload = decoder_layers(module.model)[0]._get_fsdp_state()._fsdp_param_group.offload_policy
    assert isinstance(offload, CPUOffloadPolicy) == cpu_offload, offload
    reference = tiny_model(family)
    return compare_training(module, reference, reference_run(reference))


PARITY_KEYS = ("first_loss", "first_grads", "later_grads", "weights_after_3_steps", "validation_loss")


def parity_row(family: str, layout: str, ranks: list[dict]) -> str:
    """A sweep's table row of :func:`fit_against_one_process`'s errors, the worst rank's of each."""
    first_loss, first_grads, later_grads, weights, validation = (
        f"{max(rank[key] for rank in ranks):.1e}" for key in PARITY_KEYS
    )
    return f"| {family} | {layout} | {first_loss} | {first_grads} / {later_grads} | {weights} | {validation} |"


def check_checkpoint_resume_across_layouts(
    directory: str, resumes: list[tuple[dict, dict]], family: str = "gemma3", *, num_hidden_layers: int = 4
) -> dict:
    """Lightning checkpoints (default: Gemma 3, tied) saved after 2 steps at one layout and resumed at another, for
    each (saved at, resumed at) pair of strategy sizes: the remaining losses are those of the uninterrupted run."""

    def fit(sizes: dict, steps: int, ckpt_path: Path | None = None) -> tuple[HFLossCausalLM, L.Trainer]:
        module = HFLossCausalLM(tiny_model(family, seed=5 + dist.get_rank(), num_hidden_layers=num_hidden_layers))
        run = trainer(AutoModelParallelStrategy(**sizes), max_steps=steps)
        dp = dist.get_world_size() // sizes.get("pp", 1) // sizes.get("tp", 1) // sizes.get("cp", 1)
        run.fit(module, data(dp), ckpt_path=ckpt_path)
        return module, run

    whole, _ = fit({}, 4)
    result = {}
    for saved_at, resumed_at in resumes:
        checkpoint = Path(directory) / "-".join(["saved", *(f"{name}{size}" for name, size in saved_at.items())])
        if not checkpoint.exists():
            fit(saved_at, 2)[1].save_checkpoint(checkpoint)
        resumed, _ = fit(resumed_at, 4, ckpt_path=checkpoint)
        errors = [abs(a - b) / b for a, b in zip(resumed.losses, whole.losses[2:], strict=True)]
        result[f"{saved_at or 'whole'} resumed at {resumed_at or 'whole'}"] = max(errors)
    assert max(result.values()) < FP32_TOLERANCE, result
    return result


def assert_experts_distributed(model: torch.nn.Module, *, ep: int) -> None:
    """At ep > 1 every experts module holds 1/ep of its experts on this rank (before FSDP's own split)."""
    if ep == 1:
        return
    found = [module for _, module in experts_modules(model)]
    assert found, "no experts module"
    for module in found:
        for param in module.parameters(recurse=False):
            assert "ep" in param.device_mesh.mesh_dim_names, param.device_mesh
            ep_dim = param.device_mesh.mesh_dim_names.index("ep")
            assert param.placements[ep_dim] == Shard(0), param.placements


def check_meta_model_from_configure_model(tp: int, family: str = "llama") -> dict:
    """A model built on meta in configure_model is parallelized, initialised like HF, and trains in parity."""
    torch.manual_seed(7 + dist.get_rank())  # ranks disagree: every rank must take rank 0's random state
    module = MetaInitCausalLM(family)
    trainer(AutoModelParallelStrategy(tp=tp)).fit(module, data(dist.get_world_size() // tp))
    torch.manual_seed(7)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(tiny_config(family))
    reference.to_empty(device="cpu")
    reference.init_weights()
    return compare_training(module, reference, reference_run(reference))


def check_self_parallelized_module_left_alone() -> dict:
    module = SelfParallelizedCausalLM()
    trainer(AutoModelParallelStrategy(tp=1)).fit(module, data(dist.get_world_size()))
    layers = module.model.model.layers
    # parallelize() wrapped each layer once; a second pass would have failed or double-wrapped.
    assert all(isinstance(layer, FSDPModule) for layer in layers)
    reference = tiny_model()
    return compare_training(module, reference, reference_run(reference))


def check_bf16_trainer(
    tp: int,
    precision: str,
    family: str = "llama",
    ep: int = 1,
    cp: int = 1,
    compile: bool | dict = False,
    activation_checkpointing: bool | str = False,
) -> dict:
    """Trainer(precision="bf16-mixed") gives FSDP2 a bf16 policy with fp32 gradient reduction over fp32
    weights; "bf16-true" casts the weights to bf16 before sharding, except those the model pins to fp32 (Ernie's
    MoE router). Either run's losses must be as close to fp32 as a single-process bf16 run's (twice its error at
    most: see parity.within_bf16_noise). At cp > 1 the step returns the model's own loss, and the losses must be
    within that noise of the same run's with the sequences whole (cp=1, the ranks data-parallel). ``compile`` and
    ``activation_checkpointing``: the strategy's options."""
    module = (HFLossCausalLM if cp > 1 else CausalLM)(tiny_model(family))
    strategy = AutoModelParallelStrategy(
        tp=tp, ep=ep, cp=cp, compile=compile, activation_checkpointing=activation_checkpointing
    )
    trainer(strategy, precision=precision).fit(module, data(dist.get_world_size() // tp // cp))
    assert_experts_distributed(module.model, ep=ep)
    pinned = {id(t) for _, _, t in pinned_to_fp32(module.model, fp32_pinned_names(module.model))}
    if precision == "bf16-mixed":
        policy = decoder_layers(module.model)[0]._get_fsdp_state()._mp_policy
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32), policy
    else:
        dtypes = {p.dtype for p in module.model.parameters() if id(p) not in pinned}
        assert dtypes == {torch.bfloat16}, dtypes
    assert {p.dtype for p in module.model.parameters() if id(p) in pinned} <= {torch.float32}
    loss = hf_loss if cp > 1 else None
    reference_losses, _ = reference_run(tiny_model(family), loss=loss)
    bf16_reference = tiny_model(family)
    with keep_pinned_fp32(bf16_reference, fp32_pinned_names(bf16_reference)):
        bf16_reference.to(torch.bfloat16)
    bf16_losses, _ = reference_run(bf16_reference, loss=loss)
    noise = max(abs(a - b) / b for a, b in zip(bf16_losses, reference_losses, strict=True))
    if cp > 1:
        whole = HFLossCausalLM(tiny_model(family))
        trainer(AutoModelParallelStrategy(tp=tp, ep=ep), precision=precision).fit(
            whole, data(dist.get_world_size() // tp)
        )
        reference_losses, bound = whole.losses, noise
    else:
        bound = 2 * noise + 1e-3
    error = max(abs(a - b) / b for a, b in zip(module.losses, reference_losses, strict=True))
    assert error <= bound, (error, noise)
    return {"loss_error": error, "single_process_bf16_loss_vs_fp32": noise, "pinned_fp32": len(pinned)}


class RankProbe(CausalLM):
    """Logs its data-parallel rank with a summing sync_dist, and records the batches it was dealt."""

    def training_step(self, batch, batch_idx):
        dp_rank = dist.get_rank() // self.trainer.strategy.parallel_dims.tp  # tp is the innermost axis
        self.log("dp_rank_sum", float(dp_rank), sync_dist=True, reduce_fx="sum")
        self.seen_tokens = batch[0].tolist()
        self.loss_parallel_active = _loss_parallel_active()
        return super().training_step(batch, batch_idx)


def check_data_parallel_wiring(tp: int) -> dict:
    """Sampler replicas and sync_dist reductions span the data-parallel ranks only; TP peers see one batch."""
    strategy = AutoModelParallelStrategy(tp=tp)
    module = RankProbe()
    dp = dist.get_world_size() // tp
    fit = trainer(strategy, max_steps=1)
    fit.fit(module, data(dp))
    sampler = strategy.distributed_sampler_kwargs
    assert sampler == {"num_replicas": dp, "rank": dist.get_rank() // tp}, sampler
    # Each rank logs its dp rank; over the dp ranks the sum is 0 + 1 + ..., a world-wide sum counts it tp times.
    assert fit.callback_metrics["dp_rank_sum"].item() == sum(range(dp)), fit.callback_metrics
    assert module.loss_parallel_active and not _loss_parallel_active(), "loss_parallel must span the stage only"
    metrics = fit.validate(module, data(dp), verbose=False)  # after fit: loss_parallel entered again
    val_loss = metrics[0]["val_loss"]
    for name in ("val_loss", "val_loss_unsynced"):
        assert not isinstance(fit.callback_metrics[name], DTensor), f"logged {name} must be a plain tensor"
    return {"tokens": module.seen_tokens, "val_loss": val_loss}


def _loss_parallel_active() -> bool:
    from torch.distributed.tensor import DTensor

    return torch.ops.aten.nll_loss_forward.default in DTensor._op_dispatcher._custom_op_handlers


def check_invalid_size_raises_everywhere() -> str:
    """tp that does not divide the world raises the same ValueError on every rank, before any collective."""
    try:
        trainer(AutoModelParallelStrategy(tp=3)).fit(CausalLM(), data(1))
    except ValueError as error:
        return str(error)
    raise AssertionError("tp=3 on 2 ranks did not raise")


def check_verify_plans_refuses_a_wrong_plan_everywhere() -> str:
    """verify_plans=True with a plan that trains Phi3 wrong: the same ValueError on every rank, before parallelize
    (in the worker's process group, verify_plan runs in a child process)."""
    strategy = AutoModelParallelStrategy(tp=2, verify_plans=True, tp_plan="parity.naive_fused_plan")
    module = CausalLM(tiny_model("phi3"))
    try:
        trainer(strategy).fit(module, data(1))
    except ValueError as error:
        assert "The user plan trains Phi3ForCausalLM wrong at tp=2" in str(error), error
        assert not any(isinstance(p, DTensor) for p in module.parameters()), "refused after parallelize"
        return str(error).splitlines()[0]
    raise AssertionError("verify_plans did not refuse a plan that trains wrong")


def check_verify_plans_failing_on_one_rank_stops_every_rank() -> str:
    """A verification that fails on one rank only (its child process killed): every rank raises, none is left
    waiting in parallelize's first collective."""
    import lightning_automodel.strategy.auto_model_parallel as strategy_module

    verify_plan = strategy_module.verify_plan

    def killed_on_rank_1(*args, **kwargs):
        if dist.get_rank() == 1:
            raise RuntimeError("verify_plan's child process failed: Killed")
        return verify_plan(*args, **kwargs)

    strategy_module.verify_plan = killed_on_rank_1
    try:
        trainer(AutoModelParallelStrategy(tp=2, verify_plans=True)).fit(CausalLM(tiny_model("granite")), data(1))
    except (RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    finally:
        strategy_module.verify_plan = verify_plan
    raise AssertionError("a verification failing on rank 1 did not stop training")


def check_no_hf_model_is_an_error() -> str:
    class NoModel(CausalLM):
        def __init__(self) -> None:
            super().__init__(model=torch.nn.Linear(4, 4))

    try:
        trainer(AutoModelParallelStrategy()).fit(NoModel(), data(dist.get_world_size()))
    except TypeError as error:
        assert "found no Hugging Face model" in str(error), error
        return str(error)
    raise AssertionError("a module without a Hugging Face model did not raise")


def check_trainer_gradient_clipping(
    tp: int, sp: bool, build: Callable[[], torch.nn.Module] = tiny_model, lr: float = 10.0
) -> dict:
    """Trainer(gradient_clip_val=...) clips by the global norm over every mesh (of the model ``build`` makes).

    With SGD each weight update is lr times the clipped gradient, so a norm off by a factor (1 + e) makes every
    update off by e: the updates are compared relative to their size (AdamW would hide a wrong norm). A large lr
    keeps the updates far above fp32 rounding of the weights, and a small enough one keeps the steps from
    amplifying rounding (LoRA's product B @ A reacts to both factors' steps at once).
    """
    module = CausalLM(build(), optimizer=torch.optim.SGD, lr=lr)
    strategy = AutoModelParallelStrategy(tp=tp, sp=sp)
    clipping = dict(gradient_clip_val=0.1, gradient_clip_algorithm="norm")
    trainer(strategy, **clipping).fit(module, data(dist.get_world_size() // tp))
    initial, reference = build(), build()
    result = compare_training(
        module,
        reference,
        reference_run(reference, optimizers=lambda m: [torch.optim.SGD(m.parameters(), lr=lr)], clip=0.1),
    )
    start = dict(initial.named_parameters())
    final = dict(reference.named_parameters())
    updates = {name: final[name] - start[name] for name in final}
    differences = [(full(p) - final[name]).abs().max() for name, p in module.model.named_parameters()]
    # Relative to the largest update: a wrong norm scales every update alike, rounding does not.
    result["update"] = (max(differences) / max(u.abs().max() for u in updates.values())).item()
    assert result["update"] < 1e-4, result
    return result


def check_gradient_accumulation(tp: int) -> dict:
    """accumulate_grad_batches=2 over half batches gives the gradients of the whole batch, and FSDP
    reduce-scatters once per optimizer step, not once per micro-batch."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp_group  # to count reductions

    calls = []
    reduce = fsdp_group.foreach_reduce

    def counting_reduce(*args, **kwargs):
        calls.append(1)
        return reduce(*args, **kwargs)

    module = CausalLM()
    dp = dist.get_world_size() // tp
    tokens, labels = batch(GLOBAL_BATCH)
    half_batches = DataLoader(TensorDataset(tokens, labels), batch_size=GLOBAL_BATCH // dp // 2)
    fsdp_group.foreach_reduce = counting_reduce
    try:
        trainer(AutoModelParallelStrategy(tp=tp), accumulate_grad_batches=2).fit(module, half_batches)
    finally:
        fsdp_group.foreach_reduce = reduce
    units = sum(isinstance(m, FSDPModule) for m in module.model.modules())
    assert len(calls) == STEPS * units, f"{len(calls)} reduce-scatters for {STEPS} steps of {units} FSDP units"
    micro_losses = zip(module.losses[::2], module.losses[1::2], strict=True)
    module.losses = [(first + second) / 2 for first, second in micro_losses]  # the whole batch's mean
    reference = tiny_model()
    return compare_training(module, reference, reference_run(reference))


class ManualCausalLM(CausalLM):
    """Manual optimization with an LR scheduler: manual_backward must run inside the stage's loss_parallel."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        tokens, labels = batch
        loss, _ = loss_of(self.model, tokens, labels)
        self.losses.append(self.trainer.strategy.reduce(loss.detach()).item())
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()  # Lightning calls on_before_optimizer_step, which records the gradients
        scheduler.step()

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0]).logits  # vocab-sharded under tp: handed back as a plain tensor


def check_manual_optimization_and_predict(tp: int) -> dict:
    """Manual optimization with a halving LR matches a single process; predict after fit returns full logits."""
    module = ManualCausalLM()
    fit = trainer(AutoModelParallelStrategy(tp=tp))
    fit.fit(module, data(dist.get_world_size() // tp))
    reference = tiny_model()
    tokens, labels = batch(GLOBAL_BATCH)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    losses, grads = [], []
    for _ in range(STEPS):
        loss, _ = loss_of(reference, tokens, labels)
        optimizer.zero_grad()
        loss.backward()
        grads.append({name: p.grad.clone() for name, p in reference.named_parameters()})
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    result = compare_training(module, reference, (losses, grads))
    predictions = fit.predict(module, DataLoader(TensorDataset(tokens[:2]), batch_size=2))
    assert not isinstance(predictions[0], DTensor), "predict must hand back plain tensors"
    result["predicted_logits"] = relative_error(predictions[0], reference(tokens[:2]).logits)
    assert result["predicted_logits"] < FP32_TOLERANCE, result
    return result


def check_validate_then_fit(pp: int, **strategy_options: object) -> int:
    """trainer.validate, then trainer.fit of the same module: an FSDP2 unit that keeps its weights gathered after
    forward (the root, without pp) comes out of validate gathered, its gathered parameters registered in place of the
    sharded ones; the optimizer fit builds must step the sharded ones all the same (the strategy moves the model to
    its device first, where FSDP2 reshards every unit; without that move, the embedding's gathered weight was handed
    to the optimizer): every parameter it holds is a DTensor, and every weight moves."""
    module = HFLossCausalLM(tiny_model(num_hidden_layers=4))
    initial = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    dp = dist.get_world_size() // pp
    strategy = AutoModelParallelStrategy(pp=pp, **strategy_options)
    trainer(strategy, limit_val_batches=1).validate(module, data(dp), verbose=False)
    fitting = trainer(AutoModelParallelStrategy(pp=pp, **strategy_options))
    fitting.fit(module, data(dp))
    stepped = [p for group in fitting.optimizers[0].param_groups for p in group["params"]]
    assert all(isinstance(p, DTensor) for p in stepped), [type(p).__name__ for p in stepped]
    unchanged = [name for name, p in module.model.named_parameters() if torch.equal(full(p), initial[name])]
    assert not unchanged, unchanged
    return len(stepped)
