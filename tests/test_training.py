"""Lightning's training features under tp x dp, HSDP and HSDP x TP, each against a single process; the eight-rank
launch also runs the pipeline's pp x tp x dp_shard layout, pp x cp x tp with sp, and HSDP x cp; the sweep every axis
above one at once (32 ranks)."""

from functools import partial

import pytest
from context_parallel_checks import check_rows_split_over_pp_and_cp

from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.trainer_checks import (
    check_bf16_trainer,
    check_context_parallel_trainer_parity,
    check_pipeline_trainer_parity,
    check_trainer_parity,
)
from lightning_automodel.testing.training_checks import (
    check_evaluation_without_fit,
    check_param_groups,
    check_refused_precision,
    check_token_normalised_loss,
    check_two_optimizers,
)


def test_training_features_on_two_ranks():
    """dp=2 token-normalised loss; param groups, two optimizers and evaluation without fit at tp=2; a model
    with its router pinned to fp32 under bf16-true and bf16-mixed; a refused precision."""
    checks = [
        partial(check_token_normalised_loss, 1),
        partial(check_param_groups, 2),
        partial(check_two_optimizers, 2),
        partial(check_evaluation_without_fit, 2),
        check_refused_precision,
    ]
    checks += [partial(check_bf16_trainer, 1, precision, "ernie_moe") for precision in ("bf16-true", "bf16-mixed")]
    results = run_checks(2, checks)
    for message in results["check_refused_precision()"]:
        assert "precision='16-mixed'" in message and "Use precision='bf16-mixed'" in message


def test_four_ranks_hsdp_and_uneven_tokens():
    """HSDP (dp_replicate=2 x dp_shard=2) through Trainer.fit; token-normalised loss at tp=2 x dp=2."""
    run_checks(
        4, [partial(check_trainer_parity, 1, False, False, dp_replicate=2), partial(check_token_normalised_loss, 2)]
    )


@pytest.mark.sweep  # tests/test_pipeline.py runs pp x cp and pp x tp x sp on four ranks, HSDP x tp elsewhere
def test_eight_ranks_hsdp_times_tp_pipeline_and_context():
    """dp_replicate=2 x dp_shard=2 x tp=2 with sequence parallel; the pipeline's layouts of 8: pp=2 x tp=2 x dp_shard=2
    with sp (1F1B, 4 micro-batches) and pp=2 x cp=2 x tp=2 with sp (Gemma 3); HSDP x cp: dp_replicate=2 x
    dp_shard=2 x cp=2; in one launch of 8 processes."""
    checks = [
        partial(check_trainer_parity, 2, True, False, dp_replicate=2),
        partial(check_pipeline_trainer_parity, 2, "1F1B", microbatches=4, tp=2, sp=True),
        partial(check_pipeline_trainer_parity, 2, "1F1B", "gemma3", microbatches=2, cp=2, tp=2, sp=True),
        partial(check_context_parallel_trainer_parity, 2, dp_replicate=2),
    ]
    run_checks(8, checks, timeout=500, pg_timeout=120)


@pytest.mark.sweep
def test_pipeline_context_and_tensor_parallel_calls_on_eight_ranks():
    """pp=2 x cp=2 x tp=2 with sp: Llama's call on rows padded and packed each their own way (their lengths padded
    inside the call to a multiple of 2 cp x tp, so that each stage's share splits over tp)."""
    run_checks(8, [partial(check_rows_split_over_pp_and_cp, "llama", pp=2, tp=2, sp=True)], timeout=500)


@pytest.mark.sweep
def test_every_axis_at_once_on_32_ranks():
    """pp=2 x dp_replicate=2 x dp_shard=2 x cp=2 x tp=2 with sp (32 processes), through the Trainer against one
    process: Llama under 1F1B and Gemma 3 (tied embeddings, a sliding layer) under Interleaved1F1B with two stages
    per rank."""
    every_axis = dict(microbatches=2, dp_replicate=2, cp=2, tp=2, sp=True)
    checks = [
        partial(check_pipeline_trainer_parity, 2, "1F1B", **every_axis),
        partial(check_pipeline_trainer_parity, 2, "Interleaved1F1B", "gemma3", stages_per_rank=2, **every_axis),
    ]
    results = run_checks(32, checks, timeout=1500, pg_timeout=600)
    for check, per_rank in results.items():
        print(check, {name: max(result[name] for result in per_rank) for name in per_rank[0]})
