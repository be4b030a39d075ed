"""``lightning-automodel``: train, evaluate, inspect and export Hugging Face causal LMs from a YAML config.

    lightning-automodel fit --config config.yaml        # validate, test and predict alike (LightningCLI)
    lightning-automodel fit --config config.yaml --print_config
    lightning-automodel plan --config config.yaml [--world_size 64] [--verify] [--activations] [fit's overrides]
    lightning-automodel plan --config config.yaml --fit 80 [--workers 4]    # the layouts that fit 80 GiB GPUs
    lightning-automodel export CHECKPOINT --output DIR

``fit``/``validate``/``test``/``predict`` are Lightning's own LightningCLI over :class:`CausalLMModule` and any
LightningDataModule (``TextDataModule``, ``ChatDataModule`` and ``DemoDataModule`` also by their short names). The
Trainer's defaults differ from Lightning's in three ways: the strategy is ``AutoModelParallelStrategy``
(``"automodel"``), the logger a CSVLogger, which the end-of-training summary draws its loss curve from, and the
progress bar counts a ``max_steps`` run in steps (:class:`StepProgressBar`).
"""

from __future__ import annotations

import argparse
import os
import sys

from lightning_automodel.cli.export import export_command
from lightning_automodel.cli.lightning_cli import DESCRIPTION, cli, drop_lightning_tips, ignore_lightning_deprecations
from lightning_automodel.cli.plan import plan_command

# Every command, as `lightning-automodel --help` lists them: LightningCLI's parser knows its four only.
COMMANDS = {
    "fit": "train the config's model (LightningCLI's fit: the Trainer, the module, the data)",
    "validate": "one pass over the validation data",
    "test": "one pass over the test data",
    "predict": "predictions over the predict data",
    "plan": "what the config's strategy does to its model, without GPUs: the plan, memory per rank, layouts that fit",
    "export": "a checkpoint of fit as a Hugging Face model directory, LoRA merged",
}


def main(argv: list[str] | None = None) -> None:
    """``argv`` defaults to the command line (which LightningCLI then reads itself, as it prefers)."""
    given = [expand_home(argument) for argument in (sys.argv[1:] if argv is None else argv)]
    if argv is None:
        sys.argv[1:] = given  # what LightningCLI, and the processes Lightning's launcher starts, read
    commands = {"plan": plan_command, "export": export_command}
    ignore_lightning_deprecations()
    drop_lightning_tips()
    if not given or given[0] in ("-h", "--help"):
        _front_door(given)
    elif given[0] in commands:
        commands[given[0]](given[1:])
    else:
        cli(None if argv is None else given)


def expand_home(argument: str) -> str:
    """``--output=~/models/x`` with the home directory for ``~``: a shell expands a ``~`` that starts a word, not one
    after ``=``, and the option would name a folder called ``~``."""
    option, equals, value = argument.partition("=") if argument.startswith("--") else ("", "", argument)
    return option + equals + os.path.expanduser(value) if value.startswith("~") else argument


def _front_door(given: list[str]) -> None:
    """The command's own help: every command with what it does, each command's options behind its own --help."""
    parser = argparse.ArgumentParser(
        prog="lightning-automodel",
        description=DESCRIPTION,
        epilog="`lightning-automodel COMMAND --help` lists a command's options; fit, validate, test and predict"
        " take the same --config.",
    )
    subcommands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, summary in COMMANDS.items():
        subcommands.add_parser(name, help=summary)
    if given:
        parser.parse_args(given)  # --help: prints the commands and exits
    parser.error("a command is needed")
