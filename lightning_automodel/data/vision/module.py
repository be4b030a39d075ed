"""``VisionChatDataModule``: vision-language fine-tuning records, the loss on the answers, pixels made as rows are
read (see docs/data.md, "Images")."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset
from transformers import AutoProcessor, PreTrainedTokenizerBase

from lightning_automodel.data.encoding import Encoded
from lightning_automodel.data.modules.chat import ChatDataModule
from lightning_automodel.data.sources.expand import expand_sources, source_name
from lightning_automodel.data.store import IMAGES, TokenStore
from lightning_automodel.data.vision.records import VisionRecordEncoder, processor_digest
from lightning_automodel.data.vision.rows import VisionRows, collate_rows


class VisionChatDataModule(ChatDataModule):
    """Fine-tuning batches from TRL's vision records (``{"messages": [...], "images": [...]}``: ``.jsonl`` lines
    naming image files, or table rows holding ``datasets``' image structs), rendered by the model's processor
    (``processor``: a local directory ``AutoProcessor`` loads, or the processor itself, in Python).

    The cache holds each record's ids, trained mask and image paths (a table's images stay in its rows), built and
    checked once; a row is one record, padded, with its images' pixel inputs made when it is read (in the loader's
    workers with ``num_workers``). ``pack=True``: as many consecutive records a row as fit, each computed as if alone
    (:mod:`~lightning_automodel.data.vision.packing`: LLaVA and the M-RoPE models; refused for others at setup).
    Batches are collated by :func:`~lightning_automodel.data.vision.rows.collate_rows`. Other arguments are
    :class:`~lightning_automodel.data.modules.base.TokenDataModule`'s, but ``tokenizer`` (the processor's).
    """

    _collate = staticmethod(collate_rows)

    def __init__(self, train_files: Any, processor: str | Any, pack: bool = False, **kwargs: Any) -> None:
        if kwargs.get("tokenizer") is not None:
            raise ValueError("tokenizer: the processor's own tokenizer renders vision records; leave tokenizer unset.")
        if kwargs.get("streaming"):
            raise ValueError("streaming: vision records are cached; leave streaming unset.")
        super().__init__(train_files, pack=pack, **kwargs)
        self.processor_path = processor
        self._sources: dict[str, Any] = {}

    @functools.cached_property
    def processor(self) -> Any:
        """Loaded at first use, as the tokenizer is."""
        if not isinstance(self.processor_path, str):
            return self.processor_path
        return AutoProcessor.from_pretrained(self.processor_path)

    @functools.cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        tokenizer = self.processor.tokenizer
        if tokenizer.pad_token_id is None:  # masked out of the loss and the attention: any id does
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def _settings(self) -> dict[str, Any]:
        return {"records": "vision", "processor": processor_digest(self.processor)}

    def _encoder(self) -> VisionRecordEncoder:
        return VisionRecordEncoder(self.processor)

    def _store(self, role: str, source: int | None = None) -> TokenStore:
        files = expand_sources(self.files[role] if source is None else self.sources[source].path, role)
        self._sources |= {source_name(file): file for file in files}  # a table's rows are read again for images
        return super()._store(role, source)

    def _staged(self, encoded: Iterator[Encoded], staging: Path) -> Iterator[Encoded]:
        """The batches as they pass; once all have, each record's image paths (None: in its table row), in
        ``images.json``."""
        paths = []
        for batch in encoded:
            paths.extend(batch.images)
            yield batch
        (staging / IMAGES).write_text(json.dumps(paths))

    def _rows(self, store: TokenStore, *, chosen: np.ndarray | None) -> Dataset:
        options = dict(seq_len=self.seq_len, pad_id=self.tokenizer.pad_token_id, chosen=chosen)
        rows = VisionRows(store, processor=self.processor, sources=self._sources, pack=self.pack, **options)
        if rows.truncated:
            rank_zero_warn(
                f"{rows.truncated} of {len(rows.documents)} records are longer than seq_len={self.seq_len}: each keeps"
                " its first seq_len tokens (its images all fit; the rest of its answers is not trained on)."
            )
        return rows
