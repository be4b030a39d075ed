"""CausalLMModule inside gloo workers: its loss, metrics, optimizer and schedule against a single process.

The reference is independent of the module's code: transformers' own loss (``labels=``), an argmax accuracy
over the full logits, and an AdamW loop written out here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from loading_checks import remove, saved_checkpoint
from peft import PeftModel
from torch.utils.data import DataLoader, Dataset
from transformers import AutoModelForCausalLM

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.lm import CausalLMModule, PredictionWriter
from lightning_automodel.lm.optimization import learning_rate_factor
from lightning_automodel.testing.exports import assert_same_directory, save_pretrained_whole
from lightning_automodel.testing.harness import shared_directory
from lightning_automodel.testing.models import SHRUNK, VOCAB, tiny_config
from lightning_automodel.testing.parity import FP32_TOLERANCE, STEPS, TRAINED_LOSS_TOLERANCE, full
from lightning_automodel.testing.trainer_parity import assert_experts_distributed, compare_training, trainer

GLOBAL_BATCH = 8
SEQ = 16
HPARAMS = dict(learning_rate=1e-2, weight_decay=0.1, betas=(0.9, 0.95), warmup_steps=1, min_lr_ratio=0.1)


# A mixture-of-experts model adding its auxiliary load-balancing loss, weighted so that it matters.
AUXILIARY = dict(output_router_logits=True, router_aux_loss_coef=0.5)


class RecordingLM(CausalLMModule):
    """CausalLMModule, recording what the reference is compared with: the synced loss it logs (the language-model
    loss, plus the weighted auxiliary loss where the model adds one) and the gradients the optimizer gets."""

    def __init__(self, family: str = "llama", loss_chunks: int = 1) -> None:
        super().__init__(config=model_config(family).to_dict(), loss_chunks=loss_chunks, **HPARAMS)
        self.losses: list[float] = []
        self.accuracies: list[float] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, optimizer) -> None:
        self.grads.append({n: full(p.grad).clone() for n, p in self.model.named_parameters() if p.grad is not None})

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        metrics = self.trainer.callback_metrics
        auxiliary = (
            metrics["train_aux_loss"].item() * self.hf_config.router_aux_loss_coef if "train_aux_loss" in metrics else 0
        )
        self.losses.append(metrics["train_loss"].item() + auxiliary)
        self.accuracies.append(self.trainer.callback_metrics["train_accuracy"].item())


class Rows(Dataset):
    def __init__(self, rows: dict[str, torch.Tensor]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows["input_ids"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self.rows.items()}


def padded_rows(count: int, seed: int) -> dict[str, torch.Tensor]:
    """Right-padded rows of 3 to SEQ real tokens: ranks hold different numbers of scored tokens, so a mean of
    per-rank means would be wrong."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (count, SEQ), generator=generator)
    lengths = torch.randint(3, SEQ + 1, (count,), generator=generator)
    real = torch.arange(SEQ) < lengths[:, None]
    input_ids[~real] = 0
    return {"input_ids": input_ids, "labels": input_ids.masked_fill(~real, -100), "attention_mask": real.long()}


def packed_rows(count: int, seed: int) -> dict[str, torch.Tensor]:
    """Rows of two or three documents end to end, position ids restarting at each, most rows with trailing padding
    (a document of its own): a document's first token is no target, as the data modules make them."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (count, SEQ), generator=generator)
    labels, position_ids = input_ids.clone(), torch.zeros_like(input_ids)
    for row in range(count):
        real = SEQ - int(torch.randint(0, 4, (1,), generator=generator))
        cuts = sorted(torch.randperm(real - 3, generator=generator)[:2].add(2).tolist())  # documents of 2+ tokens
        for start, end in zip([0, *cuts, real], [*cuts, real, SEQ], strict=True):
            position_ids[row, start:end] = torch.arange(end - start)
            labels[row, start : start + 1] = -100
        input_ids[row, real:], labels[row, real:] = 0, -100
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


ROWS = {"padded": padded_rows, "packed": packed_rows}


def model_config(family: str):
    return tiny_config(family, **AUXILIARY) if family in SHRUNK else tiny_config(family)


def reference_metrics(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' own loss over all rows at once (with its auxiliary loss, if any), the language-model loss alone,
    and the argmax accuracy of the full logits."""
    output = model(**rows, use_cache=False)
    predicted = output.logits[:, :-1].argmax(-1)
    targets = rows["labels"][:, 1:]
    scored = targets != -100
    accuracy = ((predicted == targets) & scored).sum() / scored.sum()
    aux_loss = getattr(output, "aux_loss", None)
    auxiliary = 0 if aux_loss is None else model.router_aux_loss_coef * aux_loss
    return {"loss": output.loss, "lm_loss": output.loss - auxiliary, "accuracy": accuracy, "tokens": scored.sum()}


