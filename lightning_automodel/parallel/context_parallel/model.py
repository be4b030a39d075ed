"""A model made context parallel: its call takes the whole batch, as without cp, and runs this rank's share of every
sequence. Labels are shifted for next-token prediction before the split, position ids are the global ones, and rows
are padded on the right to a multiple of 2 cp tokens (ignored by the loss, never seen by an earlier token); the loss
is this rank's share of the global batch's token mean, as under pp. A pipelined model (pp > 1) is split once, before
its schedule: the stages hand each other this rank's share of the hidden states, and each micro-batch's stages get
the split of its rows."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_automodel.hf.vision.mrope import is_mrope, text_positions, whole_row_positions
from lightning_automodel.parallel.context_parallel.attention import (
    ATTENTION,
    CPAttention,
    attention_kernel,
    text_model_only,
)
from lightning_automodel.parallel.context_parallel.images import (
    IMAGE_INPUTS,
    TOKEN_INPUTS,
    has_images,
    held_image_arguments,
    token_blocks,
)
from lightning_automodel.parallel.context_parallel.sequence_split import SequenceSplit, documents, token_indices
from lightning_automodel.parallel.experts.load_balancing_loss import balancing_of, load_balancing_loss
from lightning_automodel.parallel.loss import (
    data_parallel_group,
    global_token_mean,
    next_token_targets,
    token_hits,
    token_loss_sum,
)
from lightning_automodel.parallel.mesh import axis_size
from lightning_automodel.parallel.model_calls import (
    ParallelCausalLMOutput,
    own_forward,
    take_over_calls,
    taken_over,
    training_call,
)
from lightning_automodel.parallel.pipeline import PipelineOptions, pipeline_of
from lightning_automodel.parallel.pipeline.calls import refuse_unknown_inputs


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
        :func:`token_indices`; under pp on the last stage only, when not training)."""
        training_call(
            self.model,
            labels,
            why="Under context parallel (cp > 1) each rank computes the logits of its share of every sequence only",
        )
        self._check_same_rows(input_ids)
        images = {name: inputs.pop(name) for name in IMAGE_INPUTS if inputs.get(name) is not None}
        tokens = {name: inputs.pop(name) for name in TOKEN_INPUTS if inputs.get(name) is not None}
        if has_images(images) and position_ids is None and is_mrope(self.model.config):
            position_ids = whole_row_positions(self.model, input_ids, images=images, tokens=tokens)
        split, held, targets = self._split_rows(input_ids, labels, attention_mask, position_ids, tokens, images)
        token_mask = split.query_visible
        if (pipeline := pipeline_of(self.model)) is not None:
            refuse_unknown_inputs({**inputs, **images, **tokens})
            rows_split = lambda rows, first: {"sequence_split": split.rows(rows)}  # noqa: E731 - a micro-batch's rows
            return pipeline.run(**held, targets=targets, token_mask=token_mask, row_inputs=rows_split)
        if has_images(images):
            whole = F.pad(input_ids, (0, self.padded_length(input_ids.size(1)) - input_ids.size(1)))
            where = dict(input_ids=whole, index=split.query_index, group=self.group, rank=self.rank, cp=self.cp)
            inputs |= held_image_arguments(self.model, images, **where)
        outputs = own_forward(self.model, ContextParallelModel)(
            **held,
            sequence_split=split,
            **{**inputs, "use_cache": False},  # a cache of this rank's keys and values would serve nothing
        )
        if targets is None:
            return ParallelCausalLMOutput(logits=outputs.logits)
        result = self._with_loss(outputs.logits, targets)
        if (balancing := balancing_of(self.model)) is not None:
            group = data_parallel_group(self.mesh)
            options = dict(num_experts=balancing.num_experts, top_k=balancing.top_k)
            aux_loss, _ = load_balancing_loss(outputs.router_logits, attention_mask=token_mask, group=group, **options)
            loss = result.loss.full_tensor() if isinstance(result.loss, DTensor) else result.loss  # tp: replicated
            result.loss = loss + balancing.weight * aux_loss
            result.aux_loss = aux_loss.detach()
        return result

    def _split_rows(
        self,
        input_ids: Tensor,
        labels: Tensor | None,
        attention_mask: Tensor | None,
        position_ids: Tensor | None,
        tokens: dict[str, Tensor],
        images: dict[str, Tensor],
    ) -> tuple[SequenceSplit, dict[str, Tensor], Tensor | None]:
        """The split of the rows (padded to :meth:`padded_length`), this rank's token ids, global positions (a
        multimodal rotary model's several rows of them too) and values of ``tokens``, and its shifted labels."""
        length = input_ids.size(1)
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand(input_ids.size(0), -1)
        visible = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        targets = next_token_targets(labels) if labels is not None else None
        extra = self.padded_length(length) - length
        if extra:  # padding on the right, at the last position: nothing attends to it, and the loss ignores it
            input_ids, visible = F.pad(input_ids, (0, extra)), F.pad(visible, (0, extra), value=False)
            position_ids = torch.cat([position_ids, position_ids[..., -1:].expand(*position_ids.shape[:-1], extra)], -1)
            targets = F.pad(targets, (0, extra), value=-100) if targets is not None else None
            tokens = {name: F.pad(value, (0, extra)) for name, value in tokens.items()}
        blocks = token_blocks(tokens, images=images)
        split = self.split(text_positions(position_ids), visible, length + extra, blocks=blocks)
        index = split.query_index
        held = dict(input_ids=input_ids[:, index], position_ids=position_ids[..., index])
        held |= {name: value[:, index] for name, value in tokens.items()}
        return split, held, targets[:, index] if targets is not None else None

    def padded_length(self, length: int) -> int:
        """The length rows of ``length`` tokens are padded to, a rank holding 1 / cp of it: a multiple of 2 cp (two
        chunks a rank), times the ranks a pipeline's stages split their share over (tp under sequence parallel)."""
        pipeline = pipeline_of(self.model)
        multiple = 2 * self.cp * (pipeline.sequence_shards() if pipeline is not None else 1)
        return -(-length // multiple) * multiple

    def _check_same_rows(self, input_ids: Tensor) -> None:
        """The ranks of a cp group split the same rows (the sampler deals them by dp rank): rows of other shapes would
        gather mismatched keys, other tokens would be attended to as if they were these. One small all-reduce."""
        if is_fake(input_ids):  # a memory estimate (planning/memory/activations.py): rows without values to compare
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

    def split(self, position_ids: Tensor, visible: Tensor, length: int, *, blocks: Tensor | None) -> SequenceSplit:
        """The split of a batch of ``length`` tokens a row (a multiple of 2 cp); ``blocks``: the image each token
        belongs to, where an image's tokens see each other both ways (see :func:`.images.token_blocks`)."""
        held = [token_indices(length, self.cp, rank, position_ids.device) for rank in range(self.cp)]
        query_index, key_index = held[self.rank], torch.cat(held)
        document = documents(position_ids)
        return SequenceSplit(
            query_index=query_index,
            key_index=key_index,
            query_document=document[:, query_index],
            key_document=document[:, key_index],
            query_visible=visible[:, query_index],
            key_visible=visible[:, key_index],
            group=self.group,
            kernel=self.kernel,
            query_block=blocks[:, query_index] if blocks is not None else None,
            key_block=blocks[:, key_index] if blocks is not None else None,
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
        pipeline = pipeline_of(self)
        if pipeline is not None and pipeline.in_schedule:  # a stage of the schedule run() started: split already
            return super().forward(input_ids, attention_mask=attention_mask, position_ids=position_ids, **inputs)
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


def check_cp_with_pipeline(*, cp: int, pipeline: PipelineOptions | None) -> None:
    """A loss of one's own under pp (``pp_loss_fn``) shifts a micro-batch's labels itself; under cp a rank holds two
    separate chunks of every sequence, whose labels cannot be shifted where they are: refused."""
    if cp > 1 and pipeline is not None and pipeline.loss_fn is not None:
        raise ValueError(
            f"pp_loss_fn with cp={cp}: the loss function shifts a micro-batch's labels itself, and under context"
            " parallel a rank holds two separate chunks of every sequence, whose labels cannot be shifted where they"
            " are. Use the default loss (pp_loss_fn=None), or cp=1."
        )


def context_parallel_model(model: nn.Module, mesh: DeviceMesh, *, attention: CPAttention = "auto") -> ContextParallel:
    """Make ``model``'s calls split their batch over the cp ranks of ``mesh``, its attention gather the rest (with the
    kernel ``attention`` names)."""
    model.set_attn_implementation(text_model_only(model, ATTENTION))
    context = ContextParallel(model, mesh, attention=attention)
    take_over_calls(model, ContextParallelModel, prefix="ContextParallel", context=context)
    return context


def context_parallel_of(model: nn.Module) -> ContextParallel | None:
    """The context-parallel split of a model :func:`context_parallel_model` made (a PEFT model's base), or None."""
    return taken_over(model, ContextParallelModel, "context")
