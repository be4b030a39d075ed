"""The `lightning-automodel` command's arguments: --help, --print_config, the strategy's help, the example configs,
any data module, a weighted mixture in YAML, the progress bar and `~` in options."""

from __future__ import annotations

import inspect
import re
import shutil
import sys
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ProgressBar

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.cli import cli, expand_home, main
from lightning_automodel.data.mixture import Source
from lightning_automodel.strategy.argument_docs import argument_description

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_the_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    listed = capsys.readouterr().out
    assert all(f"    {command} " in listed for command in ("fit", "validate", "test", "predict", "plan", "export"))
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2 and "a command is needed" in capsys.readouterr().err


def test_print_config(capsys, no_pytest_argv):
    """Every option of the strategy, model and data is in the printed config, ready to edit."""
    overrides = ["--trainer.strategy.init_args.tp=1", "--trainer.strategy.init_args.sp=false"]
    with pytest.raises(SystemExit) as exit:
        cli(["fit", f"--config={EXAMPLES / 'demo.yaml'}", *overrides, "--print_config"])
    assert exit.value.code == 0
    printed = capsys.readouterr().out
    expected = (
        "class_path: lightning_automodel.AutoModelParallelStrategy",
        "tp: 1",
        "sp: false",
        "activation_checkpointing: null",  # False, unless layout: auto chooses it
        "warmup_steps: 10",
        "class_path: lightning_automodel.data.DemoDataModule",
    )
    for line in expected:
        assert line in printed, printed


def test_the_strategys_help_describes_every_argument(capsys, no_pytest_argv):
    """`fit --trainer.strategy.help AutoModelParallelStrategy`: every argument of the constructor with its one-line
    description, the first sentence of the options field it sets (strategy/argument_docs.py)."""
    with pytest.raises(SystemExit) as exit:
        main(["fit", "--trainer.strategy.help", "AutoModelParallelStrategy"])
    assert exit.value.code == 0
    printed = capsys.readouterr().out
    arguments = list(inspect.signature(AutoModelParallelStrategy.__init__).parameters)[1:]
    assert len(arguments) > 30  # 34 when written
    for name in arguments:
        entry = re.search(rf"^  --trainer\.strategy\.{name} [^\n]*\n(.*?)\(type:", printed, re.MULTILINE | re.DOTALL)
        assert entry is not None, name
        shown = "".join(entry[1].split())  # the help wraps lines, breaking words at hyphens
        assert shown and shown == "".join(argument_description(name).split()), (name, entry[1])


def test_every_example_config_parses(no_pytest_argv):
    """The example configs name real options (a typo would fail only when someone launches them), and a typo is
    caught: parsing exits with an error code."""
    for config in EXAMPLES.glob("*.yaml"):
        with pytest.raises(SystemExit) as exit:
            cli(["fit", f"--config={config}", "--print_config"])
        assert exit.value.code == 0, config
    with pytest.raises(SystemExit) as exit:
        cli(["fit", f"--config={EXAMPLES / 'demo.yaml'}", "--trainer.strategy.init_args.tq=2", "--print_config"])
    assert exit.value.code != 0


def test_a_pipeline_loss_of_ones_own_by_import_path(no_pytest_argv, capsys):
    """pp_loss_fn in YAML: the import path of a function returning a Tensor."""
    loss_fn = "lightning_automodel.testing.trainer_checks.z_loss_sum"
    with pytest.raises(SystemExit) as exit:
        cli(
            [
                "fit",
                f"--config={EXAMPLES / 'llama70b_pp_tp_fsdp.yaml'}",
                f"--trainer.strategy.init_args.pp_loss_fn={loss_fn}",
                "--print_config",
            ]
        )
    assert exit.value.code == 0 and f"pp_loss_fn: {loss_fn}" in capsys.readouterr().out


def test_any_data_module(no_pytest_argv):
    """The CLI takes any LightningDataModule, not only this package's."""
    with pytest.raises(SystemExit) as exit:
        cli(
            [
                "fit",
                f"--config={EXAMPLES / 'demo.yaml'}",
                "--data=lightning.pytorch.demos.boring_classes.BoringDataModule",
                "--print_config",
            ]
        )
    assert exit.value.code == 0


def test_a_weighted_mixture_in_yaml(tmp_path, capsys, no_pytest_argv):
    """train_files as weighted sources: parsed from YAML, printed back, and the data module's sources."""
    config = tmp_path / "mixture.yaml"
    config.write_text(
        "data:\n  class_path: lightning_automodel.data.TextDataModule\n  init_args:\n    train_files:\n"
        "      - {path: web/*.jsonl, weight: 0.7}\n      - {path: [code/a.jsonl, code/b.jsonl], weight: 0.3}\n"
        "    stopping_strategy: first_exhausted\n"
    )
    arguments = [f"--config={EXAMPLES / 'demo.yaml'}", f"--config={config}", "--trainer.devices=1"]
    with pytest.raises(SystemExit) as exit:
        cli(["fit", *arguments, "--print_config"])
    assert exit.value.code == 0
    printed = capsys.readouterr().out
    assert "  - path: web/*.jsonl\n      weight: 0.7\n" in printed and "stopping_strategy: first_exhausted" in printed
    data = cli(arguments, run=False).datamodule
    assert data.sources == [Source("web/*.jsonl", 0.7), Source(["code/a.jsonl", "code/b.jsonl"], 0.3)]


def test_the_progress_bar_counts_steps_unless_the_config_says_otherwise(no_pytest_argv):
    """The command's Trainer gets the step-counting bar, unless the config turns the bar off or brings its own."""
    configs = {
        "default": [],
        "off": ["--trainer.enable_progress_bar=false"],
        "own": ["--trainer.callbacks=lightning.pytorch.callbacks.TQDMProgressBar"],
    }
    bars = {}
    for name, overrides in configs.items():
        arguments = [f"--config={EXAMPLES / 'demo.yaml'}", "--trainer.devices=1", "--seed_everything=false"]
        trainer = cli([*arguments, *overrides], run=False).trainer
        bars[name] = [type(callback).__name__ for callback in trainer.callbacks if isinstance(callback, ProgressBar)]
    assert bars == {"default": ["StepProgressBar"], "off": [], "own": ["TQDMProgressBar"]}


def test_a_tilde_after_an_equals_sign_is_the_home_directory(capsys, monkeypatch, tmp_path):
    """`--output=~/models/x`: the shell leaves that `~` alone, and the command expands it in every option."""
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copy(EXAMPLES / "demo.yaml", tmp_path / "demo.yaml")
    command = ["plan", "--config=~/demo.yaml"]
    monkeypatch.setattr(sys, "argv", ["lightning-automodel", *command])
    main()
    assert "ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2, ep=1)" in capsys.readouterr().out
    assert sys.argv[1:] == ["plan", f"--config={tmp_path}/demo.yaml"]  # as Lightning's launcher re-runs it
    assert expand_home("--output=~/models/x") == f"--output={tmp_path}/models/x"
    assert expand_home('--model.config={"path": "~"}') == '--model.config={"path": "~"}'
