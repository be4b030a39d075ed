"""Fine-tuning data: conversations and prompt/completion records made rows whose labels are the answers alone,
packed with position ids restarting at each record, truncated by stated rules; bad records named by file and line."""

import json

import pytest

from lightning_automodel.data import ChatDataModule, cache
from lightning_automodel.data.chat import encode_record
from lightning_automodel.data.rows import IGNORE_INDEX
from lightning_automodel.data.tokenizer import EOS_ID, PAD_ID, byte_tokenizer

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
}
PAIR = {"prompt": "1+1=", "completion": "2"}


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "DEFAULT_ROOT", tmp_path / "token-cache")


def write_records(path, records):
    path.write_text("".join((record if isinstance(record, str) else json.dumps(record)) + "\n" for record in records))
    return str(path)


def trained_text(tokenizer, ids, labels):
    return tokenizer.decode([token for token, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])


def test_labels_are_the_answers_alone():
    tokenizer = byte_tokenizer()
    ids, trained = encode_record(tokenizer, CHAT, "x")
    assert tokenizer.decode(ids).startswith("### system:\nBe brief.\n### user:\nHi?\n### assistant:\nHello.<eos>")
    assert tokenizer.decode([t for t, keep in zip(ids, trained, strict=True) if keep]) == "Hello.<eos>4<eos>"
    ids, trained = encode_record(tokenizer, PAIR, "x")
    assert ids == [*b"1+1=", *b"2", EOS_ID] and trained.tolist() == [0, 0, 0, 0, 1, 1]


def test_a_template_without_generation_blocks_is_rendered_turn_by_turn():
    """Each answer is what its turn adds to the rendering up to its generation prompt (here with the turn's closing
    newline); a template that rewrites earlier turns is refused, naming the fix."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    ids, trained = encode_record(tokenizer, CHAT, "x")
    assert ids == encode_record(byte_tokenizer(), CHAT, "x")[0]
    assert tokenizer.decode([t for t, keep in zip(ids, trained, strict=True) if keep]) == "Hello.<eos>\n4<eos>\n"
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ messages | length }}"
    with pytest.raises(ValueError, match=r"x, message 2: the chat template renders .* \{% generation %\} blocks"):
        encode_record(tokenizer, CHAT, "x")


def test_packed_rows_restart_positions_at_each_record_and_train_on_answers(tmp_path):
    path = write_records(tmp_path / "sft.jsonl", [CHAT, PAIR, PAIR, CHAT])
    module = ChatDataModule(train_files=path, seq_len=112, batch_size=2)
    module.setup("fit")
    rows, tokenizer = module.datasets["train"], module.tokenizer
    lengths = [len(encode_record(tokenizer, record, "x")[0]) for record in (CHAT, PAIR, PAIR, CHAT)]
    assert lengths[0] + 2 * lengths[1] <= 112 < lengths[0] + 2 * lengths[1] + lengths[3]
    assert len(rows) == 2  # [CHAT, PAIR, PAIR] and [CHAT]: records in order, never split
    first = {name: value.tolist() for name, value in rows[0].items()}
    assert set(first) == {"input_ids", "labels", "position_ids"}
    starts = [0, lengths[0], lengths[0] + lengths[1], sum(lengths[:3])]  # the last: the padding
    expected = [p for start, end in zip(starts, [*starts[1:], 112], strict=True) for p in range(end - start)]
    assert first["position_ids"] == expected
    assert trained_text(tokenizer, first["input_ids"], first["labels"]) == "Hello.<eos>4<eos>2<eos>2<eos>"
    assert first["input_ids"][starts[3] :] == [PAD_ID] * (112 - starts[3])
    one_a_row = ChatDataModule(train_files=path, seq_len=112, pack=False)
    one_a_row.setup("fit")
    padded = one_a_row.datasets["train"][1]
    assert set(padded) == {"input_ids", "labels", "attention_mask"} and len(one_a_row.datasets["train"]) == 4
    assert padded["attention_mask"].sum() == lengths[1]


def test_truncation_keeps_a_records_start_and_refuses_a_prompt_that_fills_the_row(tmp_path, recwarn):
    long_answer = {"prompt": "Q:", "completion": "a" * 40}
    path = write_records(tmp_path / "sft.jsonl", [PAIR, long_answer])
    module = ChatDataModule(train_files=path, seq_len=16)
    module.setup("fit")
    rows = module.datasets["train"]
    assert len(rows) == 2 and rows[1]["input_ids"].tolist() == [*b"Q:", *b"a" * 14]
    assert rows[1]["labels"].tolist() == [IGNORE_INDEX] * 2 + [*b"a" * 14]
    assert any("1 of 2 records are longer than seq_len=16" in str(w.message) for w in recwarn)
    long_prompt = write_records(tmp_path / "long.jsonl", [PAIR, {"prompt": "p" * 16, "completion": "a"}])
    with pytest.raises(ValueError, match=r"long\.jsonl, line 2: the prompt alone takes 16 tokens, seq_len=16"):
        ChatDataModule(train_files=long_prompt, seq_len=16).setup("fit")


BAD_RECORDS = {
    "no role": ({"messages": [{"content": "hi"}]}, r"line 2, message 0: a message needs a 'role' and a 'content'"),
    "no content": ({"messages": [{"role": "user"}]}, r"message 0: a message needs a 'role' and a 'content'"),
    "unknown role": ({"messages": [{"role": "bot", "content": "x"}]}, r"role 'bot' is not one of"),
    "answer first": (
        {"messages": [{"role": "assistant", "content": "x"}]},
        r"message 0: a 'assistant' message cannot come first",
    ),
    "two questions": (
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
        r"message 1: a 'user' message cannot come after a 'user' message",
    ),
    "late system": (
        {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
        r"message 1: a 'system' message cannot come after a 'user' message",
    ),
    "no answer": ({"messages": [{"role": "user", "content": "a"}]}, r"line 2: no assistant answer to train on"),
    "empty completion": ({"prompt": "a", "completion": " "}, r"line 2: the completion is empty"),
    "other fields": ({"text": "a"}, r"line 2: neither a conversation .* found \['text'\]"),
    "not json": ("{'messages': []}", r"line 2: not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_a_bad_record_is_named_by_file_and_line(tmp_path, case):
    record, message = BAD_RECORDS[case]
    path = write_records(tmp_path / "sft.jsonl", [PAIR, record])
    with pytest.raises(ValueError, match=rf"sft\.jsonl, {message}" if message.startswith("line") else message):
        ChatDataModule(train_files=path, seq_len=64, tokenize_workers=0).setup("fit")


def test_a_tokenizer_without_a_chat_template_and_a_text_file_are_refused(tmp_path):
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    path = write_records(tmp_path / "sft.jsonl", [CHAT])
    with pytest.raises(ValueError, match=r"sft\.jsonl, line 1: the tokenizer has no chat template .* prompt/complet"):
        ChatDataModule(train_files=path, tokenizer=str(tmp_path / "tokenizer")).setup("fit")
    text = tmp_path / "notes.txt"
    text.write_text("plain text")
    with pytest.raises(ValueError, match=r"notes\.txt: fine-tuning records are read from \.jsonl files"):
        ChatDataModule(train_files=str(text)).setup("fit")
