"""Training through a real Trainer against one process, at every parallelism (see
:mod:`lightning_automodel.testing.trainer_parity`): tensor, data and expert parallel in fp32 and bf16, gradient
clipping, context parallel, pipeline parallel and compiled blocks. The suite runs these at a few layouts; the sweeps in
scripts/ at many.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import lightning as L
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.fsdp import CPUOffloadPolicy

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.parallel import decoder_layers
from lightning_automodel.parallel.context_parallel import context_parallel_of
from lightning_automodel.parallel.fsdp.dtypes import keep_pinned_fp32, pinned_to_fp32
from lightning_automodel.parallel.loss import causal_lm_loss_sum, next_token_targets
from lightning_automodel.parallel.parallelizer import fp32_pinned_names
from lightning_automodel.parallel.pipeline import pipeline_of
from lightning_automodel.testing.models import SHRUNK, tiny_model
from lightning_automodel.testing.parity import full
from lightning_automodel.testing.trainer_parity import (
    CausalLM,
    HFLossCausalLM,
    assert_experts_distributed,
    compare_training,
    data,
    fit_against_one_process,
    hf_loss,
    reference_run,
    trainer,
)

CONTEXT_PARALLEL_LAYERS = 2
PIPELINE_LAYERS = 4  # two per stage at pp=2, one per stage at pp=4
COMPILED_LAYERS = 4  # two per stage at pp=2


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


def check_context_parallel_trainer_parity(
    cp: int,
    family: str = "llama",
    *,
    tp: int = 1,
    sp: bool = False,
    dp_replicate: int = 1,
    activation_checkpointing: bool = False,
    config: dict | None = None,
) -> dict:
    """3 AdamW steps through Trainer.fit with every sequence split over ``cp`` ranks (dp_shard takes the rest) match
    one process on the whole batch; validate's loss too."""
    strategy = AutoModelParallelStrategy(
        tp, sp=sp, cp=cp, dp_replicate=dp_replicate, activation_checkpointing=activation_checkpointing
    )
    layers = (
        {} if family in SHRUNK else dict(num_hidden_layers=CONTEXT_PARALLEL_LAYERS)
    )  # the coverage report's configs: as they are
    config = dict(config or {}, **layers)
    module, result = fit_against_one_process(strategy, family, config, dp=dist.get_world_size() // cp // tp)
    assert context_parallel_of(module.model) is not None and strategy.device_mesh["cp"].size() == cp
    return result


def z_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A loss of one's own (``pp_loss_fn``): next-token cross-entropy plus PaLM's z-loss (the squared log-partition,
    weighted 0.1 here to weigh in), summed over the scored tokens."""
    scored = next_token_targets(labels) != -100
    loss_sum, _ = causal_lm_loss_sum(logits, labels)
    return loss_sum + 0.1 * (logits.float().logsumexp(-1)[scored] ** 2).sum()


def z_loss(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """:func:`z_loss_sum` as one process computes it: a token mean."""
    return z_loss_sum(model(input_ids=tokens).logits, labels) / (next_token_targets(labels) != -100).sum()


def check_pipeline_trainer_parity(
    pp: int,
    schedule: str,
    family: str = "llama",
    *,
    microbatches: int | None = None,
    dp_replicate: int = 1,
    activation_checkpointing: bool = False,
    tp: int = 1,
    sp: bool = False,
    ep: int = 1,
    cp: int = 1,
    stages_per_rank: int = 1,
    config: dict | None = None,
    own_loss: bool = False,
    cpu_offload: bool = False,
) -> dict:
    """3 AdamW steps through Trainer.fit at pp ranks of ``stages_per_rank`` stages (dp_shard takes the rest) match one
    process; validate's loss too. The weights every rank starts from differ: rank 0's must win. ``config``: overrides
    of the family's tiny config; ``own_loss``: the strategy's pp_loss_fn is :func:`z_loss_sum`; ``cp``: every
    sequence split over cp ranks before the schedule; ``cpu_offload``: FSDP2's CPU offload of the stages' weights."""
    config = dict(config or {}, num_hidden_layers=PIPELINE_LAYERS)
    strategy = AutoModelParallelStrategy(
        tp,
        sp=sp,
        pp=pp,
        pp_schedule=schedule,
        pp_microbatches=microbatches,
        pp_stages_per_rank=stages_per_rank,
        pp_loss_fn=z_loss_sum if own_loss else None,
        dp_replicate=dp_replicate,
        ep=ep,
        cp=cp,
        activation_checkpointing=activation_checkpointing,
        cpu_offload=cpu_offload,
    )
    module, result = fit_against_one_process(
        strategy,
        family,
        config,
        dp=dist.get_world_size() // pp // tp // cp,
        loss=z_loss if own_loss else hf_loss,
        stages=True,
    )
    pipeline = pipeline_of(module.model)
    assert pipeline is not None and pipeline.pp == pp and len(pipeline.stage_modules()) == stages_per_rank
    assert (context_parallel_of(module.model) is not None) == (cp > 1)
    offload = decoder_layers(module.model)[0]._get_fsdp_state()._fsdp_param_group.offload_policy
    assert isinstance(offload, CPUOffloadPolicy) == cpu_offload, offload
    assert_experts_distributed(module.model, ep=ep)
    return result


class GraphsAndTimes(L.Callback):
    """After each training step: how many graphs dynamo has compiled in this process, and the step's seconds."""

    def __init__(self) -> None:
        self.graphs: list[int] = []
        self.seconds: list[float] = []

    def on_train_batch_start(self, *args: object) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, *args: object) -> None:
        self.seconds.append(time.perf_counter() - self.start)
        self.graphs.append(counters["stats"]["unique_graphs"])

    def summary(self, training: int | None, evaluation: int | None) -> dict:
        """The first step compiles ``training`` graphs, the validation after it ``evaluation`` more (grad mode is one
        of dynamo's guards), later steps none. None: any number but none after the validation (a block with graph
        breaks compiles a graph per piece)."""
        assert self.graphs[0] > 0 and self.graphs[1] == self.graphs[2], self.graphs
        if training is not None:
            assert self.graphs == [training, *[training + evaluation] * 2], self.graphs
        return {"graphs": self.graphs[-1], "first_step_s": self.seconds[0], "later_step_s": max(self.seconds[1:])}


