"""Data modules for causal language modelling: local text/JSONL files, and a built-in demo corpus.

Every batch is a dict ``{"input_ids": LongTensor[B, L], "labels": LongTensor[B, L]}`` (plus ``"attention_mask"``
when ``pack=False``). Labels follow Hugging Face's convention: aligned with ``input_ids`` (the model's loss shifts
them by one itself) and ``-100`` wherever no loss is wanted (padding).

Loaders are torchdata ``StatefulDataLoader``s: Lightning saves their ``state_dict()`` in checkpoints, so a resumed
run continues with the very batch it would have seen next. The training order is a pure function of ``seed`` and
the epoch, and on several processes each data-parallel rank reads its share of it (tensor-parallel peers read the
same rows), so a resume is exact in any epoch.
"""

from __future__ import annotations

import functools
import glob
import io
import json
import math
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lightning_automodel.lm.sampler import ResumableShuffle
from lightning_automodel.lm.tokenizer import byte_tokenizer

IGNORE_INDEX = -100
TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl", ".json")
_BLANK_LINES = re.compile(r"\n[ \t]*\n")
# The splits each Trainer stage reads.
_STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("test",)}


# ----------------------------------------------------------------------------------------------------- reading


def expand_files(patterns: Sequence[str] | str) -> list[str]:
    """Expand paths and glob patterns (``**`` included) into files: pattern by pattern, sorted, without duplicates.

    Each pattern must match something: a typo should fail loudly rather than train on less data.
    """
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    if not patterns:
        raise ValueError("No files given (an empty list): pass paths or glob patterns of .txt/.jsonl files.")
    files: dict[str, None] = {}
    for pattern in patterns:
        matches = sorted(
            path for path in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(path)
        )
        if not matches:
            raise ValueError(f"No file matches {pattern!r}: {_unmatched_hint(pattern)}")
        files.update(dict.fromkeys(matches))
    return list(files)


def _unmatched_hint(pattern: str) -> str:
    if os.path.isdir(os.path.expanduser(pattern)):
        return f"it is a directory; name its files, e.g. {os.path.join(pattern, '*.jsonl')!r}."
    return "check the path, or quote the glob pattern in the shell."


def read_documents(patterns: Sequence[str] | str, text_field: str = "text") -> list[str]:
    """Read the documents of every matched file, in file order.

    ``.txt``: paragraphs separated by blank lines are documents (a file without a blank line is one document).
    ``.jsonl``/``.json``: one JSON object per line, its ``text_field`` is a document; blank lines are skipped.
    Empty documents are dropped: they would only add stray end-of-sequence tokens. A file must be UTF-8 and hold at
    least one document: an empty or undecodable file is more likely a broken export than meant, and is an error
    naming it.
    """
    return [document for path in expand_files(patterns) for document in _file_documents(path, text_field)]


def _file_documents(path: str, text_field: str) -> list[str]:
    if not path.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES):
        supported = ", ".join(TEXT_SUFFIXES + JSONL_SUFFIXES)
        raise ValueError(f"Cannot read {path!r}: supported file types are {supported}. Rename or convert it.")
    text = _read_utf8(path)
    if not text.strip():
        raise ValueError(f"{path} is empty: fill it, or leave it out of the files.")
    if path.endswith(TEXT_SUFFIXES):
        documents = _text_documents(text)
    else:
        documents = list(_jsonl_documents(path, text, text_field))
    documents = [document for document in documents if document.strip()]
    if not documents:  # only JSONL gets here: a text file with a non-blank character has a document
        raise ValueError(
            f"{path} has no text: the {text_field!r} of every line is blank. Set text_field to the field with the"
            " text, or leave the file out."
        )
    return documents


def _read_utf8(path: str) -> str:
    """The file's text, newlines translated as ``open`` does; a file that is not UTF-8 is an error naming the line
    and byte where decoding fails (``open`` would name neither the file nor the line)."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(
            f"{path}, line {line} (byte {error.start}): not UTF-8 ({error.reason}: {data[error.start : error.end]!r})."
            f" Convert the file to UTF-8, e.g. `iconv -f LATIN1 -t UTF-8 {path} > {path}.utf8` for a Latin-1 file."
        ) from error
    return io.StringIO(text, newline=None).read()


def _text_documents(text: str) -> list[str]:
    return [paragraph.strip("\n") for paragraph in _BLANK_LINES.split(text)]


def _jsonl_documents(path: str, text: str, text_field: str) -> Iterator[str]:
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            yield _text_of(_json_line(path, number, line), text_field, f"{path}, line {number}")


def _json_line(path: str, number: int, line: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}, line {number}: not valid JSON ({error.msg}). .jsonl/.json files hold one JSON object per line."
        ) from error


def _text_of(record: object, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        found = sorted(record) if isinstance(record, dict) else f"a {type(record).__name__}"
        raise ValueError(
            f"{where}: no field {text_field!r} (found {found}). Set text_field to the field with the text."
        )
    if not isinstance(record[text_field], str):
        raise ValueError(f"{where}: field {text_field!r} is a {type(record[text_field]).__name__}, not a string.")
    return record[text_field]


def split_documents(documents: Sequence[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Hold out ``fraction`` of the documents (at least one), chosen by ``seed``; both parts keep file order."""
    if fraction <= 0:
        return list(documents), []
    held_out_count = max(1, round(fraction * len(documents)))
    if held_out_count >= len(documents):
        raise ValueError(
            f"val_fraction={fraction} holds out all {len(documents)} training documents: lower it or add documents."
        )
    order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(seed)).tolist()
    held_out = set(order[:held_out_count])
    train = [document for i, document in enumerate(documents) if i not in held_out]
    return train, [document for i, document in enumerate(documents) if i in held_out]


