"""Weighted mixtures of training sources: the spec, the schedule's guarantee, the cached order (epoch length by
stopping strategy, exact resume at any position and data-parallel size), the streamed mixture's resume, and both
through Lightning's checkpoints. The multi-process resume at tp=2 x dp=2 is in test_data.py's launch."""

from collections import Counter
from itertools import islice

import numpy as np
import pytest
import torch
from test_data import write, write_jsonl
from test_data_resume import fit

from lightning_automodel.data import ChatDataModule, TextDataModule, cache, mixture
from lightning_automodel.data.mixture import (
    MixedRows,
    MixedStream,
    Source,
    epoch_length,
    parse_sources,
    schedule,
    source_schedule,
)
from lightning_automodel.data.sampler import MixtureShuffle

WEIGHTS = [(0.7, 0.3), (1 / 7, 2 / 7, 4 / 7), (0.5, 0.3, 0.15, 0.05), (0.02, 0.98)]


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "DEFAULT_ROOT", tmp_path / "token-cache")


# ----------------------------------------------------------------------------------------------------- the spec


def test_train_files_as_weighted_sources_are_normalized():
    given = [{"path": "a/*.jsonl", "weight": 3}, {"path": ["b.txt", "c.txt"], "weight": 1.0}]
    assert parse_sources(given) == [Source("a/*.jsonl", 0.75), Source(["b.txt", "c.txt"], 0.25)]
    for plain in ("a.txt", ["a.txt", "b/*.txt"], []):
        assert parse_sources(plain) is None


@pytest.mark.parametrize(
    ("train_files", "message"),
    [
        (["a.txt", {"path": "b.txt", "weight": 1}], r"mixes weighted sources and plain paths .* give every entry as"),
        ([{"path": "a.txt", "weight": 1}, {"path": "b.txt", "weight": 0}], r"train_files\[1\] .* a positive number"),
        ([{"path": "a.txt", "weight": 1}, {"path": "b.txt", "weight": "x"}], r"train_files\[1\] .* a positive number"),
        ([{"path": "a.txt", "weight": 1}, {"path": "b.txt"}], r"train_files\[1\] .* \(found path\)\. Name both"),
        ([{"path": "a.txt", "weight": 1}, {"path": "b", "weight": 1, "wieght": 2}], r"found path, weight, wieght"),
        ([{"path": [], "weight": 1}, {"path": "b.txt", "weight": 1}], r"train_files\[0\] .* a non-empty list"),
        ([{"path": "a.txt", "weight": 1}], r"a mixture of one source .* Give the source's path\(s\) as train_files"),
    ],
)
def test_a_bad_mixture_is_refused_naming_the_fix(train_files, message):
    with pytest.raises(ValueError, match=message):
        TextDataModule(train_files)


def test_weights_are_for_training_and_streams_repeat():
    sources = [{"path": "a.txt", "weight": 1}, {"path": "b.txt", "weight": 1}]
    with pytest.raises(ValueError, match="val_files takes paths or glob patterns, not weighted sources"):
        TextDataModule("a.txt", val_files=sources)
    with pytest.raises(ValueError, match="stopping_strategy='first_exhausted' is for cached rows"):
        TextDataModule(sources, streaming=True, stopping_strategy="first_exhausted")
    with pytest.raises(ValueError, match="stopping_strategy='longest': it is one of all_exhausted, first_exhausted"):
        TextDataModule(sources, stopping_strategy="longest")


# ----------------------------------------------------------------------------------------------------- the schedule


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("seed", [0, 1, -5])
def test_the_schedule_holds_the_weights_in_every_prefix(weights, seed):
    """Over 10,000 rows each source's share is within 1% of its weight (relative); in every prefix, each source's
    rows are within 2 of its weight's (the bound: 1 + w (k - 2) for k sources)."""
    sources = source_schedule(weights, seed=seed, stop=10_000)
    counts = np.stack([np.cumsum(sources == s) for s in range(len(weights))], axis=1)
    expected = np.arange(1, 10_001)[:, None] * np.array(weights)
    assert np.all(np.abs(counts[-1] - expected[-1]) / expected[-1] < 0.01), counts[-1]
    bound = 1 + np.array(weights) * max(len(weights) - 2, 0)
    assert np.all(np.abs(counts - expected) < np.minimum(bound, 2)), np.abs(counts - expected).max(axis=0)


