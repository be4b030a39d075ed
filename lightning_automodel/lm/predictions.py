"""What ``predict`` scores: each row's summed next-token loss and scored tokens (``CausalLMModule.predict_step``), the
same under every layout as in one process; and a file of them, which ``Trainer.predict`` would hand back to a script
but the command would drop: this writer (Lightning's ``BasePredictionWriter``) keeps them as each rank's batches end
and writes them from rank 0, in the data's order."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import Tensor, nn

from lightning_automodel.parallel.context_parallel import context_parallel_of
from lightning_automodel.parallel.full_tensor import full_tensor
from lightning_automodel.parallel.loss import causal_lm_loss_sum
from lightning_automodel.parallel.pipeline import pipeline_of

# A row's index in the predict data -> its summed loss and scored tokens.
RowScores = dict[int, tuple[float, int]]


def row_scores(model: nn.Module, *, labels: Tensor, **inputs: Tensor | None) -> dict[str, Tensor]:
    """Each row's summed next-token loss (``loss_sum``) and scored tokens (``tokens``), on every rank. Under pipeline
    parallel the last stage computes them; under context parallel each rank its share of a row, a call a row (the
    call's loss is the batch's), summed over the cp ranks. Pipeline and context parallel together are refused."""
    context, pipeline = context_parallel_of(model), pipeline_of(model)
    if context is not None and pipeline is not None:  # on every rank, before any collective
        raise ValueError(
            "CausalLMModule's predict scores each row, which a pipeline split by context parallel does not give (its"
            " loss is the batch's): predict with pp=1 or cp=1."
        )
    rows = labels.size(0)
    scores = torch.zeros(2, rows, device=labels.device)
    if context is not None:
        for row in range(rows):
            one_row = {name: value[row : row + 1] if value is not None else None for name, value in inputs.items()}
            outputs = model(**one_row, labels=labels[row : row + 1])
            scores[0, row], scores[1, row] = outputs.loss_sum, outputs.num_tokens
        dist.all_reduce(scores, group=context.group)
        return {"loss_sum": scores[0], "tokens": scores[1].long()}
    logits = model(**inputs, use_cache=False).logits
    for row in range(rows if logits is not None else 0):  # None: a pipeline stage before the last
        loss_sum, count = causal_lm_loss_sum(logits[row : row + 1], labels[row : row + 1])
        scores[0, row], scores[1, row] = full_tensor(loss_sum).detach(), count
    if pipeline is not None:
        scores = pipeline.from_last_stage(scores)
    return {"loss_sum": scores[0], "tokens": scores[1].long()}


class PredictionWriter(BasePredictionWriter):
    """One JSON line a row of the predict data, in its order: ``{"row": 0, "loss": 1.02, "tokens": 127,
    "perplexity": 2.77}`` (the mean next-token loss over the row's scored tokens, in nats; loss and perplexity are
    null for a row with none, and the perplexity of a loss above ~709 nats is ``Infinity``), written to ``path``, by
    default ``predictions.jsonl`` in the run's directory (``trainer.log_dir``: the logger's version directory, else
    ``default_root_dir``), and named at the end with the loss over every scored token.

    Every rank keeps the rows it predicted, by their index in the dataset (which Lightning's predict loop records); at
    the end rank 0 gathers them and keeps each row once: tensor-parallel peers and pipeline stages return the same
    rows, and a padded distributed split predicts up to dp - 1 rows twice.
    """

    def __init__(self, path: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output = path
        self.path: Path | None = None  # where the last predict wrote
        self._rows: RowScores = {}

    def on_predict_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._rows = {}

    def write_on_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        prediction: dict[str, Any],
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        if not batch_indices:
            raise ValueError(
                "PredictionWriter needs each row's index in the predict data, which Lightning records for a"
                " torch DataLoader only: give predict a DataLoader."
            )
        sums, tokens = prediction["loss_sum"].tolist(), prediction["tokens"].tolist()
        for index, loss_sum, count in zip(batch_indices, sums, tokens, strict=True):
            self._rows.setdefault(int(index), (loss_sum, count))

    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.output is not None:
            self.path = Path(self.output)
        else:  # on every rank: log_dir is a broadcast
            self.path = Path(trainer.log_dir or trainer.default_root_dir) / "predictions.jsonl"
        rows = _gathered_on_rank_zero(self._rows)
        if not trainer.is_global_zero:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as file:
            for index in sorted(rows):
                file.write(json.dumps(_line(index, *rows[index])) + "\n")
        print(_summary(rows, self.path))


def _gathered_on_rank_zero(rows: RowScores) -> RowScores:
    """Every rank's rows on rank 0 (each index once); this rank's own elsewhere."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return rows
    gathered: list[RowScores] | None = [{} for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather_object(rows, gathered, dst=0)
    if gathered is None:
        return rows
    merged: RowScores = {}
    for each in gathered:
        for index, scores in each.items():
            merged.setdefault(index, scores)
    return merged


def _line(index: int, loss_sum: float, tokens: int) -> dict[str, Any]:
    loss = loss_sum / tokens if tokens else None
    return {"row": index, "loss": loss, "tokens": tokens, "perplexity": _perplexity(loss) if tokens else None}


def _perplexity(loss: float) -> float:
    """``exp(loss)``; infinite where that overflows a float (a diverged model's mean loss, above ~709 nats), so that
    the file is still written."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def _summary(rows: RowScores, path: Path) -> str:
    """The rows, the loss and perplexity over all their scored tokens, and the file: what a person reads at the end."""
    loss_sum, tokens = sum(loss for loss, _ in rows.values()), sum(count for _, count in rows.values())
    lines = ["", "Prediction summary", f"{'rows':<16} {len(rows):,} ({tokens:,} tokens scored)"]
    if tokens:
        lines += [f"{'loss':<16} {loss_sum / tokens:.4f}", f"{'perplexity':<16} {_perplexity(loss_sum / tokens):.4f}"]
    lines.append(f"{'predictions':<16} {path}")
    return "\n".join(lines)
