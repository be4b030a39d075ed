"""What the data modules for causal language models share: pre-training text (``TextDataModule``) and fine-tuning
records (``ChatDataModule``), from files, tables and ``datasets`` objects (see :mod:`lightning_automodel.data.sources`)
tokenized once into a cache (see :mod:`lightning_automodel.data.cache`).

Loaders are torchdata ``StatefulDataLoader``s: Lightning saves their ``state_dict()`` in checkpoints, so a resumed
run continues with the very batch it would have seen next. The training order is a pure function of ``seed`` and
the epoch, and on several processes each data-parallel rank reads its share of it (tensor-parallel peers read the
same rows), so a resume is exact in any epoch.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import ConcatDataset, Dataset, DistributedSampler, IterableDataset, Sampler
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lightning_automodel.data.cache import cache_key, cached_store, default_directory
from lightning_automodel.data.copies import refuse_other_copies
from lightning_automodel.data.encoding import Encoded, document_batches, encode, source_batches
from lightning_automodel.data.loaders import QuietStatefulDataLoader, data_parallel_place
from lightning_automodel.data.mixture import (
    STOPPING_STRATEGIES,
    MixedRows,
    parse_sources,
    refuse_weights,
)
from lightning_automodel.data.sampler import MixtureShuffle, ResumableShuffle
from lightning_automodel.data.sources.expand import Source, expand_sources, source_name
from lightning_automodel.data.store import TokenStore, memory_store, read_meta, write_store
from lightning_automodel.data.tokenizer import byte_tokenizer

# The splits each Trainer stage reads.
_STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("test",)}
_MAX_WORKERS = 8


class TokenDataModule(L.LightningDataModule):
    """What the text and fine-tuning data modules share: the splits, the token cache, the loaders.

    Test and predict read ``test_files``, else the validation data. ``batch_size`` counts rows per data-parallel
    rank per step. ``cache_dir``: where the tokenized files are kept (a directory per file set: ``train``, ``val``,
    ``test``); by default under ``~/.cache/lightning-automodel/tokens``, one per key. ``tokenize_workers``: processes
    tokenizing a cache (default: the CPUs, at most 8). The local rank 0 of each machine builds a missing cache; the
    other ranks wait for it at most ``cache_timeout_s``. ``shuffle``: the training rows in an order drawn from
    ``seed`` and the epoch (False: in the files' order).

    ``train_files`` as ``[{"path": ..., "weight": ...}, ...]`` is a weighted mixture (see
    :mod:`lightning_automodel.data.mixture`), each source cached on its own (``train-0``, ``train-1``, ...);
    ``stopping_strategy`` ends its epoch when the last source has given every row (``"all_exhausted"``, a source
    that runs out starting over) or when the first runs out (``"first_exhausted"``, no row repeated).
    """

    fine_tuning = False

    def __init__(
        self,
        train_files: list[str | dict[str, Any]] | str,
        val_files: list[str] | str | None = None,
        test_files: list[str] | str | None = None,
        tokenizer: str | None = None,
        seq_len: int = 512,
        batch_size: int = 8,
        pack: bool = True,
        val_fraction: float = 0.0,
        cache_dir: str | None = None,
        tokenize_workers: int | None = None,
        cache_timeout_s: float = 4 * 3600.0,
        num_workers: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        stopping_strategy: Literal["all_exhausted", "first_exhausted"] = "all_exhausted",
    ) -> None:
        super().__init__()
        if seq_len < 2:
            raise ValueError(f"seq_len={seq_len}: a row needs at least 2 tokens to have a prediction target.")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: it must be at least 1.")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction={val_fraction}: it must be in [0, 1).")
        if val_fraction > 0 and val_files is not None:
            raise ValueError("Both val_files and val_fraction are set: choose one source of validation data.")
        if tokenize_workers is not None and tokenize_workers < 0:
            raise ValueError(f"tokenize_workers={tokenize_workers}: 0 tokenizes in the rank's own process.")
        if stopping_strategy not in STOPPING_STRATEGIES:
            raise ValueError(f"stopping_strategy={stopping_strategy!r}: it is one of {', '.join(STOPPING_STRATEGIES)}.")
        refuse_weights(val_files, "val_files")
        refuse_weights(test_files, "test_files")
        self.sources = parse_sources(train_files)  # None: not a mixture
        self.stopping_strategy = stopping_strategy
        self.files = {"train": train_files, "val": val_files, "test": test_files}
        self.tokenizer_path = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.pack = pack
        self.val_fraction = val_fraction
        self.cache_dir = cache_dir
        self.tokenize_workers = min(os.cpu_count() or 1, _MAX_WORKERS) if tokenize_workers is None else tokenize_workers
        self.cache_timeout_s = cache_timeout_s
        self.num_workers = num_workers
        self.seed = seed
        self.shuffle = shuffle
        self.datasets: dict[str, Dataset] = {}  # the splits set up that hold rows: one without is absent

    @functools.cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """Loaded at first use, not at construction: a config can be read (``--print_config``, ``plan``) on a
        machine without the tokenizer's files."""
        return load_tokenizer(self.tokenizer_path)

    def setup(self, stage: str) -> None:
        stage = TrainerFn(stage).value  # "test": Lightning passes its enum, TrainerFn.TESTING
        set_up, failure = {}, None
        try:
            for split in _STAGE_SPLITS[stage]:
                if split not in self.datasets and (rows := self._split_rows(split)) is not None and len(rows):
                    self.datasets[split] = set_up[split] = rows
        except Exception as error:  # raised below on this rank, and named on the others, which would wait for it
            failure = error
        node_rank = self.trainer.node_rank if self.trainer is not None else 0
        refuse_other_copies(set_up, node_rank=node_rank, failure=failure)
        if stage == "fit" and "train" not in self.datasets:
            raise ValueError(f"No training text in {self.files['train']!r}: every document is empty.")
        if stage != "fit" and _STAGE_SPLITS[stage][0] not in self.datasets:
            raise ValueError(f"Nothing to {stage}: set val_files, val_fraction or test_files.")

    def documents(self, split: str) -> list[str] | None:
        """The documents of ``split`` ("train", "val" or "test") given in code, or None to read the files: a
        subclass overrides this to bring other data (tokenized in memory, not cached)."""
        return None

    def _split_rows(self, split: str) -> Dataset | None:
        """The rows of ``split``, or None where it has no source (no files or documents for it)."""
        documents = self.documents(split)
        if documents is not None:
            batches = document_batches(documents, f"<{type(self).__name__} {split}>")
            store = memory_store(encode(batches, self._encoder(), workers=0), **self._store_options())
            return self._rows(store, chosen=None)
        role, part = self._file_set(split)
        if role is None:
            return None
        if role == "train" and self.sources is not None:
            return self._mixed_rows(part)
        store = self._store(role)
        chosen = None if part is None else held_out_split(store.documents, self.val_fraction, self.seed)[part]
        return self._rows(store, chosen=chosen)

    def _mixed_rows(self, part: int | None) -> Dataset:
        """A mixture's rows: weighted for training; the held-out part (``part`` 1) of every source, unweighted."""
        parts = []
        for index in range(len(self.sources)):
            store = self._store("train", source=index)
            chosen = None if part is None else held_out_split(store.documents, self.val_fraction, self.seed)[part]
            parts.append(self._rows(store, chosen=chosen))
        return ConcatDataset(parts) if part == 1 else MixedRows(parts, [source.weight for source in self.sources])

    def _file_set(self, split: str) -> tuple[str | None, int | None]:
        """Which file set ``split`` reads, and which part of it (0: kept for training, 1: held out; None: all)."""
        if split == "test" and self.files["test"] is not None:
            return "test", None
        if split in ("val", "test") and self.files["val"] is not None:
            return "val", None
        if self.val_fraction > 0:
            return "train", 0 if split == "train" else 1
        return ("train", None) if split == "train" else (None, None)

    def _store(self, role: str, source: int | None = None) -> TokenStore:
        """The cache of ``role``'s files, or of the mixture's ``source``."""
        files = expand_sources(self.files[role] if source is None else self.sources[source].path, role)
        key = cache_key(files=files, tokenizer=self.tokenizer, settings=self._settings())
        name = role if source is None else f"{role}-{source}"
        directory = Path(self.cache_dir).expanduser() / name if self.cache_dir else default_directory(key)

        def build(staging: Path) -> None:
            batches = source_batches(files, self._encoder())
            encoded = encode(batches, self._encoder(), workers=self.tokenize_workers)
            write_store(staging, self._staged(encoded, staging), key=key, **self._store_options())
            self._check_sources(files, staging)

        trainer = self.trainer
        builder = trainer is None or trainer.local_rank == 0
        return cached_store(directory, key=key, build=build, builder=builder, timeout_s=self.cache_timeout_s)

    @staticmethod
    def _check_sources(files: list[Source], staging: Path) -> None:
        """Refuse a source that gave no document (only one whose every text is blank gets here)."""
        given = {name for name, documents, *_ in read_meta(staging)["sources"] if documents}
        if empty := [name for name in map(source_name, files) if name not in given]:
            raise ValueError(
                f"{empty[0]} has no text: the text of every line is blank. Set text_field to the field with the text,"
                " or leave the file out."
            )

    def _staged(self, encoded: Iterator[Encoded], staging: Path) -> Iterator[Encoded]:
        """The batches written into a cache being built in ``staging``: a subclass keeping more than tokens writes
        its own files there as they pass (the vision module's image references)."""
        return encoded

    def _store_options(self) -> dict[str, Any]:
        vocabulary = max(len(self.tokenizer), max(self.tokenizer.get_vocab().values(), default=0) + 1)
        return {"vocabulary": vocabulary, "fine_tuning": self.fine_tuning}

    def _settings(self) -> dict[str, Any]:
        raise NotImplementedError

    def _encoder(self) -> Any:
        raise NotImplementedError

    def _rows(self, store: TokenStore, *, chosen: np.ndarray | None) -> Dataset:
        raise NotImplementedError

    _collate: Callable[[list[dict]], dict] | None = None  # None: torch's default, rows of tensors of one shape

    def train_dataloader(self) -> QuietStatefulDataLoader:
        rows = self.datasets["train"]
        if isinstance(rows, IterableDataset):  # streamed: each rank's share is its own stream
            return self._loader(rows)
        return self._loader(rows, sampler=self._train_sampler(rows))

    def _train_sampler(self, rows: Dataset) -> ResumableShuffle:
        place = data_parallel_place(self.trainer)
        if isinstance(rows, MixedRows):
            return MixtureShuffle(rows, self.seed, stopping_strategy=self.stopping_strategy, **place)
        return ResumableShuffle(rows, self.seed, shuffle=self.shuffle, **place)

    def val_dataloader(self) -> QuietStatefulDataLoader | list:
        rows = self.datasets.get("val")
        return self._loader(rows) if rows is not None else []  # an empty list makes Lightning skip validation

    def test_dataloader(self) -> QuietStatefulDataLoader:
        return self._loader(self.datasets["test"])

    def predict_dataloader(self) -> QuietStatefulDataLoader:
        # Lightning deals predict rows unevenly, and a sharded model needs every rank in every forward pass: a
        # padded split (up to dp - 1 rows predicted twice, as in validation) keeps the ranks in step.
        rows, place = self.datasets["test"], data_parallel_place(self.trainer)
        sampler = DistributedSampler(rows, shuffle=False, **place) if place.get("num_replicas", 1) > 1 else None
        return self._loader(rows, sampler=sampler)

    def _loader(self, rows: Dataset, sampler: Sampler | None = None) -> QuietStatefulDataLoader:
        # Forked loader workers share the memory-mapped cache; a spawned one would get a pickled copy of it.
        context = "fork" if self.num_workers else None
        return QuietStatefulDataLoader(
            rows,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            multiprocessing_context=context,
            collate_fn=self._collate,
        )


def held_out_split(count: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The documents kept for training and the ``fraction`` held out (at least one), chosen by ``seed``; both in
    order."""
    held_out_count = max(1, round(fraction * count))
    if held_out_count >= count:
        raise ValueError(
            f"val_fraction={fraction} holds out all {count} training documents: lower it or add documents."
        )
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).numpy()
    held_out = np.zeros(count, dtype=bool)
    held_out[order[:held_out_count]] = True
    return np.flatnonzero(~held_out), np.flatnonzero(held_out)


def load_tokenizer(path: str | None) -> PreTrainedTokenizerBase:
    if path is None:
        return byte_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"The tokenizer in {path!r} has no eos_token: documents could not be separated. Set one.")
    if tokenizer.pad_token_id is None:
        # Padding is masked out of the loss and the attention, so any id would do; EOS is the usual stand-in.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
