"""Checks that drive a real Lightning Trainer inside gloo workers (see lightning_automodel.testing.trainer_parity)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from resume_checks import fit_on_one_device, two_groups
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

from lightning_automodel import AutoModelParallelStrategy, parallelize
from lightning_automodel.testing.models import batch, tiny_config, tiny_model
from lightning_automodel.testing.parity import (
    FP32_TOLERANCE,
    LR,
    STEPS,
    full,
    loss_of,
    relative_error,
)
from lightning_automodel.testing.trainer_parity import (
    GLOBAL_BATCH,
    CausalLM,
    HFLossCausalLM,
    compare_training,
    data,
    reference_run,
    trainer,
)


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


def check_checkpoint_resume_across_layouts(
    directory: str, resumes: list[tuple[dict | None, dict]], family: str = "gemma3", *, num_hidden_layers: int = 4
) -> dict:
    """Lightning checkpoints (default: Gemma 3, tied) saved after 2 steps at one layout (None: Lightning's single file
    from one device) and resumed at another, for each (saved at, resumed at) pair of strategy sizes: the remaining
    losses are those of the uninterrupted run. AdamW in two param groups, as CausalLMModule's."""

    def module(seed: int) -> HFLossCausalLM:
        return HFLossCausalLM(tiny_model(family, seed=seed, num_hidden_layers=num_hidden_layers), optimizer=two_groups)

    def fit(sizes: dict, steps: int, ckpt_path: Path | None = None) -> tuple[HFLossCausalLM, L.Trainer]:
        resumed = module(5 + dist.get_rank())
        run = trainer(AutoModelParallelStrategy(**sizes), max_steps=steps)
        dp = dist.get_world_size() // sizes.get("pp", 1) // sizes.get("tp", 1) // sizes.get("cp", 1)
        run.fit(resumed, data(dp), ckpt_path=ckpt_path)
        return resumed, run

    whole, _ = fit({}, 4)
    result = {}
    for saved_at, resumed_at in resumes:
        name = ["one-device"] if saved_at is None else (f"{name}{size}" for name, size in saved_at.items())
        checkpoint = Path(directory) / "-".join(["saved", *name])
        if saved_at is None and not checkpoint.exists():
            fit_on_one_device(module(5), 2, save=checkpoint)
        elif not checkpoint.exists():
            fit(saved_at, 2)[1].save_checkpoint(checkpoint)
        resumed, _ = fit(resumed_at, 4, ckpt_path=checkpoint)
        errors = [abs(a - b) / b for a, b in zip(resumed.losses, whole.losses[2:], strict=True)]
        result[f"{saved_at if saved_at is not None else 'one device'} resumed at {resumed_at or 'whole'}"] = max(errors)
    assert max(result.values()) < FP32_TOLERANCE, result
    return result


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


class RankProbe(CausalLM):
    """Logs its data-parallel rank with a summing sync_dist, and records the batches it was dealt."""

    def training_step(self, batch, batch_idx):
        dp_rank = dist.get_rank() // self.trainer.strategy.options.dims.tp  # tp is the innermost axis
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
    strategy = AutoModelParallelStrategy(tp=2, verify_plans=True, tp_plan="plan_checks.naive_fused_plan")
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
    import lightning_automodel.strategy.plan_verification as strategy_module

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
