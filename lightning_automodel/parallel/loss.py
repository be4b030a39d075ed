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
from torch.distributed.device_mesh import DeviceMesh

from lightning_automodel.mesh import reduction_mesh


def global_token_mean(loss_sum: Tensor, num_tokens: Tensor | int, device_mesh: DeviceMesh) -> Tensor:
    """This rank's share of the mean loss over all data-parallel ranks' tokens.

    ``loss_sum`` is the sum of this rank's per-token losses and ``num_tokens`` how many tokens it summed. The
    result is ``loss_sum / global_tokens * dp``, where ``dp`` is the number of ranks FSDP averages gradients over
    (dp_replicate x dp_shard x cp): the averaged gradients are those of the global mean, and the mean of the
    results over those ranks is the global mean loss, which ``self.log(..., sync_dist=True)`` reports.
    """
    mesh = reduction_mesh(device_mesh)
    total = torch.as_tensor(num_tokens, dtype=torch.float32, device=device_mesh.device_type).detach().clone()
    dist.all_reduce(total, group=mesh.get_group())
    return loss_sum * (mesh.size() / total.clamp_min(1))


def causal_lm_loss(logits: Tensor, labels: Tensor, device_mesh: DeviceMesh, *, ignore_index: int = -100) -> Tensor:
    """Next-token cross-entropy, averaged over the non-ignored tokens of the global batch.

    ``labels`` follow Hugging Face's convention: aligned with the input ids (position t is scored on predicting
    ``labels[:, t + 1]``), ``ignore_index`` where no loss is wanted (padding, prompts). The labels are shifted,
    not the logits, so vocabulary-sharded logits (tensor parallel, under ``loss_parallel``) are used as they are.
    """
    targets = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), ignore_index=ignore_index, reduction="sum"
    )
    return global_token_mean(loss_sum, (targets != ignore_index).sum(), device_mesh)
