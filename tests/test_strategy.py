"""AutoModelParallelStrategy driven by a real Trainer: 3 AdamW steps against a single process, and the wiring."""

import subprocess
import sys
from functools import partial

import lightning as L
import pytest
import torch
from lightning_checks import (
    check_data_parallel_wiring,
    check_gradient_accumulation,
    check_invalid_size_raises_everywhere,
    check_manual_optimization_and_predict,
    check_meta_model_from_configure_model,
    check_no_hf_model_is_an_error,
    check_self_parallelized_module_left_alone,
    check_validate_then_fit,
    check_verify_plans_failing_on_one_rank_stops_every_rank,
    check_verify_plans_refuses_a_wrong_plan_everywhere,
)

import lightning_automodel
from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.parallel.float8 import Float8Options
from lightning_automodel.parallel.fsdp.precision import mixed_precision_policy
from lightning_automodel.parallel.options import ParallelOptions
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.trainer_checks import (
    check_bf16_trainer,
    check_trainer_gradient_clipping,
    check_trainer_parity,
)

AC = (False, True)


def test_trainer_on_two_ranks():
    """tp=2, tp=2 with sp (with and without activation checkpointing) and dp_shard=2; then the wiring. Ranks spawned
    as launchers start them (each its own interpreter and hash seed), unlike the other tests' forked ones."""
    checks = [partial(check_trainer_parity, 2, True, ac) for ac in AC]
    checks += [partial(check_trainer_parity, tp, False, False) for tp in (2, 1)]
    checks += [
        partial(check_trainer_parity, 2, True, False, "llama", True),  # CPU offload, on a CPU-only machine too
        partial(check_meta_model_from_configure_model, 2),
        check_self_parallelized_module_left_alone,
        partial(check_bf16_trainer, 2, "bf16-mixed"),
        partial(check_bf16_trainer, 2, "bf16-true"),
        # FSDP2 casts a layer's inputs in a profiler mark in its recomputation only (torch 2.13): selective
        # checkpointing raised on the mark before its marks passed by (parallel/activation_checkpointing.py).
        partial(check_bf16_trainer, 1, "bf16-mixed", activation_checkpointing="selective"),
        partial(check_gradient_accumulation, 1),
        partial(check_gradient_accumulation, 2),
        partial(check_manual_optimization_and_predict, 2),
        check_no_hf_model_is_an_error,
        partial(check_validate_then_fit, 1),
        check_invalid_size_raises_everywhere,
    ]
    results = run_checks(2, checks, fresh_interpreters=True)
    for message in results["check_invalid_size_raises_everywhere()"]:
        assert "tp=3" in message and "valid tp sizes are [1, 2]" in message


@pytest.mark.sweep  # 28 s of child processes; verify_plan's own refusals: tests/test_verify.py
def test_verify_plans_on_two_ranks():
    """The strategy's ``verify_plans``: a wrong plan refused alike on every rank; a rank whose verification fails
    stops every rank."""
    checks = [
        check_verify_plans_refuses_a_wrong_plan_everywhere,
        check_verify_plans_failing_on_one_rank_stops_every_rank,
    ]
    results = run_checks(2, checks, fresh_interpreters=True)
    refusals = results["check_verify_plans_refuses_a_wrong_plan_everywhere()"]
    assert refusals[0] == refusals[1], refusals
    rank0, rank1 = results["check_verify_plans_failing_on_one_rank_stops_every_rank()"]
    assert rank0.startswith("ValueError: verify_plans: verifying the plan of GraniteForCausalLM failed on rank 1")
    assert rank1 == "RuntimeError: verify_plan's child process failed: Killed", rank1


def test_trainer_on_four_ranks():
    """tp=2 x dp_shard=2 with and without activation checkpointing (and with sp); sampler and metric wiring."""
    checks = [partial(check_trainer_parity, 2, False, ac) for ac in AC]
    checks += [partial(check_trainer_parity, 2, True, True), partial(check_data_parallel_wiring, 2)]
    checks += [partial(check_trainer_parity, 2, True, mode) for mode in ("selective", "submodule")]
    checks += [partial(check_trainer_gradient_clipping, 2, sp) for sp in (False, True)]
    results = run_checks(4, checks)
    wiring = results["check_data_parallel_wiring(2)"]
    assert len({r["val_loss"] for r in wiring}) == 1, "every rank must report the same validation loss"
    tokens = [r["tokens"] for r in wiring]
    assert tokens[0] == tokens[1] and tokens[2] == tokens[3], "tensor-parallel peers must read the same batch"
    assert tokens[0] != tokens[2], "data-parallel ranks must read different batches"


def test_registered_as_automodel():
    trainer = L.Trainer(strategy="automodel", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, AutoModelParallelStrategy)