# ----------------------------------------------------------------------------------------------------- rows


class TokenRows(Dataset):
    """Rows of exactly ``seq_len`` token ids; the first ``lengths[i]`` tokens of row ``i`` are real, the rest pad."""

    def __init__(self, tokens: torch.Tensor, lengths: torch.Tensor, attention_mask: bool) -> None:
        self.tokens = tokens
        self.lengths = lengths
        self.attention_mask = attention_mask

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        input_ids = self.tokens[index]
        real = torch.arange(len(input_ids)) < self.lengths[index]
        item = {"input_ids": input_ids, "labels": input_ids.masked_fill(~real, IGNORE_INDEX)}
        if self.attention_mask:
            item["attention_mask"] = real.long()
        return item


def pack_rows(documents: Sequence[Sequence[int]], seq_len: int, eos_id: int, pad_id: int) -> TokenRows:
    """Concatenate the documents, each followed by ``eos_id``, and cut the stream into rows of ``seq_len``.

    The last row is padded rather than dropped, so every token is trained on. Rows need no attention mask: the
    padding only ever trails, where causal attention keeps it from every real token.
    """
    stream = torch.tensor(list(chain.from_iterable([*document, eos_id] for document in documents)), dtype=torch.long)
    rows = math.ceil(len(stream) / seq_len)
    tokens = torch.full((rows * seq_len,), pad_id, dtype=torch.long)
    tokens[: len(stream)] = stream
    lengths = torch.full((rows,), seq_len, dtype=torch.long)
    if rows:
        lengths[-1] = len(stream) - (rows - 1) * seq_len
    return TokenRows(tokens.view(rows, seq_len), lengths, attention_mask=False)


def pad_rows(documents: Sequence[Sequence[int]], seq_len: int, eos_id: int, pad_id: int) -> TokenRows:
    """One row per document (followed by ``eos_id``), right-padded to ``seq_len``, with an attention mask.

    A longer document is split, not truncated, so no text is thrown away: into chunks of ``seq_len`` that overlap
    by one token, because a row's first token is never a prediction target. So every token but a document's first
    is a target exactly once, and no row is without one.
    """
    chunks = [chunk for document in documents for chunk in _overlapping_chunks([*document, eos_id], seq_len)]
    tokens = torch.full((len(chunks), seq_len), pad_id, dtype=torch.long)
    for row, chunk in zip(tokens, chunks, strict=True):
        row[: len(chunk)] = torch.tensor(chunk, dtype=torch.long)
    lengths = torch.tensor([len(chunk) for chunk in chunks], dtype=torch.long)
    return TokenRows(tokens, lengths, attention_mask=True)


def _overlapping_chunks(tokens: list[int], seq_len: int) -> list[list[int]]:
    return [tokens[start : start + seq_len] for start in range(0, max(len(tokens) - 1, 1), seq_len - 1)]


# ----------------------------------------------------------------------------------------------------- modules


