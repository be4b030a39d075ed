"""Lightning's LightningCLI over CausalLMModule and any data module, with the command's Trainer defaults: what
``fit``, ``validate``, ``test`` and ``predict`` run, and what ``plan`` parses a config with."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning as L
from jsonargparse import Namespace
from lightning.pytorch.callbacks import BasePredictionWriter, ProgressBar
from lightning.pytorch.cli import LightningCLI

from lightning_automodel import data  # noqa: F401 - its data modules' short names, for LightningCLI
from lightning_automodel.lm import CausalLMModule, PredictionWriter
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


def drop_lightning_tips() -> None:
    """Lightning 2.6 logs "💡 Tip:" adverts for its cloud packages (litlogger, litmodels) at every run: lines the
    command's user did not ask for and need not act on. A filter on the logger Lightning logs them through drops
    those lines alone, in the command's processes (not in a user's own script that imports the package)."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_not_a_tip)


def _not_a_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip:")


def ignore_checkpoint_dirpath_warning() -> None:
    """``validate``, ``test`` and ``predict`` restore the checkpoint callbacks' state from ``--ckpt_path`` into a new
    run's directory, and ModelCheckpoint warns once a process that its dirpath changed and its best scores are not
    reloaded: scores it keeps for saving, which it does during ``fit`` only. Ignored by message, category and module,
    in the command's processes, for those three subcommands."""
    warnings.filterwarnings(
        "ignore", "The dirpath has changed from", UserWarning, r"lightning\.pytorch\.callbacks\.model_checkpoint"
    )


class AutomodelCLI(LightningCLI):
    """LightningCLI whose Trainer gets a :class:`StepProgressBar` unless the config brings a progress bar of its own
    or turns the bar off; whose default logger writes under ``--trainer.default_root_dir``; whose ``predict`` writes
    what it scores (:class:`PredictionWriter`, unless the config brings a prediction writer of its own); and whose
    ``validate``, ``test`` and ``predict`` do not warn about the checkpoint callbacks' directory."""

    def before_instantiate_classes(self) -> None:
        _default_logger_under_root_dir(self._get(self.config, "trainer"))

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        section = self.config_init.get(str(self.subcommand), self.config_init)
        trainer = {**section.get("trainer", {}), **kwargs}
        callbacks = trainer.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        if self.subcommand in ("validate", "test", "predict"):
            ignore_checkpoint_dirpath_warning()
        if trainer.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(StepProgressBar())
        if self.subcommand == "predict" and not any(isinstance(c, BasePredictionWriter) for c in callbacks):
            callbacks.append(PredictionWriter())
        kwargs["callbacks"] = callbacks
        return super().instantiate_trainer(**kwargs)


def _default_logger_under_root_dir(trainer: Namespace) -> None:
    """The command's default logger (a CSVLogger in ``"."``) in ``default_root_dir`` where one is given: Lightning
    puts its own default logger there, but a logger the Trainer is given keeps its ``save_dir``. A logger the config
    sets otherwise keeps its own."""
    logger, root = trainer.get("logger"), trainer.get("default_root_dir")
    default = TRAINER_DEFAULTS["logger"]
    if root is None or not isinstance(logger, Namespace) or logger.get("class_path") != default["class_path"]:
        return
    if logger.init_args.get("save_dir") == default["init_args"]["save_dir"]:
        logger.init_args.save_dir = root


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
