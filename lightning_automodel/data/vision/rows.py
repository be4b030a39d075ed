"""Vision rows: one record a row, padded, or several (``pack``), their pixel inputs made when the row is read; and
their collation.

A row keeps its records' token ids, their labels and their images' pixel inputs together (whatever the processor's
image processor returns: ``pixel_values``, and ``image_grid_thw`` for Qwen2-VL, ...), the images in the records'
order. Packed rows are laid out by :mod:`.packing`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_automodel.data.rows import make_row, packed_row_starts
from lightning_automodel.data.sources.expand import Source
from lightning_automodel.data.sources.tables import open_table, table_rows
from lightning_automodel.data.store import IMAGES, TokenStore
from lightning_automodel.data.vision.images import load_image, record_images
from lightning_automodel.data.vision.packing import packed_positions, packing_rope_index

# Per-token inputs, stacked over a batch; every other input of a row is per image, concatenated over the batch.
TOKEN_INPUTS = ("input_ids", "labels", "attention_mask", "position_ids", "token_type_ids", "mm_token_type_ids")


def image_token_ids(processor: Any) -> list[int]:
    ids = getattr(processor, "image_token_ids", None) or [getattr(processor, "image_token_id", None)]
    return [int(token) for token in ids if token is not None]


def image_spans(store: TokenStore, documents: np.ndarray, image_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``documents``: where its image tokens end (0: none), and its longest run of them (an image's
    tokens, or adjacent images'). One pass over the store's tokens, not a document at a time."""
    positions = np.flatnonzero(np.isin(store.tokens, image_ids))
    owner = np.searchsorted(store.offsets, positions, side="right") - 1
    relative = positions - store.offsets[owner]
    ends, runs = np.zeros(store.documents, np.int64), np.zeros(store.documents, np.int64)
    np.maximum.at(ends, owner, relative + 1)
    breaks = np.flatnonzero((np.diff(positions) != 1) | (np.diff(owner) != 0)) + 1
    starts = np.concatenate([[0], breaks]).astype(np.int64) if len(positions) else np.zeros(0, np.int64)
    lengths = np.diff(np.concatenate([starts, [len(positions)]]))
    np.maximum.at(runs, owner[starts], lengths)
    return ends[documents], runs[documents]


def source_of(store: TokenStore, document: int) -> str:
    """The name of the source ``document`` comes from."""
    ends = np.cumsum([source.documents for source in store.sources])
    return store.sources[int(np.searchsorted(ends, document, side="right"))].name


