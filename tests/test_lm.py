"""CausalLMModule: parity with a single process under tp x dp, its schedule, and its use without our strategy."""

import json
import math
import re
from functools import partial
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel
from lm_checks import (
    check_causal_lm_module,
    check_lora_checkpoint_exports_merged,
    check_three_heads_train_on_packed_documents,
)
from lm_refusal_checks import (
    check_bad_data_refused_on_every_rank,
    check_chunked_loss_refused_where_the_call_computes_it,
    check_predict_in_step_or_refused,
)
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, MambaConfig

from lightning_automodel.data import DemoDataModule, byte_tokenizer
from lightning_automodel.lm import CausalLMModule, PredictionWriter, StepProgressBar
from lightning_automodel.lm.limits import check_batch, check_seq_len
from lightning_automodel.lm.optimization import learning_rate_factor
from lightning_automodel.testing.harness import check_name, run_checks
from lightning_automodel.testing.models import tiny_config


def test_parity_at_tp2_dp2_with_sp():
    """Logged loss and accuracy at each step, gradients, weights, validation metrics: as a single process; the same
    on packed rows (documents told apart by their position ids alone) with the loss three uneven sequence chunks at a
    time (6, 6 and 4 of 16 tokens), under loss parallel."""
    checks = [
        partial(check_causal_lm_module, 2, True),
        partial(check_causal_lm_module, 2, True, loss_chunks=3, rows="packed"),
    ]
    results = run_checks(4, checks, timeout=300)
    print(results)


def test_mixture_of_experts_auxiliary_loss_over_the_global_batch():
    """Qwen3-MoE built on meta, adding its load-balancing loss (weighted 0.5), at tp=2 with sp x dp=2 and its
    experts split over ep=2 on padded rows: each step's loss, every gradient and the weights as transformers' own loss
    of the global batch in one process, though each rank routes only its own rows (the ranks' per-expert sums are
    added before the shares are multiplied) and its experts compute other ranks' tokens."""
    run_checks(4, [partial(check_causal_lm_module, 2, True, "qwen3_moe", ep=2)], timeout=300)


def test_lora_export_predict_and_refusals():
    """At tp=2, trained adapters merged into a plain Hugging Face model by `export`: the same logits. At dp=2,
    predict over uneven batches is refused on every rank, and the data module's split predicts every row; a Llama of
    3 heads trains under FSDP2 on packed documents (its shrunk replica, which checks them, keeps 3 heads). At tp=2,
    data the model cannot take is refused on both ranks before the first step, with the numbers and the file."""
    checks = [
        partial(check_lora_checkpoint_exports_merged, 2),
        check_predict_in_step_or_refused,
        check_chunked_loss_refused_where_the_call_computes_it,
        check_three_heads_train_on_packed_documents,
        partial(check_bad_data_refused_on_every_rank, 2),
    ]
    refused = run_checks(2, checks)[check_name(checks[-1])]
    assert refused[0] == refused[1], refused
    assert "has 258 tokens but the model's vocab_size is 128" in refused[0]["vocabulary"], refused
    assert "seq_len=128 is longer than the model's max_position_embeddings=64" in refused[0]["positions"], refused
    assert "DIR/val.txt, line 1 (byte 3): not UTF-8" in refused[0]["file"], refused


def test_learning_rate_schedule():
    """Warm-up rises linearly to the peak; cosine and linear decay reach min_lr_ratio at the last step LambdaLR
    runs (step total_steps - 1)."""
    factor = dict(warmup_steps=4, total_steps=15, min_lr_ratio=0.1)
    assert [learning_rate_factor(s, schedule="cosine", **factor) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert learning_rate_factor(4, schedule="cosine", **factor) == 1.0
    assert math.isclose(learning_rate_factor(9, schedule="cosine", **factor), 0.55)
    assert math.isclose(learning_rate_factor(9, schedule="linear", **factor), 0.55)
    assert math.isclose(learning_rate_factor(14, schedule="cosine", **factor), 0.1)
    assert math.isclose(learning_rate_factor(14, schedule="linear", **factor), 0.1)
    assert learning_rate_factor(100, schedule="constant", **factor) == 1.0


def test_under_lightnings_own_strategy(tmp_path):
    """On one device with Lightning's default strategy, transformers builds the model whole and it trains; the
    vocabulary comes from the data module's tokenizer, rounded up to a multiple of 64."""
    config = tiny_config("llama").to_dict()
    del config["vocab_size"]
    module = CausalLMModule(config=config, learning_rate=1e-3)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        val_check_interval=2,
        limit_val_batches=1,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DemoDataModule(seq_len=32, batch_size=2, num_documents=50, val_documents=10))
    assert type(trainer.strategy).__name__ == "SingleDeviceStrategy"
    assert module.model.config.vocab_size == 320  # 258 byte-level ids, rounded up
    assert {"train_loss", "train_accuracy", "val_loss", "val_perplexity", "val_accuracy"} <= set(
        trainer.callback_metrics
    )


