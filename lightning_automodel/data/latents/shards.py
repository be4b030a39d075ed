"""Shards of precomputed samples on disk, and their writer: safetensors files (each tensor the file's samples
stacked on dim 0) and Parquet files (a row a sample). A shard is read a sample at a time, never whole: safetensors
through ``safe_open`` (a slice of the memory-mapped file), Parquet a row group at a time."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from lightning_automodel.data.latents.keys import INDEX
from lightning_automodel.data.sources.tables import import_pyarrow

if TYPE_CHECKING:
    import pyarrow as pa

SUFFIXES = (".safetensors", ".parquet")
GROUP_BYTES = 8 * 2**20  # of a Parquet shard's row group, by default
SHAPE_SUFFIX = ".shape"  # Parquet: the column holding each row's shape of the tensor column before the suffix
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class Shard:
    """One file's samples: ``rows`` of them, each a dict of tensors named ``keys`` with ``dtypes``."""

    path: Path
    rows: int
    dtypes: dict[str, torch.dtype]

    @property
    def keys(self) -> list[str]:
        return list(self.dtypes)

    def shapes(self, key: str) -> list[tuple[int, ...]]:
        """Each sample's shape of ``key`` (read from the file's header or shape columns, not the tensors)."""
        raise NotImplementedError

    def read(self, row: int) -> dict[str, Tensor]:
        raise NotImplementedError


class SafetensorsShard(Shard):
    def __init__(self, path: Path) -> None:
        self.path = path
        with safe_open(path, framework="pt") as file:
            slices = {key: file.get_slice(key) for key in file.keys()}
            self._shapes = {key: tuple(part.get_shape()) for key, part in slices.items()}
            self.dtypes = {key: _SAFETENSORS_DTYPES[part.get_dtype()] for key, part in slices.items()}
        counts = {key: shape[0] if shape else 0 for key, shape in self._shapes.items()}
        if len(set(counts.values())) > 1 or 0 in counts.values():
            raise ValueError(
                f"{path}: its tensors hold {counts} samples; every tensor of a shard stacks the same samples on dim"
                " 0 (a (N, ...) tensor each). Write it with write_latent_shard."
            )
        self.rows = next(iter(counts.values()), 0)

    def shapes(self, key: str) -> list[tuple[int, ...]]:
        return [self._shapes[key][1:]] * self.rows

    def read(self, row: int) -> dict[str, Tensor]:
        with safe_open(self.path, framework="pt") as file:
            return {key: file.get_slice(key)[row : row + 1][0] for key in self.dtypes}


