"""Data modules and byte tokenizer: exact rows, file formats, splits."""

import json

import numpy as np
import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoTokenizer

from lightning_automodel.data import cache
from lightning_automodel.data.demo import DemoDataModule, demo_documents
from lightning_automodel.data.encoding import DocumentEncoder, encode, source_batches
from lightning_automodel.data.modules.base import held_out_split
from lightning_automodel.data.modules.text import TextDataModule
from lightning_automodel.data.rows import IGNORE_INDEX, PackedRows, PaddedRows
from lightning_automodel.data.sources.expand import expand_sources
from lightning_automodel.data.store import TokenStore, memory_store
from lightning_automodel.data.tokenizer import BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, byte_tokenizer

TEXTS = ["hello world", "héllo wörld, 日本語 🎉", "  leading spaces\n\ttabs\r\n", "\x00\x7f\xff", "a<eos>b", ""]


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return str(path)


def write_jsonl(path, records):
    return write(path, "".join(json.dumps(record) + "\n" for record in records))


def byte_ids(text):
    return list(text.encode("utf-8"))


def stream(rows):
    """The real tokens of rows, concatenated in row order."""
    return [token for i in range(len(rows)) for token in rows[i]["input_ids"].tolist() if token != PAD_ID]


def tokens_of(rows):
    return [rows[i]["input_ids"].tolist() for i in range(len(rows))]


def store_of(documents, eos_id):
    """A store of token lists, each followed by ``eos_id``."""
    lengths = [len(document) + 1 for document in documents]
    tokens = np.array([token for document in documents for token in (*document, eos_id)])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return TokenStore(tokens, offsets, np.arange(1, len(documents) + 1), (("<test>", len(documents)),))


def pack_rows(documents, seq_len, eos_id, pad_id, separate=False):
    return PackedRows(store_of(documents, eos_id), seq_len, pad_id, chosen=None, separate=separate)


def pad_rows(documents, seq_len, eos_id, pad_id):
    return PaddedRows(store_of(documents, eos_id), seq_len, pad_id, chosen=None)


def read_documents(patterns, text_field="text"):
    """The documents of files as the text data module reads them (each without its EOS)."""
    tokenizer = byte_tokenizer()
    encoder = DocumentEncoder(tokenizer, text_field)
    encoded = encode(source_batches(expand_sources(patterns), encoder), encoder, workers=0)
    store = memory_store(encoded, vocabulary=len(tokenizer), fine_tuning=False)
    return [
        tokenizer.decode(store.tokens[a : b - 1]) for a, b in zip(store.offsets[:-1], store.offsets[1:], strict=True)
    ]


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "DEFAULT_ROOT", tmp_path / "token-cache")


# ----------------------------------------------------------------------------------------------------- tokenizer


def test_byte_tokenizer_ids_are_bytes_and_round_trip(tmp_path):
    tokenizer = byte_tokenizer()
    assert (len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id) == (BYTE_VOCAB_SIZE, EOS_ID, PAD_ID)
    assert (EOS_ID, PAD_ID, BYTE_VOCAB_SIZE) == (257, 256, 258)
    assert tokenizer.bos_token is None
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        ids = tokenizer(text, split_special_tokens=True)["input_ids"]
        assert ids == byte_ids(text), text  # no BOS, no EOS added, one id per byte
        assert tokenizer.decode(ids) == text
        assert reloaded(text, split_special_tokens=True)["input_ids"] == ids
        assert reloaded.decode(ids) == text
    assert (reloaded.eos_token_id, reloaded.pad_token_id, len(reloaded)) == (EOS_ID, PAD_ID, BYTE_VOCAB_SIZE)
    assert tokenizer.decode([104, 105, EOS_ID, PAD_ID], skip_special_tokens=True) == "hi"


# ----------------------------------------------------------------------------------------------------- rows


def test_pack_rows_cuts_the_eos_separated_stream_and_pads_only_the_last_row():
    rows = pack_rows([[1, 2, 3], [4], [5, 6, 7, 8]], seq_len=4, eos_id=9, pad_id=0)
    assert tokens_of(rows) == [[1, 2, 3, 9], [4, 9, 5, 6], [7, 8, 9, 0]]
    last = rows[2]
    assert set(last) == {"input_ids", "labels"}
    assert last["input_ids"].tolist() == [7, 8, 9, 0]
    assert last["labels"].tolist() == [7, 8, 9, IGNORE_INDEX]
    assert rows[0]["labels"].tolist() == [1, 2, 3, 9]


