"""``datasets`` data without ``datasets``' own processing: a ``Dataset`` or ``DatasetDict`` given in Python, or a
directory ``save_to_disk`` wrote, read through its Arrow tables (see :mod:`.tables`), with no ``map`` cache.

``datasets`` stays optional: an object is recognized only when ``datasets`` is imported (it made it), and a
directory by the files ``save_to_disk`` writes beside its Arrow shards.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from lightning_automodel.data.sources.tables import DatasetSource

# The split of a DatasetDict each file set reads, by the names datasets' builders give them.
SPLIT_NAMES = {"train": ("train",), "val": ("validation", "valid", "val", "dev"), "test": ("test",)}
_STATE, _DICT = "state.json", "dataset_dict.json"


def is_dataset_object(given: object) -> bool:
    module = sys.modules.get("datasets")
    return module is not None and isinstance(given, (module.Dataset, module.DatasetDict))


def is_dataset_directory(path: str) -> bool:
    return os.path.isfile(os.path.join(path, _STATE)) or os.path.isfile(os.path.join(path, _DICT))


def dataset_object_source(given: Any, role: str) -> DatasetSource:
    """The ``Dataset`` itself, or the ``DatasetDict``'s split for ``role``."""
    if isinstance(given, sys.modules["datasets"].DatasetDict):
        given = given[_split_for(list(given), role, "the DatasetDict")]
    return DatasetSource.of(given)


def dataset_directory_files(path: str, role: str) -> list[str]:
    """The Arrow shards of a ``save_to_disk`` directory, in their order; of a ``DatasetDict``'s, those of the split
    for ``role``."""
    if os.path.isfile(os.path.join(path, _DICT)):
        splits = json.loads(open(os.path.join(path, _DICT)).read())["splits"]
        path = os.path.join(path, _split_for(splits, role, path))
    state = json.loads(open(os.path.join(path, _STATE)).read())
    return [os.path.join(path, shard["filename"]) for shard in state["_data_files"]]


def _split_for(splits: list[str], role: str, where: str) -> str:
    for name in SPLIT_NAMES[role]:
        if name in splits:
            return name
    raise ValueError(
        f"{where} has no split for the {role} files ({' or '.join(repr(n) for n in SPLIT_NAMES[role])}; it has"
        f" {', '.join(map(repr, splits))}): pass the split itself, e.g. dataset[{splits[0]!r}] (in Python) or the"
        f" split's directory."
    )