class ParquetShard(Shard):
    """Layout: a row a sample; a tensor ``key`` is a binary column ``key`` of its raw bytes (C order, the machine's
    byte order) and a ``key.shape`` column of its shape (a list of ints), the field of ``key`` naming its torch
    dtype in its metadata (``{"dtype": "bfloat16"}``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        file = import_pyarrow().parquet.ParquetFile(path)
        schema = file.schema_arrow
        tensors = [name for name in schema.names if not name.endswith(SHAPE_SUFFIX)]
        self.dtypes = {}
        for key in tensors:
            metadata = schema.field(key).metadata or {}
            if b"dtype" not in metadata or key + SHAPE_SUFFIX not in schema.names:
                raise ValueError(
                    f"{path}: column {key!r} is not a tensor column (no dtype in its field's metadata or no"
                    f" {key + SHAPE_SUFFIX!r} column). Write the shard with write_latent_shard."
                )
            self.dtypes[key] = getattr(torch, metadata[b"dtype"].decode())
        self.rows = file.metadata.num_rows
        self._groups = np.cumsum([0] + [file.metadata.row_group(g).num_rows for g in range(file.num_row_groups)])
        self._cached: tuple[int, pa.Table] | None = None  # the row group read last: a batch often reads on in it

    def shapes(self, key: str) -> list[tuple[int, ...]]:
        column = import_pyarrow().parquet.read_table(self.path, columns=[key + SHAPE_SUFFIX]).column(0).to_pylist()
        return [tuple(shape) for shape in column]

    def read(self, row: int) -> dict[str, Tensor]:
        group = int(np.searchsorted(self._groups, row, side="right")) - 1
        if self._cached is None or self._cached[0] != group:
            self._cached = (group, import_pyarrow().parquet.ParquetFile(self.path).read_row_group(group))
        table, at = self._cached[1], row - int(self._groups[group])
        sample = {}
        for key, dtype in self.dtypes.items():
            data = bytearray(table.column(key)[at].as_py())
            shape = table.column(key + SHAPE_SUFFIX)[at].as_py()
            sample[key] = (
                torch.frombuffer(data, dtype=dtype).reshape(shape) if data else torch.empty(shape, dtype=dtype)
            )
        return sample

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_cached": None}  # a loader worker reads its own row groups


def open_shard(path: Path) -> Shard:
    """The shard in ``path``, its header read (not its tensors); an unreadable file named with the reason."""
    kinds = {".safetensors": SafetensorsShard, ".parquet": ParquetShard}
    if path.suffix not in kinds:
        raise ValueError(f"{path}: a latent shard is a {' or '.join(SUFFIXES)} file.")
    try:
        return kinds[path.suffix](path)
    except ValueError:
        raise
    except Exception as error:
        raise ValueError(f"{path} cannot be read as a {path.suffix[1:]} shard: {error}") from error


def write_latent_shard(path: str | Path, samples: dict[str, Tensor], *, rows_per_group: int | None = None) -> None:
    """Write ``samples`` (tensors named ``latents``, ``text_embeddings``, ..., each stacking the shard's samples on
    dim 0) to ``path``, a ``.safetensors`` or a ``.parquet`` file. A Parquet shard is read a row group at a time,
    in shuffled order: ``rows_per_group`` (None: as many samples as fill ``GROUP_BYTES``, at least one) bounds what
    a sample's read decodes."""
    path = Path(path)
    counts = {key: value.shape[0] if value.dim() else 0 for key, value in samples.items()}
    if not samples or len(set(counts.values())) > 1 or 0 in counts.values():
        raise ValueError(f"{path}: the tensors hold {counts} samples; each is to stack the same samples on dim 0.")
    if INDEX in samples:
        raise ValueError(f"{path}: {INDEX!r} is not stored: the data set numbers its samples in the order it reads.")
    if path.suffix == ".safetensors":
        save_file({key: value.contiguous() for key, value in samples.items()}, path)
    elif path.suffix == ".parquet":
        sample_bytes = sum(value[0].numel() * value.element_size() for value in samples.values())
        rows_per_group = rows_per_group or max(1, GROUP_BYTES // max(sample_bytes, 1))
        import_pyarrow().parquet.write_table(_parquet_table(samples), path, row_group_size=rows_per_group)
    else:
        raise ValueError(f"{path}: a latent shard is a {' or '.join(SUFFIXES)} file.")


def _parquet_table(samples: dict[str, Tensor]) -> pa.Table:
    pa = import_pyarrow()
    columns, fields = [], []
    for key, value in samples.items():
        rows = value.contiguous().cpu()
        raw = rows.view(torch.uint8).reshape(rows.shape[0], rows[0].numel() * rows.element_size()).numpy()
        columns.append(pa.array([raw[row].tobytes() for row in range(rows.shape[0])], type=pa.binary()))
        columns.append(pa.array([list(rows.shape[1:])] * rows.shape[0], type=pa.list_(pa.int64())))
        dtype = str(rows.dtype).removeprefix("torch.")
        fields += [
            pa.field(key, pa.binary(), metadata={"dtype": dtype}),
            pa.field(key + SHAPE_SUFFIX, pa.list_(pa.int64())),
        ]
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))