def test_the_schedule_of_any_range_is_that_of_the_whole(monkeypatch):
    """A range's schedule, computed without the rows before it, is the whole schedule's; computed in chunks too.
    It depends on the seed, and it is random, not a fixed rotation."""
    weights = [0.5, 0.3, 0.2]
    whole = schedule(weights, seed=7, start=0, stop=20_000)
    rng = np.random.default_rng(0)
    for start in [0, 1, 4095, 4096, 9_999, *rng.integers(0, 19_000, 20).tolist()]:
        stop = start + int(rng.integers(1, 1000))
        assert np.array_equal(schedule(weights, seed=7, start=start, stop=stop), whole[start:stop]), (start, stop)
    monkeypatch.setattr(mixture, "CHUNK", 333)
    assert np.array_equal(source_schedule(weights, seed=7, stop=20_000), whole)
    assert not np.array_equal(schedule(weights, seed=8, start=0, stop=20_000), whole)
    halves = schedule([0.5, 0.5], seed=0, start=0, stop=1000)
    assert 0 < (halves[1:] == halves[:-1]).mean() < 0.5  # alternating most often, but not always


# ----------------------------------------------------------------------------------------------------- the cached order


def mixed(sizes, weights):
    return MixedRows([range(size) for size in sizes], [weight / sum(weights) for weight in weights])


def sampler(sizes, weights, strategy="all_exhausted", seed=0, num_replicas=1, rank=0, epoch=0):
    shuffle = MixtureShuffle(
        mixed(sizes, weights), seed, stopping_strategy=strategy, num_replicas=num_replicas, rank=rank
    )
    shuffle.set_epoch(epoch)
    return shuffle


def by_source(order, sizes):
    """Each source's rows (its own indices) in the order read."""
    starts = np.cumsum([0, *sizes])
    sources = np.searchsorted(starts, order, side="right") - 1
    return [
        [index - starts[s] for index, source in zip(order, sources, strict=True) if source == s]
        for s in range(len(sizes))
    ]


def test_all_exhausted_reads_every_row_repeating_a_source_in_new_permutations():
    """The default: the epoch ends with the last source's last row; a source that runs out starts over, in another
    permutation; the shares are the weights'."""
    sizes, weights = [40, 3000, 500], [0.5, 0.3, 0.2]
    order = list(sampler(sizes, weights))
    assert len(order) == epoch_length(weights, sizes, seed=0, stopping_strategy="all_exhausted")
    assert abs(len(order) - 10_000) <= 2  # the second source's 3000 rows at 0.3
    rows = by_source(order, sizes)
    assert [len(source) for source in rows] == pytest.approx([w * len(order) for w in weights], abs=2)
    assert sorted(rows[1]) == list(range(3000)), "the last source to run out is read once"
    assert sorted(set(rows[2])) == list(range(500)), "a source that ran out is not read through"
    passes = [rows[0][at : at + 40] for at in range(0, len(rows[0]) - 39, 40)]
    assert len(passes) >= 124 and all(sorted(p) == list(range(40)) for p in passes), "a pass is not a permutation"
    assert len({tuple(p) for p in passes}) == len(passes), "a source repeats the same permutation"


def test_first_exhausted_ends_the_epoch_when_a_source_runs_out():
    sizes, weights = [40, 3000, 500], [0.5, 0.3, 0.2]
    order = list(sampler(sizes, weights, strategy="first_exhausted"))
    rows = by_source(order, sizes)
    assert sorted(rows[0]) == list(range(40)), "the first source to run out gives each row once"
    assert all(len(set(source)) == len(source) for source in rows), "a row repeats within the epoch"
    assert schedule(weights, seed=0, start=len(order), stop=len(order) + 1)[0] == 0, "the next row was there to read"
    assert len(order) == epoch_length(weights, sizes, seed=0, stopping_strategy="first_exhausted")
    assert abs(len(order) - 80) <= 2  # the first source's 40 rows at 0.5