class TextDataModule(L.LightningDataModule):
    """Causal-LM batches from local ``.txt`` and ``.jsonl`` files (see ``read_documents`` for the formats).

    Each document is tokenized without special tokens and followed by the tokenizer's EOS token. ``pack=True``
    concatenates all documents and cuts rows of ``seq_len`` (no compute wasted on padding; attention crosses
    document boundaries, as usual in pre-training). ``pack=False`` gives each document its own padded rows, with
    an attention mask. ``batch_size`` counts rows per data-parallel rank per step. Test and predict read
    ``test_files``, else the validation data. Every rank tokenizes in ``setup``: fine for local files.
    """

    def __init__(
        self,
        train_files: list[str] | str,
        val_files: list[str] | str | None = None,
        test_files: list[str] | str | None = None,
        tokenizer: str | None = None,
        seq_len: int = 512,
        batch_size: int = 8,
        pack: bool = True,
        text_field: str = "text",
        val_fraction: float = 0.0,
        num_workers: int = 0,
        seed: int = 0,
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
        self.train_files = train_files
        self.val_files = val_files
        self.test_files = test_files
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.pack = pack
        self.text_field = text_field
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.seed = seed
        self.tokenizer_path = tokenizer
        self.datasets: dict[str, TokenRows] = {}

    @functools.cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """Loaded at first use, not at construction: a config can be read (``--print_config``, ``plan``) on a
        machine without the tokenizer's files."""
        return _load_tokenizer(self.tokenizer_path)

    def setup(self, stage: str) -> None:
        for split in _STAGE_SPLITS[stage]:
            if split not in self.datasets:
                self.datasets[split] = self._rows(self.documents(split))
        if stage == "fit" and not self.datasets["train"]:
            raise ValueError(f"No training text in {self.train_files!r}: every document is empty.")
        if stage != "fit" and not self.datasets[_STAGE_SPLITS[stage][0]]:
            raise ValueError(f"Nothing to {stage}: set val_files, val_fraction or test_files.")

    def documents(self, split: str) -> list[str]:
        """The documents of ``split`` ("train", "val" or "test"); subclasses override this to bring other data."""
        if split == "test" and self.test_files is not None:
            return read_documents(self.test_files, self.text_field)
        if split in ("val", "test") and self.val_files is not None:
            return read_documents(self.val_files, self.text_field)
        if split == "train" or self.val_fraction > 0:
            train, held_out = split_documents(
                read_documents(self.train_files, self.text_field), self.val_fraction, self.seed
            )
            return train if split == "train" else held_out
        return []

    def _rows(self, documents: list[str]) -> TokenRows:
        make_rows = pack_rows if self.pack else pad_rows
        return make_rows(
            self._tokenize(documents), self.seq_len, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        )

    def _tokenize(self, documents: list[str]) -> list[list[int]]:
        if not documents:  # the tokenizer rejects an empty batch
            return []
        # Text that happens to spell a special token ("<eos>") stays text: a document cannot forge a boundary.
        encoded = self.tokenizer(documents, add_special_tokens=False, split_special_tokens=True, verbose=False)
        return encoded["input_ids"]

    def train_dataloader(self) -> StatefulDataLoader:
        rows = self.datasets["train"]
        return self._loader(rows, sampler=ResumableShuffle(rows, self.seed, **data_parallel_place(self.trainer)))

    def val_dataloader(self) -> StatefulDataLoader | list:
        rows = self.datasets.get("val")
        return self._loader(rows) if rows else []  # an empty list makes Lightning skip validation

    def test_dataloader(self) -> StatefulDataLoader:
        return self._loader(self.datasets["test"])

    def predict_dataloader(self) -> StatefulDataLoader:
        # Lightning deals predict rows unevenly, and a sharded model needs every rank in every forward pass: a
        # padded split (up to dp - 1 rows predicted twice, as in validation) keeps the ranks in step.
        rows, place = self.datasets["test"], data_parallel_place(self.trainer)
        sampler = DistributedSampler(rows, shuffle=False, **place) if place.get("num_replicas", 1) > 1 else None
        return self._loader(rows, sampler=sampler)

    def _loader(self, rows: TokenRows, sampler: Sampler | None = None) -> StatefulDataLoader:
        return QuietStatefulDataLoader(rows, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers)


class QuietStatefulDataLoader(StatefulDataLoader):
    """torchdata's ``StatefulDataLoader`` without the warning its constructor causes: it calls ``torch.set_vital``,
    which torch deprecated, a warning per process that only torchdata can act on. A class rather than a filter
    around our call: Lightning rebuilds loaders to insert its distributed sampler, and it rebuilds this class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "'set_vital' is deprecated", UserWarning, r"torchdata\.")
            super().__init__(*args, **kwargs)


def data_parallel_place(trainer: L.Trainer | None) -> dict[str, int]:
    """This rank's data-parallel ``rank`` and the data-parallel size ``num_replicas``, from the strategy
    (``{}`` outside a distributed run). Tensor-parallel peers share a place: they read the same rows, and count as
    one replica (the strategy's world size and global rank would deal them different rows)."""
    kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
    return {"num_replicas": kwargs["num_replicas"], "rank": kwargs["rank"]} if kwargs else {}


def _load_tokenizer(path: str | None) -> PreTrainedTokenizerBase:
    if path is None:
        return byte_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"The tokenizer in {path!r} has no eos_token: documents could not be separated. Set one.")
    if tokenizer.pad_token_id is None:
        # Padding is masked out of the loss and the attention, so any id would do; EOS is the usual stand-in.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
