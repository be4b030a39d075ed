"""benchmarks/data.py and benchmarks/data_tables.py follow the data modules: their readings run in this process on a
tiny corpus (the benchmarks run each in a fresh process on 10M tokens and more), so that a change of the modules'
interfaces fails here rather than when someone next measures."""

from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def benchmarks(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import each other by name, as run from there
    import data
    import data_tables

    monkeypatch.setattr(data_tables, "ROW_GROUP_ROWS", 1)  # a group for each of 8 ranks from a few documents
    return data, data_tables


def test_the_data_benchmarks_read_jsonl_and_parquet_as_a_rank_of_8(benchmarks, tmp_path):
    data, data_tables = benchmarks
    options = {"seq_len": 64, "batch_size": 2, "tokenize_workers": 0}
    (tmp_path / "jsonl").mkdir()
    (tmp_path / "parquet").mkdir()
    corpora = {
        "jsonl": data.write_corpus(tmp_path / "jsonl", 1_000_000),
        "parquet": data_tables.write_parquet(tmp_path / "parquet", 1_000_000),
    }
    for name, files in corpora.items():
        cached = data.read_as_rank(files, str(tmp_path / f"cache-{name}"), options, 2)
        assert cached["tokens_per_s"] > 0, name
        for shuffled in ({"shuffle": True, "shuffle_buffer": 4}, {"shuffle": False}):
            streamed = data.read_as_rank(files, str(tmp_path / "none"), {**options, "streaming": True, **shuffled}, 2)
            assert 0 < streamed["state_bytes"] < 2_000, (name, shuffled, streamed)
    limit = data_tables._pyarrow_read(corpora["parquet"], True)
    assert limit["rows"] > 8 and limit["tokens_per_s"] > 0
