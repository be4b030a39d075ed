"""Parquet and Arrow files, ``save_to_disk`` directories and ``datasets`` objects: the rows of the same documents in
JSONL, token for token, cached and streamed; a stream's share of a table's row groups, each row once; errors that
name the file and row."""

import json
import sys

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_token_cache import streamed

from lightning_automodel.data import ChatDataModule, TextDataModule, cache
from lightning_automodel.data.copies import describe
from lightning_automodel.data.sources.expand import expand_sources
from lightning_automodel.data.sources.tables import DatasetSource, open_table, table_rows
from lightning_automodel.data.streaming.shares import shares

DOCUMENTS = [f"document {i}: " + "word " * (i % 11) + "é" * (i % 3) for i in range(60)]
CHATS = [
    {
        "messages": [
            {"role": "user", "content": f"What is {i} + {i}?"},
            {"role": "assistant", "content": f"{2 * i}."},
        ]
    }
    for i in range(30)
]
PAIRS = [{"prompt": f"{i} times 3 is", "completion": f" {3 * i}."} for i in range(30)]


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "DEFAULT_ROOT", tmp_path / "token-cache")


def jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def parquet(path, records, row_group_size=7):
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return str(path)


def arrow(path, records, *, stream):
    table = pa.Table.from_pylist(records)
    with pa.OSFile(str(path), "wb") as sink:
        writer = pa.ipc.new_stream(sink, table.schema) if stream else pa.ipc.new_file(sink, table.schema)
        with writer:
            for batch in table.to_batches(max_chunksize=9):
                writer.write_batch(batch)
    return str(path)


def rows(module, split="train"):
    module.setup("fit")
    data = module.datasets[split]
    return [{name: value.tolist() for name, value in data[i].items()} for i in range(len(data))]


def text_rows(train_files, **options):
    return rows(TextDataModule(train_files=train_files, seq_len=24, shuffle=False, **options))


def test_tables_give_the_rows_of_the_same_documents_in_jsonl(tmp_path):
    """Parquet (several row groups), Arrow (stream and file formats), a save_to_disk directory, a Dataset and a
    DatasetDict given in Python, and all of them mixed with text and JSONL files: the rows of the same documents in
    JSONL, token for token, extra columns left alone; cached, and streamed at one rank."""
    records = [{"text": text, "id": i} for i, text in enumerate(DOCUMENTS)]
    expected = text_rows(jsonl(tmp_path / "all.jsonl", records))
    saved = datasets.Dataset.from_list(records)
    saved.save_to_disk(str(tmp_path / "saved"))
    sources = {
        "parquet": parquet(tmp_path / "all.parquet", records),
        "arrow stream": arrow(tmp_path / "stream.arrow", records, stream=True),
        "arrow file": arrow(tmp_path / "file.arrow", records, stream=False),
        "save_to_disk": str(tmp_path / "saved"),
        "Dataset": saved,
        "DatasetDict": datasets.DatasetDict({"train": saved}),
        "loaded": datasets.load_from_disk(str(tmp_path / "saved")),
    }
    for kind, source in sources.items():
        assert text_rows(source) == expected, kind
        streamed = iter(stream_of(source))
        assert [{k: v.tolist() for k, v in next(streamed).items()} for _ in expected[1:]] == expected[:-1], kind
    mixed = [
        parquet(tmp_path / "a.parquet", records[:20]),
        jsonl(tmp_path / "b.jsonl", records[20:35]),
        str(tmp_path / "c.txt"),
        arrow(tmp_path / "d.arrow", records[45:], stream=True),
    ]
    (tmp_path / "c.txt").write_text("\n\n".join(DOCUMENTS[35:45]))
    assert text_rows(mixed) == expected


def test_a_dataset_is_read_in_its_own_order_with_its_own_columns(tmp_path):
    """A select or shuffle, a column renamed, a DatasetDict's validation split: what the dataset holds, not its
    files."""
    dataset = datasets.Dataset.from_list([{"body": text} for text in DOCUMENTS])
    reordered = dataset.select(range(59, -1, -2)).rename_column("body", "text")
    expected = text_rows(jsonl(tmp_path / "r.jsonl", [{"text": DOCUMENTS[i]} for i in range(59, -1, -2)]))
    assert text_rows(reordered) == expected
    split = datasets.DatasetDict({"train": dataset, "validation": dataset.select(range(59, -1, -2))})
    module = TextDataModule(train_files=split, val_files=split, text_field="body", seq_len=24, shuffle=False)
    assert rows(module, "val") == expected
    with pytest.raises(
        ValueError, match=r"has no split for the test files \('test'; it has 'train', 'validation'\): pass the split"
    ):
        expand_sources(split, "test")


def test_conversations_and_completions_from_tables_are_their_jsonl_rows(tmp_path):
    """A table's messages column (a list of structs), or its prompt and completion columns: the JSONL records' rows,
    labels included."""
    for records, name in ((CHATS, "chat"), (PAIRS, "pairs")):
        expected = rows(
            ChatDataModule(train_files=jsonl(tmp_path / f"{name}.jsonl", records), seq_len=64, shuffle=False)
        )
        assert any(label != -100 for row in expected for label in row["labels"])
        for source in (parquet(tmp_path / f"{name}.parquet", records), datasets.Dataset.from_list(records)):
            assert rows(ChatDataModule(train_files=source, seq_len=64, shuffle=False)) == expected, name