def check_causal_lm_module(
    tp: int, sp: bool, family: str = "llama", ep: int = 1, loss_chunks: int = 1, rows: str = "padded"
) -> dict:
    """3 steps of CausalLMModule (meta init, AdamW with decay groups, warm-up then cosine) on padded rows (or
    ``rows="packed"``: documents packed, told apart by position ids) match a single process: the logged loss and
    accuracy at every step, every gradient, the weights, then validation's loss, perplexity and accuracy over two
    uneven batches, and predict's per-sequence losses. A mixture-of-experts ``family`` adds its auxiliary loss,
    over the global batch; ``loss_chunks``, the module's."""
    train = ROWS[rows](GLOBAL_BATCH, seed=1)  # an epoch of one step: every step sees the same global batch
    val = ROWS[rows](2 * GLOBAL_BATCH, seed=2)
    dp = dist.get_world_size() // tp
    loader = DataLoader(Rows(train), batch_size=GLOBAL_BATCH // dp)
    val_loader = DataLoader(Rows(val), batch_size=GLOBAL_BATCH // dp)

    torch.manual_seed(7 + dist.get_rank())  # ranks disagree: every rank must take rank 0's random state
    module = RecordingLM(family, loss_chunks)
    fit = trainer(AutoModelParallelStrategy(tp=tp, sp=sp, ep=ep))
    fit.fit(module, loader)
    assert_experts_distributed(module.model, ep=ep)
    logged = fit.validate(module, val_loader, verbose=False)[0]

    torch.manual_seed(7)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(model_config(family))
    reference.to_empty(device="cpu")
    reference.init_weights()
    losses, accuracies, grads = reference_training(reference, train)
    result = compare_training(module, reference, (losses, grads))
    accuracy_errors = [abs(a - b) for a, b in zip(module.accuracies, accuracies, strict=True)]
    one_token = 1 / reference_metrics(reference, train)["tokens"].item()
    assert max(accuracy_errors) <= one_token, (module.accuracies, accuracies)

    with torch.no_grad():
        expected = reference_metrics(reference, val)
    val_errors = {
        "val_loss": abs(logged["val_loss"] - expected["lm_loss"].item()),
        "val_perplexity": abs(logged["val_perplexity"] - expected["lm_loss"].exp().item())
        / expected["lm_loss"].exp().item(),
        "val_accuracy": abs(logged["val_accuracy"] - expected["accuracy"].item()),
    }
    assert val_errors["val_loss"] < TRAINED_LOSS_TOLERANCE and val_errors["val_perplexity"] < TRAINED_LOSS_TOLERANCE
    assert val_errors["val_accuracy"] <= 1 / expected["tokens"].item(), (logged, expected)
    predicted = predict_error(fit, module, reference, val, val_loader)
    return {**result, "train_accuracy": max(accuracy_errors), **val_errors, "predict": predicted}


def predict_error(
    fit: L.Trainer, module: L.LightningModule, reference: torch.nn.Module, rows: dict, loader: DataLoader
) -> float:
    """predict's per-sequence summed losses against ``reference``'s (asserted within the trained-loss tolerance), and
    its token counts (asserted equal). Lightning deals rows r, r + dp, ... to data-parallel rank r. The file
    PredictionWriter writes holds every row once, in order, with the reference's tokens and mean loss."""
    directory = shared_directory()
    writer = PredictionWriter(path=str(directory / "predictions.jsonl"))
    fit.callbacks.append(writer)
    outputs = fit.predict(module, loader)
    fit.callbacks.remove(writer)
    predicted = torch.cat([output["loss_sum"] for output in outputs])
    dp_rank, dp = (fit.strategy.distributed_sampler_kwargs[key] for key in ("rank", "num_replicas"))
    with torch.no_grad():
        inputs = {name: value for name, value in rows.items() if name != "labels"}
        logits = reference(**inputs, use_cache=False).logits
    targets = torch.nn.functional.pad(rows["labels"][:, 1:], (0, 1), value=-100)
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    expected_sums, expected_tokens = per_token.sum(1), (targets != -100).sum(1)
    error = ((predicted - expected_sums[dp_rank::dp]).abs().max() / expected_sums.abs().max()).item()
    assert error < TRAINED_LOSS_TOLERANCE, (predicted, expected_sums)
    assert torch.equal(torch.cat([output["tokens"] for output in outputs]), expected_tokens[dp_rank::dp])
    dist.barrier()  # rank 0 has written the file
    written = [json.loads(line) for line in (directory / "predictions.jsonl").read_text().splitlines()]
    assert [line["row"] for line in written] == list(range(len(expected_sums))), written
    assert [line["tokens"] for line in written] == expected_tokens.tolist(), written
    expected_means = (expected_sums / expected_tokens).tolist()
    written_error = max(abs(line["loss"] / expected_means[line["row"]] - 1) for line in written)
    assert written_error < TRAINED_LOSS_TOLERANCE, (written, expected_sums / expected_tokens)
    remove(directory)
    return max(error, written_error)


def reference_training(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> tuple[list, list, list]:
    """AdamW with weight decay on matrices only and the module's warm-up + cosine factor, written out."""
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": HPARAMS["weight_decay"]}, {"params": vectors, "weight_decay": 0.0}],
        lr=HPARAMS["learning_rate"],
        betas=HPARAMS["betas"],
    )
    losses, accuracies, grads = [], [], []
    for step in range(STEPS):
        factor = learning_rate_factor(
            step, warmup_steps=1, total_steps=STEPS, schedule="cosine", min_lr_ratio=HPARAMS["min_lr_ratio"]
        )
        for group in optimizer.param_groups:
            group["lr"] = HPARAMS["learning_rate"] * factor
        metrics = reference_metrics(model, rows)
        optimizer.zero_grad()
        metrics["loss"].backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        losses.append(metrics["loss"].item())
        accuracies.append(metrics["accuracy"].item())
    return losses, accuracies, grads


def check_lora_checkpoint_exports_merged(tp: int) -> dict:
    """A LoRA run's checkpoint (adapters trained 2 steps at tp, so lora_B is no longer zero) exported by
    `lightning-automodel export`: a plain transformers model whose logits are the trained PEFT model's, in the files
    and tensors of PEFT's merge_and_unload then save_pretrained (40 kB shards); with --lora=adapter, a directory
    PeftModel.from_pretrained loads with the trained adapters."""
    from lightning_automodel.testing.harness import shared_directory

    directory = shared_directory()
    rows = padded_rows(GLOBAL_BATCH, seed=1)
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    module = CausalLMModule(config=tiny_config("llama").to_dict(), lora=lora, learning_rate=1e-2)
    fit = trainer(AutoModelParallelStrategy(tp=tp), max_steps=2)
    fit.fit(module, DataLoader(Rows(rows), batch_size=GLOBAL_BATCH // (dist.get_world_size() // tp)))
    fit.save_checkpoint(directory / "lora.ckpt")
    with torch.no_grad():
        logits = module.model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits.full_tensor()
    trained_b = max(p.full_tensor().abs().max().item() for n, p in module.model.named_parameters() if "lora_B" in n)
    if dist.get_rank() == 0:  # the command, as users run it: one process, outside the process group
        command = [sys.executable, "-m", "lightning_automodel.cli", "export", str(directory / "lora.ckpt")]
        subprocess.run(
            [*command, f"--output={directory / 'merged'}", "--max_shard_size=40000"], check=True, timeout=120
        )
        subprocess.run([*command, f"--output={directory / 'adapter'}", "--lora=adapter"], check=True, timeout=120)
        with torch.device("meta"):
            whole = AutoModelForCausalLM.from_config(tiny_config("llama"))
        save_pretrained_whole(directory / "lora.ckpt", whole, directory / "peer", lora=lora, max_shard_size=40_000)
        assert_same_directory(directory / "merged", directory / "peer")
    adapters = {name: full(p) for name, p in module.model.named_parameters() if "lora_" in name}
    if dist.get_rank() == 0:
        loaded = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_config(tiny_config("llama")), directory / "adapter"
        )
        assert all(torch.equal(loaded.get_parameter(name), tensor) for name, tensor in adapters.items()), "adapter"
    dist.barrier()
    merged = AutoModelForCausalLM.from_pretrained(directory / "merged")
    assert not any("lora" in name for name in merged.state_dict())
    with torch.no_grad():
        expected = merged(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    assert trained_b > 1e-3 and error < FP32_TOLERANCE, (trained_b, error)
    return {"lora_B_max": trained_b, "logits": error}


def check_three_heads_train_on_packed_documents() -> dict:
    """A Llama of 3 heads (hidden 96) under FSDP2 alone, on the demo's packed documents: its shrunk replica keeps its
    3 heads (hidden 48), so the packed-documents check accepts it, and it trains."""
    from torch.distributed.fsdp import FSDPModule

    from lightning_automodel.data import DemoDataModule

    config = tiny_config("llama", vocab_size=320, hidden_size=96, num_attention_heads=3, num_key_value_heads=3)
    module = CausalLMModule(config=config.to_dict())
    run = trainer(AutoModelParallelStrategy(), max_steps=1)
    run.fit(module, datamodule=DemoDataModule(seq_len=16, batch_size=2, num_documents=8, val_documents=0))
    assert run.global_step == 1 and isinstance(module.model, FSDPModule), (run.global_step, type(module.model))
    return {"steps": run.global_step}


class PretrainedRecordingLM(RecordingLM):
    """RecordingLM from a pretrained directory: random init under pp draws per stage, so the reference needs the
    weights from a file (and takes them so under cp too)."""

    def __init__(self, directory: Path) -> None:
        CausalLMModule.__init__(self, model=str(directory), **HPARAMS)
        self.losses, self.accuracies, self.grads = [], [], []


def check_causal_lm_module_split(
    *, pp: int = 1, cp: int = 1, tp: int = 1, family: str = "llama", rows: str = "padded"
) -> dict:
    """CausalLMModule unchanged when the model's call splits the batch, under pp (1F1B over pp micro-batches) or cp
    (also x tp, whose vocabulary-sharded logits make the summed loss a DTensor):
    3 steps on padded (or packed) rows (AdamW with decay groups, warm-up then cosine) match transformers' model in
    one process:
    the logged loss and accuracy at every step, this rank's gradients, the weights; then validation's loss,
    perplexity and accuracy; predict's per-sequence losses on every rank under pp or cp, refused under both. A
    mixture-of-experts family adds its load-balancing loss (logged apart) over the real tokens of the global batch."""
    directory = saved_checkpoint(family, **(AUXILIARY if family in SHRUNK else {}))
    train, val = ROWS[rows](GLOBAL_BATCH, seed=1), ROWS[rows](2 * GLOBAL_BATCH, seed=2)
    dp = dist.get_world_size() // pp // cp // tp
    module = PretrainedRecordingLM(directory)
    fit = trainer(AutoModelParallelStrategy(tp, pp=pp, cp=cp))
    fit.fit(module, DataLoader(Rows(train), batch_size=GLOBAL_BATCH // dp))
    val_loader = DataLoader(Rows(val), batch_size=GLOBAL_BATCH // dp)
    logged = fit.validate(module, val_loader, verbose=False)[0]
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    losses, accuracies, grads = reference_training(reference, train)
    result = compare_training(module, reference, (losses, grads), stages=True)
    one_token = 1 / reference_metrics(reference, train)["tokens"].item()
    result["train_accuracy"] = max(abs(a - b) for a, b in zip(module.accuracies, accuracies, strict=True))
    with torch.no_grad():
        expected = reference_metrics(reference, val)
    result["val_loss"] = abs(logged["val_loss"] - expected["lm_loss"].item())
    result["val_perplexity"] = abs(logged["val_perplexity"] / expected["lm_loss"].exp().item() - 1)
    result["val_accuracy"] = abs(logged["val_accuracy"] - expected["accuracy"].item())
    assert result["train_accuracy"] <= one_token and result["val_accuracy"] <= 1 / expected["tokens"].item(), result
    assert max(result["val_loss"], result["val_perplexity"]) < TRAINED_LOSS_TOLERANCE, result
    if pp == 1 or cp == 1:
        result["predict"] = predict_error(fit, module, reference, val, val_loader)
    else:
        try:
            fit.predict(module, val_loader)
        except ValueError as error:
            assert "predict with pp=1 or cp=1" in str(error), error
        else:
            raise AssertionError("CausalLMModule's predict under pp x cp was not refused")
    remove(directory)
    return result
