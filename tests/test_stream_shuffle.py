"""The shuffled stream: its units in an order drawn anew each pass from the seed, its documents mixed in a bounded
buffer, and a state that resumes the very rows that followed, buffer included, in a few bytes a buffered document."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_automodel.data.encoding import DocumentEncoder
from lightning_automodel.data.sources.expand import expand_sources
from lightning_automodel.data.streaming.stream import StreamedRows
from lightning_automodel.data.tokenizer import EOS_ID, PAD_ID, byte_tokenizer

DOCUMENTS = [f"doc {i:03d} " + "x" * (i % 7) for i in range(48)]


def corpus(tmp_path):
    """The documents in a JSONL file, a text file and a Parquet file of 4 row groups."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS[:16]))
    (tmp_path / "b.txt").write_text("\n\n".join(DOCUMENTS[16:32]))
    pq.write_table(
        pa.Table.from_pylist([{"text": t} for t in DOCUMENTS[32:]]), tmp_path / "c.parquet", row_group_size=4
    )
    return expand_sources([str(tmp_path / name) for name in ("a.jsonl", "b.txt", "c.parquet")])


def stream_of(sources, **options):
    return StreamedRows(sources, DocumentEncoder(byte_tokenizer()), seq_len=16, pad_id=PAD_ID, separate=True, **options)


def documents_read(stream, count):
    """The first ``count`` documents the stream lays into its rows."""
    tokens, iterator = [], iter(stream)
    while tokens.count(EOS_ID) < count:
        tokens += next(iterator)["input_ids"].tolist()
    text = byte_tokenizer().decode([t for t in tokens if t != PAD_ID])
    return text.split("<eos>")[:count]


def test_each_pass_reads_every_document_once_in_an_order_drawn_from_the_seed(tmp_path):
    sources = corpus(tmp_path)
    stream = stream_of(sources, shuffle=True, seed=3)
    read = documents_read(stream, 3 * len(DOCUMENTS))
    passes = [read[i * len(DOCUMENTS) : (i + 1) * len(DOCUMENTS)] for i in range(3)]
    assert all(sorted(one) == sorted(DOCUMENTS) for one in passes), "a pass misses or repeats documents"
    assert len({tuple(one) for one in passes}) == 3, "the order does not change with the pass"
    assert passes[0] != DOCUMENTS, "not shuffled"
    assert documents_read(stream_of(sources, shuffle=True, seed=3), 48) == passes[0]
    assert documents_read(stream_of(sources, shuffle=True, seed=4), 48) != passes[0]
    assert documents_read(stream_of(sources), 48) == DOCUMENTS, "unshuffled, the order is the files'"


def test_the_buffer_mixes_documents_across_units(tmp_path):
    """With a buffer, a document read late can come out early: documents of the Parquet file's last row group
    (read last in the unshuffled order) appear in the first pass's worth of rows."""
    sources = corpus(tmp_path)
    read = documents_read(stream_of(sources, shuffle_buffer=16, seed=0), 48)
    assert read != DOCUMENTS and len(set(read)) > 40
    positions = [DOCUMENTS.index(text) for text in read[:24]]
    assert max(positions) > 24, "the first half came out in order: the buffer does not mix"


@pytest.mark.parametrize("buffer", [0, 5, 64], ids=["no buffer", "small buffer", "buffer over a pass"])
def test_a_shuffled_stream_resumes_exactly_from_its_state(tmp_path, buffer):
    """Saved after every row, at 2 data-parallel ranks, through JSON (as a checkpoint holds it): the rows that
    followed, across passes; the state holds the buffer's places, not its tokens."""
    sources = corpus(tmp_path)
    whole = stream_of(sources, shuffle=True, shuffle_buffer=buffer, seed=1, rank=1, num_replicas=2)
    iterator, rows, states = iter(whole), [], []
    for _ in range(60):
        rows.append(next(iterator)["input_ids"].tolist())
        states.append(json.dumps(whole.state_dict()))
    assert whole.passes >= 2
    for step in (0, 7, 23, 41):
        resumed = stream_of(sources, shuffle=True, shuffle_buffer=buffer, seed=1, rank=1, num_replicas=2)
        resumed.load_state_dict(json.loads(states[step]))
        again = iter(resumed)
        assert [next(again)["input_ids"].tolist() for _ in range(59 - step)] == rows[step + 1 :], step
    places = json.loads(states[-1])["ranks"][1]["buffer"]
    assert (places is None) == (buffer == 0) and (buffer == 0 or len(places["places"]) == buffer)


def test_a_stream_resumed_with_other_shuffle_settings_is_refused(tmp_path):
    sources = corpus(tmp_path)
    saved = stream_of(sources, shuffle=True, shuffle_buffer=4)
    next(iter(saved))
    state = saved.state_dict()
    for options in ({"shuffle": True}, {"shuffle": False, "shuffle_buffer": 4}, {"shuffle": True, "shuffle_buffer": 8}):
        with pytest.raises(ValueError, match=r"saved with shuffle=True, shuffle_buffer=4 and resumes with"):
            stream_of(sources, **options).load_state_dict(state)


def test_the_buffer_holds_each_document_apart_in_2_bytes_a_token(tmp_path):
    """The buffer's documents are kept in the smallest type of the tokenizer's ids (the byte tokenizer's: 2 bytes,
    not the encoder's 8), each a copy of its own rather than a view keeping its whole tokenized batch alive; so too
    resumed, the buffered documents read again from their places."""
    sources = corpus(tmp_path)
    stream = stream_of(sources, shuffle=True, shuffle_buffer=8)
    next(iter(stream))
    resumed = stream_of(sources, shuffle=True, shuffle_buffer=8)
    resumed.load_state_dict(json.loads(json.dumps(stream.state_dict())))
    for held in (stream, resumed):
        kept = [tokens for tokens, _ in held.buffer.documents]
        assert len(kept) == 8 and all(tokens.dtype == np.uint16 and tokens.base is None for tokens in kept)