def test_pack_rows_exact_multiple_has_no_padding_row():
    rows = pack_rows([[1, 2, 3]], seq_len=2, eos_id=9, pad_id=0)
    assert tokens_of(rows) == [[1, 2], [3, 9]]
    assert rows[1]["labels"].tolist() == [3, 9]


def test_pad_rows_masks_exactly_the_padding_and_splits_long_documents_with_one_token_overlap():
    rows = pad_rows([[1, 2], [3, 4, 5, 6, 7, 8]], seq_len=4, eos_id=9, pad_id=0)
    # [3..8, 9] is 7 tokens: chunks start every seq_len - 1 = 3 tokens, so each token after the first is a target once.
    assert tokens_of(rows) == [[1, 2, 9, 0], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert rows[0]["labels"].tolist() == [1, 2, 9, IGNORE_INDEX]
    assert rows[0]["attention_mask"].tolist() == [1, 1, 1, 0]
    assert rows[2]["labels"].tolist() == [6, 7, 8, 9]
    assert rows[2]["attention_mask"].tolist() == [1, 1, 1, 1]


def test_pad_rows_never_makes_a_row_without_a_target():
    rows = pad_rows([[1, 2, 3, 4, 5, 6]], seq_len=4, eos_id=9, pad_id=0)  # 7 tokens with EOS
    assert tokens_of(rows) == [[1, 2, 3, 4], [4, 5, 6, 9]]
    rows = pad_rows([[1, 2, 3, 4, 5, 6, 7]], seq_len=4, eos_id=9, pad_id=0)  # 8 tokens: a 2-token tail
    assert tokens_of(rows) == [[1, 2, 3, 4], [4, 5, 6, 7], [7, 9, 0, 0]]
    assert rows[2]["labels"].tolist() == [7, 9, IGNORE_INDEX, IGNORE_INDEX]


# ----------------------------------------------------------------------------------------------------- reading


def test_txt_paragraphs_are_documents(tmp_path):
    paragraphs = write(tmp_path / "a.txt", "first line\nsame doc\n\nsecond\n \t\n\n\nthird  \n")
    single = write(tmp_path / "b.txt", "one document\nwithout blank lines\n")
    windows = tmp_path / "c.txt"
    windows.write_bytes(b"first\r\nsame doc\r\n\r\nsecond\r\n")
    assert read_documents(paragraphs) == ["first line\nsame doc", "second", "third  "]
    assert read_documents(single) == ["one document\nwithout blank lines"]
    assert read_documents(str(windows)) == ["first\nsame doc", "second"]  # newlines translated as open() does


def test_jsonl_reads_the_text_field_and_skips_blank_lines(tmp_path):
    path = write(tmp_path / "d.jsonl", '{"body": "x", "id": 1}\n\n{"body": "héllo"}\n{"body": ""}\n')
    assert read_documents(path, text_field="body") == ["x", "héllo"]
    json_path = write_jsonl(tmp_path / "e.json", [{"text": "j"}])
    assert read_documents(json_path) == ["j"]


def test_jsonl_missing_field_names_file_line_and_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "ok"}, {"content": "no text"}])
    with pytest.raises(ValueError, match=r"d\.jsonl, line 2: no field 'text' \(found \['content'\]\)"):
        read_documents(path)
    path = write(tmp_path / "array.json", '[{"text": "a"},\n {"text": "b"}]\n')
    with pytest.raises(ValueError, match=r"array\.json, line 1: not valid JSON .* one JSON object per line"):
        read_documents(path)
    path = write_jsonl(tmp_path / "n.jsonl", [{"text": 3}])
    with pytest.raises(ValueError, match=r"n\.jsonl, line 1: field 'text' is a int, not a string"):
        read_documents(path)


def test_unknown_extension_and_unmatched_pattern_are_errors(tmp_path):
    csv = write(tmp_path / "d.csv", "a,b\n")
    with pytest.raises(ValueError, match=r"d\.csv.*\.txt, \.jsonl, \.json"):
        read_documents(csv)
    with pytest.raises(ValueError, match=r"No file matches '.*nothing\*\.txt'"):
        read_documents(str(tmp_path / "nothing*.txt"))