def test_the_epochs_rows_change_not_its_sources():
    sizes, weights = [30, 50], [0.4, 0.6]
    first, second = list(sampler(sizes, weights)), list(sampler(sizes, weights, epoch=1))
    starts = np.cumsum([0, *sizes])
    assert first != second and len(first) == len(second)
    assert np.array_equal(np.searchsorted(starts, first, "right"), np.searchsorted(starts, second, "right"))
    assert list(sampler(sizes, weights, seed=1)) != first


@pytest.mark.parametrize("num_replicas", [1, 2])
@pytest.mark.parametrize("strategy", ["all_exhausted", "first_exhausted"])
def test_the_mixture_resumes_at_every_position(num_replicas, strategy):
    """The state saved after any row, the epoch's last included, resumes on the rows that followed (the next
    epoch's after the last row)."""
    sizes, weights = [5, 13], [0.5, 0.5]
    for rank in range(num_replicas):
        sampled = sampler(sizes, weights, strategy, num_replicas=num_replicas, rank=rank, epoch=2)
        epoch = list(sampled)
        sampled.set_epoch(3)
        next_epoch = list(sampled)
        for position in range(len(epoch) + 1):
            iterator = iter(sampler(sizes, weights, strategy, num_replicas=num_replicas, rank=rank, epoch=2))
            list(islice(iterator, position))
            resumed = iter(sampler(sizes, weights, strategy, num_replicas=num_replicas, rank=rank))
            resumed.load_state_dict(iterator.state_dict())
            rest = epoch[position:] if position < len(epoch) else next_epoch
            assert list(resumed) == rest, (rank, position)


@pytest.mark.parametrize("num_replicas", [1, 3])
def test_the_mixture_resumed_at_another_data_parallel_size_reads_the_rest_of_the_epoch(num_replicas):
    """Saved after 3 rows on each of 2 ranks (6 rows read together), resumed on 1 or 3 ranks: together, the
    epoch's rows as that size deals them."""
    sizes, weights = [7, 20], [0.3, 0.7]
    saved = [iter(sampler(sizes, weights, num_replicas=2, rank=rank)) for rank in (0, 1)]
    read = [next(iterator) for _ in range(3) for iterator in saved]
    resumed = [iter(sampler(sizes, weights, num_replicas=num_replicas, rank=r)) for r in range(num_replicas)]
    for iterator in resumed:
        iterator.load_state_dict(saved[0].state_dict())
    whole = [row for r in range(num_replicas) for row in sampler(sizes, weights, num_replicas=num_replicas, rank=r)]
    assert Counter(read + [row for iterator in resumed for row in iterator]) == Counter(whole)


def test_the_ranks_deal_the_single_process_order():
    sizes, weights = [7, 20], [0.3, 0.7]
    alone = list(sampler(sizes, weights))
    dealt = [list(sampler(sizes, weights, num_replicas=3, rank=rank)) for rank in range(3)]
    padded = alone + alone[: 3 * len(dealt[0]) - len(alone)]
    assert [padded[rank::3] for rank in range(3)] == dealt


# ----------------------------------------------------------------------------------------------------- the data modules


def corpora(tmp_path, counts=(12, 40)):
    """Text sources whose documents name their source and number: ``a 0``, ``a 1``, ... and ``b 0``, ..."""
    return [
        write(tmp_path / f"{name}.txt", "\n\n".join(f"{name} {index}" for index in range(count)))
        for name, count in zip("ab", counts, strict=True)
    ]


def texts(rows):
    """Each row's text, without EOS and padding (a padded row holds one document)."""
    return [bytes(token for token in row.tolist() if token < 256).decode() for row in rows]


def loader_rows(loader):
    return [row for batch in loader for row in batch["input_ids"]]


def test_a_cached_mixture_reads_each_source_by_its_weight_from_its_own_cache(tmp_path):
    a, b = corpora(tmp_path)
    sources = [{"path": a, "weight": 0.25}, {"path": b, "weight": 0.75}]
    data = TextDataModule(sources, pack=False, seq_len=8, batch_size=4, cache_dir=str(tmp_path / "tokens"))
    data.setup("fit")
    assert sorted(path.name for path in (tmp_path / "tokens").glob("[!.]*")) == ["train-0", "train-1"]
    rows = texts(loader_rows(data.train_dataloader()))
    assert sorted(set(rows)) == sorted([f"a {i}" for i in range(12)] + [f"b {i}" for i in range(40)])
    assert sum(row.startswith("a") for row in rows) == pytest.approx(len(rows) / 4, abs=2)


