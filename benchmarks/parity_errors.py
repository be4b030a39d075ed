"""Print the errors every parity check measures, layout by layout: the numbers behind the test tolerances.

    .venv/bin/python benchmarks/parity_errors.py      # about 4 minutes on 2 CPU cores (gloo, 2, 4 and 8 processes)

Each line is one check of lightning_automodel.testing (parallelize_checks, trainer_checks, mixed_dtype_checks,
training_checks) and its errors against a single-process run of the same model (relative to the largest reference
value, except weights: absolute).
"""

import json
from functools import partial

from lightning_automodel.testing import mixed_dtype_checks, parallelize_checks, trainer_checks, training_checks
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.models import FAMILIES

LAYOUTS_2 = ((2, False), (2, True), (1, False))  # (tp, sp) on 2 ranks; dp_shard takes the rest
AC = (False, True)


def world_of_two() -> list:
    checks = [partial(parallelize_checks.check_layout, tp, sp, ac) for tp, sp in LAYOUTS_2 for ac in AC]
    checks += [
        partial(parallelize_checks.check_bf16_layout, 2, True),
        partial(parallelize_checks.check_clip_grad_norm, 2, True),
    ]
    checks += [partial(trainer_checks.check_trainer_parity, tp, sp, ac) for tp, sp in LAYOUTS_2 for ac in AC]
    checks += [partial(parallelize_checks.check_family, family, sp) for family in FAMILIES for sp in (False, True)]
    checks += [
        partial(trainer_checks.check_trainer_parity, 2, sp, False, family)
        for family in FAMILIES
        for sp in (False, True)
    ]
    checks.append(partial(parallelize_checks.check_family, "granite", False))
    checks.append(partial(trainer_checks.check_trainer_parity, 2, False, False, "granite"))
    checks += [partial(trainer_checks.check_bf16_trainer, 2, precision) for precision in ("bf16-mixed", "bf16-true")]
    checks += [mixed_dtype_checks.check_float64_router_training]
    checks += [partial(mixed_dtype_checks.check_bf16_model_with_fp32_router, policy) for policy in (False, True)]
    checks += [partial(trainer_checks.check_bf16_trainer, 1, p, "ernie_moe") for p in ("bf16-mixed", "bf16-true")]
    checks += [partial(training_checks.check_token_normalised_loss, 1), partial(training_checks.check_param_groups, 2)]
    checks += [
        partial(training_checks.check_two_optimizers, 2),
        partial(training_checks.check_evaluation_without_fit, 2),
    ]
    checks += [partial(parallelize_checks.check_fsdp_schedule, *options) for options in ((None, 0, 1), (True, 2, 2))]
    return checks


def world_of_four() -> list:
    checks = [partial(parallelize_checks.check_layout, 2, sp, ac) for sp in (False, True) for ac in AC]
    checks += [partial(parallelize_checks.check_bf16_layout, 2, False)]
    checks += [
        partial(parallelize_checks.check_layout, 1, False, False, 2),
        partial(parallelize_checks.check_layout, 2, True, False, 2),
    ]
    checks += [partial(trainer_checks.check_trainer_parity, 2, sp, ac) for sp in (False, True) for ac in AC]
    checks += [partial(trainer_checks.check_trainer_gradient_clipping, 2, sp) for sp in (False, True)]
    checks += [partial(trainer_checks.check_trainer_parity, 1, False, False, dp_replicate=2)]
    checks += [partial(training_checks.check_token_normalised_loss, 2)]
    return checks


def world_of_eight() -> list:
    return [partial(trainer_checks.check_trainer_parity, 2, True, False, dp_replicate=2)]


def main() -> None:
    for world_size, checks in ((2, world_of_two()), (4, world_of_four()), (8, world_of_eight())):
        for name, per_rank in run_checks(world_size, checks, timeout=1200).items():
            errors = {key: float(f"{value:.2e}") for key, value in per_rank[0].items()}
            print(f"world {world_size}  {name}  {json.dumps(errors)}")


if __name__ == "__main__":
    main()
