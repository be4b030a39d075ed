"""CausalLMModule: parity with a single process under tp x dp, its schedule, and its use without our strategy."""

import math
from functools import partial

import lightning as L
import pytest
from harness import run_checks
from lm_checks import check_causal_lm_module, check_lora_checkpoint_exports_merged, check_predict_in_step_or_refused
from models import tiny_config

from lightning_automodel.lm import CausalLMModule, DemoDataModule
from lightning_automodel.lm.module import learning_rate_factor


def test_parity_at_tp2_dp2_with_sp():
    """Logged loss and accuracy at each step, gradients, weights, validation metrics: as a single process."""
    results = run_checks(4, [partial(check_causal_lm_module, 2, True)], timeout=300)
    print(results)


def test_lora_export_and_predict():
    """At tp=2, trained adapters merged into a plain Hugging Face model by `export`: the same logits. At dp=2,
    predict over uneven batches is refused on every rank, and the data module's split predicts every row."""
    run_checks(2, [partial(check_lora_checkpoint_exports_merged, 2), check_predict_in_step_or_refused])


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


def test_flops_per_token():
    """6 FLOPs per trained weight, 4 per frozen one, none for the embedding lookup, plus attention; a third of
    each in evaluation."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_automodel.lm.flops import flops_per_token

    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    weights = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    attention = 12 * 2 * 64 * 16  # layers x width x sequence
    assert flops_per_token(model, 16) == 6 * weights + attention
    assert flops_per_token(model, 16, training=False) == 2 * weights + attention // 3
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert flops_per_token(lora, 16) == 6 * adapters + 4 * weights + attention
