"""The `lightning-automodel` command run as a user runs it, in processes of its own: the demo learning under fit,
export to Hugging Face, predict, and the fine-tuning example."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_automodel.cli import cli
from lightning_automodel.data import ChatDataModule, DemoDataModule

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


def commonest_byte_share() -> float:
    data = DemoDataModule()
    data.setup("validate")
    tokens = torch.cat([data.datasets["val"][i]["labels"] for i in range(len(data.datasets["val"]))])
    tokens = tokens[tokens >= 0]
    return tokens.bincount().max().item() / len(tokens)


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
