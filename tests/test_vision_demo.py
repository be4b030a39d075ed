"""The vision-language demo: its pictures, CausalLMModule on images through a Trainer, the export of its checkpoint
(model and processor), and (-m sweep) the demo itself learning at tp=2 + sp x dp_shard=2 on 4 processes."""

from __future__ import annotations

import contextlib
import csv
import io
import random
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.loggers import CSVLogger
from PIL import Image
from test_cli import EXAMPLES, lightning_automodel, working_directory
from transformers import AutoModelForImageTextToText, AutoProcessor, LlavaForConditionalGeneration

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.data import IGNORE_INDEX, cache
from lightning_automodel.data.vision.demo import COLOURS, QUESTIONS, VisionDemoDataModule, demo_picture, demo_records
from lightning_automodel.data.vision.rows import collate_rows
from lightning_automodel.hf.peft import unwrap_peft
from lightning_automodel.io.checkpoint_to_hf import export_checkpoint
from lightning_automodel.lm import CausalLMModule
from lightning_automodel.parallel.loss import next_token_hit_mask

DEMO = EXAMPLES / "vision_demo.yaml"
STEPS = 4


def test_demo_records_are_deterministic_and_answer_their_pictures():
    """The same seed, the same records (PNG bytes included); another seed, others. Each colour answer is the
    colour nearest the picture's commonest non-grey pixel, and both questions are asked."""
    records = demo_records(40, seed=5)
    assert records == demo_records(40, seed=5)
    assert records != demo_records(40, seed=6)
    asked = {record["messages"][0]["content"][1]["text"] for record in records}
    assert asked == set(QUESTIONS.values())
    for record in records:
        if record["messages"][0]["content"][1]["text"] != QUESTIONS["colour"]:
            continue
        image = Image.open(io.BytesIO(record["images"][0]["bytes"])).convert("RGB")
        _, pixel = max((count, rgb) for count, rgb in image.getcolors() if len(set(rgb)) > 1)
        nearest = min(COLOURS, key=lambda name: sum((a - b) ** 2 for a, b in zip(COLOURS[name], pixel, strict=True)))
        assert record["messages"][1]["content"][0]["text"] == nearest


@pytest.fixture
def trained(tmp_path, monkeypatch):
    """The demo's model and data, small, trained STEPS steps in this process under the strategy (whose process
    group conftest's fixture ends after the test): the run's directory, the trainer, the module, the data, what fit
    printed, and the vision tower's weights before the first step."""
    monkeypatch.setattr(cache, "DEFAULT_ROOT", tmp_path / "tokens")
    data = VisionDemoDataModule(num_records=64, val_records=16, batch_size=8)
    module = CausalLMModule(config=yaml.safe_load(DEMO.read_text())["model"]["config"], learning_rate=3e-3)
    tower = TowerAtStart()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=AutoModelParallelStrategy(),
        max_steps=STEPS,
        val_check_interval=STEPS,
        default_root_dir=tmp_path,
        logger=CSVLogger(tmp_path),
        callbacks=[tower],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.fit(module, data)
    return tmp_path, trainer, module, data, printed.getvalue(), tower.weights


