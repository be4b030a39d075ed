"""Exact resume of the training loader: the shuffle's order and state, Lightning's checkpoints mid-epoch and at an
epoch's end, streams and mixtures at tp=2 x dp=2."""

from functools import partial
from itertools import islice

import lightning as L
import pytest
import torch
from data_checks import DEMO, check_mixture_resume, check_resume_across_epochs, check_streamed_resume
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DistributedSampler

from lightning_automodel.data import cache
from lightning_automodel.data.demo import DemoDataModule, demo_documents
from lightning_automodel.data.modules.text import TextDataModule
from lightning_automodel.data.sampler import ResumableShuffle
from lightning_automodel.testing.harness import check_name, run_checks


def tokens_of(rows):
    return [rows[i]["input_ids"].tolist() for i in range(len(rows))]


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "DEFAULT_ROOT", tmp_path / "token-cache")


def demo_loader(num_workers=0):
    module = DemoDataModule(num_documents=60, val_documents=0, seq_len=16, batch_size=4, num_workers=num_workers)
    module.setup("fit")
    return module.train_dataloader()


def batches(loader, count):
    return [batch["input_ids"] for batch in islice(loader, count)]


@pytest.mark.parametrize("epoch", [0, 1])
def test_train_loader_resumes_exactly_from_its_state_dict(epoch):
    original = demo_loader()
    original.sampler.set_epoch(epoch)
    iterator = iter(original)
    batches(iterator, 5)
    state = original.state_dict()
    expected = batches(iterator, 6)

    # Lightning builds the resumed iterator before calling set_epoch: the state alone must restore the epoch.
    resumed = demo_loader()
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    assert all(torch.equal(a, b) for a, b in zip(batches(iterator, 3), expected[:3], strict=True))
    state = resumed.state_dict()
    again = demo_loader()  # a second resume continues from the total position, not from the first resume
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(batches(iter(again), 3), expected[3:], strict=True))


def test_shuffle_depends_on_seed_and_epoch_only():
    def epoch_rows(loader):
        return torch.cat([batch["input_ids"] for batch in loader])

    loader = demo_loader()
    first = epoch_rows(loader)
    assert torch.equal(first, epoch_rows(demo_loader()))
    loader.sampler.set_epoch(1)
    second = epoch_rows(loader)
    assert not torch.equal(first, second)
    assert sorted(map(tuple, first.tolist())) == sorted(map(tuple, second.tolist()))  # same rows, other order


@pytest.mark.parametrize(("size", "num_replicas"), [(10, 1), (10, 3), (2, 4)])
def test_shuffle_deals_each_rank_what_a_distributed_sampler_would(size, num_replicas):
    """Same seed and epoch, same rows per rank as torch's DistributedSampler, padding included."""
    for rank in range(num_replicas):
        ours = ResumableShuffle(range(size), seed=3, num_replicas=num_replicas, rank=rank)
        torchs = DistributedSampler(range(size), num_replicas=num_replicas, rank=rank, seed=3)
        ours.set_epoch(2)
        torchs.set_epoch(2)
        assert list(ours) == list(torchs)


@pytest.mark.parametrize("num_replicas", [1, 3])
def test_shuffle_resumed_at_another_data_parallel_size_reads_the_rest_of_the_epoch(num_replicas):
    """Saved after 3 rows on each of 2 ranks (6 rows read together), resumed on 1 or 3 ranks."""
    saved = [iter(ResumableShuffle(range(12), seed=0, num_replicas=2, rank=rank)) for rank in (0, 1)]
    read = [next(iterator) for _ in range(3) for iterator in saved]
    resumed = [
        iter(ResumableShuffle(range(12), seed=0, num_replicas=num_replicas, rank=r)) for r in range(num_replicas)
    ]
    for iterator in resumed:
        iterator.load_state_dict(saved[0].state_dict())
    assert sorted(read + [row for iterator in resumed for row in iterator]) == list(range(12))


