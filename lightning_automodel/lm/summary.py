"""What a person reads when training ends: the final metrics, the throughput, where checkpoints went, and a
loss curve drawn from the CSV logs."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only

from lightning_automodel.data.loaders import data_parallel_place

_SHOWN = ("train_loss", "val_loss", "val_perplexity", "val_accuracy", "val_answer_accuracy")
_NOTES = {"val_answer_accuracy": " (held-out records whose every answer token is the model's argmax)"}


class TrainingSummary(Callback):
    """At the end of ``fit``, on rank 0: final losses, perplexity and accuracy, tokens per second over the whole
    run (every data-parallel rank's tokens, from the first step to the end of fit, validation and checkpoint saves
    included), the checkpoints, and ``loss.png`` beside the CSV logs (with matplotlib installed)."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._tokens = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self._tokens += batch["input_ids"].numel() * data_parallel_place(trainer).get("num_replicas", 1)

    @rank_zero_only
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        lines = [
            f"{name:<16} {trainer.callback_metrics[name].item():.4f}{_NOTES.get(name, '')}"
            for name in _SHOWN
            if name in trainer.callback_metrics
        ]
        if self._start is not None:
            seconds = time.perf_counter() - self._start
            lines.append(f"{'tokens/s':<16} {self._tokens / seconds:,.0f} ({self._tokens:,} tokens in {seconds:.1f} s)")
        lines += _checkpoint_lines(trainer)
        curve = _plot_from_csv_logs(trainer)
        if curve is not None:
            lines.append(f"{'loss curve':<16} {curve}")
        print("\n".join(["", "Training summary", *lines]))


def plot_losses(metrics_csv: str | Path, output: str | Path) -> Path:
    """Draw every ``*_loss`` column of a CSVLogger's ``metrics.csv`` against the step into ``output`` (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only
    import matplotlib.pyplot as plt

    curves: dict[str, tuple[list[int], list[float]]] = {}
    with open(metrics_csv, newline="") as file:
        for row in csv.DictReader(file):
            for name, value in row.items():
                if name.endswith("_loss") and value:
                    steps, values = curves.setdefault(name, ([], []))
                    steps.append(int(row["step"]))
                    values.append(float(value))
    if not curves:
        raise ValueError(f"{metrics_csv} has no *_loss column with values.")
    figure, axes = plt.subplots(figsize=(7, 4))
    for name, (steps, values) in sorted(curves.items()):
        axes.plot(steps, values, marker="o" if len(steps) < 20 else None, label=name)
    axes.set(xlabel="step", ylabel="loss", title="loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(output, dpi=120)
    plt.close(figure)
    return Path(output)


def _checkpoint_lines(trainer: L.Trainer) -> list[str]:
    lines = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        if callback.best_model_path:
            lines.append(f"{'best checkpoint':<16} {callback.best_model_path}")
        if callback.last_model_path:
            lines.append(f"{'last checkpoint':<16} {callback.last_model_path}")
    return lines


def _plot_from_csv_logs(trainer: L.Trainer) -> str | None:
    logger = next((logger for logger in trainer.loggers if isinstance(logger, CSVLogger)), None)
    if logger is None:
        return None
    logger.save()
    metrics_csv = Path(logger.log_dir) / "metrics.csv"
    if not metrics_csv.is_file():
        return None
    try:
        return str(plot_losses(metrics_csv, metrics_csv.with_name("loss.png")))
    except ImportError:
        return 'not drawn: pip install "lightning-automodel[plot]" (matplotlib)'