def test_the_chat_examples_parquet_holds_the_chat_sets_records():
    """examples/data/chat.parquet (conversations and pairs in one table, null where a row is the other kind) gives
    the rows of examples/data/chat.jsonl."""
    parquet_rows, jsonl_rows = (
        rows(ChatDataModule(train_files=f"examples/data/chat.{suffix}", seq_len=256, shuffle=False))
        for suffix in ("parquet", "jsonl")
    )
    assert len(jsonl_rows) > 10 and parquet_rows == jsonl_rows


def test_table_errors_name_the_file_and_row(tmp_path):
    def setup(module_class, records, **options):
        module_class(train_files=parquet(tmp_path / "bad.parquet", records), seq_len=64, **options).setup("fit")

    with pytest.raises(ValueError, match=r"bad\.parquet: no column 'text' \(it has 'body', 'id'\)\. Set text_field"):
        setup(TextDataModule, [{"body": "x", "id": 1}])
    with pytest.raises(ValueError, match=r"bad\.parquet, row 2: field 'text' is null"):
        setup(TextDataModule, [{"text": "a"}, {"text": "b"}, {"text": None}])
    with pytest.raises(ValueError, match=r"bad\.parquet, row 0: field 'text' is a int, not a string"):
        setup(TextDataModule, [{"text": 1}, {"text": 2}], text_field="text")
    with pytest.raises(ValueError, match=r"no column 'messages', nor 'prompt' and 'completion' \(it has 'text'\)"):
        setup(ChatDataModule, [{"text": "x"}])
    share_gpt = [{"messages": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}]
    with pytest.raises(ValueError, match=r"bad\.parquet, row 0, message 0: a message needs a 'role' and a 'content'"):
        setup(ChatDataModule, share_gpt)
    with pytest.raises(ValueError, match=r"bad\.parquet, row 0: 'messages' must be a non-empty list"):
        setup(ChatDataModule, [{"messages": "Hi", "x": 1}])
    empty = pa.Table.from_pylist([], schema=pa.schema([("text", pa.string())]))
    pq.write_table(empty, tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match=r"empty\.parquet is empty: it has no rows"):
        TextDataModule(train_files=str(tmp_path / "empty.parquet")).setup("fit")


def test_without_pyarrow_a_table_names_the_install(tmp_path, monkeypatch):
    path = parquet(tmp_path / "a.parquet", [{"text": "x"}])
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"needs pyarrow: `pip install 'lightning-automodel\[tables\]'`"):
        TextDataModule(train_files=path).setup("fit")


def test_the_cache_key_follows_a_table_and_a_datasets_fingerprint(tmp_path):
    records = [{"text": text} for text in DOCUMENTS]
    path = parquet(tmp_path / "a.parquet", records)
    first = text_rows(path, cache_dir=str(tmp_path / "cache"))
    parquet(tmp_path / "a.parquet", records[:30])
    assert text_rows(path, cache_dir=str(tmp_path / "cache")) != first, "a changed Parquet file reused the cache"
    half = datasets.Dataset.from_list(records[:30])
    assert text_rows(datasets.Dataset.from_list(records)) == first
    assert text_rows(half) == text_rows(path), "another dataset reused a cache keyed by a fingerprint"


def stream_of(sources, **options):
    return streamed(expand_sources(sources), seq_len=24, **options)


def test_a_stream_deals_row_groups_over_the_ranks_each_row_once(tmp_path):
    """At one rank a table's stream cuts the cached rows; at several, the row groups of all tables (counted across
    them, so that tables of one group spread too) go round the ranks, and the shares hold every row once."""
    records = [{"text": text} for text in DOCUMENTS]
    files = [parquet(tmp_path / "a.parquet", records[:40]), parquet(tmp_path / "b.parquet", records[40:], 100)]
    expected = text_rows(files)
    stream = iter(stream_of(files))
    assert [{k: v.tolist() for k, v in next(stream).items()} for _ in range(len(expected) - 1)] == expected[:-1]
    sources = expand_sources(files)
    for num_replicas in (1, 2, 3, 5, 8):
        by_rank = shares(sources, num_replicas)
        read = [
            row["text"]
            for units in by_rank
            for unit in units
            for _, row in table_rows(open_table(sources[unit.source]), ["text"], start=unit.start, stop=unit.end)
        ]
        assert sorted(read) == sorted(DOCUMENTS), num_replicas
        assert [len(units) for units in by_rank] == [
            7 // num_replicas + (rank < 7 % num_replicas) for rank in range(num_replicas)
        ]


def test_a_mixture_of_tables_and_datasets_cached_and_streamed(tmp_path):
    """A Parquet file and a DatasetDict weighed 3:1: every row of an epoch comes from one of them, in about those
    shares, cached and streamed; the machines' comparison describes both sources."""
    first = [{"text": "a" * 20} for _ in range(40)]
    second = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "b" * 20} for _ in range(40)])})
    sources = [{"path": parquet(tmp_path / "a.parquet", first), "weight": 3}, {"path": second, "weight": 1}]
    cached = TextDataModule(train_files=sources, seq_len=21)
    cached.setup("fit")
    streamed = TextDataModule(train_files=sources, seq_len=21, streaming=True, shuffle_buffer=4)
    streamed.setup("fit")
    for name, rows_read in (
        ("cached", [row["input_ids"] for row in cached.train_dataloader()]),
        ("streamed", [next(iter(streamed.train_dataloader()))["input_ids"]]),
    ):
        letters = [chr(int(row[0])) for batch in rows_read for row in batch]
        assert set(letters) <= {"a", "b"} and 0.6 < letters.count("a") / len(letters) <= 0.9, (name, letters)
    described = describe(cached.datasets["train"])
    assert [entry.name for entry in described.entries] == [
        str(tmp_path / "a.parquet"),
        DatasetSource.of(second["train"]).name,
    ]
