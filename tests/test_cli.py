"""The `lightning-automodel` command: the demo learning under fit, export to Hugging Face, plan, --print_config."""

from __future__ import annotations

import csv
import inspect
import json
import math
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ProgressBar
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.cli import cli, expand_home, main
from lightning_automodel.cli.config import configured
from lightning_automodel.cli.plan import plan_for_config
from lightning_automodel.data import ChatDataModule, DemoDataModule
from lightning_automodel.data.mixture import Source
from lightning_automodel.strategy.argument_docs import argument_description
from lightning_automodel.strategy.module_hints import adamw_of, loss_chunks_of

EXAMPLES = Path(__file__).parents[1] / "examples"
DEMO_STEPS = 100
TORCHAO_NOTICE = "Skipping import of cpp extensions"  # torchao's, on import under a torch it was not built for


def lightning_automodel(*args: str, cwd: Path, timeout: float = 400) -> str:
    """Run the command as a user does, in its own processes; its output, or a failure showing it."""
    command = [sys.executable, "-m", "lightning_automodel.cli", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    """The demo config, shortened, on 2 processes at tp=2 with sequence parallel, the run pointed at a directory of
    its own (``--trainer.default_root_dir``), away from the working directory: that directory, with the output."""
    directory = tmp_path_factory.mktemp("demo")
    output = lightning_automodel(
        "fit",
        f"--config={EXAMPLES / 'demo.yaml'}",
        "--trainer.devices=2",
        f"--trainer.max_steps={DEMO_STEPS}",
        f"--trainer.val_check_interval={DEMO_STEPS}",
        f"--trainer.default_root_dir={directory}",
        cwd=working_directory(directory),
    )
    (directory / "output.txt").write_text(output)
    return directory


def working_directory(run: Path) -> Path:
    """Where the demo's commands run from, beside the run's own directory."""
    path = run.parent / f"{run.name}-cwd"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="module")
def demo_export(demo_run) -> Path:
    """The demo run's checkpoint, exported by `lightning-automodel export` (with the command's output beside it)."""
    checkpoint = next((demo_run / "lightning_logs/version_0/checkpoints").iterdir())
    output = lightning_automodel("export", str(checkpoint), "--output=hf", cwd=demo_run)
    (demo_run / "export.txt").write_text(output)
    return demo_run / "hf"


def test_demo_learns(demo_run):
    """Far above chance within the shortened demo (100 steps of 16 rows): next-byte accuracy on held-out
    documents over 0.4 (measured 0.51), where always guessing the commonest byte (a space) scores 0.20 and a
    uniform guess 0.004; the summary and the loss curve are written."""
    rows = list(csv.DictReader(open(demo_run / "lightning_logs/version_0/metrics.csv")))
    final = next(row for row in reversed(rows) if row["val_accuracy"])
    first_loss = float(next(row for row in rows if row["train_loss"])["train_loss"])
    assert float(final["val_accuracy"]) > 0.4, final
    assert float(final["val_loss"]) < first_loss / 2, (first_loss, final)
    assert commonest_byte_share() < 0.21
    output = (demo_run / "output.txt").read_text()
    assert "Training summary" in output and "val_accuracy" in output and "tokens/s" in output, output[-3000:]
    assert (demo_run / "lightning_logs/version_0/loss.png").stat().st_size > 10_000
    # tp=2 on 2 ranks is one model replica: the throughput monitor reports it as one device, with no global figure
    # doubling its tokens (Lightning's own would count the batch once per tp rank).
    throughput = [row for row in rows if row["train/device/items_per_sec"]]
    assert throughput and "train/items_per_sec" not in rows[0], sorted(rows[0])
    tokens_per_step = float(throughput[-1]["train/device/items_per_sec"]) / float(
        throughput[-1]["train/device/batches_per_sec"]
    )
    assert abs(tokens_per_step - 16 * 128) < 1e-6, tokens_per_step