class TowerAtStart(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.weights = {name: full(p).detach().clone() for name, p in tower_parameters(pl_module)}


def tower_parameters(module: CausalLMModule):
    """The tower's parameters that LLaVA uses: it reads the last layer's hidden states, before the final norm."""
    named = module.model.named_parameters()
    return [(name, p) for name, p in named if "vision_tower" in name and "post_layernorm" not in name]


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def test_the_module_trains_on_images_and_its_export_loads(trained):
    """A config with a vision tower's builds LLaVA, its vocabulary, special tokens and image token from the
    processor; the batches' pixels reach the model (the tower's weights move); validation logs the answer accuracy,
    which the summary prints. Then the checkpoint's export (:func:`check_export`)."""
    _, trainer, module, data, printed, tower = trained
    model = unwrap_peft(module.model)
    assert isinstance(model, LlavaForConditionalGeneration)
    assert model.config.image_token_id == data.processor.image_token_id
    assert model.config.text_config.vocab_size == 320 and model.config.text_config.eos_token_id == 257
    moved = [name for name, p in tower_parameters(module) if not torch.equal(full(p), tower[name])]
    assert len(moved) == len(tower), sorted(set(tower) - set(moved))
    metrics = trainer.callback_metrics
    assert 0 <= metrics["val_answer_accuracy"] <= 1 and "train_answer_accuracy" not in metrics, sorted(metrics)
    assert "val_answer_accuracy 0." in printed and "loss curve" in printed, printed
    check_export(trained)


def check_export(trained) -> None:
    """`export` of the checkpoint: AutoModelForImageTextToText and AutoProcessor load it; the processor renders a
    held-out record to the data's ids; the model's loss over the held-out rows is the logged val_loss (the same
    weights), and it generates to the tokenizer's EOS."""
    directory, trainer, _, data, _, _ = trained
    export_checkpoint(trainer.checkpoint_callback.best_model_path, directory / "hf")
    model = AutoModelForImageTextToText.from_pretrained(directory / "hf").eval()
    processor = AutoProcessor.from_pretrained(directory / "hf")
    rows = data.datasets["val"]
    record = demo_records(64 + 16, seed=0)[64]
    image = Image.open(io.BytesIO(record["images"][0]["bytes"]))
    rendered = processor.apply_chat_template(
        record["messages"], processor_kwargs={"images": [image]}, tokenize=True, return_dict=True
    )
    kept = int(rows[0]["attention_mask"].sum())
    assert list(rendered["input_ids"][0]) == rows[0]["input_ids"][:kept].tolist()
    batch = collate_rows([rows[i] for i in range(len(rows))])
    with torch.no_grad():
        logits = model(**{name: value for name, value in batch.items() if name != "labels"}).logits
    targets = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX)
    logged = float(next(row for row in reversed(metrics_rows(directory)) if row["val_loss"])["val_loss"])
    assert abs(loss.item() - logged) < 1e-4, (loss.item(), logged)
    hit, scored = next_token_hit_mask(logits, batch["labels"])
    right = (hit | ~scored).all(dim=1).float().mean().item()
    assert right == float(
        next(row for row in reversed(metrics_rows(directory)) if row["val_loss"])["val_answer_accuracy"]
    )
    assert model.generation_config.eos_token_id == processor.tokenizer.eos_token_id


def test_answer_accuracy_counts_records_whose_every_answer_token_is_the_argmax():
    """Row 0's two answer tokens are both ranked first, row 1's second is not, row 2 has no answer: 1 of 2."""
    labels = torch.tensor([[0, 1, 2, IGNORE_INDEX], [0, 1, 2, IGNORE_INDEX], [0, 1, 2, IGNORE_INDEX]])
    labels[:, 0] = IGNORE_INDEX
    labels[2] = IGNORE_INDEX
    logits = torch.zeros(3, 4, 5)
    logits[:, 0, 1] = logits[:, 1, 2] = 1.0  # position t predicts labels[t + 1]
    logits[1, 1, 3] = 2.0
    module = CausalLMModule(config={"model_type": "llama"})
    module._count_answers("val", *next_token_hit_mask(logits, labels))
    assert module.val_metrics["answer_accuracy"].compute().item() == 0.5


def metrics_rows(directory: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(open(next(directory.rglob("metrics.csv")))))


def answer(model, processor, image, question: str) -> str:
    """The model's greedy answer to ``question`` about ``image``."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    inputs = processor.apply_chat_template(
        messages,
        processor_kwargs={"images": [image]},
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    return processor.tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.sweep
def test_the_vision_demo_learns_and_its_export_answers_new_pictures(tmp_path, monkeypatch):
    """The demo as its user runs it (4 processes, tp=2 + sp x dp_shard=2, the token cache and records written
    anew): held-out answer accuracy at least 0.9 (chance: 1/3 for shapes, 1/5 for colours), the summary and loss
    curve written; the exported model answers pictures drawn with another seed, by greedy decoding, as often."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run = tmp_path / "run"
    start = time.perf_counter()
    output = lightning_automodel(
        "fit", f"--config={DEMO}", f"--trainer.default_root_dir={run}", cwd=working_directory(run), timeout=900
    )
    seconds = time.perf_counter() - start
    final = next(row for row in reversed(metrics_rows(run)) if row.get("val_answer_accuracy"))
    assert float(final["val_answer_accuracy"]) >= 0.9, (final, output[-3000:])
    assert "val_answer_accuracy" in output and (run / "lightning_logs/version_0/loss.png").is_file(), output[-3000:]
    checkpoint = next((run / "lightning_logs/version_0/checkpoints").iterdir())
    lightning_automodel("export", str(checkpoint), f"--output={tmp_path / 'hf'}", cwd=tmp_path)
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf").eval()
    processor = AutoProcessor.from_pretrained(tmp_path / "hf")
    rng, right = random.Random(12345), 0
    for index in range(40):
        image, colour, shape = demo_picture(rng)
        kind = ("colour", "shape")[index % 2]
        right += answer(model, processor, image, QUESTIONS[kind]) == (colour if kind == "colour" else shape)
    assert right >= 36, (right, seconds)
    print(f"vision demo: {seconds:.0f} s, val_answer_accuracy {final['val_answer_accuracy']}, new pictures {right}/40")