class _RecordBatches(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"])
        return self.weight * batch["input_ids"].float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(max_steps, tmp_path, ckpt_path=None, data=None):
    module = _RecordBatches()
    data = data or DemoDataModule(num_documents=10, val_documents=0, seq_len=32, batch_size=4)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[checkpoints],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer, module.seen


@pytest.mark.parametrize("last_batch", [4, 11], ids=["mid-epoch", "epoch end"])
def test_lightning_checkpoint_resumes_on_the_same_batches(tmp_path, last_batch):
    """Saved after the given batch of epoch 1: resumed, the run reads what it read uninterrupted. Saved after an
    epoch's last batch, Lightning resumes into the next epoch without building a new iterator."""
    trainer, full = fit(40, tmp_path)
    per_epoch = trainer.num_training_batches
    assert per_epoch == 11
    step = per_epoch + last_batch
    checkpoint = next(tmp_path.glob(f"*-step={step}.ckpt"))
    assert torch.load(checkpoint, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    _, resumed = fit(40, tmp_path / "resumed", ckpt_path=checkpoint)
    same = [torch.equal(a, b) for a, b in zip(resumed, full[step:], strict=True)]
    assert all(same), f"resumed from step {step}, the run reads other batches (False) than uninterrupted: {same}"


def test_lightning_checkpoint_resumes_a_stream_on_the_same_batches(tmp_path):
    """Streamed rows saved mid-pass and resumed through Lightning's checkpoint: the batches that followed, into the
    next pass over the files."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(demo_documents(10, seed=0)))

    def streamed():
        return TextDataModule(train_files=str(corpus), streaming=True, seq_len=32, batch_size=4)

    _, full = fit(30, tmp_path / "whole", data=streamed())
    checkpoint = next((tmp_path / "whole").glob("*-step=7.ckpt"))
    _, resumed = fit(30, tmp_path / "resumed", ckpt_path=checkpoint, data=streamed())
    assert len(resumed) == 23 and all(torch.equal(a, b) for a, b in zip(resumed, full[7:], strict=True))
    with pytest.raises(ValueError, match=r"set Trainer\(max_steps=\.\.\.\)"):
        fit(-1, tmp_path / "endless", data=streamed())


def test_distributed_resume_across_epochs_reads_the_uninterrupted_rows(tmp_path):
    """World 4 at tp=2 x dp_shard=2, two epochs: tensor-parallel peers read the same rows, the two data-parallel
    ranks share out every row once per epoch, in an order that changes with the epoch; resumed from the end of
    epoch 0 or from mid-way through epoch 1, every rank reads the rows it read uninterrupted. Streamed: tp peers
    read the same rows, the dp ranks others, and a resume from step 3 the rows that followed. A weighted mixture of
    two sources, cached and streamed, alike (its cached epoch reads every row of both sources)."""
    check = partial(check_resume_across_epochs, str(tmp_path), 2)
    streamed = partial(check_streamed_resume, str(tmp_path), 2)
    mixture = partial(check_mixture_resume, str(tmp_path), 2)
    results = run_checks(4, [check, streamed, mixture])
    ranks = results[check_name(check)]
    data = DemoDataModule(**DEMO)
    data.setup("fit")
    epochs = epoch_rows(ranks)
    for epoch in epochs:
        assert sorted(epoch) == sorted(map(tuple, tokens_of(data.datasets["train"]))), "not every row once an epoch"
    assert epochs[0] != epochs[1], "the order does not change with the epoch: a replayed epoch would go unseen"
    assert_resumed_across_epochs(ranks)
    assert_resumed_stream(results[check_name(streamed)])
    mixed = results[check_name(mixture)]
    sources = TextDataModule(
        [{"path": str(tmp_path / f"mixture-{name}.txt"), "weight": 1} for name in "ab"], seq_len=16
    )
    sources.setup("fit")
    for epoch in epoch_rows([rank["cached"] for rank in mixed]):
        assert set(epoch) == set(map(tuple, tokens_of(sources.datasets["train"]))), "a mixture's epoch misses rows"
    assert_resumed_across_epochs([rank["cached"] for rank in mixed])
    assert_resumed_stream([rank["streamed"] for rank in mixed])


def dp_rows(runs):
    """Each data-parallel rank's uninterrupted rows, once its tensor-parallel peers are found to read the same."""
    by_dp_rank = {}
    for run in runs:
        by_dp_rank.setdefault(run["dp_rank"], []).append(run["whole"])
    assert sorted(by_dp_rank) == [0, 1], "the strategy's data-parallel ranks are not the expected ones"
    assert all(rows == peers[0] for peers in by_dp_rank.values() for rows in peers), "tp peers read other rows"
    assert by_dp_rank[0][0] != by_dp_rank[1][0], "the dp ranks read the same rows"
    return [by_dp_rank[dp][0] for dp in (0, 1)]


def epoch_rows(runs):
    """The rows both data-parallel ranks read in each of the two epochs."""
    per_epoch = runs[0]["per_epoch"]
    whole = dp_rows(runs)
    return [
        [tuple(row) for rows in whole for step in rows[at : at + per_epoch] for row in step] for at in (0, per_epoch)
    ]


def assert_resumed_across_epochs(runs):
    differ = sorted({step for run in runs for step, rows in run["resumed"].items() if rows != run["whole"][step:]})
    assert not differ, f"resumed from steps {differ}: other rows than the uninterrupted run"


def assert_resumed_stream(runs):
    dp_rows(runs)
    resumed = [run["resumed"] == run["whole"][3:] for run in runs]
    assert all(resumed), f"a resumed stream reads other rows (False) than uninterrupted: {resumed}"