def test_empty_files_and_files_without_text_are_errors(tmp_path):
    """A file that adds nothing is more likely a broken export than meant: named, with what it lacks."""
    cases = {
        "empty.txt": ("", r"empty\.txt is empty: fill it, or leave it out"),
        "blank.txt": ("\n \t\n\n", r"blank\.txt is empty"),
        "empty.jsonl": ("\n\n", r"empty\.jsonl is empty"),
        "blank.jsonl": ('{"text": ""}\n{"text": " "}\n', r"blank\.jsonl has no text: the text of every line is"),
    }
    good = write(tmp_path / "good.txt", "some text")
    for name, (text, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            TextDataModule(train_files=[good, write(tmp_path / name, text)]).setup("fit")


def test_a_file_that_is_not_utf8_is_named_with_its_line_and_byte(tmp_path):
    latin1 = "first line\nsecond été\n".encode("latin-1")  # é is 0xe9 in Latin-1, not valid UTF-8 there
    for name, data in (("a.txt", latin1), ("b.jsonl", b'{"text": "ok"}\n' + b'{"text": "caf\xe9"}\n')):
        path = tmp_path / name
        path.write_bytes(data)
        line, byte = (2, 18) if name == "a.txt" else (2, 28)
        with pytest.raises(ValueError, match=rf"{name}, line {line} \(byte {byte}\): not UTF-8 .*iconv -f LATIN1"):
            read_documents(str(path))


def test_no_files_and_a_directory_are_errors(tmp_path):
    with pytest.raises(ValueError, match="No files given"):
        read_documents([])
    write(tmp_path / "data" / "a.jsonl", '{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"No file matches '.*data': it is a directory; name its files, e\.g\."):
        read_documents(str(tmp_path / "data"))


def test_glob_patterns_expand_sorted_without_duplicates(tmp_path):
    b = write(tmp_path / "b.txt", "B")
    a = write(tmp_path / "a.txt", "A")
    nested = write(tmp_path / "sub" / "deep" / "c.jsonl", '{"text": "C"}\n')
    assert expand_sources(str(tmp_path / "*.txt")) == [a, b]
    assert expand_sources([str(tmp_path / "**" / "*.jsonl"), b, str(tmp_path / "*.txt")]) == [nested, b, a]
    assert read_documents([str(tmp_path / "**" / "*.*")]) == ["A", "B", "C"]


def test_held_out_split_is_deterministic_disjoint_and_complete():
    train, held_out = (part.tolist() for part in held_out_split(50, 0.2, seed=3))
    assert len(held_out) == 10 and len(train) == 40
    assert set(train).isdisjoint(held_out) and set(train) | set(held_out) == set(range(50))
    assert train == sorted(train) and held_out == sorted(held_out)  # file order is kept
    assert held_out_split(50, 0.2, seed=3)[1].tolist() == held_out
    assert held_out_split(50, 0.2, seed=4)[1].tolist() != held_out
    assert len(held_out_split(50, 0.001, seed=3)[1]) == 1
    with pytest.raises(ValueError, match="holds out all 2"):
        held_out_split(2, 0.9, seed=0)


# ----------------------------------------------------------------------------------------------------- modules


def test_text_data_module_batches_hold_every_document_with_eos(tmp_path):
    documents = ["first document", "zwei: ü", "third one is a little longer"]
    write_jsonl(tmp_path / "train.jsonl", [{"text": text} for text in documents])
    module = TextDataModule(train_files=str(tmp_path / "*.jsonl"), seq_len=8, batch_size=3)
    module.setup("fit")
    rows = module.datasets["train"]
    assert stream(rows) == [token for text in documents for token in [*byte_ids(text), EOS_ID]]
    assert module.val_dataloader() == []
    loader = module.train_dataloader()
    assert isinstance(loader, StatefulDataLoader)
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["input_ids"].shape == (3, 8) and batch["input_ids"].dtype == torch.long
    assert len(loader) == 3  # 53 tokens -> 7 rows -> 3 batches; the partial batch is kept


def test_text_data_module_pad_mode_and_special_token_text(tmp_path):
    write(tmp_path / "train.txt", "ab\n\ncd<eos>e\n")
    module = TextDataModule(train_files=str(tmp_path / "train.txt"), seq_len=6, batch_size=4, pack=False)
    module.setup("fit")
    batch = next(iter(module.train_dataloader()))
    columns = (batch[key].tolist() for key in ("input_ids", "labels", "attention_mask"))
    rows = sorted(zip(*columns, strict=True))
    pad = IGNORE_INDEX
    assert rows == [
        ([97, 98, EOS_ID, PAD_ID, PAD_ID, PAD_ID], [97, 98, EOS_ID, pad, pad, pad], [1, 1, 1, 0, 0, 0]),
        ([99, 100, 60, 101, 111, 115], [99, 100, 60, 101, 111, 115], [1] * 6),  # "<eos>" in text stays bytes
        ([115, 62, 101, EOS_ID, PAD_ID, PAD_ID], [115, 62, 101, EOS_ID, pad, pad], [1, 1, 1, 1, 0, 0]),
    ]


def test_val_test_and_predict_sources(tmp_path):
    write(tmp_path / "train.txt", "\n\n".join(f"train {i}" for i in range(10)))
    write(tmp_path / "val.txt", "validation")
    write(tmp_path / "test.txt", "testing")
    train, val, test = (str(tmp_path / name) for name in ("train.txt", "val.txt", "test.txt"))

    def first_text(module, loader):
        row = next(iter(loader))["input_ids"][0]
        return module.tokenizer.decode(row, skip_special_tokens=True)

    module = TextDataModule(train_files=train, val_files=val, seq_len=16)
    module.setup("test")
    assert first_text(module, module.test_dataloader()) == "validation"  # test falls back to val_files
    module = TextDataModule(train_files=train, val_files=val, test_files=test, seq_len=16)
    module.setup("predict")
    assert first_text(module, module.predict_dataloader()) == "testing"

    module = TextDataModule(train_files=train, val_fraction=0.2, seq_len=64, seed=1)
    module.setup("fit")
    held_out = [read_documents(train)[i] for i in held_out_split(10, 0.2, seed=1)[1]]
    assert first_text(module, module.val_dataloader()) == "".join(held_out)
    assert len(stream(module.datasets["train"])) + len(stream(module.datasets["val"])) == 10 * len("train 0") + 10

    with pytest.raises(ValueError, match="Nothing to validate"):
        TextDataModule(train_files=train).setup("validate")
    with pytest.raises(ValueError, match="^Nothing to test: set val_files"):  # the stage as Lightning passes it
        TextDataModule(train_files=train).setup(TrainerFn.TESTING)
    with pytest.raises(ValueError, match="choose one source"):
        TextDataModule(train_files=train, val_files=val, val_fraction=0.1)


def test_an_empty_validation_set_is_an_error_not_a_skip(tmp_path):
    """Validation data asked for and empty stops setup (Lightning would skip validation without a word); a
    val_fraction too small for the corpus still holds out one document; no validation source is no validation."""
    train = write(tmp_path / "train.txt", "\n\n".join(f"train {i}" for i in range(10)))
    empty = write(tmp_path / "val.jsonl", '{"text": ""}\n')
    with pytest.raises(ValueError, match=r"val\.jsonl has no text"):
        TextDataModule(train_files=train, val_files=empty).setup("fit")
    module = TextDataModule(train_files=train, val_fraction=0.001, seq_len=64)
    module.setup("fit")
    assert len(module.val_dataloader()) == 1
    module = TextDataModule(train_files=train, seq_len=64)
    module.setup("fit")
    assert module.val_dataloader() == [] and "val" not in module.datasets
    module = DemoDataModule(num_documents=4, val_documents=0, seq_len=16)  # documents given in code: none held out
    module.setup("fit")
    assert module.val_dataloader() == [] and "val" not in module.datasets


def test_demo_documents_are_deterministic_in_the_seed():
    assert demo_documents(20, seed=5) == demo_documents(20, seed=5)
    assert demo_documents(20, seed=5) != demo_documents(20, seed=6)
    module = DemoDataModule(num_documents=30, val_documents=5, seed=5)
    module.setup("fit")
    assert (module.seq_len, module.batch_size) == (128, 16)
    documents = demo_documents(35, seed=5)
    assert stream(module.datasets["val"]) == [t for text in documents[30:] for t in [*byte_ids(text), EOS_ID]]
    assert len(stream(module.datasets["train"])) == sum(len(byte_ids(text)) + 1 for text in documents[:30])
