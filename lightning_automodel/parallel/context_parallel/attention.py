"""Context-parallel attention, a function of transformers' attention registry that every family calls from its own
attention code: this rank's queries against every rank's keys and values (all-gathered over cp) under a mask in global
positions; flex attention over a block mask on GPUs, SDPA over a dense bias elsewhere. torch's ``context_parallel()``
handles neither CPU nor Hugging Face's masks (sliding windows, packed documents, padding)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import AuxRequest, flex_attention
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from lightning_automodel.parallel.context_parallel.sequence_split import SequenceSplit

ATTENTION = "lightning_automodel_cp"  # the name of the attention function in transformers' registry
CPAttention = Literal["auto", "flex", "sdpa"]  # the attention kernel under cp; "auto": flex on GPUs, SDPA elsewhere


def attention_kernel(attention: CPAttention, device_type: str) -> str:
    """The kernel ``attention`` names on ``device_type``: "flex" or "sdpa"."""
    if attention not in ("auto", "flex", "sdpa"):
        raise ValueError(f"cp_attention={attention!r}: use 'auto' (flex on GPUs, SDPA elsewhere), 'flex' or 'sdpa'.")
    if attention == "auto":
        return "sdpa" if device_type == "cpu" else "flex"
    return attention


def context_parallel_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    sequence_split: SequenceSplit | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Attention of this rank's queries over every rank's keys (transformers' attention-function signature:
    [B, heads, S, D] in, [B, S, heads, D] out). Soft-capped logits (``softcap``, Gemma 2) and attention sinks
    (``s_aux``, GPT-OSS: a logit per head that takes a share of the softmax and gives nothing) are computed as
    transformers' eager attention computes them. The kernel is the split's: flex attention over a block mask, or
    SDPA over a dense bias (and always under attention dropout, which flex attention lacks)."""
    if sequence_split is None:
        raise RuntimeError(
            f"{type(module).__name__} ran context-parallel attention without the call's sequence split: its model"
            " does not hand the call's keyword arguments to its attention, which cp needs."
        )
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    sinks = sinks.to_local() if isinstance(sinks, DTensor) else sinks
    if sequence_split.kernel == "flex" and not dropout:
        output = _flex_attention(
            query,
            key,
            value,
            sequence_split,
            scaling=scaling,
            sliding_window=sliding_window,
            softcap=softcap,
            sinks=sinks,
        )
        return output.transpose(1, 2).contiguous(), None
    keys, values = sequence_split.gather(key), sequence_split.gather(value)
    bias = sequence_split.bias(sliding_window, like=query)
    if query.device.type != "cpu" and query.size(1) != keys.size(1):  # as transformers: GQA with a mask on CUDA
        groups = query.size(1) // keys.size(1)  # would fall back to SDPA's math kernel: expand the KV heads instead
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    if softcap is None and sinks is None:
        output = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=bias,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=query.size(1) != keys.size(1),
        )
    else:
        output = _eager_attention(
            query, keys, values, bias, scaling=scaling, softcap=softcap, sinks=sinks, dropout=dropout
        )
    return output.transpose(1, 2).contiguous(), None


def _flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    split: SequenceSplit,
    *,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """Flex attention over the split's block mask ([B, heads, S / cp, D] out): soft-capping as a score modification;
    sinks from the softmax's log-normalizer (a sink logit s leaves each output the share 1 / (1 + exp(s - lse)) =
    sigmoid(lse - s) of its value, exactly as a sink column in the softmax does)."""
    if query.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise ValueError(
            "cp_attention='flex' cannot train on CPU: torch has no flex-attention backward there. Use"
            " cp_attention='sdpa' (the default on CPU) to train; flex attention serves evaluation on CPU."
        )
    keys, values = split.gather(key), split.gather(value)
    score_mod = None if softcap is None else (lambda score, b, h, q, k: torch.tanh(score / softcap) * softcap)
    output = _flex_kernel(query.device.type)(
        query,
        keys,
        values,
        score_mod=score_mod,
        block_mask=split.block_mask(sliding_window, like=query),
        scale=scaling,
        enable_gqa=query.size(1) != keys.size(1),
        return_aux=AuxRequest(lse=True) if sinks is not None else None,
    )
    if sinks is None:
        return output
    output, aux = output
    kept = torch.sigmoid(aux.lse - sinks.to(aux.lse.dtype).reshape(1, -1, 1))
    return output * kept.unsqueeze(-1).to(output.dtype)


@functools.cache
def _flex_kernel(device_type: str) -> Callable[..., Any]:
    """Flex attention compiled into a fused kernel, except on CPU (where it only evaluates, and compiling costs more
    than it saves): uncompiled it computes the whole score matrix."""
    return flex_attention if device_type == "cpu" else torch.compile(flex_attention)


def _eager_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    bias: Tensor,
    *,
    scaling: float | None,
    softcap: float | None,
    sinks: Tensor | None,
    dropout: float,
) -> Tensor:
    """Attention with its logits soft-capped (tanh, before the mask) and a sink logit per head appended to every
    row's softmax, as transformers' eager attention of Gemma 2 and GPT-OSS computes them."""
    groups = query.size(1) // keys.size(1)
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = query @ keys.transpose(2, 3) * (scaling if scaling is not None else query.size(-1) ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + bias
    if sinks is not None:
        sink = sinks.reshape(1, -1, 1, 1).expand(scores.size(0), -1, scores.size(2), 1)
        scores = torch.cat([scores, sink.to(scores.dtype)], dim=-1)
    probabilities = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    if sinks is not None:
        probabilities = probabilities[..., :-1]
    return F.dropout(probabilities, p=dropout) @ values if dropout else probabilities @ values


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask transformers would build: none (the attention builds its own from the whole batch)."""
    return None


AttentionInterface.register(ATTENTION, context_parallel_attention)
AttentionMaskInterface.register(ATTENTION, _no_mask)


def text_model_only(model: nn.Module, implementation: str) -> str | dict[str, str]:
    """transformers' attention setting that gives ``implementation`` to ``model``'s text model alone: a multimodal
    model's vision tower encodes whole images and keeps its own attention."""
    config = model.config
    text = config.get_text_config()
    for key in getattr(config, "sub_configs", {}):
        if getattr(config, key, None) is text:
            return {key: implementation}
    return implementation