def test_a_model_is_required():
    with pytest.raises(ValueError, match="`model=` a local Hugging Face model directory, or `config=`"):
        CausalLMModule(config={"hidden_size": 64})
    with pytest.raises(ValueError, match="loss_chunks=0 must be a positive integer"):
        CausalLMModule(config={"model_type": "llama"}, loss_chunks=0)


def test_flops_per_token():
    """6 FLOPs per trained weight, 4 per frozen one, none for the embedding lookup, plus attention; a third of
    each in evaluation."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_automodel.planning.flops import flops_per_token

    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    weights = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    attention = 12 * 2 * 64 * 16  # layers x width x sequence
    assert flops_per_token(model, 16) == 6 * weights + attention
    assert flops_per_token(model, 16, training=False) == 2 * weights + attention // 3
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert flops_per_token(lora, 16) == 6 * adapters + 4 * weights + attention


def test_flops_per_token_of_a_mixture_of_experts_count_the_experts_a_token_is_routed_to():
    """A token runs num_experts_per_tok of the experts: their weights count that share (the tenfold of Qwen3-30B-A3B's
    8 of 128 counted whole before, understating its tokens/s in layout="auto"'s ranking)."""
    from transformers import AutoModelForCausalLM

    from lightning_automodel.hf.layer_configs import attention_shapes
    from lightning_automodel.parallel.tensor.styles.experts import is_experts
    from lightning_automodel.planning.flops import flops_per_token

    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    config = model.config
    experts = {id(p) for m in model.modules() if is_experts(m) for p in m.parameters()}
    embedding = model.get_input_embeddings().weight
    dense = sum(p.numel() for p in model.parameters() if id(p) not in experts and p is not embedding)
    routed = sum(p.numel() for p in model.parameters() if id(p) in experts)
    attention = flops_per_token(model, 16) - round(
        6 * (dense + routed * config.num_experts_per_tok / config.num_experts)
    )
    assert routed and config.num_experts_per_tok < config.num_experts
    heads, _, head_dim = attention_shapes(config)[0]
    assert attention == 12 * config.num_hidden_layers * heads * head_dim * 16, attention


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    """Before any weight is read, naming both sizes and the fix: the config key for a new model, the model's own
    tokenizer for a pretrained one (whose checkpoint fixes the vocabulary)."""
    new_model = CausalLMModule(config=tiny_config("llama").to_dict())  # vocab_size 128, the byte tokenizer has 258
    expected = r"The tokenizer \(built in code\) has 258 tokens but the model's vocab_size is 128: ids from 128 up"
    with pytest.raises(ValueError, match=expected + r".*\(model\.config\.vocab_size\) to at least 258"):
        new_model.build_model(byte_tokenizer(), meta=True)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path / "model")
    byte_tokenizer().save_pretrained(tmp_path / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    expected = re.escape(f"The tokenizer '{tmp_path / 'tokenizer'}' has 258 tokens but the model's vocab_size is 128")
    fix = re.escape(f"Use the model's own tokenizer (data tokenizer: {tmp_path / 'model'})")
    with pytest.raises(ValueError, match=f"{expected}.*{fix}"):
        CausalLMModule(model=str(tmp_path / "model")).build_model(tokenizer, meta=True)


def test_a_diverged_models_predictions_are_written_with_an_infinite_perplexity(tmp_path, capsys):
    """A mean loss of 800 nats (``math.exp`` overflows above ~709): the file is written, its perplexity infinite, as
    is the summary's; a row with no scored token has neither."""
    writer, trainer = PredictionWriter(path=str(tmp_path / "predictions.jsonl")), SimpleNamespace(is_global_zero=True)
    writer.on_predict_epoch_start(trainer, None)
    prediction = {"loss_sum": torch.tensor([3200.0, 0.0]), "tokens": torch.tensor([4, 0])}
    writer.write_on_batch_end(trainer, None, prediction, [0, 1], None, 0, 0)
    writer.on_predict_epoch_end(trainer, None)
    written = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert written == [
        {"row": 0, "loss": 800.0, "tokens": 4, "perplexity": math.inf},
        {"row": 1, "loss": None, "tokens": 0, "perplexity": None},
    ]
    assert "perplexity       inf" in capsys.readouterr().out


def small_trainer(tmp_path, **kwargs):
    options = dict(accelerator="cpu", devices=1, max_steps=1, default_root_dir=tmp_path, enable_progress_bar=False)
    return L.Trainer(**{**options, "enable_model_summary": False, "logger": False, **kwargs})


def test_rows_longer_than_the_positions_are_refused_before_the_first_step(tmp_path):
    """The data module's seq_len against the model's max_position_embeddings, when the model is built; a model
    without such a limit takes any length."""
    module = CausalLMModule(config=tiny_config("llama", vocab_size=320).to_dict())  # max_position_embeddings 64
    trainer = small_trainer(tmp_path)
    expected = r"seq_len=128 is longer than the model's max_position_embeddings=64: .* seq_len to at most 64"
    with pytest.raises(ValueError, match=expected):
        trainer.fit(module, DemoDataModule(seq_len=128, num_documents=8, val_documents=0))
    assert trainer.global_step == 0 and module.model is None
    check_seq_len(10**6, MambaConfig())


def test_batches_outside_the_vocabulary_are_refused_with_the_element(tmp_path):
    """Any data module's batches: ids and labels (other than -100) outside the vocabulary, and rows longer than
    the positions, are a ValueError naming the element, in the step (the embedding would raise a bare IndexError
    on CPU, a device-side assert on a GPU)."""
    config = tiny_config("llama")  # vocab_size 128, max_position_embeddings 64
    check_batch({"input_ids": torch.tensor([[1, 127]]), "labels": torch.tensor([[-100, 127]])}, config)
    bad = {
        r"input_ids\[1, 0\] is 128, outside the model's vocabulary \(0\.\.127; vocab_size=128\)": (
            {"input_ids": torch.tensor([[1, 2], [128, 3]])}
        ),
        r"labels\[0, 1\] is -5, outside the model's vocabulary \(0\.\.127 or -100;": (
            {"input_ids": torch.tensor([[1, 2]]), "labels": torch.tensor([[-100, -5]])}
        ),
        r"seq_len=65 is longer than the model's max_position_embeddings=64": {"input_ids": torch.ones(1, 65).long()},
    }
    for message, batch in bad.items():
        with pytest.raises(ValueError, match=message):
            check_batch(batch, config)
    ids = torch.randint(0, 128, (20, 8), generator=torch.Generator().manual_seed(0))
    ids[13, 5] = 200  # the second row of the seventh batch
    module = CausalLMModule(config=config.to_dict())
    trainer = small_trainer(tmp_path, max_steps=20)
    with pytest.raises(ValueError, match=r"input_ids\[1, 5\] is 200, outside the model's vocabulary"):
        trainer.fit(module, DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=2))
    assert trainer.global_step == 6