class VisionRows(Dataset):
    """One record a row, padded to ``seq_len`` with an attention mask, and its images' pixel inputs; with ``pack``,
    as many consecutive records a row as fit, kept apart by position ids that restart at each (see :mod:`.packing`),
    and all their images' pixel inputs in order.

    Refused at setup (on every rank, before any collective), naming the record's file and line: an image whose
    tokens alone exceed ``seq_len``, images whose tokens end past ``seq_len`` (cutting them would leave the model
    fewer image tokens than image features), a prompt that leaves no answer token. A longer record whose images fit
    keeps its first ``seq_len`` tokens, as text records do.
    """

    def __init__(
        self,
        store: TokenStore,
        *,
        seq_len: int,
        pad_id: int,
        chosen: np.ndarray | None,
        processor: Any,
        sources: dict[str, Source],
        pack: bool = False,
    ) -> None:
        self.store, self.seq_len, self.pad_id = store, seq_len, pad_id
        self.processor, self.sources = processor, sources
        self.documents = np.arange(store.documents) if chosen is None else chosen
        self.image_ids = image_token_ids(processor)
        self._refuse_too_long()
        self.kept = np.minimum(store.lengths[self.documents], seq_len)
        self.truncated = int((store.lengths[self.documents] > seq_len).sum())
        self.paths = json.loads((store.directory / IMAGES).read_text())
        self.pack = pack
        self.rope_index = packing_rope_index(processor) if pack else None
        self.row_starts = packed_row_starts(self.kept, seq_len) if pack else np.arange(len(self.documents) + 1)

    def _refuse_too_long(self) -> None:
        ends, runs = image_spans(self.store, self.documents, self.image_ids)
        prompts = self.store.first_targets(self.documents)
        checks = (
            (runs > self.seq_len, "{run} image tokens in a run (an image's), more than seq_len={seq_len}"),
            (
                ends > self.seq_len,
                "its images' tokens end at token {end}, past seq_len={seq_len} (a cut would split one)",
            ),
            (prompts >= self.seq_len, "the prompt alone takes {prompt} tokens, seq_len={seq_len} leaves no answer"),
        )
        for refused, message in checks:
            if (found := np.flatnonzero(refused)).size:
                first = int(found[0])
                said = message.format(run=runs[first], end=ends[first], prompt=prompts[first], seq_len=self.seq_len)
                raise ValueError(
                    f"{self.store.where(int(self.documents[first]))}: {said} ({found.size} such records). Raise"
                    " seq_len, lower the image processor's resolution, or leave these records out."
                )

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        records = range(int(self.row_starts[index]), int(self.row_starts[index + 1]))
        lengths = [int(self.kept[record]) for record in records]
        pieces = []
        for record, kept in zip(records, lengths, strict=True):
            start = int(self.store.offsets[self.documents[record]])
            pieces.append((self.store.tokens[start : start + kept], self.store.trained[start : start + kept], True))
        row = make_row(pieces, seq_len=self.seq_len, pad_id=self.pad_id, positions=self.pack)
        images = [self._images(int(self.documents[record])) for record in records]
        if any(images):
            pixels = self.processor.image_processor([one for some in images for one in some], return_tensors="pt")
            row |= {name: torch.as_tensor(value) for name, value in pixels.items()}
        for name in ("token_type_ids", "mm_token_type_ids"):
            if name in self.processor.model_input_names:
                row[name] = torch.from_numpy(np.isin(row["input_ids"].numpy(), self.image_ids).astype(np.int64))
        if self.rope_index is not None:
            counts = [len(some) for some in images]
            row["position_ids"] = packed_positions(row, lengths=lengths, images=counts, rope_index=self.rope_index)
        return row

    def _images(self, document: int) -> list[Any]:
        where = self.store.where(document)
        paths = self.paths[document]
        if paths is None:  # bytes (or paths) in the table's row: read it again
            name, row = source_of(self.store, document), int(self.store.lines[document])
            _, record = next(table_rows(open_table(self.sources[name]), ["images"], start=row, stop=row + 1))
            directory = os.path.dirname(name) if os.path.isfile(name) else ""
            paths = record_images(record, where, directory=directory, table=True)
        return [load_image(path, f"{where}, image {number}") for number, path in enumerate(paths)]


def collate_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-token inputs stacked (M-RoPE's ``(4, seq)`` position ids into ``(4, batch, seq)``); per-image inputs
    (pixels, grids, sizes) concatenated over the batch's images, in order: LLaVA's ``pixel_values`` become
    ``(images, 3, H, W)``, Qwen2-VL's patches ``(patches, dim)`` with ``image_grid_thw`` ``(images, 3)``, as the
    models take them. A batch without images has no pixel inputs."""
    batch = {}
    for name in dict.fromkeys(name for row in rows for name in row):
        values = [row[name] for row in rows if name in row]
        if name in TOKEN_INPUTS:
            batch[name] = torch.stack(values, dim=values[0].ndim - 1)
            continue
        shapes = {tuple(value.shape[1:]) for value in values}
        if len(shapes) > 1:
            raise ValueError(
                f"The batch's {name!r} have other shapes past their first dimension ({sorted(shapes)}): this image"
                " processor's outputs cannot be concatenated over records. Set batch_size=1."
            )
        batch[name] = torch.cat(values)
    return batch
