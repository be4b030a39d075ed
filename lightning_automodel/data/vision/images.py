"""A record's images: where each is (a file's path, or bytes in a table's row) and the image decoded, as RGB.

A JSONL record names its images by path, relative to the JSONL file's directory or absolute (no inline base64:
lines stay readable, and the bytes stay in the image files). A table's ``images`` column holds what Hugging Face
``datasets``' ``Image`` feature writes, a struct ``{"bytes": binary, "path": string}`` (bytes first; a path alone
is relative to the table's directory), or plain path strings. Pillow decodes them: an optional dependency, imported
when an image is first read.
"""

from __future__ import annotations

import io
import os
from typing import Any

ImageRef = str | dict  # a path, or a datasets Image struct {"bytes": ..., "path": ...}


def import_pillow() -> Any:
    try:
        from PIL import Image
    except ImportError as error:
        raise ImportError(
            "Reading images needs Pillow: `pip install 'lightning-automodel[vision]'` (or pillow)."
        ) from error
    return Image


def record_images(record: dict, where: str, *, directory: str, table: bool) -> list[ImageRef]:
    """The record's ``images``, each a path made absolute (relative ones from ``directory``) or a bytes struct; an
    absent field is no images."""
    images = record.get("images")
    if images is None:
        return []
    if not isinstance(images, list):
        raise ValueError(f"{where}: 'images' is a {type(images).__name__}, not a list of images.")
    return [
        _reference(image, f"{where}, image {index}", directory=directory, table=table)
        for index, image in enumerate(images)
    ]


def _reference(image: object, where: str, *, directory: str, table: bool) -> ImageRef:
    if isinstance(image, str):
        return os.path.join(directory, os.path.expanduser(image))
    if table and isinstance(image, dict) and (image.get("bytes") is not None or image.get("path") is not None):
        if image.get("bytes") is not None:
            return {"bytes": image["bytes"], "path": image.get("path")}
        return os.path.join(directory, image["path"])
    kinds = "a path, or a {'bytes': ..., 'path': ...} struct (datasets' Image feature)" if table else "a path"
    raise ValueError(f"{where}: an image is {kinds}; found {type(image).__name__} {str(image)[:60]!r}.")


def load_image(image: ImageRef, where: str) -> Any:
    """The image decoded (whole, so that a truncated file fails here), as RGB."""
    pillow = import_pillow()
    shown = image if isinstance(image, str) else f"bytes of {image.get('path') or 'an image'}"
    if isinstance(image, str) and not os.path.isfile(image):
        raise ValueError(f"{where}: no image file {image}. Paths are relative to the records' file's directory.")
    try:
        opened = pillow.open(image if isinstance(image, str) else io.BytesIO(image["bytes"]))
        opened.load()
        return opened.convert("RGB")
    except (OSError, ValueError, pillow.DecompressionBombError) as error:
        raise ValueError(f"{where}: {shown} is not an image Pillow can decode ({error}).") from error
