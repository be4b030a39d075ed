"""The attention kernel the estimate counts: a GPU's fused SDPA kernel, with attention dropout too.

The estimate's step runs on fake CPU tensors, where SDPA takes CPU's flash kernel only without attention dropout: with
dropout it falls back to its math path, which keeps the [heads, S, S] scores, their softmax and dropout's mask for
backward. A GPU's flash and memory-efficient kernels keep none of them: they save the output and the softmax's
log-sum-exp, and draw the same dropout mask again in backward from the RNG state they saved (two scalars). Measured on
a GPT-2-shaped model (1,024 wide, 16 heads, 2,048 tokens, bf16): 86 MB a layer without dropout, 0.83 GiB with 0.1 on
the math path. So the step's SDPA calls run with dropout 0: CPU's flash kernel, which holds what the GPU's holds with
dropout or without. A model's own eager attention (``attn_implementation="eager"``) keeps its scores on a GPU too, and
is counted as it runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import wraps

import torch.nn.functional as F

ASSUMED_KERNEL = "SDPA's fused kernel (flash or memory-efficient, as on a GPU): neither scores nor dropout's mask kept"

_DROPOUT_ARGUMENT = 4  # scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, ...)


@contextmanager
def fused_attention() -> Iterator[None]:
    """SDPA called without attention dropout while the step runs, so that CPU takes the fused kernel a GPU takes with
    dropout. The function itself is replaced: a torch function mode, the hook torch offers, is not active where
    backward recomputes a checkpointed layer (its mode stack is empty there), and the recomputed layer would then
    take the math path its forward did not."""
    sdpa = F.scaled_dot_product_attention

    @wraps(sdpa)
    def without_dropout(*args, **kwargs):
        if len(args) > _DROPOUT_ARGUMENT:
            args = (*args[:_DROPOUT_ARGUMENT], 0.0, *args[_DROPOUT_ARGUMENT + 1 :])
        return sdpa(*args, **{**kwargs, "dropout_p": 0.0} if "dropout_p" in kwargs else kwargs)

    F.scaled_dot_product_attention = without_dropout
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa
