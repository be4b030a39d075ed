"""Context parallel (``cp``): every sequence split over cp ranks, attention over all of it (Llama 3's way).

Each rank keeps its share of a sequence's tokens through every layer; only attention needs the others', and it
gathers them: each rank keeps its queries, all-gathers keys and values over cp (cheap under grouped KV heads), and
masks in global token positions. The gather's backward sums every rank's gradient into the keys' and values'
owner. The sequence is cut into 2 cp chunks and rank i holds chunks i and 2 cp - 1 - i, so that under the causal
mask every rank's queries see as many keys: equal work for a kernel that skips masked blocks, flex attention over a
block mask (on GPUs: torch has no flex-attention backward on CPU). The portable kernel, SDPA over a dense bias of the
rank's queries against every key, computes S / cp x S scores on every rank and its bias is quadratic in the row.

torch's ``context_parallel()`` handles only the flash, efficient and cuDNN SDPA kernels (nothing on CPU) and no
masks of Hugging Face's (sliding windows, packed documents, padding). The attention here is a function of
transformers' attention registry (``AttentionInterface``), which every modern family calls with its own
projections, rotary embeddings and per-layer settings (``sliding_window``): the model's own attention code path.
Its mask is built from the whole batch, which every rank of a cp group holds: positions in the sequence (causal,
sliding windows), documents (packed rows: a document starts where the position ids do not continue) and padding
(a key the attention mask hides). A query never sees less than itself (a padding query's row is never empty).

The model's call takes the whole batch, as without cp (``self.model(input_ids=..., labels=...)``), and splits it
(:class:`ContextParallelModel`): labels are shifted for next-token prediction before the split, position ids are
the global ones, and rows are padded on the right to a multiple of 2 cp tokens (ignored by the loss, and never seen
by an earlier token). The loss is this rank's share of the global batch's token mean, as under pp.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from lightning_automodel.hf.shrink import shrunk_config
from lightning_automodel.parallel.loss import global_token_mean, next_token_targets, token_hits, token_loss_sum
from lightning_automodel.parallel.mesh import axis_size
from lightning_automodel.parallel.model_calls import (
    ParallelCausalLMOutput,
    own_forward,
    take_over_calls,
    taken_over,
    training_call,
)

ATTENTION = "lightning_automodel_cp"  # the name of the attention function in transformers' registry
CPAttention = Literal["auto", "flex", "sdpa"]  # the attention kernel under cp; "auto": flex on GPUs, SDPA elsewhere


def attention_kernel(attention: CPAttention, device_type: str) -> str:
    """The kernel ``attention`` names on ``device_type``: "flex" or "sdpa"."""
    if attention not in ("auto", "flex", "sdpa"):
        raise ValueError(f"cp_attention={attention!r}: use 'auto' (flex on GPUs, SDPA elsewhere), 'flex' or 'sdpa'.")
    if attention == "auto":
        return "sdpa" if device_type == "cpu" else "flex"
    return attention


def token_indices(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> Tensor:
    """The positions in a sequence of ``seq_len`` (a multiple of 2 ``cp``) that cp rank ``rank`` holds: chunks
    ``rank`` and ``2 cp - 1 - rank`` of 2 cp."""
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)]).to(device)


def documents(position_ids: Tensor) -> Tensor:
    """Each token's document in its row: a new one starts wherever the position ids do not continue the previous
    token's (packed rows restart them)."""
    starts = torch.ones_like(position_ids, dtype=torch.long)
    starts[:, 1:] = (position_ids[:, 1:] != position_ids[:, :-1] + 1).long()
    return starts.cumsum(-1)


