"""Pre-training text: cached or streamed, one source or a weighted mixture."""

from __future__ import annotations

from typing import Any

import numpy as np
from torch.utils.data import Dataset

from lightning_automodel.data.encoding import DocumentEncoder
from lightning_automodel.data.loaders import data_parallel_place
from lightning_automodel.data.mixture import (
    MixedStream,
)
from lightning_automodel.data.modules.base import TokenDataModule
from lightning_automodel.data.rows import PackedRows, PaddedRows
from lightning_automodel.data.sources.expand import expand_sources
from lightning_automodel.data.store import TokenStore
from lightning_automodel.data.streaming.shares import check_enough_documents
from lightning_automodel.data.streaming.stream import StreamedRows

DEFAULT_SHUFFLE_BUFFER = 1000  # documents, as datasets' IterableDataset.shuffle


class TextDataModule(TokenDataModule):
    """Pre-training batches from ``.txt``, ``.jsonl``, Parquet and Arrow files and ``datasets`` objects: a text
    file's paragraphs (separated by blank lines), a JSONL line's or a table row's ``text_field`` are documents, each
    tokenized without special tokens and followed by the tokenizer's EOS token.

    ``pack=True`` lays the documents end to end and cuts rows of ``seq_len`` (no compute wasted on padding); with
    ``separate_documents`` (the default) position ids restart at each document, so attention keeps them apart, and
    without it attention crosses from one into the next. ``pack=False`` gives each document its own padded rows,
    with an attention mask. ``streaming=True`` reads and tokenizes the training files as training goes, each rank
    its share, with no cache (see :mod:`lightning_automodel.data.streaming.stream`), the order of its units drawn
    anew each pass and its documents mixed in a buffer of ``shuffle_buffer`` (default 1,000) when ``shuffle``;
    validation and test data are cached.
    See :class:`TokenDataModule` for the splits and the cache.
    """

    def __init__(
        self,
        train_files: list[str | dict[str, Any]] | str,
        *,
        separate_documents: bool = True,
        text_field: str = "text",
        streaming: bool = False,
        shuffle_buffer: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(train_files, **kwargs)
        if shuffle_buffer is not None and (shuffle_buffer < 0 or not streaming or not self.shuffle):
            raise ValueError(
                f"shuffle_buffer={shuffle_buffer}: it is the documents a stream mixes (streaming=True, shuffle=True),"
                " 0 or more; cached rows are shuffled whole."
            )
        if streaming and (not self.pack or self.val_fraction > 0 or self.num_workers > 0):
            raise ValueError(
                "streaming=True reads the training files as training goes: it packs (pack=True), holds nothing out"
                " (give val_files instead of val_fraction) and reads in the rank's own process (num_workers=0: its"
                " state is gathered from every rank when a checkpoint is saved)."
            )
        if streaming and self.sources is not None and self.stopping_strategy == "first_exhausted":
            raise ValueError(
                "streaming=True repeats a mixture's source that runs out (a stream is endless):"
                " stopping_strategy='first_exhausted' is for cached rows. Leave it at 'all_exhausted'."
            )
        self.separate_documents = separate_documents
        self.text_field = text_field
        self.streaming = streaming
        self.shuffle_buffer = (
            (DEFAULT_SHUFFLE_BUFFER if streaming and self.shuffle else 0) if shuffle_buffer is None else shuffle_buffer
        )

    def _split_rows(self, split: str) -> Dataset | None:
        if not (self.streaming and split == "train" and self.documents(split) is None):
            return super()._split_rows(split)
        if self.trainer is not None and self.trainer.max_steps < 0:
            raise ValueError("streaming=True makes an endless stream of rows: set Trainer(max_steps=...).")
        if (
            self.trainer is not None
            and self.files["val"] is not None
            and isinstance(self.trainer.val_check_interval, float)
        ):
            raise ValueError(
                "streaming=True makes an endless epoch, whose fraction never comes: set Trainer(val_check_interval=...)"
                " to a number of steps."
            )
        place = data_parallel_place(self.trainer)
        if self.sources is None:
            return self._stream(self.files["train"], place, seed=self.seed)
        streams = [
            self._stream(source.path, place, seed=self.seed + index) for index, source in enumerate(self.sources)
        ]
        return MixedStream(streams, [source.weight for source in self.sources], seed=self.seed, **place)

    def _stream(self, patterns: Any, place: dict[str, int], *, seed: int) -> StreamedRows:
        """This rank's stream of the files of ``patterns`` (all training files, or a mixture's source), its shuffle
        drawn from ``seed``."""
        files = expand_sources(patterns, "train")
        by_rank = check_enough_documents(files, self._encoder(), place.get("num_replicas", 1))
        return StreamedRows(
            files,
            self._encoder(),
            seq_len=self.seq_len,
            pad_id=self.tokenizer.pad_token_id,
            separate=self.separate_documents,
            units=by_rank[place.get("rank", 0)],
            shuffle=self.shuffle,
            shuffle_buffer=self.shuffle_buffer,
            seed=seed,
            **place,
        )

    @property
    def keeps_documents_apart(self) -> bool:
        """Whether rows hold several documents told apart by their position ids (the model must mask by them)."""
        return self.pack and self.separate_documents

    def _settings(self) -> dict[str, Any]:
        return {"records": "documents", "text_field": self.text_field}

    def _encoder(self) -> DocumentEncoder:
        return DocumentEncoder(self.tokenizer, self.text_field)

    def _rows(self, store: TokenStore, *, chosen: np.ndarray | None) -> Dataset:
        pad_id = self.tokenizer.pad_token_id
        if self.pack:
            return PackedRows(store, self.seq_len, pad_id, chosen=chosen, separate=self.separate_documents)
        return PaddedRows(store, self.seq_len, pad_id, chosen=chosen)