def test_a_mixture_holds_out_val_fraction_of_every_source(tmp_path):
    a, b = corpora(tmp_path)
    data = TextDataModule([{"path": a, "weight": 1}, {"path": b, "weight": 1}], pack=False, val_fraction=0.25)
    data.setup("fit")
    val = data.datasets["val"]
    held_out = set(texts(val[i]["input_ids"] for i in range(len(val))))
    trained = set(texts(loader_rows(data.train_dataloader())))
    assert len([row for row in held_out if row.startswith("a")]) == 3 and len(held_out) == 3 + 10
    assert not held_out & trained and len(held_out | trained) == 12 + 40


def test_a_chat_mixture_reads_both_sources(tmp_path):
    records = [
        write_jsonl(tmp_path / f"{name}.jsonl", [{"prompt": f"{name}{i}?", "completion": "ok"} for i in range(n)])
        for name, n in (("x", 3), ("y", 9))
    ]
    data = ChatDataModule([{"path": records[0], "weight": 2}, {"path": records[1], "weight": 1}], pack=False)
    data.setup("fit")
    prompts = [row.split("?")[0] for row in texts(loader_rows(data.train_dataloader()))]
    assert set(prompts) == {f"x{i}" for i in range(3)} | {f"y{i}" for i in range(9)}
    assert sum(prompt[0] == "x" for prompt in prompts) == pytest.approx(len(prompts) * 2 / 3, abs=2)


def streamed(sources):
    data = TextDataModule(sources, streaming=True, seq_len=8, batch_size=2)
    data.setup("fit")
    return data.train_dataloader()


def test_a_streamed_mixture_resumes_from_its_state_and_repeats_a_source_that_runs_out(tmp_path):
    """Resumed from its state mid-stream, the rows that followed (with other sources, refused); each source's rows
    are those of its stream alone, which starts over once through its files."""
    a, b = corpora(tmp_path, counts=(3, 40))
    sources = [{"path": a, "weight": 0.4}, {"path": b, "weight": 0.6}]
    loader = streamed(sources)
    iterator = iter(loader)
    head = loader_rows(islice(iterator, 7))
    state = loader.state_dict()
    following = loader_rows(islice(iterator, 9))
    resumed = streamed(sources)
    resumed.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(loader_rows(islice(resumed, 9)), following, strict=True))
    assert isinstance(loader.dataset, MixedStream) and loader.dataset.streams[0].passes >= 2, "a did not run out"
    with pytest.raises(ValueError, match="saved with 2 sources and resumes with 3: .* Resume with the same sources"):
        streamed([*sources, {"path": b, "weight": 1}]).dataset.load_state_dict(loader.dataset.state_dict())
    from_a = np.flatnonzero(schedule([0.4, 0.6], seed=0, start=0, stop=32) == 0)
    alone = list(islice(iter(streamed(a).dataset), len(from_a)))
    assert all(torch.equal((head + following)[i], row["input_ids"]) for i, row in zip(from_a, alone, strict=True))


@pytest.mark.parametrize("streaming", [False, True], ids=["cached", "streamed"])
def test_lightning_checkpoint_resumes_a_mixture_on_the_same_batches(tmp_path, streaming):
    """Saved mid-epoch 1 and at the end of epoch 0 (cached), or mid-stream: resumed, the batches that followed."""
    a, b = corpora(tmp_path)
    sources = [{"path": a, "weight": 0.3}, {"path": b, "weight": 0.7}]

    def data():
        return TextDataModule(sources, streaming=streaming, seq_len=16, batch_size=4)

    trainer, full = fit(16, tmp_path / "whole", data=data())
    per_epoch = trainer.num_training_batches
    steps = [7] if streaming else [per_epoch, per_epoch + 2]
    assert streaming or per_epoch < 16 - 2
    for step in steps:
        checkpoint = next((tmp_path / "whole").glob(f"*-step={step}.ckpt"))
        _, resumed = fit(16, tmp_path / f"resumed-{step}", ckpt_path=checkpoint, data=data())
        assert len(resumed) == 16 - step and all(torch.equal(x, y) for x, y in zip(resumed, full[step:], strict=True))
