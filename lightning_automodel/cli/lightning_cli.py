"""Lightning's LightningCLI over CausalLMModule and any data module, with the command's Trainer defaults: what
``fit``, ``validate``, ``test`` and ``predict`` run, and what ``plan`` parses a config with."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningCLI

from lightning_automodel import data  # noqa: F401 - its data modules' short names, for LightningCLI
from lightning_automodel.lm import CausalLMModule
from lightning_automodel.lm.progress import StepProgressBar

TRAINER_DEFAULTS = {
    "strategy": "automodel",
    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "."}},
}


DESCRIPTION = "Train, evaluate, inspect and export Hugging Face causal LMs from a YAML config."


def ignore_lightning_deprecations() -> None:
    """Lightning 2.6's data loop builds torch's deprecated ``LeafSpec``: a FutureWarning per process that only
    Lightning can act on. The command owns its processes (those Lightning's launcher starts run this function too),
    so it ignores that warning, matched by message, category and module, and no other."""
    warnings.filterwarnings(
        "ignore",
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        FutureWarning,
        r"lightning\.pytorch\.utilities\._pytree",
    )


class AutomodelCLI(LightningCLI):
    """LightningCLI whose Trainer gets a :class:`StepProgressBar` unless the config brings a progress bar of its own
    or turns the bar off."""

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        section = self.config_init.get(str(self.subcommand), self.config_init)
        trainer = {**section.get("trainer", {}), **kwargs}
        callbacks = trainer.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if trainer.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            kwargs["callbacks"] = [*callbacks, StepProgressBar()]
        return super().instantiate_trainer(**kwargs)


def cli(
    argv: list[str] | None = None, *, run: bool = True, cli_class: type[LightningCLI] = AutomodelCLI
) -> LightningCLI:
    """Lightning's CLI over CausalLMModule and any data module, with this package's Trainer defaults."""
    return cli_class(
        CausalLMModule,
        L.LightningDataModule,
        subclass_mode_data=True,
        trainer_defaults=TRAINER_DEFAULTS,
        args=argv,
        run=run,
        parser_kwargs={"description": DESCRIPTION},
    )