def test_demo_is_quiet_and_counts_steps(demo_run):
    """A first run prints no warning its user cannot act on (torchdata's set_vital and Lightning's LeafSpec
    deprecations were printed once per process, torchao's notice that it skips its C++ extensions too), and its
    progress bar counts steps to max_steps (Lightning's read "Epoch 0/-2")."""
    output = (demo_run / "output.txt").read_text()
    for noise in ("set_vital", "LeafSpec", "deprecated", "Warning", "Epoch 0/-2", TORCHAO_NOTICE, "Tip:"):
        assert noise not in output, f"{noise!r} in:\n{output[-6000:]}"
    assert re.search(rf"Step +━+ {DEMO_STEPS}/{DEMO_STEPS} ", output), output[-3000:]


def test_the_run_goes_to_the_default_root_dir(demo_run, no_pytest_argv):
    """`--trainer.default_root_dir` takes the run (checkpoints, metrics, loss curve) with the default logger; nothing
    is written where the command ran. A logger the config sets keeps its own save_dir."""
    output = (demo_run / "output.txt").read_text()
    assert f"best checkpoint  {demo_run}/lightning_logs/version_0/checkpoints/" in output, output[-3000:]
    assert f"loss curve       {demo_run}/lightning_logs/version_0/loss.png" in output, output[-3000:]
    assert list(working_directory(demo_run).iterdir()) == []
    arguments = [f"--config={EXAMPLES / 'demo.yaml'}", "--trainer.devices=1", "--seed_everything=false"]
    root = f"--trainer.default_root_dir={demo_run / 'other'}"
    assert cli([*arguments, root], run=False).trainer.logger.save_dir == str(demo_run / "other")
    own = f"--trainer.logger.init_args.save_dir={demo_run / 'own'}"
    assert cli([*arguments, root, own], run=False).trainer.logger.save_dir == str(demo_run / "own")


def test_export_holds_the_trained_weights(demo_run, demo_export):
    """`export` writes a directory that from_pretrained loads (with the byte tokenizer); its loss over the
    validation documents is the val_loss logged at the last step, whose weights the checkpoint holds."""
    output = (demo_run / "export.txt").read_text()
    # torch's "assuming the intent is to load in a single process" was a warning of every export.
    assert "Warning" not in output and TORCHAO_NOTICE not in output, output
    model = AutoModelForCausalLM.from_pretrained(demo_export)
    tokenizer = AutoTokenizer.from_pretrained(demo_export)
    assert tokenizer.decode(tokenizer("Once upon a time")["input_ids"]) == "Once upon a time"
    rows = list(csv.DictReader(open(demo_run / "lightning_logs/version_0/metrics.csv")))
    logged = float(next(row for row in reversed(rows) if row["val_loss"])["val_loss"])
    with torch.no_grad():
        loss = model(**demo_rows("validate"), use_cache=False).loss.item()
    assert abs(loss - logged) < 1e-4, (loss, logged)


def test_predict_writes_each_rows_loss(demo_run, demo_export):
    """`predict` on the demo's checkpoint, at tp=2 on 2 processes: one JSON line a row of the predict data (the demo's
    held-out documents), in order, with its scored tokens and mean loss as the exported model computes them in one
    process; the file named at the end, and no warning about the checkpoint callback's directory (once a process)."""
    checkpoint = next((demo_run / "lightning_logs/version_0/checkpoints").iterdir())
    output = lightning_automodel(
        "predict",
        f"--config={EXAMPLES / 'demo.yaml'}",
        "--trainer.devices=2",
        f"--trainer.default_root_dir={demo_run}",
        f"--ckpt_path={checkpoint}",
        cwd=working_directory(demo_run),
    )
    path = demo_run / "lightning_logs/version_1/predictions.jsonl"
    assert f"predictions      {path}" in output, output[-3000:]
    for noise in ("dirpath has changed", "Warning", TORCHAO_NOTICE, "Tip:"):
        assert noise not in output, f"{noise!r} in:\n{output[-6000:]}"
    written = [json.loads(line) for line in path.read_text().splitlines()]
    batch = demo_rows("predict")
    model = AutoModelForCausalLM.from_pretrained(demo_export)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    targets = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    tokens = (targets != -100).sum(1)
    assert [line["row"] for line in written] == list(range(len(tokens)))
    assert [line["tokens"] for line in written] == tokens.tolist()
    expected = per_token.sum(1) / tokens
    error = max(abs(line["loss"] / expected[line["row"]].item() - 1) for line in written)
    assert error < 1e-4, (error, written[:3], expected[:3])
    assert all(abs(line["perplexity"] - math.exp(line["loss"])) < 1e-9 * line["perplexity"] for line in written)