class SequenceSplit:
    """How a batch's sequences are split over a cp group, for the attention of the queries this rank holds against
    the keys of every rank (gathered in rank order). ``group``: the cp ranks; None simulates the split in one
    process (the queries and keys are then the same tokens). A plain class, not a dataclass: FSDP's mixed-precision
    input cast copies dataclasses it finds in a layer's arguments, which would give every layer a cache of its own."""

    def __init__(
        self,
        *,
        query_index: Tensor,
        key_index: Tensor,
        query_document: Tensor,
        key_document: Tensor,
        key_visible: Tensor,
        group: dist.ProcessGroup | None,
        kernel: str = "sdpa",
    ) -> None:
        self.query_index = query_index  # [S / cp] positions of this rank's tokens in the sequence
        self.key_index = key_index  # [S] positions of the gathered keys
        self.query_document = query_document  # [B, S / cp]
        self.key_document = key_document  # [B, S]
        self.key_visible = key_visible  # [B, S] False where the attention mask hides a key (padding)
        self.group = group
        self.kernel = kernel
        self._masks: dict[tuple, Tensor | BlockMask] = {}

    def bias(self, sliding_window: int | None, like: Tensor) -> Tensor:
        """:meth:`mask` as an additive bias (0 or the lowest value of ``like``'s dtype, on its device), made once per
        call and window for every layer: SDPA would otherwise turn each layer's boolean mask into a bias of its own,
        which autograd keeps for backward, layer after layer ([B, 1, S / cp, S] each)."""
        key = ("bias", sliding_window, like.dtype, like.device)
        if key not in self._masks:
            allowed = self.mask(sliding_window).to(like.device)
            bias = torch.zeros(allowed.shape, dtype=like.dtype, device=like.device)
            self._masks[key] = bias.masked_fill_(~allowed, torch.finfo(like.dtype).min)
        return self._masks[key]

    def block_mask(self, sliding_window: int | None, like: Tensor) -> BlockMask:
        """:meth:`allows` as flex attention's block mask (on ``like``'s device), made once per call and window: the
        kernel skips the blocks it hides, and nothing quadratic in the row is stored."""
        key = ("block", sliding_window, like.device)
        if key not in self._masks:
            batch, queries, keys = self.query_document.size(0), self.query_index.numel(), self.key_index.numel()
            self._masks[key] = create_block_mask(
                lambda b, h, query, key: self.allows(b, query, key, sliding_window),
                batch,
                None,
                queries,
                keys,
                device=like.device,
                _compile=like.device.type != "cpu",  # chunked, never the whole [B, S / cp, S] mask at once
            )
        return self._masks[key]

    def mask(self, sliding_window: int | None) -> Tensor:
        """[B, 1, S / cp, S]: :meth:`allows` for every query and key."""
        batch = torch.arange(self.query_document.size(0), device=self.query_index.device)[:, None, None]
        query = torch.arange(self.query_index.numel(), device=self.query_index.device)[None, :, None]
        key = torch.arange(self.key_index.numel(), device=self.query_index.device)[None, None, :]
        return self.allows(batch, query, key, sliding_window)[:, None]

    def allows(self, batch: Tensor, query: Tensor, key: Tensor, sliding_window: int | None) -> Tensor:
        """Whether the query at ``query`` (of this rank's) of row ``batch`` attends to the gathered key at ``key``
        (indices, broadcast together), Hugging Face's conventions: causal, a sliding window of ``sliding_window``
        tokens including the query's own, within one document, visible keys."""
        query_position, key_position = self.query_index[query], self.key_index[key]
        allowed = key_position <= query_position
        if sliding_window is not None:
            allowed = allowed & (key_position > query_position - sliding_window)
        allowed = allowed & (self.query_document[batch, query] == self.key_document[batch, key])
        return (allowed & self.key_visible[batch, key]) | (key_position == query_position)

    def gather(self, tensor: Tensor) -> Tensor:
        """Keys or values [B, heads, S / cp, D] of every cp rank, concatenated in rank order along the sequence."""
        if self.group is None:
            return tensor
        gathered = funcol.all_gather_single_autograd(tensor.transpose(0, 2).contiguous(), 0, self.group)
        return funcol.wait_tensor(gathered).transpose(0, 2)


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


