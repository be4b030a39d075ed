"""Trainer(precision=...) flags as FSDP2 mixed-precision policies, and the flags refused with what to use instead."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

# Trainer(precision=...) flags and the FSDP2 MixedPrecisionPolicy each maps to ("-true" flags cast the weights
# instead, and FSDP computes in their dtype); what is missing is refused by ``mixed_precision_policy``.
_PRECISION_POLICIES: dict[str, MixedPrecisionPolicy | None] = {
    "32-true": None,
    "bf16-mixed": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16-true": None,
    "16-true": None,
}


_PRECISION_ADVICE = {
    "16-mixed": "fp16 mixed precision needs loss scaling, which FSDP2's sharded gradients do not get here. Use"
    " precision='bf16-mixed' (fp32 weights, bf16 compute, no scaling needed), or '16-true' to train in fp16.",
    "64-true": "FSDP2 and tensor parallel are not meant for fp64 training. Use precision='32-true'.",
}


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy | None:
    """The FSDP2 policy for a ``Trainer(precision=...)`` flag; an unsupported flag is an error that says what to use."""
    if precision not in _PRECISION_POLICIES:
        advice = _PRECISION_ADVICE.get(precision, f"Use one of {', '.join(map(repr, _PRECISION_POLICIES))}.")
        raise ValueError(f"AutoModelParallelStrategy does not support precision={precision!r}. {advice}")
    return _PRECISION_POLICIES[precision]