class RecordTrainingBar(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int]] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        task = trainer.progress_bar_callback.train_progress_bar
        self.seen.append((task.description.strip(), int(task.completed), int(task.total)))


def test_step_progress_bar_counts_optimizer_steps_across_epochs_and_resumes(tmp_path):
    """4 batches an epoch, 2 per optimizer step, max_steps=3: the bar reads "Step k/3", k the optimizer steps
    taken, through both epochs (Lightning's reads "Epoch 0/-2" and counts each epoch's batches: 4 of 3, then 2
    of 1). Resumed after step 2 of 4 one batch a step, it goes on at 3/4 (Lightning's: 3 of 2). A run bounded by
    epochs keeps Lightning's bar."""
    options = dict(limit_train_batches=4, limit_val_batches=0, enable_progress_bar=True)

    def bar_of(ckpt_path=None, **kwargs):
        record = RecordTrainingBar()
        trainer = small_trainer(tmp_path, callbacks=[StepProgressBar(), record], **options, **kwargs)
        trainer.fit(BoringModel(), ckpt_path=ckpt_path)
        return trainer, record.seen

    _, seen = bar_of(max_steps=3, accumulate_grad_batches=2)
    assert seen == [("Step", steps, 3) for steps in (0, 1, 1, 2, 2, 3)]
    trainer, _ = bar_of(max_steps=2)
    trainer.save_checkpoint(tmp_path / "step-2.ckpt")
    _, seen = bar_of(tmp_path / "step-2.ckpt", max_steps=4)
    assert seen == [("Step", 3, 4), ("Step", 4, 4)]
    _, seen = bar_of(max_steps=-1, max_epochs=1)
    assert seen == [("Epoch 0/0", 1, 4), ("Epoch 0/0", 2, 4), ("Epoch 0/0", 3, 4), ("Epoch 0/0", 4, 4)]
