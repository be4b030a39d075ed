"""Models with parameters of several dtypes, sharded by fully_shard_by_dtype (one launch of two ranks)."""

from functools import partial

from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.mixed_dtype_checks import (
    check_bf16_model_with_fp32_router,
    check_float64_router_training,
    check_stock_fsdp_refuses_mixed_dtypes,
)


def test_mixed_dtype_models_on_two_ranks():
    checks = [check_stock_fsdp_refuses_mixed_dtypes, check_float64_router_training]
    checks += [partial(check_bf16_model_with_fp32_router, mixed) for mixed in (False, True)]
    results = run_checks(2, checks)
    for name, values in results.items():
        print(name, values[0])
