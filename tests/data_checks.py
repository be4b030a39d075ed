"""The language-model data modules under a real Trainer inside gloo workers (lightning_automodel.testing.harness)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import lightning as L
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


def fit_recording(
    data: Callable[[], L.LightningDataModule],
    *,
    tp: int,
    steps: int,
    checkpoints: Path | None = None,
    ckpt_path: Path | None = None,
) -> tuple[L.Trainer, list]:
    """A run of ``steps`` on ``data()`` (saving after every step into ``checkpoints``, if given): the Trainer, and the
    rows of each step."""
    module = RecordRows()
    callbacks = [ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_top_k=-1)] if checkpoints else []
    run = trainer(
        AutoModelParallelStrategy(tp=tp), max_steps=steps, callbacks=callbacks, enable_checkpointing=bool(callbacks)
    )
    run.fit(module, data(), ckpt_path=ckpt_path)
    return run, module.rows


def dp_rank(run: L.Trainer) -> int:
    return run.strategy.distributed_sampler_kwargs["rank"]


def check_resume_across_epochs(directory: str, tp: int) -> dict:
    """Two epochs uninterrupted, saving after every step; then resumed from the end of epoch 0 and from mid-way
    through epoch 1. Returns this rank's data-parallel rank, the steps of an epoch, the rows of each uninterrupted
    step, and the rows of each resumed run by the step it resumed from (the test compares them across ranks)."""
    return resumed_across_epochs(partial(DemoDataModule, **DEMO), Path(directory), tp=tp)


def resumed_across_epochs(data: Callable[[], L.LightningDataModule], checkpoints: Path, *, tp: int) -> dict:
    run, whole = fit_recording(data, tp=tp, steps=STEPS, checkpoints=checkpoints)
    per_epoch = run.num_training_batches
    resumed = {
        step: fit_recording(data, tp=tp, steps=STEPS, ckpt_path=next(checkpoints.glob(f"*-step={step}.ckpt")))[1]
        for step in (per_epoch, per_epoch + 1)
    }
    return {"dp_rank": dp_rank(run), "per_epoch": per_epoch, "whole": whole, "resumed": resumed}


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
    return resumed_stream(
        partial(TextDataModule, [str(corpus), str(table)], streaming=True, shuffle_buffer=8, seq_len=16, batch_size=3),
        Path(directory) / "streamed",
        tp=tp,
    )


def resumed_stream(data: Callable[[], L.LightningDataModule], checkpoints: Path, *, tp: int) -> dict:
    run, whole = fit_recording(data, tp=tp, steps=6, checkpoints=checkpoints)
    resumed = fit_recording(data, tp=tp, steps=6, ckpt_path=next(checkpoints.glob("*-step=3.ckpt")))[1]
    return {"dp_rank": dp_rank(run), "whole": whole, "resumed": resumed}


def mixture_sources(directory: Path) -> list[dict]:
    """Two sources of two demo documents each, 7 and 15 rows of 16 tokens, weighted alike: a cached epoch is 29 rows
    (3 steps of 5 at dp=2, one row repeated to deal it evenly), in which the first source runs out twice and starts
    over; a streamed rank runs through its share of the first source 3 to 6 times in 6 steps."""
    sources = [directory / "mixture-a.txt", directory / "mixture-b.txt"]
    if dist.get_rank() == 0:
        for path, seed in zip(sources, (9, 10), strict=True):
            path.write_text("\n\n".join(demo_documents(2, seed=seed)))
    dist.barrier()
    return [{"path": str(path), "weight": 1.0} for path in sources]


def check_mixture_resume(directory: str, tp: int) -> dict:
    """A weighted mixture of two sources, cached (two epochs; resumed from the end of epoch 0 and mid-way through
    epoch 1) and streamed (resumed from step 3), each saving after every step: the rows by data-parallel rank,
    uninterrupted and resumed, as the checks above return them."""
    sources = mixture_sources(Path(directory))
    cached = partial(TextDataModule, sources, seq_len=16, batch_size=5, cache_dir=f"{directory}/mixture-cache")
    streamed = partial(TextDataModule, sources, streaming=True, seq_len=16, batch_size=5)
    return {
        "cached": resumed_across_epochs(cached, Path(directory) / "mixture", tp=tp),
        "streamed": resumed_stream(streamed, Path(directory) / "mixture-streamed", tp=tp),
    }
