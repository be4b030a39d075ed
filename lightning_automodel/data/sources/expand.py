"""What ``train_files`` (and ``val_files``, ``test_files``) name, made a list of sources: paths and glob patterns of
files, ``save_to_disk`` directories, ``datasets`` objects given in Python."""

from __future__ import annotations

import glob
import os
from typing import Any, Literal

from lightning_automodel.data.sources.hf_datasets import (
    dataset_directory_files,
    dataset_object_source,
    is_dataset_directory,
    is_dataset_object,
)
from lightning_automodel.data.sources.tables import TABLE_SUFFIXES, DatasetSource, is_table_file
from lightning_automodel.data.sources.text_files import JSONL_SUFFIXES, TEXT_SUFFIXES, is_jsonl

Source = str | DatasetSource  # a file's path, or a dataset given in Python
SUPPORTED = TEXT_SUFFIXES + JSONL_SUFFIXES + TABLE_SUFFIXES


def expand_sources(given: Any, role: str = "train") -> list[Source]:
    """Expand paths, glob patterns (``**`` included), dataset directories and objects into sources: one by one, a
    pattern's files sorted, without duplicates. ``role`` ("train", "val" or "test") picks a ``DatasetDict``'s split.

    Each pattern must match something: a typo should fail loudly rather than train on less data.
    """
    items = [given] if isinstance(given, str) or is_dataset_object(given) else list(given)
    if not items:
        raise ValueError(
            f"No files given (an empty list): pass paths or glob patterns of {', '.join(SUPPORTED)} files."
        )
    sources: dict[Any, Source] = {}
    for item in items:
        for source in _expand(item, role):
            sources.setdefault(source.name if isinstance(source, DatasetSource) else source, source)
    return list(sources.values())


def _expand(item: Any, role: str) -> list[Source]:
    if is_dataset_object(item):
        return [dataset_object_source(item, role)]
    if not isinstance(item, str):
        raise ValueError(
            f"Cannot read {item!r}: give paths or glob patterns (str), or a datasets.Dataset / DatasetDict in Python."
        )
    path = os.path.expanduser(item)
    if os.path.isdir(path) and is_dataset_directory(path):
        return dataset_directory_files(path, role)
    matches = sorted(match for match in glob.glob(path, recursive=True) if os.path.isfile(match))
    if not matches:
        raise ValueError(f"No file matches {item!r}: {_unmatched_hint(path)}")
    for match in matches:
        if not match.endswith(SUPPORTED):
            raise ValueError(
                f"Cannot read {match!r}: supported file types are {', '.join(SUPPORTED)}, and directories written by"
                " datasets' save_to_disk. Rename or convert it."
            )
    return matches


def _unmatched_hint(path: str) -> str:
    if os.path.isdir(path):
        return (
            f"it is a directory; name its files, e.g. {os.path.join(path, '*.parquet')!r} (a directory written by"
            " datasets' save_to_disk is read as a dataset)."
        )
    return "check the path, or quote the glob pattern in the shell."


def source_name(source: Source) -> str:
    return source.name if isinstance(source, DatasetSource) else source


def source_kind(source: Source) -> Literal["text", "json", "table"]:
    """How a source is read: a text file's paragraphs, a JSONL file's lines, a table's rows."""
    if isinstance(source, DatasetSource) or is_table_file(source):
        return "table"
    return "json" if is_jsonl(source) else "text"


def position_word(name: str) -> str:
    """What a source named ``name`` counts its pieces in, for messages: a table's rows, a file's lines."""
    return "row" if name.endswith(TABLE_SUFFIXES) or name.startswith("<datasets.") else "line"
