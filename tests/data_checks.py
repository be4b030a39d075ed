"""The language-model data modules under a real Trainer inside gloo workers (lightning_automodel.testing.harness)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.data import TextDataModule
from lightning_automodel.data.demo import DemoDataModule, demo_documents
from lightning_automodel.testing.models import VOCAB, tiny_model
from lightning_automodel.testing.trainer_parity import CausalLM, trainer

# 28 rows of 16 tokens, 5 per data-parallel rank and step: at dp=2, an epoch is 3 steps (5 + 5 + 4 rows, no padding).
DEMO = dict(num_documents=3, val_documents=0, seq_len=16, batch_size=5)
STEPS = 6  # two epochs


class RecordRows(CausalLM):
    """Trains on the demo rows (folded into the tiny vocabulary) and records the rows of every step."""

    def __init__(self) -> None:
        super().__init__(tiny_model())
        self.rows: list[list[list[int]]] = []

    def training_step(self, batch, batch_idx):
        self.rows.append(batch["input_ids"].tolist())
        tokens = batch["input_ids"] % VOCAB
        return super().training_step((tokens, tokens), batch_idx)


def check_resume_across_epochs(directory: str, tp: int) -> dict:
    """Two epochs uninterrupted, saving after every step; then resumed from the end of epoch 0 and from mid-way
    through epoch 1. Returns this rank's data-parallel rank, the steps of an epoch, the rows of each uninterrupted
    step, and the rows of each resumed run by the step it resumed from (the test compares them across ranks)."""

    def fit(ckpt_path: Path | None = None, callbacks: tuple = ()) -> tuple:
        module = RecordRows()
        strategy = AutoModelParallelStrategy(tp=tp)
        run = trainer(strategy, max_steps=STEPS, callbacks=list(callbacks), enable_checkpointing=bool(callbacks))
        run.fit(module, DemoDataModule(**DEMO), ckpt_path=ckpt_path)
        return run, module.rows

    run, whole = fit(callbacks=(ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=-1),))
    per_epoch = run.num_training_batches
    resumed = {
        step: fit(ckpt_path=next(Path(directory).glob(f"*-step={step}.ckpt")))[1] for step in (per_epoch, per_epoch + 1)
    }
    dp_rank = run.strategy.distributed_sampler_kwargs["rank"]
    return {"dp_rank": dp_rank, "per_epoch": per_epoch, "whole": whole, "resumed": resumed}


def check_streamed_resume(directory: str, tp: int) -> dict:
    """A shuffled stream of the demo documents (a text file and a Parquet file of 8 row groups every rank names),
    through a buffer of 8 documents, for 6 steps, saving after every step, then resumed from step 3. Returns this
    rank's data-parallel rank, its rows uninterrupted and resumed."""
    corpus = Path(directory) / "corpus.txt"
    table = Path(directory) / "corpus.parquet"
    if dist.get_rank() == 0:
        corpus.write_text("\n\n".join(demo_documents(40, seed=0)))
        rows = [{"text": text} for text in demo_documents(40, seed=1)]
        pq.write_table(pa.Table.from_pylist(rows), table, row_group_size=5)
    dist.barrier()
    checkpoints = Path(directory) / "streamed"

    def fit(ckpt_path: Path | None = None, callbacks: tuple = ()) -> tuple:
        module = RecordRows()
        data = TextDataModule([str(corpus), str(table)], streaming=True, shuffle_buffer=8, seq_len=16, batch_size=3)
        run = trainer(
            AutoModelParallelStrategy(tp=tp),
            max_steps=6,
            callbacks=list(callbacks),
            enable_checkpointing=bool(callbacks),
        )
        run.fit(module, data, ckpt_path=ckpt_path)
        return run, module.rows

    run, whole = fit(callbacks=(ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_top_k=-1),))
    resumed = fit(ckpt_path=next(checkpoints.glob("*-step=3.ckpt")))[1]
    return {"dp_rank": run.strategy.distributed_sampler_kwargs["rank"], "whole": whole, "resumed": resumed}
