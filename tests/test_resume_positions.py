"""Resumed from each position a ModelCheckpoint saves at, training goes on as it went uninterrupted: every step's
batch, loss (bitwise), current_epoch, batch_idx and global_step, and at the end the logging step count and the
weights. Positions: mid-epoch (in the second epoch), an epoch's last batch (``every_n_train_steps`` dividing the
epoch), an epoch's end (``every_n_epochs``) and after the epoch's validation; under ``max_steps`` and under
``max_epochs`` with ``configure_optimizers`` reading ``estimated_stepping_batches``. Lightning 2.6 alone gets many
of them wrong (docs/checkpoints.md, "Resume positions"); the strategy's ``EpochEndResume`` makes them exact.
"""

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.data import cache
from lightning_automodel.data.demo import DemoDataModule
from lightning_automodel.data.loaders import QuietStatefulDataLoader
from lightning_automodel.data.sampler import ResumableShuffle
from lightning_automodel.data.tokenizer import BYTE_VOCAB_SIZE
from lightning_automodel.lm.module import CausalLMModule
from lightning_automodel.strategy.epoch_end_resume import EpochEndResume
from lightning_automodel.testing.models import batch, tiny_config, tiny_model
from lightning_automodel.testing.parity import full
from lightning_automodel.testing.trainer_parity import CausalLM

SAVES = {  # ModelCheckpoint's options, by the position it saves at
    "steps": dict(every_n_train_steps=1),
    "epochs": dict(every_n_epochs=1, save_on_train_epoch_end=True),
    # With validation: after the epoch's validation. (mode, unused without a monitor, keys its state apart.)
    "validated": dict(every_n_epochs=1, mode="max"),
}
POSITIONS = {  # the save, and the steps after the first epoch it holds
    "mid-epoch": ("steps", 1),
    "last batch": ("steps", 0),
    "epoch end": ("epochs", 0),
    "after validation": ("validated", 0),
}
STOPS = {"max_steps": dict(max_steps=9), "max_epochs": dict(max_epochs=3)}  # three epochs of 3 batches


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "DEFAULT_ROOT", tmp_path / "token-cache")


class Record(L.Callback):
    """Each step as the run took it, and where the run ended."""

    def __init__(self) -> None:
        self.steps: list[tuple] = []
        self.end: tuple = ()
        self.weights: list[torch.Tensor] = []

    def on_train_start(self, trainer, pl_module):
        self.per_epoch = trainer.num_training_batches

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rows = batch["input_ids"] if isinstance(batch, dict) else batch[0]
        loss = outputs["loss"].item()
        self.steps.append((trainer.current_epoch, batch_idx, trainer.global_step, loss, rows.tolist()))

    def on_train_end(self, trainer, pl_module):
        self.end = (trainer.fit_loop.epoch_loop._batches_that_stepped, trainer.current_epoch, trainer.global_step)
        self.weights = [full(parameter).detach().clone() for parameter in pl_module.parameters()]


class Linear(L.LightningModule):
    """A step whose loss tells the batches and the weights apart; its optimizer reads the number of steps, as
    CausalLMModule's schedule does (which, under max_epochs, makes Lightning build the loader before the resume)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        return (self.layer(batch[0]) - 1).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        assert self.trainer.estimated_stepping_batches > 0
        return torch.optim.SGD(self.parameters(), lr=0.01)


class OneDevice(EpochEndResume, SingleDeviceStrategy):
    """Lightning's one-device strategy with the workaround."""


def rows(count: int = 12) -> TensorDataset:
    return TensorDataset(torch.arange(float(count)).unsqueeze(1))


LOADERS = {  # 3 batches an epoch, in an order that changes with the epoch
    "plain": lambda: DataLoader(rows(), batch_size=4, sampler=DistributedSampler(rows(), num_replicas=1, rank=0)),
    "stateful": lambda: StatefulDataLoader(rows(), batch_size=4, sampler=DistributedSampler(rows(), 1, 0)),
    "project's": lambda: QuietStatefulDataLoader(rows(), batch_size=4, sampler=ResumableShuffle(rows(), seed=0)),
}


def fit(root: Path, make: dict, stop: dict, ckpt_path: Path | None = None) -> Record:
    """``make``: the strategy, module and data (loaders or a data module) of a run, built afresh for each."""
    record = Record()
    saves = [ModelCheckpoint(root / name, save_top_k=-1, **options) for name, options in SAVES.items()]
    trainer = L.Trainer(
        strategy=make["strategy"](),
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        callbacks=[record, *(saves if ckpt_path is None else [])],
        enable_checkpointing=ckpt_path is None,
        **stop,
    )
    trainer.fit(make["module"](), *make["data"](), ckpt_path=ckpt_path)
    return record