def test_constructible_from_lightning_cli():
    from lightning.pytorch.cli import LightningCLI

    cli = LightningCLI(
        L.LightningModule,
        run=False,
        args=[
            "--trainer.accelerator=cpu",
            "--trainer.devices=4",
            "--trainer.logger=false",
            "--trainer.strategy=lightning_automodel.AutoModelParallelStrategy",
            "--trainer.strategy.tp=2",
            "--trainer.strategy.sp=true",
            "--trainer.strategy.activation_checkpointing=true",
        ],
    )
    strategy = cli.trainer.strategy
    assert isinstance(strategy, AutoModelParallelStrategy)
    options = strategy.options
    assert (options.dims.tp, options.parallel.sp, options.parallel.activation_checkpointing) == (2, True, "full")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(cp=2, pp=2, pp_loss_fn=len), "pp_loss_fn with cp=2: the loss function shifts"),
        (dict(pp=2, pp_schedule="Bogus"), "pp_schedule='Bogus'"),
        (dict(pp=2, pp_schedule="Interleaved1F1B"), "set pp_stages_per_rank=2"),
        (dict(pp=2, pp_stages_per_rank=2), "needs a schedule that runs several stages per rank"),
        (dict(pp=2, pp_schedule="ZBVZeroBubble", pp_stages_per_rank=2), "in a V"),
        (dict(pp=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=0), "must be a positive integer"),
        (dict(pp=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2, pp_microbatches=5), "2 rounds of equal"),
        (dict(pp=2, pp_schedule="PipelineScheduleSingle"), "a base class of torch's schedules"),
        (dict(pp=2, pp_schedule="PipelineScheduleMulti"), "a base class of torch's schedules"),
        (dict(pp=4, pp_microbatches=2), "at least as many micro-batches as stages"),
        (dict(pp=2, pp_layers_per_stage=[1, 1, 1]), "one per stage"),
        (dict(sp=True), "it needs tp > 1"),
        (dict(activation_checkpointing="everything"), "activation_checkpointing='everything': use False"),
        (dict(tp=0), "tp=0 is invalid"),
        (dict(forward_prefetch=-1), "gathered ahead (0 or more)"),
        (dict(backward_prefetch=0), "behind (1 or more"),
        (dict(async_save=True, save_distributed_checkpoint=False), "async_save=True writes sharded checkpoints"),
        (dict(save_trainable_only=True, save_distributed_checkpoint=False), "save_trainable_only=True writes sharded"),
    ],
)
def test_unsupported_options_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError) as error:
        AutoModelParallelStrategy(**kwargs)
    assert message in str(error.value)


def test_the_help_without_sources_summarizes_the_arguments(monkeypatch):
    """Where the sources are not shipped (a pyc-only install), the options fields' docstrings cannot be read: the
    constructor's docstring is its summary alone, so that the package still imports."""
    from lightning_automodel.strategy import argument_docs

    def no_source(obj):
        raise OSError("could not get source code")

    def init(self, tp: int | None = None, sp: bool | None = None) -> None: ...

    argument_docs.field_docs.cache_clear()  # the fields' docstrings read again, without sources
    monkeypatch.setattr(argument_docs.inspect, "getsource", no_source)
    assert argument_docs.with_argument_docs(init) is init
    assert (
        init.__doc__ == "The strategy's options, built from its arguments and checked before any process group exists."
    )
    monkeypatch.undo()
    assert "\nArgs:\n    tp: " in argument_docs.with_argument_docs(init).__doc__  # with sources: described


def test_the_options_hold_one_form_of_each_setting():
    """activation_checkpointing and float8 are read once, where the arguments arrive (the strategy's, parallelize's
    keywords), and held in one form: the mode's name, Float8Options or None; ParallelOptions refuses another."""
    for given, mode in [(True, "full"), (False, "off"), (None, "off"), ("off", "off"), ("selective", "selective")]:
        options = AutoModelParallelStrategy(activation_checkpointing=given).options
        assert options.parallel.activation_checkpointing == mode, given
    search = AutoModelParallelStrategy(layout="auto", activation_checkpointing=True, gpu_memory=8).options.search
    assert search.checkpointing == "full"
    assert AutoModelParallelStrategy(float8=True).options.parallel.float8 == Float8Options()
    assert AutoModelParallelStrategy().options.parallel.float8 is None
    keywords = ParallelOptions.from_keywords(activation_checkpointing=True, float8={"recipe": "rowwise"})
    assert keywords == ParallelOptions(activation_checkpointing="full", float8=Float8Options(recipe="rowwise"))
    with pytest.raises(ValueError, match="ParallelOptions holds one of off, selective, submodule, full"):
        ParallelOptions(activation_checkpointing=True)
    with pytest.raises(ValueError, match="ParallelOptions holds Float8Options or None"):
        ParallelOptions(float8=True)


@pytest.mark.parametrize(
    ("precision", "param_dtype"),
    [("32-true", None), ("bf16-true", None), ("16-true", None), ("bf16-mixed", torch.bfloat16)],
)
def test_precision_flags_map_to_a_policy(precision, param_dtype):
    policy = mixed_precision_policy(precision)
    if param_dtype is None:
        assert policy is None  # "-true" flags cast the weights; FSDP computes in their dtype
    else:
        assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, torch.float32)


@pytest.mark.parametrize(
    ("precision", "advice"),
    [
        ("16-mixed", "Use precision='bf16-mixed'"),
        ("64-true", "Use precision='32-true'"),
        ("transformer-engine", "Use one of '32-true', 'bf16-mixed', 'bf16-true', '16-true'"),
    ],
)
def test_other_precision_flags_are_refused_with_advice(precision, advice):
    with pytest.raises(ValueError, match=f"does not support precision='{precision}'") as error:
        mixed_precision_policy(precision)
    assert advice in str(error.value)


def test_public_api():
    """Every public name resolves (imported on first use); importing the planner's part of the package imports
    neither Lightning nor the checkpoint I/O, which its child processes do not need."""
    assert set(lightning_automodel.__all__) >= {"AutoModelParallelStrategy", "ParallelDims", "parallelize"}
    assert sorted(lightning_automodel._HOME_OF) == sorted(lightning_automodel.__all__)
    for name in lightning_automodel.__all__:
        assert getattr(lightning_automodel, name).__name__ == name
    code = (
        "import sys, lightning_automodel.planning.search.workers; print(sorted(m for m in sys.modules"
        " if m.split('.')[0] == 'lightning' or m.startswith('lightning_automodel.io')))"
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert found.strip() == "[]", found