class ContextParallel:
    """A model's context-parallel split: the cp group, and what a call needs to split its batch."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, *, attention: CPAttention = "auto") -> None:
        self.model = model
        self.mesh = mesh
        self.cp = axis_size(mesh, "cp")
        self.group = mesh["cp"].get_group()
        self.rank = mesh["cp"].get_local_rank()
        self.kernel = attention_kernel(attention, mesh.device_type)

    def run(
        self,
        input_ids: Tensor,
        *,
        labels: Tensor | None,
        attention_mask: Tensor | None,
        position_ids: Tensor | None,
        **inputs: Any,
    ) -> ParallelCausalLMOutput:
        """The model's call on this rank's share of the batch; with labels, the loss (this rank's share of the
        global token mean) and the totals of this rank's tokens. The logits are this rank's tokens' (in the order of
        :func:`token_indices`)."""
        training_call(
            self.model,
            labels,
            why="Under context parallel (cp > 1) each rank computes the logits of its share of every sequence only",
        )
        self._check_same_rows(input_ids)
        length = input_ids.size(1)
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand(input_ids.size(0), -1)
        visible = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        targets = next_token_targets(labels) if labels is not None else None
        extra = -length % (2 * self.cp)
        if extra:  # padding on the right, at the last position: nothing attends to it, and the loss ignores it
            input_ids, visible = F.pad(input_ids, (0, extra)), F.pad(visible, (0, extra), value=False)
            position_ids = torch.cat([position_ids, position_ids[:, -1:].expand(-1, extra)], dim=1)
            targets = F.pad(targets, (0, extra), value=-100) if targets is not None else None
        split = self.split(position_ids, visible, length + extra)
        index = split.query_index
        outputs = own_forward(self.model, ContextParallelModel)(
            input_ids=input_ids[:, index],
            position_ids=position_ids[:, index],
            sequence_split=split,
            **{**inputs, "use_cache": False},  # a cache of this rank's keys and values would serve nothing
        )
        if targets is None:
            return ParallelCausalLMOutput(logits=outputs.logits)
        return self._with_loss(outputs.logits, targets[:, index])

    def _check_same_rows(self, input_ids: Tensor) -> None:
        """The ranks of a cp group split the same rows (the sampler deals them by dp rank): rows of other shapes would
        gather mismatched keys, other tokens would be attended to as if they were these. One small all-reduce."""
        if is_fake(input_ids):  # a memory estimate (planning/activation_memory.py): rows without values to compare
            return
        summary = torch.tensor([*input_ids.shape, int(input_ids.sum())], device=input_ids.device)
        extremes = torch.cat([summary, -summary])
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.group)
        if not torch.equal(extremes[:3], -extremes[3:]):
            raise ValueError(
                f"cp rank {self.rank} was given other rows than its cp peers (shape {tuple(input_ids.shape)}): every"
                " rank of a cp group must call the model with the same batch, as Lightning's sampler deals it by"
                " data-parallel rank. A sampler or data module of your own must deal by dp rank, not by global rank."
            )

    def split(self, position_ids: Tensor, visible: Tensor, length: int) -> SequenceSplit:
        """The split of a batch of ``length`` tokens a row (a multiple of 2 cp)."""
        held = [token_indices(length, self.cp, rank, position_ids.device) for rank in range(self.cp)]
        query_index, key_index = held[self.rank], torch.cat(held)
        document = documents(position_ids)
        return SequenceSplit(
            query_index=query_index,
            key_index=key_index,
            query_document=document[:, query_index],
            key_document=document[:, key_index],
            key_visible=visible[:, key_index],
            group=self.group,
            kernel=self.kernel,
        )

    def _with_loss(self, logits: Tensor, targets: Tensor) -> ParallelCausalLMOutput:
        loss_sum, tokens = token_loss_sum(logits, targets)
        hits, _ = token_hits(logits, targets)
        loss = global_token_mean(loss_sum, tokens, self.mesh)
        plain_sum = (loss_sum.to_local() if isinstance(loss_sum, DTensor) else loss_sum).detach()  # tp: replicated
        return ParallelCausalLMOutput(loss=loss, logits=logits, loss_sum=plain_sum, num_tokens=tokens, num_hits=hits)


# A split of whole rows of token ids only: no cache (named cache since transformers 5.24), no embeddings.
REFUSED_INPUTS = ("cache", "past_key_values", "cache_position", "inputs_embeds")


class ContextParallelModel(nn.Module):
    """The forward of a context-parallel model (see :func:`take_over_calls`): it splits the batch it is called with
    over the cp ranks."""

    context: ContextParallel

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("Under context parallel (cp > 1) the model trains and evaluates; generate with cp=1.")

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        *args: Any,
        labels: Tensor | None = None,
        **inputs: Any,
    ) -> ParallelCausalLMOutput:
        given = {name: value for name, value in inputs.items() if value is not None}
        refused = [name for name in REFUSED_INPUTS if name in given] + (
            ["return_dict=False"] if given.get("return_dict") is False else []
        )
        if args or input_ids is None or refused:
            raise ValueError(
                "Under context parallel (cp > 1) the model's call splits whole rows over the cp ranks: it takes"
                " input_ids, labels, a 2D attention_mask and position_ids as keywords (got"
                f" {len(args)} more positional arguments{'' if input_ids is not None else ', no input_ids'}"
                f"{', ' + ', '.join(refused) if refused else ''}); no cache, no generation: generate with cp=1."
            )
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"Under context parallel (cp > 1) the attention mask marks each token of the rows: shape"
                f" {tuple(input_ids.shape)}, as input_ids (got {tuple(attention_mask.shape)})."
            )
        return self.context.run(
            input_ids, labels=labels, attention_mask=attention_mask, position_ids=position_ids, **given
        )


def check_cp_with_pp(*, cp: int, pp: int) -> None:
    """Context parallel does not compose with pipeline parallel yet: refused."""
    if cp > 1 and pp > 1:
        raise ValueError(f"cp={cp} with pp={pp}: context parallel does not compose with pipeline parallel yet.")


def context_parallel_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot split its sequences over cp ranks (None if it can), found without any collective: a
    shrunk replica of it (random weights, in this process) must compute the same logits on its tokens in the order
    of a cp=2 split, through the attention here, as whole. A model whose attention does not run through
    transformers' attention functions (linear attention, state-space layers) or that derives positions from where
    a token sits rather than from ``position_ids`` computes others, and is refused."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return f"{type(model).__name__} is not a Hugging Face model; context parallel splits those only"
    if getattr(model.config, "is_encoder_decoder", False):
        return f"{type(model).__name__} is an encoder-decoder model; context parallel splits decoder-only models"
    if getattr(model.config, "output_router_logits", False):
        return (
            f"{type(model).__name__} adds its experts' load-balancing loss (output_router_logits=True), which would be"
            " over this rank's tokens only: set output_router_logits=False"
        )
    try:
        error = _split_error(model)
    except Exception as failure:  # noqa: BLE001 - the model's own code, whatever it raises, refuses the split
        return (
            f"{type(model).__name__} fails with its sequences split, on a shrunk replica"
            f" ({type(failure).__name__}: {failure})"
        )
    if not error < 1e-5:
        return (
            f"{type(model).__name__} computes other logits with its sequences split than whole (relative error"
            f" {error:.2g} on a shrunk replica): its attention does not run through transformers' attention"
            " functions (linear attention, state-space layers), or its positions are not read from position_ids"
        )
    return None


def _split_error(model: nn.Module, *, cp: int = 2, length: int = 16) -> float:
    """The largest difference of a shrunk replica's logits computed on its tokens reordered as ``cp`` ranks hold
    them (all of them one rank's queries and keys, so no collective) and whole, relative to the largest logit."""
    config = shrunk_config(model.config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        whole = type(model)(config).eval()
        tokens = torch.randint(0, config.vocab_size, (2, length))
    order = torch.cat([token_indices(length, cp, rank) for rank in range(cp)])
    positions = torch.arange(length).expand(2, -1)
    split = SequenceSplit(
        query_index=order,
        key_index=order,
        query_document=torch.ones(2, length, dtype=torch.long),
        key_document=torch.ones(2, length, dtype=torch.long),
        key_visible=torch.ones(2, length, dtype=torch.bool),
        group=None,
    )
    with torch.no_grad():
        expected = whole(input_ids=tokens, use_cache=False).logits
        whole.set_attn_implementation(ATTENTION)
        reordered = whole(
            input_ids=tokens[:, order], position_ids=positions[:, order], sequence_split=split, use_cache=False
        ).logits
    actual = torch.empty_like(reordered)
    actual[:, order] = reordered
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def context_parallel_model(model: nn.Module, mesh: DeviceMesh, *, attention: CPAttention = "auto") -> ContextParallel:
    """Make ``model``'s calls split their batch over the cp ranks of ``mesh``, its attention gather the rest (with the
    kernel ``attention`` names)."""
    model.set_attn_implementation(ATTENTION)
    context = ContextParallel(model, mesh, attention=attention)
    take_over_calls(model, ContextParallelModel, prefix="ContextParallel", context=context)
    return context


def context_parallel_of(model: nn.Module) -> ContextParallel | None:
    """The context-parallel split of a model :func:`context_parallel_model` made (a PEFT model's base), or None."""
    return taken_over(model, ContextParallelModel, "context")


__all__ = [
    "ATTENTION",
    "CPAttention",
    "ContextParallel",
    "ContextParallelModel",
    "SequenceSplit",
    "attention_kernel",
    "context_parallel_attention",
    "context_parallel_model",
    "context_parallel_of",
    "check_cp_with_pp",
    "context_parallel_problem",
    "documents",
    "token_indices",
]