def demo_rows(stage: str) -> dict[str, torch.Tensor]:
    """The rows the demo's data module gives ``stage`` ("validate": its validation rows; "predict": its test rows,
    the same documents), stacked."""
    data = DemoDataModule()
    data.setup(stage)
    rows = data.datasets["val" if stage == "validate" else "test"]
    return {
        key: torch.stack([rows[i][key] for i in range(len(rows))]) for key in ("input_ids", "labels", "position_ids")
    }


def test_importing_the_package_prints_nothing():
    """transformers imports torchao wherever it is installed, and the pinned torchao under this torch logs that it
    skips its C++ extensions (a filter added first, which passes every record, sees it): importing the package, and
    torchao's float8 after it (as float8=... does), prints nothing."""
    code = (
        "import logging\n"
        "seen = []\n"
        "logging.getLogger('torchao').addFilter(lambda record: seen.append(record.getMessage()) or True)\n"
        "import lightning_automodel, torchao.float8\n"
        f"print(any(message.startswith({TORCHAO_NOTICE!r}) for message in seen))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout + done.stderr == "True\n", done.stdout + done.stderr


def test_plan_of_a_config(no_pytest_argv):
    """`plan` reads the same YAML and overrides as fit: the 8B example at tp=4 with sp x dp_shard=2, with no GPU
    (the config asks for GPUs), then at another world size and tp."""
    report = str(plan_for_config(str(EXAMPLES / "llama_tp_fsdp.yaml")))
    assert "ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=4, ep=1)" in report
    assert "model.layers.*.mlp.down_proj             RowwiseParallel x32" in report
    assert "8,030,261,248 in all, 1,003,882,496 per rank (12.50%; ideal 1/8)" in report
    other = plan_for_config(str(EXAMPLES / "llama_tp_fsdp.yaml"), "--trainer.strategy.init_args.tp=8", world_size=32)
    assert "ParallelDims(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=8, ep=1)" in str(other)
    # The config's seed_everything must not seed this process: Lightning would re-seed every later run from it.
    assert "PL_GLOBAL_SEED" not in os.environ


def test_plan_of_the_128k_context_example(no_pytest_argv):
    """The 32-GPU long-context example: cp=4 x tp=8, FSDP over dp_shard x cp, and the keys and values each rank
    receives per token and layer: 2 (K, V) x 1 KV head (8 / tp) x 128 x 4 bytes x 3/4 of the row."""
    report = str(plan_for_config(str(EXAMPLES / "llama8b_128k_cp_tp.yaml")))
    assert "ParallelDims(pp=1, dp_replicate=1, dp_shard=1, cp=4, tp=8, ep=1)" in report
    assert "context parallel: cp=4, each rank holds 1/4 of every sequence (chunks i and 7-i of 8" in report
    assert "768 bytes received per token of a row, per layer and rank" in report
    assert "8,030,261,248 in all, 251,003,904 per rank (3.13%; ideal 1/32)" in report


def test_plan_of_the_70b_pipeline_example(no_pytest_argv):
    """The 64-GPU example planned with 8 of its 80 layers (the whole takes 80 s here; its memory ratios are in
    benchmarks/pipeline.py): 4 stages, the embedding and the head counted as one layer each."""
    report = plan_for_config(str(EXAMPLES / "llama70b_pp_tp_fsdp.yaml"), "--model.config.num_hidden_layers=8")
    assert "ParallelDims(pp=4, dp_replicate=1, dp_shard=2, cp=1, tp=8, ep=1)" in str(report)
    assert "schedule 1F1B, 16 micro-batches per step; idle (bubble) fraction (p-1)/(m+p-1) = 15.8%" in str(report)
    stages = [(stage.layers, stage.ranks) for stage in report.stages]
    assert stages == [
        ({0: range(0, 1)}, "0-15"),
        ({1: range(1, 4)}, "16-31"),
        ({2: range(4, 7)}, "32-47"),
        ({3: range(7, 8)}, "48-63"),
    ]
    held = sum(stage.parameters_per_rank for stage in report.stages) * 16
    assert held == pytest.approx(report.total_parameters, rel=1e-3)
    interleaved = plan_for_config(
        str(EXAMPLES / "llama70b_pp_tp_fsdp.yaml"),
        "--model.config.num_hidden_layers=14",
        "--trainer.strategy.init_args.pp_schedule=Interleaved1F1B",
        "--trainer.strategy.init_args.pp_stages_per_rank=2",
    )
    assert "pp=4 x 2 stages per rank, schedule Interleaved1F1B, 16 micro-batches per step" in str(interleaved)
    assert "(p-1)/(vm+p-1) = 8.6%" in str(interleaved)
    assert interleaved.stages[0].layers == {0: range(0, 1), 4: range(7, 9)}, interleaved.stages[0]
    assert interleaved.stages[3].layers == {3: range(5, 7), 7: range(13, 14)}, interleaved.stages[3]
    assert "pp rank 3 (ranks 48-63): stage 3: layers 5-6; stage 7: layer 13, norm, head;" in str(interleaved)


def test_plan_steps_as_the_module_computes_its_loss(no_pytest_argv):
    """The step `plan` and layout="auto" measure takes the LightningModule's loss_chunks and AdamW, asked through the
    strategy's ModuleHints and OptimizerHints (CausalLMModule answers; a module that does not computes the logits
    whole and steps foreach AdamW, torch's default on GPUs)."""
    config = configured(str(EXAMPLES / "demo.yaml"), "--model.loss_chunks=4", "--model.adamw=fused", world_size=2)
    assert (config.step_options().loss_chunks, config.step_options().adamw) == (4, "fused")
    assert (loss_chunks_of(L.LightningModule()), adamw_of(L.LightningModule())) == (1, "foreach")


def test_plan_takes_the_vocabulary_from_the_data(no_pytest_argv):
    """A config without vocab_size gets the tokenizer's, rounded up, as fit would."""
    report = plan_for_config(str(EXAMPLES / "demo.yaml"))
    assert "ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2, ep=1)" in str(report)
    assert report.total_parameters == 2 * 320 * 128 + 2 * (4 * 128 * 128 + 3 * 128 * 256 + 2 * 128) + 128


def test_plan_command_prints_no_warning(capsys, monkeypatch):
    """`plan` as run from the shell, sys.argv holding its command line: LightningCLI's warning against giving it
    both arguments and a command line was printed on every run."""
    assert _warnings_of_plan(["plan", f"--config={EXAMPLES / 'demo.yaml'}"], monkeypatch) == []
    assert "ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2, ep=1)" in capsys.readouterr().out


def _warnings_of_plan(command: list[str], monkeypatch) -> list[str]:
    """The warnings a shell's user sees from ``command`` run with it in sys.argv: what Python shows by default, so no
    DeprecationWarning raised outside __main__ (jsonargparse's)."""
    monkeypatch.setattr(sys, "argv", ["lightning-automodel", *command])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(command)
    return [str(warning.message) for warning in caught if not issubclass(warning.category, DeprecationWarning)]


def test_plan_prints_each_finding_once_in_its_report(capsys, caplog, monkeypatch):
    """`plan` of a layout that parallelizes the model once a pipeline stage and once a checkpointing mode (pp=2, the
    activation estimate), over flattened mesh axes (HSDP: dp_replicate=2) with keys and values gathered (cp=2), of a
    plan with a pattern that matches no module: no warning and no log record of ours, torch's deprecations of its
    old mesh slicing and functional collective among them; the pattern named once, in the report."""
    command = [
        "plan",
        f"--config={EXAMPLES / 'demo.yaml'}",
        "--world_size=16",
        "--activations",
        "--trainer.strategy.init_args.pp=2",
        "--trainer.strategy.init_args.cp=2",
        "--trainer.strategy.init_args.dp_replicate=2",
        "--trainer.strategy.init_args.tp_plan=plan_checks.plan_with_a_stray_pattern",
    ]
    assert _warnings_of_plan(command, monkeypatch) == []
    assert [record.getMessage() for record in caplog.records if record.name.startswith("lightning_automodel")] == []
    out = capsys.readouterr().out
    assert out.startswith("LlamaForCausalLM on ParallelDims(pp=2, dp_replicate=2, dp_shard=1, cp=2, tp=2, ep=1)"), out
    assert out.count("no_such_proj") == 2, out  # its line in the plan (x0), and the patterns matching no module
    assert "patterns matching no module: model.layers.*.mlp.no_such_proj" in out


# The demo's model as a Phi3, whose fused gate_up_proj a plan can split wrong.
DEMO_AS_PHI3 = (
    '--model.config={"model_type": "phi3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,'
    ' "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 128, "pad_token_id": 0}'
)


def test_plan_verify_passes_on_the_demo_and_fails_on_a_wrong_plan(capsys, no_pytest_argv):
    """`plan --verify` prints the plan and its verification; a plan that trains wrong exits with 1."""
    main(["plan", f"--config={EXAMPLES / 'demo.yaml'}", "--verify"])
    out = capsys.readouterr().out
    assert "verify_plan: LlamaForCausalLM at tp=2, sp=True, with the family plan for LlamaForCausalLM" in out
    assert "PASSED" in out
    wrong = ["--trainer.strategy.init_args.tp_plan=plan_checks.naive_fused_plan", DEMO_AS_PHI3]
    with pytest.raises(SystemExit) as exited:
        main(["plan", f"--config={EXAMPLES / 'demo.yaml'}", "--verify", *wrong])
    assert exited.value.code == 1
    out = capsys.readouterr().out
    assert re.search(r"model\.layers\.0\.mlp\.gate_up_proj\.weight +1\.\de\+00  WRONG", out), out
    assert "FAILED" in out


def test_plan_refuses_rows_longer_than_the_positions(no_pytest_argv):
    with pytest.raises(ValueError, match="seq_len=256 is longer than the model's max_position_embeddings=128"):
        plan_for_config(str(EXAMPLES / "demo.yaml"), "--data.init_args.seq_len=256")


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


def commonest_byte_share() -> float:
    data = DemoDataModule()
    data.setup("validate")
    tokens = torch.cat([data.datasets["val"][i]["labels"] for i in range(len(data.datasets["val"]))])
    tokens = tokens[tokens >= 0]
    return tokens.bincount().max().item() / len(tokens)


def test_plan_command_estimates_at_the_config_batch(capsys, no_pytest_argv):
    main(["plan", "--config", str(EXAMPLES / "demo.yaml"), "--batch_size", "2", "--seq_len", "64"])
    out = capsys.readouterr().out
    assert "activations per rank, 2 rows x 64 tokens a step" in out
    assert "checkpointing full" in out


def test_plan_command_lists_the_layouts_that_fit(capsys, no_pytest_argv):
    config = str(EXAMPLES / "demo.yaml")
    main(["plan", "--config", config, "--world_size", "2", "--fit", "0.05", "--batch_size", "2", "--seq_len", "64"])
    out = capsys.readouterr().out
    assert "layouts that fit 0.05 GiB per GPU" in out
    assert "2 rows x 64 tokens a batch" in out
    assert "throughput model: 989 TFLOP/s" in out
    assert re.search(r"^ +1 +1 +1 +2 +1  (off|selective|submodule|full) ", out, re.MULTILINE), out  # dp_shard=2 fits
    winner = re.search(r"^ +(\d+) +(\d+) +(\d+) +(\d+) +(\d+)  (\w+) ", out, re.MULTILINE).groups()
    pp, tp, cp, dp_shard, dp_replicate, checkpointing = winner
    overrides = out.split("or as fit's overrides:\n")[1].splitlines()[0].split()
    assert f"--trainer.strategy.init_args.tp={tp}" in overrides and f"--trainer.strategy.init_args.pp={pp}" in overrides
    assert (
        f"      dp_shard: {dp_shard}" in out and "    class_path: lightning_automodel.AutoModelParallelStrategy" in out
    )
    # The overrides pasted into fit give the layout the table's first row names.
    config = configured(config, *overrides, world_size=2)
    dims = config.dims
    assert (dims.pp, dims.tp, dims.cp, dims.dp_shard, dims.dp_replicate) == tuple(map(int, winner[:5])), dims


def test_the_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    listed = capsys.readouterr().out
    assert all(f"    {command} " in listed for command in ("fit", "validate", "test", "predict", "plan", "export"))
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2 and "a command is needed" in capsys.readouterr().err


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


def test_the_fine_tuning_example_trains_on_the_answers_and_stops(tmp_path):
    """examples/sft_chat.yaml as a user runs it (one process here): its chat records through the byte tokenizer's
    template, packed, the loss on the answers only, and the loss falls. Exported, the model answers a question of its
    data and stops there, at the byte tokenizer's <eos> (257; LlamaConfig's default, 2, in the config and generation
    config made generate run on to max_new_tokens)."""
    lightning_automodel(
        "fit",
        f"--config={EXAMPLES / 'sft_chat.yaml'}",
        "--trainer.devices=1",
        "--trainer.strategy.init_args.tp=1",
        "--trainer.strategy.init_args.sp=false",
        f"--data.init_args.train_files={EXAMPLES / 'data' / 'chat.parquet'}",
        f"--data.init_args.cache_dir={tmp_path / 'tokens'}",
        cwd=tmp_path,
    )
    metrics = csv.DictReader(open(next(tmp_path.rglob("metrics.csv"))))
    losses = [float(line["train_loss"]) for line in metrics if line.get("train_loss")]
    assert losses[-1] < losses[0] - 1, losses
    data = ChatDataModule(
        train_files=str(EXAMPLES / "data" / "chat.jsonl"),
        val_fraction=0.1,
        seq_len=256,
        cache_dir=str(tmp_path / "tokens"),
    )
    data.setup("fit")
    row = data.datasets["train"][0]
    answers = data.tokenizer.decode(row["input_ids"][row["labels"] != -100])
    assert answers.startswith("6 + 6 = 12.<eos>Tuesday comes after Monday.<eos>"), answers

    checkpoint = next((tmp_path / "lightning_logs/version_0/checkpoints").iterdir())
    lightning_automodel("export", str(checkpoint), "--output=hf", cwd=tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    special = (model.generation_config.eos_token_id, model.generation_config.pad_token_id, model.config.bos_token_id)
    assert special == (tokenizer.eos_token_id, tokenizer.pad_token_id, None) == (257, 256, None), special
    question = [{"role": "user", "content": "What is 6 + 6?"}]
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    generated = model.generate(**prompt, max_new_tokens=40, do_sample=False)[0, prompt["input_ids"].size(1) :]
    answer = tokenizer.decode(generated)
    assert generated[-1] == tokenizer.eos_token_id and len(generated) < 40, answer
    assert answer.endswith("= 12.<eos>"), answer


def test_plan_command_counts_the_images_of_a_vision_language_model(capsys, no_pytest_argv):
    """The vision demo's LLaVA: the tower's parameters per rank, the images of the estimated step and what they add
    to each mode's peak."""
    config = str(EXAMPLES / "vision_demo.yaml")
    main(["plan", "--config", config, "--batch_size", "2", "--images_per_row", "2"])
    out = capsys.readouterr().out
    assert re.search(r"vision tower and projector: .* per rank \(\d+\.\d% of the rank's\)", out), out
    assert "activations per rank, 2 rows x 80 tokens a step" in out
    assert "2 images a row of 16 tokens each (images_per_row=, image_tokens=)" in out
    assert re.search(r"checkpointing full +\d+\.\d\d GiB \(images \d+\.\d\d GiB\)", out), out
