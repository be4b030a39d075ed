"""Vision fine-tuning records made token ids and a trained mask by the model's processor, once, at the cache's build.

A record is TRL's vision format: ``{"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text",
"text": ...}]}, {"role": "assistant", "content": ...}], "images": [...]}``, the i-th ``{"type": "image"}`` part
standing for the i-th image. The processor's chat template renders it and the processor expands each image's
placeholder into its tokens (as many as that image's size gives), so the ids are the model's own; the answers are
marked as text-only records' are (:func:`lightning_automodel.data.chat.encode_conversation`: generation blocks, else
turn by turn). Every image is decoded here, so a missing or broken one is an error naming its file and line before
any training; the pixels are made again when a row is read (:mod:`.rows`): the cache holds ids, not pixels.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lightning_automodel.data.chat import check_messages, encode_conversation
from lightning_automodel.data.encoding import Encoded, PieceBatch, joined
from lightning_automodel.data.sources.tables import Table, is_table_file
from lightning_automodel.data.sources.text_files import json_record
from lightning_automodel.data.vision.images import load_image, record_images


@dataclass(frozen=True)
class VisionEncoded(Encoded):
    """A batch's records, with each one's image paths kept for reading (None: the images are in its table row)."""

    images: list[list[str] | None] = field(default_factory=list)


def image_parts(messages: list[dict]) -> int:
    """How many ``{"type": "image"}`` placeholders the conversation holds."""
    return sum(
        1
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") == "image"
    )


def processor_digest(processor: Any) -> str:
    """What of the processor, besides its tokenizer, makes the ids: its class, its own settings and its image
    processor's (LLaVA's patch size is the processor's, the pixels the image processor's: the tokens an image takes)
    and its chat template."""
    parts = [type(processor).__name__, processor.to_json_string(), str(processor.chat_template)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


class _Rendering:
    """The processor as :func:`encode_conversation` sees a tokenizer: each rendering of a conversation (or of its
    first turns) is given the images its placeholders stand for, and returns one sequence's ids and mask."""

    def __init__(self, processor: Any, images: list[Any], where: str) -> None:
        self.processor = processor
        self.images = images
        self.where = where
        self.chat_template = processor.chat_template

    def apply_chat_template(self, messages: list[dict], **options: Any) -> dict[str, list[int]]:
        count = image_parts(messages)
        kwargs = {"images": self.images[:count]} if count else {}
        try:
            rendered = self.processor.apply_chat_template(messages, processor_kwargs=kwargs, **options)
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"{self.where}: the processor could not render the record ({error}).") from error
        return {name: list(rendered[name][0]) for name in ("input_ids", "assistant_masks") if name in rendered}


class VisionRecordEncoder:
    """Vision records from ``.jsonl`` lines or table rows (their ``messages`` and ``images`` columns)."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def __call__(self, batch: PieceBatch) -> VisionEncoded:
        if batch.kind == "text":
            raise ValueError(f"{batch.source}: vision records are read from .jsonl files, Parquet or Arrow tables.")
        directory = os.path.dirname(batch.source) if batch.kind == "json" or is_table_file(batch.source) else ""
        encoded = [
            self.encode(self._record(batch, number, piece), batch.where(number), directory, table=batch.kind == "row")
            for number, piece in batch.pieces
        ]
        lengths = np.array([len(ids) for ids, _, _ in encoded], dtype=np.int64)
        return VisionEncoded(
            batch.source,
            joined([ids for ids, _, _ in encoded], lengths),
            lengths,
            np.array([number for number, _ in batch.pieces], dtype=np.int64),
            np.concatenate([trained for _, trained, _ in encoded]).astype(np.uint8),
            images=[paths for _, _, paths in encoded],
        )

    def encode(
        self, record: object, where: str, directory: str, *, table: bool
    ) -> tuple[list[int], np.ndarray, list[str] | None]:
        """The record's ids, trained mask and image paths (None from a table: read from its row again)."""
        if not isinstance(record, dict) or "messages" not in record:
            found = sorted(record) if isinstance(record, dict) else f"a {type(record).__name__}"
            raise ValueError(f"{where}: a vision record is {{'messages': [...], 'images': [...]}}; found {found}.")
        messages = record["messages"]
        check_messages(messages, where, parts=True)
        references = record_images(record, where, directory=directory, table=table)
        if (placeholders := image_parts(messages)) != len(references):
            raise ValueError(
                f"{where}: {placeholders} image placeholders ({{'type': 'image'}} parts) but {len(references)} images"
                " in 'images': each placeholder stands for the next image. Make them match."
            )
        images = [load_image(reference, f"{where}, image {index}") for index, reference in enumerate(references)]
        ids, trained = encode_conversation(_Rendering(self.processor, images, where), messages, where, parts=True)
        return ids, trained, None if table else references

    @staticmethod
    def columns(table: Table) -> list[str]:
        if "messages" not in table.column_names:
            raise ValueError(
                f"{table.name}: no column 'messages' (it has {', '.join(map(repr, table.column_names))}). Vision"
                " records are a 'messages' column and an 'images' column: rename them, e.g. with pyarrow or datasets."
            )
        return [name for name in ("messages", "images") if name in table.column_names]

    @staticmethod
    def _record(batch: PieceBatch, number: int, piece: Any) -> object:
        if batch.kind == "json":
            return json_record(batch.where(number), piece)
        return {name: value for name, value in piece.items() if value is not None}
