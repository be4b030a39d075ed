"""The token cache: built once and reused, rebuilt when what made it changes, memory-mapped, never written over a
user's files, and its failures raised on every rank; and the stream that needs no cache: the same rows, each rank its
share, resumed exactly."""

import json
import os
import random
import socket
import threading
import time

import numpy as np
import pytest

from lightning_automodel.data import TextDataModule, cache
from lightning_automodel.data.cache import cache_key, cached_store
from lightning_automodel.data.encoding import DocumentEncoder
from lightning_automodel.data.sources.text_files import file_pieces, pieces_in_range
from lightning_automodel.data.store import META, TOKENS, write_store
from lightning_automodel.data.streaming.shares import byte_range, check_enough_documents
from lightning_automodel.data.streaming.stream import StreamedRows
from lightning_automodel.data.tokenizer import PAD_ID, byte_tokenizer


def corpus(directory, documents=200):
    directory.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"text": f"document {i}: " + "word " * (i % 13)}) for i in range(documents)]
    (directory / "a.jsonl").write_text("\n".join(lines[: documents // 2]) + "\n")
    (directory / "b.txt").write_text("\n\n".join(f"paragraph {i}\nof text" for i in range(documents // 2)))
    return [str(directory / "a.jsonl"), str(directory / "b.txt")]


def rows_of(module):
    rows = module.datasets["train"]
    return [{name: value.tolist() for name, value in rows[i].items()} for i in range(len(rows))]


def test_built_once_reused_and_rebuilt_when_its_inputs_change(tmp_path):
    files = corpus(tmp_path / "data")
    options = dict(train_files=files, seq_len=32, cache_dir=str(tmp_path / "cache"))
    first = TextDataModule(**options, tokenize_workers=2)
    first.setup("fit")
    tokens = tmp_path / "cache" / "train" / TOKENS
    assert isinstance(first.datasets["train"].store.tokens, np.memmap)
    assert first.datasets["train"].store.tokens.dtype == np.uint16  # 258 tokens fit in two bytes
    built = tokens.stat().st_mtime_ns

    again = TextDataModule(**options, tokenize_workers=0)  # in-process tokenization gives the same cache
    again.setup("fit")
    assert tokens.stat().st_mtime_ns == built, "the cache was built again with nothing changed"
    assert rows_of(again) == rows_of(first)

    time.sleep(0.01)
    with open(files[1], "a") as file:
        file.write("\n\none more paragraph")
    changed = TextDataModule(**options)
    changed.setup("fit")
    assert tokens.stat().st_mtime_ns != built, "a changed file did not rebuild the cache"
    assert changed.datasets["train"].store.documents == first.datasets["train"].store.documents + 1

    rebuilt = tokens.stat().st_mtime_ns
    other_field = TextDataModule(**options, text_field="body")  # another setting: another key
    with pytest.raises(ValueError, match="no field 'body'"):
        other_field.setup("fit")
    assert tokens.stat().st_mtime_ns == rebuilt, "a failed build touched the cache in place"
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".") and "building" in p.name]


def test_key_follows_the_files_the_tokenizer_and_the_settings(tmp_path):
    files = corpus(tmp_path)
    key = cache_key(files=files, tokenizer=byte_tokenizer(), settings={"text_field": "text"})
    assert key == cache_key(files=files, tokenizer=byte_tokenizer(), settings={"text_field": "text"})
    other = byte_tokenizer()
    other.add_tokens(["<extra>"])
    assert key != cache_key(files=files, tokenizer=other, settings={"text_field": "text"})
    assert key != cache_key(files=files, tokenizer=byte_tokenizer(), settings={"text_field": "body"})
    os.utime(files[0], ns=(1, 1))
    assert key != cache_key(files=files, tokenizer=byte_tokenizer(), settings={"text_field": "text"})


def test_a_directory_with_other_files_is_refused_and_left_alone(tmp_path):
    files = corpus(tmp_path / "data")
    mine = tmp_path / "cache" / "train"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("my notes")
    (mine / TOKENS).write_text("not tokens")
    with pytest.raises(ValueError, match=r"holds files a token cache does not write \(notes\.txt\): it is left"):
        TextDataModule(train_files=files, cache_dir=str(tmp_path / "cache")).setup("fit")
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", TOKENS]
    assert (mine / "notes.txt").read_text() == "my notes" and (mine / TOKENS).read_text() == "not tokens"
    only_meta = tmp_path / "cache" / "val"
    only_meta.mkdir()
    (only_meta / META).write_text('{"my": "metadata"}')  # a cache's file name, but not a cache's meta.json
    with pytest.raises(ValueError, match=r"val holds files a token cache does not write \(meta\.json\)"):
        TextDataModule(train_files=files, val_files=files, cache_dir=str(tmp_path / "cache")).setup("validate")
    assert (only_meta / META).read_text() == '{"my": "metadata"}'
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        cached_store(tmp_path / "file", key={}, build=lambda staging: None, builder=True, timeout_s=1)


def test_a_stale_cache_is_replaced_and_a_damaged_one_named(tmp_path):
    """A cache for another key is rebuilt in place; a killed build's staging directory (its process gone) is
    removed; a truncated file is named."""
    files = corpus(tmp_path / "data")
    options = dict(train_files=files, seq_len=32, cache_dir=str(tmp_path / "cache"))
    killed = tmp_path / "cache" / f".train.building-{socket.gethostname()}-{2**22 + 1}"
    killed.mkdir(parents=True)
    (killed / TOKENS).write_bytes(b"partial")
    TextDataModule(**options).setup("fit")
    assert not killed.exists()
    directory = tmp_path / "cache" / "train"
    meta = json.loads((directory / META).read_text())
    meta["key"]["tokenizer"] = "another"  # a cache another tokenizer made: stale, rebuilt in place
    (directory / META).write_text(json.dumps(meta))
    module = TextDataModule(**options)
    module.setup("fit")
    assert json.loads((directory / META).read_text())["key"]["tokenizer"] != "another"
    with open(directory / TOKENS, "r+b") as tokens:
        tokens.truncate(10)
    with pytest.raises(ValueError, match=r"is damaged: tokens\.bin holds 10 bytes, \d+ expected\. Remove the dir"):
        TextDataModule(**options).setup("fit")


def test_other_ranks_wait_for_the_builder_and_raise_its_error(tmp_path):
    """A rank that does not build reads the cache once the builder's meta.json carries its key, and raises the
    builder's error naming the file and line, without any collective; a cache built meanwhile for another key (a
    rank naming other files) is refused rather than waited past."""
    key, directory = {"k": 1}, tmp_path / "cache"
    found = {}

    def wait() -> None:
        try:
            found["store"] = cached_store(directory, key=key, build=None, builder=False, timeout_s=30)
        except ValueError as error:
            found["error"] = str(error)

    def build(staging) -> None:
        time.sleep(0.5)
        raise ValueError("data.jsonl, line 7: no field 'text'")

    waiter = threading.Thread(target=wait)
    waiter.start()
    with pytest.raises(ValueError, match="line 7"):
        cached_store(directory, key=key, build=build, builder=True, timeout_s=30)
    waiter.join()
    assert found["error"] == "data.jsonl, line 7: no field 'text'"
    with pytest.raises(TimeoutError, match="Waited 0 s for the token cache .* with no progress"):
        cached_store(tmp_path / "other", key={"k": 2}, build=None, builder=False, timeout_s=0.3)

    def wait_for_other_files() -> None:
        try:
            cached_store(tmp_path / "third", key={"k": 3, "files": "mine"}, build=None, builder=False, timeout_s=30)
        except ValueError as error:
            found["mismatch"] = str(error)

    waiter = threading.Thread(target=wait_for_other_files)
    waiter.start()
    time.sleep(0.3)
    cached_store(tmp_path / "third", key={"k": 3, "files": "theirs"}, build=write, builder=True, timeout_s=30)
    waiter.join()
    assert "builds the token cache" in found["mismatch"]
    assert "for other inputs than this rank's (files, tokenizer or settings: files)" in found["mismatch"]


def write(staging) -> None:
    write_store(staging, [], vocabulary=258, fine_tuning=False, key={"k": 3, "files": "theirs"})


def test_default_directory_is_keyed(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "DEFAULT_ROOT", tmp_path / "root")
    files = corpus(tmp_path / "data")
    TextDataModule(train_files=files, seq_len=32).setup("fit")
    TextDataModule(train_files=files, seq_len=32, text_field="text").setup("fit")  # the same key: one entry
    TextDataModule(train_files=files[1:], seq_len=32).setup("fit")
    entries = sorted(p for p in (tmp_path / "root").iterdir() if not p.name.startswith("."))
    assert len(entries) == 2 and all((entry / META).is_file() for entry in entries)


# ----------------------------------------------------------------------------------------------------- streaming


def streamed(files, rank=0, num_replicas=1, separate=True, seq_len=32, **options):
    """A rank's stream of ``files`` (paths, or sources expanded), through the byte tokenizer."""
    return StreamedRows(
        files,
        DocumentEncoder(byte_tokenizer()),
        seq_len=seq_len,
        pad_id=PAD_ID,
        separate=separate,
        num_replicas=num_replicas,
        rank=rank,
        **options,
    )


def test_streamed_rows_are_the_cached_rows_and_never_end(tmp_path):
    """At one rank the stream cuts the rows the cache does (all but the cache's padded last one), then starts over."""
    files = corpus(tmp_path / "data", documents=40)
    cached = TextDataModule(train_files=files, seq_len=32)
    cached.setup("fit")
    expected = rows_of(cached)
    stream = iter(streamed(files))
    rows = [{name: value.tolist() for name, value in next(stream).items()} for _ in range(2 * len(expected))]
    assert rows[: len(expected) - 1] == expected[:-1]
    assert rows[len(expected) - 1]["input_ids"][:10] == expected[-1]["input_ids"][:10]  # the pass goes on into the next


def test_each_rank_streams_its_share_of_the_documents(tmp_path):
    """Byte ranges tiling a file share its documents out, each once, in order, whatever the layout (blank lines of
    spaces, CRLF, paragraphs across a range's end, ranges starting on a line's first byte); a rank's stream holds its
    share's documents."""
    rng = random.Random(0)
    for trial in range(200):
        parts = [rng.choice(["", " ", "\t ", "x", "yy é", "z" * rng.randint(1, 9)]) for _ in range(rng.randint(0, 12))]
        newline = rng.choice(["\n", "\r\n"])
        text = tmp_path / f"{trial}.txt"
        text.write_bytes((newline.join(parts) + rng.choice(["", newline])).encode())
        jsonl = tmp_path / f"{trial}.jsonl"
        jsonl.write_text("".join(json.dumps({"text": part}) + "\n" if part.strip() else "\n" for part in parts))
        for path in (str(text), str(jsonl)):
            whole = [piece for _, piece in file_pieces(path)] if "".join(parts).strip() else []
            for ranks in (1, 2, 3, 5):
                ranges = [byte_range(path, rank=rank, num_replicas=ranks) for rank in range(ranks)]
                shares = [piece for start, end in ranges for _, piece in pieces_in_range(path, start=start, end=end)]
                assert shares == whole, (path, ranks)
    files = corpus(tmp_path / "data", documents=40)
    tokenizer = byte_tokenizer()
    shares = []
    for rank in range(2):
        stream = streamed(files, rank=rank, num_replicas=2, separate=True)
        text = ""
        for row in stream:
            text += tokenizer.decode(row["input_ids"])
            if stream.passes:
                break
        shares.append(text)
    assert "document 0:" in shares[0] and "document 19:" in shares[1] and "document 19:" not in shares[0]
    assert "paragraph 0\n" in shares[0] and "paragraph 0\n" not in shares[1]


def test_a_stream_with_a_rank_of_no_document_is_refused_before_training(tmp_path):
    (tmp_path / "few.jsonl").write_text('{"text": "one"}\n{"text": " "}\n{"text": "two"}\n')
    files = [str(tmp_path / "few.jsonl")]
    check_enough_documents(files, DocumentEncoder(byte_tokenizer()), 2)
    with pytest.raises(ValueError, match=r"Data-parallel rank 1 of 3 gets no document"):
        check_enough_documents(files, DocumentEncoder(byte_tokenizer()), 3)


def test_a_stream_resumes_exactly_from_its_state(tmp_path):
    """Saved mid-pass and at a pass's end, the state restores the rows that followed, at the same data-parallel size;
    at another it is refused."""
    files = corpus(tmp_path / "data", documents=40)
    whole = streamed(files, rank=1, num_replicas=2)
    stream = iter(whole)
    rows, states = [], []
    for _ in range(30):
        rows.append(next(stream)["input_ids"].tolist())
        states.append(whole.state_dict())
    for step in (3, 11, 24):
        resumed = streamed(files, rank=1, num_replicas=2)
        resumed.load_state_dict(json.loads(json.dumps(states[step])))  # as a checkpoint holds it
        again = iter(resumed)
        assert [next(again)["input_ids"].tolist() for _ in range(29 - step)] == rows[step + 1 :], step
    with pytest.raises(ValueError, match="saved at 2 data-parallel ranks and resumes at 1"):
        streamed(files).load_state_dict(states[3])