def resume(tmp_path: Path, make: dict, stop: dict, positions: list[str]) -> tuple[Record, dict[str, Record]]:
    """The uninterrupted run, and the runs resumed from its checkpoints at ``positions``."""
    whole = fit(tmp_path / "whole", make, stop)
    assert whole.per_epoch == 3 and len(whole.steps) == 9, (whole.per_epoch, len(whole.steps))
    resumed = {}
    for position in positions:
        save, past_first_epoch = POSITIONS[position]
        checkpoint = next((tmp_path / "whole" / save).glob(f"*-step={whole.per_epoch + past_first_epoch}.ckpt"))
        resumed[position] = fit(tmp_path / position, make, stop, ckpt_path=checkpoint)
    return whole, resumed


def after(whole: Record, position: str) -> list[tuple]:
    """The uninterrupted run's steps after the checkpoint at ``position``."""
    return whole.steps[whole.per_epoch + POSITIONS[position][1] :]


def differences(whole: Record, resumed: dict[str, Record]) -> dict[str, str]:
    """What differs from the uninterrupted run, by position (none where nothing does)."""
    found = {}
    for position, run in resumed.items():
        expected = after(whole, position)
        if run.steps != expected or run.end != whole.end:
            steps = [step[:4] for step in run.steps]
            found[position] = (
                f"(epoch, batch_idx, global_step, loss) {steps}, end {run.end};"
                f" uninterrupted {[step[:4] for step in expected]}, end {whole.end}"
            )
        elif not all(torch.equal(a, b) for a, b in zip(run.weights, whole.weights, strict=True)):
            found[position] = "the same steps, other weights"
    return found


@pytest.mark.parametrize("stop", STOPS)
@pytest.mark.parametrize("loader", LOADERS)
def test_every_position_resumes_as_uninterrupted(tmp_path, loader, stop):
    """On Lightning's one-device strategy with the workaround. A plain DataLoader has no saved position (resumed
    mid-epoch, it reads the epoch's first batches again; Lightning warns): it is resumed between epochs only."""
    make = {
        "strategy": lambda: OneDevice(torch.device("cpu")),
        "module": Linear,
        "data": lambda: (LOADERS[loader](), DataLoader(rows(4))),
    }
    positions = [position for position in POSITIONS if loader != "plain" or position != "mid-epoch"]
    assert differences(*resume(tmp_path, make, STOPS[stop], positions)) == {}


def test_lightning_alone_skips_an_epoch_resumed_from_its_last_batch(tmp_path):
    """Lightning 2.6's own resume (the reproduction in docs/checkpoints.md): the StatefulDataLoader comes back
    exhausted, the epoch after the checkpoint is empty, and training goes on one epoch ahead. When this fails,
    Lightning resumes there itself and the workaround can go."""
    make = {
        "strategy": lambda: SingleDeviceStrategy(torch.device("cpu")),
        "module": Linear,
        "data": lambda: (LOADERS["stateful"](), DataLoader(rows(4))),
    }
    whole, resumed = resume(tmp_path, make, STOPS["max_steps"], ["last batch"])
    epochs = [step[0] for step in resumed["last batch"].steps]
    assert [step[0] for step in after(whole, "last batch")] == [1, 1, 1, 2, 2, 2]
    assert epochs == [2, 2, 2, 3, 3, 3], differences(whole, resumed)


def causal_lm_stateful():
    tokens, labels = batch(12)
    return StatefulDataLoader(TensorDataset(tokens, labels), batch_size=4), DataLoader(TensorDataset(tokens, labels))


def causal_lm_module() -> CausalLMModule:
    return CausalLMModule(config=tiny_config("llama", vocab_size=BYTE_VOCAB_SIZE).to_dict(), learning_rate=1e-3)


STRATEGY_RUNS = {
    # The run: a Hugging Face model, Lightning's DistributedSampler under a StatefulDataLoader, max_steps.
    "StatefulDataLoader, max_steps": dict(
        module=lambda: CausalLM(tiny_model()), data=causal_lm_stateful, stop=STOPS["max_steps"]
    ),
    # The package's own: CausalLMModule (its schedule reads estimated_stepping_batches) on the demo data, max_epochs.
    "CausalLMModule on the demo data, max_epochs": dict(
        module=causal_lm_module,
        data=lambda: (DemoDataModule(num_documents=2, val_documents=2, seq_len=32, batch_size=4),),
        stop=STOPS["max_epochs"],
    ),
}


@pytest.mark.parametrize("run", STRATEGY_RUNS)
def test_the_strategy_resumes_every_position_as_uninterrupted(tmp_path, run):
    """AutoModelParallelStrategy in one process (a world of 1), a tiny Llama, from every position: every loss
    bitwise the uninterrupted run's (Lightning alone: the first run skips an epoch, the second replays epoch 0)."""
    options = STRATEGY_RUNS[run]
    make = {"strategy": AutoModelParallelStrategy, "module": options["module"], "data": options["data"]}
    assert differences(*resume(tmp_path, make, options["stop"], list(POSITIONS))) == {}
