"""Losses averaged over every non-ignored token of the global batch, whichever rank holds which tokens.

A plain ``F.cross_entropy`` averages over this rank's tokens, and FSDP then averages the ranks' gradients: with
padding or uneven batches, ranks with few tokens weigh as much as ranks with many, and the result differs from a
single process. Dividing by the global token count instead, and multiplying by the number of ranks FSDP
averages over, gives the single-process gradients; the mean of the ranks' values is the single-process loss.
With gradient accumulation each micro-batch is divided by its own global count, which equals one big batch when
micro-batches hold equal numbers of tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_automodel.parallel.mesh import reduction_mesh


def global_token_mean(loss_sum: Tensor, num_tokens: Tensor | int, device_mesh: DeviceMesh | None) -> Tensor:
    """This rank's share of the mean loss over all data-parallel ranks' tokens.

    ``loss_sum`` is the sum of this rank's per-token losses and ``num_tokens`` how many tokens it summed. The
    result is ``loss_sum / global_tokens * dp``, where ``dp`` is the number of ranks FSDP averages gradients over
    (dp_replicate x dp_shard x cp): the averaged gradients are those of the global mean, and the mean of the
    results over those ranks is the global mean loss, which ``self.log(..., sync_dist=True)`` reports.
    Without a mesh (a strategy that builds none, such as DDP) every rank is a data-parallel rank; in one process
    it is the mean over this process's tokens.
    """
    total = torch.as_tensor(num_tokens, dtype=torch.float32, device=loss_sum.device).detach().clone()
    group = data_parallel_group(device_mesh)
    if group is None:
        return loss_sum / total.clamp_min(1)
    dist.all_reduce(total, group=group)
    return loss_sum * (dist.get_world_size(group) / total.clamp_min(1))


def data_parallel_group(device_mesh: DeviceMesh | None) -> ProcessGroup | None:
    """The ranks whose batches make the global batch (dp_replicate x dp_shard x cp of ``device_mesh``, or the
    "data_parallel" axis of Lightning's own ModelParallelStrategy's; every rank without one, as under DDP); None in
    one process."""
    if device_mesh is not None and "data_parallel" in (device_mesh.mesh_dim_names or ()):
        return device_mesh["data_parallel"].get_group()
    if device_mesh is not None:
        return reduction_mesh(device_mesh).get_group()
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def causal_lm_loss(
    logits: Tensor, labels: Tensor, device_mesh: DeviceMesh | None, *, ignore_index: int = -100
) -> Tensor:
    """Next-token cross-entropy, averaged over the non-ignored tokens of the global batch.

    ``labels`` follow Hugging Face's convention: aligned with the input ids (position t is scored on predicting
    ``labels[:, t + 1]``), ``ignore_index`` where no loss is wanted (padding, prompts). The labels are shifted,
    not the logits, so vocabulary-sharded logits (tensor parallel, under ``loss_parallel``) are used as they are.
    """
    loss_sum, num_tokens = causal_lm_loss_sum(logits, labels, ignore_index=ignore_index)
    return global_token_mean(loss_sum, num_tokens, device_mesh)


def causal_lm_loss_sum(logits: Tensor, labels: Tensor, *, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """The summed next-token cross-entropy over this rank's tokens, and how many tokens it sums (see
    :func:`causal_lm_loss` for the label convention)."""
    return token_loss_sum(logits, next_token_targets(labels, ignore_index=ignore_index), ignore_index=ignore_index)


def token_loss_sum(logits: Tensor, targets: Tensor, *, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """The summed cross-entropy of ``logits`` against ``targets`` aligned with them (labels already shifted, as
    context parallel shifts them before splitting a sequence), and how many tokens it sums."""
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=ignore_index, reduction="sum"
    )
    return loss_sum, (targets != ignore_index).sum()


def next_token_targets(labels: Tensor, *, ignore_index: int = -100) -> Tensor:
    """Labels aligned with the input ids, shifted to the position that predicts them (the last position has none)."""
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


@torch.no_grad()
def next_token_hits(logits: Tensor, labels: Tensor, *, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """How many of this rank's scored tokens the logits rank first, and how many tokens are scored.

    Vocabulary-sharded logits (a DTensor sharded on its last dim) are never gathered: each tp rank finds its
    shard's largest logit and the target's logit where its shard holds the target, and one all-reduce (max) of
    those two numbers per token decides. A tie with the target counts as a hit.
    """
    return token_hits(logits, next_token_targets(labels, ignore_index=ignore_index), ignore_index=ignore_index)


def next_token_hit_mask(logits: Tensor, labels: Tensor, *, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """Which of this rank's tokens are scored and ranked first, and which are scored (two boolean masks shaped as
    ``labels``): :func:`next_token_hits` token by token, for measures over a row's tokens."""
    return token_hit_mask(logits, next_token_targets(labels, ignore_index=ignore_index), ignore_index=ignore_index)


def token_hits(logits: Tensor, targets: Tensor, *, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """:func:`next_token_hits` against ``targets`` aligned with the logits (labels already shifted)."""
    hit, scored = token_hit_mask(logits, targets, ignore_index=ignore_index)
    return hit.sum(), scored.sum()


@torch.no_grad()
def token_hit_mask(logits: Tensor, targets: Tensor, *, ignore_index: int = -100) -> tuple[Tensor, Tensor]:
    """:func:`next_token_hit_mask` against ``targets`` aligned with the logits (labels already shifted)."""
    scored = targets != ignore_index
    local, group, offset = _vocab_shard(logits)
    index = targets.clamp_min(0).unsqueeze(-1) - offset
    held = (index >= 0) & (index < local.size(-1))
    target_logit = local.gather(-1, index.clamp(0, local.size(-1) - 1))
    target_logit = torch.where(held, target_logit, torch.finfo(local.dtype).min).squeeze(-1)
    best_and_target = torch.stack([local.amax(-1), target_logit]).float()
    if group is not None:
        dist.all_reduce(best_and_target, op=dist.ReduceOp.MAX, group=group)
    best, target_logit = best_and_target
    return (target_logit >= best) & scored, scored


def _vocab_shard(logits: Tensor) -> tuple[Tensor, dist.ProcessGroup | None, int]:
    """This rank's logits, the group that holds the rest of the vocabulary, and where this rank's part begins."""
    if not isinstance(logits, DTensor):
        return logits, None, 0
    placements = logits.placements
    if len(placements) != 1 or placements[0] not in (Shard(-1), Shard(logits.ndim - 1)):
        return logits.full_tensor(), None, 0
    mesh = logits.device_mesh
    shard_size = -(-logits.size(-1) // mesh.size())  # torch.chunk's: the last shard may be smaller
    return logits.to_local(), mesh.get_group(), mesh.get_local_rank() * shard_size
