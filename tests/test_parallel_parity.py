"""parallelize() against a single process: loss, logits and every gradient, for each layout (one launch per world)."""

from functools import partial

import pytest
from plan_checks import check_frozen_stays_frozen, check_tied_embeddings, check_user_plan

from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.parallelize_checks import (
    check_bf16_layout,
    check_clip_grad_norm,
    check_fsdp_schedule,
    check_layout,
)

AC = (False, True)


def test_world_of_two():
    """tp=2, tp=2 with sp, dp_shard=2; each with and without activation checkpointing; bf16 with tp+sp."""
    checks = [partial(check_layout, tp, sp, ac) for tp, sp in ((2, False), (2, True), (1, False)) for ac in AC]
    checks.append(partial(check_bf16_layout, 2, True))
    checks += [
        partial(check, sp) for check in (check_tied_embeddings, check_frozen_stays_frozen) for sp in (False, True)
    ]
    checks += [partial(check_user_plan, spec) for spec in ("dict", "dict path", "function path", "function")]
    checks += [partial(check_clip_grad_norm, 2, sp) for sp in (False, True)]
    checks += [partial(check_layout, 2, True, mode) for mode in ("selective", "submodule")]
    checks += [partial(check_fsdp_schedule, *options) for options in ((None, 0, 1), (True, 2, 2), (False, 1, 3))]
    run_checks(2, checks)


def test_world_of_four():
    """tp=2 x dp_shard=2, with and without sp; bf16; HSDP with and without tp. Checkpointing at this layout: the
    sweep below (every mode: at world 2 here, and through the Trainer at world 4 in tests/test_strategy.py)."""
    checks = [partial(check_layout, 2, sp, False) for sp in (False, True)]
    checks.append(partial(check_bf16_layout, 2, False))
    checks += [partial(check_layout, 1, False, False, 2), partial(check_layout, 2, True, False, 2)]
    checks.append(partial(check_clip_grad_norm, 2, True))
    run_checks(4, checks)


@pytest.mark.sweep
def test_world_of_four_with_activation_checkpointing():
    """tp=2 x dp_shard=2, with and without sp, full checkpointing; with sp, selective and submodule."""
    checks = [partial(check_layout, 2, sp, True) for sp in (False, True)]
    checks += [partial(check_layout, 2, True, mode) for mode in ("selective", "submodule")]
    run_checks(4, checks)
