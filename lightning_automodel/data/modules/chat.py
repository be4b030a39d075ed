"""Fine-tuning records: conversations and prompt/completion pairs, the loss on the answers."""

from __future__ import annotations

from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset

from lightning_automodel.data.encoding import RecordEncoder
from lightning_automodel.data.modules.base import TokenDataModule
from lightning_automodel.data.rows import ConversationRows
from lightning_automodel.data.store import TokenStore


class ChatDataModule(TokenDataModule):
    """Fine-tuning batches from records (``.jsonl`` lines, table rows): conversations (``{"messages": [{"role":
    "user", "content": ...}, ...]}``) rendered by the tokenizer's chat template, or ``{"prompt": ...,
    "completion": ...}`` pairs (see :mod:`lightning_automodel.data.chat`). Labels are -100 everywhere but the
    assistant's answers (the completion).

    ``pack=True`` puts as many consecutive records in a row as fit, position ids restarting at each (attention keeps
    them apart); ``pack=False`` one a row, padded. A record is never split; see
    :class:`~lightning_automodel.data.rows.ConversationRows` for the truncation rules. See :class:`TokenDataModule`
    for the splits and the cache.
    """

    fine_tuning = True

    @property
    def keeps_documents_apart(self) -> bool:
        return self.pack

    def _settings(self) -> dict[str, Any]:
        return {"records": "fine-tuning"}

    def _encoder(self) -> RecordEncoder:
        return RecordEncoder(self.tokenizer)

    def _rows(self, store: TokenStore, *, chosen: np.ndarray | None) -> Dataset:
        rows = ConversationRows(store, self.seq_len, self.tokenizer.pad_token_id, chosen=chosen, pack=self.pack)
        if rows.truncated:
            rank_zero_warn(
                f"{rows.truncated} of {len(rows.documents)} records are longer than seq_len={self.seq_len}: each"
                " keeps its first seq_len tokens (the rest of its answers is not trained on)."
            )
        return rows