def check_compiled_trainer_parity(
    family: str = "llama", *, tp: int = 1, backend: str = "inductor", exact_graphs: bool = True, **options: object
) -> dict:
    """3 AdamW steps and a validation through Trainer.fit with every decoder block compiled match the eager model in
    one process. The blocks share one graph a grad mode (context parallel: two, the first block building the call's
    attention mask, the others finding it); ``exact_graphs=False``: any number, none after the first validation. The
    steps' seconds. ``backend``: torch.compile's ("aot_eager": dynamo and AOTAutograd as inductor runs them, without
    inductor's code generation, which costs most of a compile on CPU)."""
    fresh_dynamo()
    strategy = AutoModelParallelStrategy(tp, compile={"backend": backend}, **options)
    dims = strategy.options.dims
    recorded = GraphsAndTimes()
    _, result = fit_against_one_process(
        strategy,
        family,
        dict(num_hidden_layers=COMPILED_LAYERS),
        dp=dist.get_world_size() // tp // dims.cp // dims.pp,
        callbacks=[recorded],
        stages=dims.pp > 1,
    )
    blocks_graphs = 2 if options.get("cp", 1) > 1 else 1  # cp: the first block builds the call's attention mask
    expected = blocks_graphs if exact_graphs else None
    return result | recorded.summary(training=expected, evaluation=expected)


def fresh_dynamo() -> None:
    """Forget what earlier checks in this process compiled: dynamo's recompile limit (8) counts the graphs of a code
    object over the process, and every check's blocks run the same forward."""
    torch._dynamo.reset()
    counters.clear()
