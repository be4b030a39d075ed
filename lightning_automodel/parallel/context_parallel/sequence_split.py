"""Which tokens a cp rank holds, and the mask of its queries against every rank's keys. A sequence is cut into 2 cp
chunks and rank i holds chunks i and 2 cp - 1 - i, so that under the causal mask every rank's queries see as many
keys: equal work for a kernel that skips masked blocks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

# The name torch 2.13 gives it (its old name warns that it is deprecated); older torch has the old name only
all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


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
        query_visible: Tensor,
        key_visible: Tensor,
        group: dist.ProcessGroup | None,
        kernel: str = "sdpa",
        query_block: Tensor | None = None,
        key_block: Tensor | None = None,
    ) -> None:
        self.query_index = query_index  # [S / cp] positions of this rank's tokens in the sequence
        self.key_index = key_index  # [S] positions of the gathered keys
        self.query_document = query_document  # [B, S / cp]
        self.key_document = key_document  # [B, S]
        self.query_visible = query_visible  # [B, S / cp] False where this rank's token is padding
        self.key_visible = key_visible  # [B, S] False where the attention mask hides a key (padding)
        self.group = group
        self.kernel = kernel
        # [B, S / cp] and [B, S]: the image each token belongs to where an image's tokens see each other both ways
        # (Gemma 3), -1 for text; None where attention is causal throughout
        self.query_block, self.key_block = query_block, key_block
        self._masks: dict[tuple, Tensor | BlockMask] = {}

    def rows(self, rows: Tensor) -> SequenceSplit:
        """The split of the batch's ``rows`` alone (a pipeline's micro-batch), with masks of its own."""
        return SequenceSplit(
            query_index=self.query_index,
            key_index=self.key_index,
            query_document=self.query_document[rows],
            key_document=self.key_document[rows],
            query_visible=self.query_visible[rows],
            key_visible=self.key_visible[rows],
            group=self.group,
            kernel=self.kernel,
            query_block=self.query_block[rows] if self.query_block is not None else None,
            key_block=self.key_block[rows] if self.key_block is not None else None,
        )

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
        tokens including the query's own, within one document, visible keys; an image's tokens see each other where
        the split has image blocks."""
        query_position, key_position = self.query_index[query], self.key_index[key]
        allowed = key_position <= query_position
        if self.query_block is not None:
            block = self.query_block[batch, query]
            allowed = allowed | ((block >= 0) & (block == self.key_block[batch, key]))
        if sliding_window is not None:
            allowed = allowed & (key_position > query_position - sliding_window)
        allowed = allowed & (self.query_document[batch, query] == self.key_document[batch, key])
        return (allowed & self.key_visible[batch, key]) | (key_position == query_position)

    def gather(self, tensor: Tensor) -> Tensor:
        """Keys or values [B, heads, S / cp, D] of every cp rank, concatenated in rank order along the sequence."""
        if self.group is None:
            return tensor
        gathered = all_gather_autograd(tensor.contiguous(), 2, self.group)
        return funcol.wait_tensor(gathered)
