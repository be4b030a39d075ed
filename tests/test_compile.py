"""Compiled decoder blocks (``compile=``) against the eager model in one process, through a real Trainer: 3 AdamW
steps (the loss and every gradient at each step, the weights after) and validate's loss, at tp=2 with sp and full
activation checkpointing (inductor), and traced by dynamo and AOTAutograd as inductor's are (the "aot_eager" backend:
inductor's code generation is most of a compile's cost on CPU) at cp=2, pp=2, LoRA over dp_shard=2 and bf16-mixed;
no graph compiled after the first step and its validation; the options refused; generation (a call with a cache)
runs the blocks eagerly. scripts/compile_sweep.py runs every layout with inductor."""

from copy import deepcopy
from functools import partial

import pytest
import torch
from compile_checks import check_compiled_lora
from torch._dynamo.utils import counters

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.hf.decoder_layers import named_decoder_layers
from lightning_automodel.parallel.compile import apply_compile
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.models import batch, tiny_model
from lightning_automodel.testing.trainer_checks import check_bf16_trainer, check_compiled_trainer_parity


def test_compiled_blocks_on_two_ranks():
    checks = [
        partial(check_compiled_trainer_parity, tp=2, sp=True, activation_checkpointing=True),
        partial(check_compiled_trainer_parity, cp=2, backend="aot_eager"),
        partial(check_compiled_trainer_parity, pp=2, backend="aot_eager"),
        partial(check_compiled_lora, backend="aot_eager"),
        partial(check_bf16_trainer, 1, "bf16-mixed", compile={"backend": "aot_eager"}),
    ]
    run_checks(2, checks, timeout=600)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(compile="yes"), "use False, True or a dict"),
        (dict(compile={"fullgraf": True}), "fullgraf not among torch.compile's keyword arguments"),
        (dict(compile=True, activation_checkpointing="selective"), "dispatches no op for its policy"),
        (dict(compile=True, activation_checkpointing="submodule"), "checkpoint hooks of its attention and MLP"),
        (dict(compile=True, ep=2), "compile with ep=2 is not supported yet"),
    ],
)
def test_compile_options_refused(options, message):
    with pytest.raises(ValueError, match=message):
        AutoModelParallelStrategy(**options)


def test_generation_runs_compiled_blocks_eagerly():
    """A call with a key/value cache (generate's) would make dynamo compile a graph per layer: it runs the blocks
    eagerly, and generates what the uncompiled model generates. Training and evaluation build no cache."""
    model, reference = tiny_model(num_hidden_layers=2).eval(), tiny_model(num_hidden_layers=2).eval()
    apply_compile(model, [layer for _, layer in named_decoder_layers(model)], {})
    assert model.config.use_cache is False
    copy = deepcopy(model)  # Lightning's weight averaging copies the model: the copy's blocks run its own weights
    assert all(layer.forward.__self__ is layer for _, layer in named_decoder_layers(copy))
    counters.clear()
    tokens, _ = batch(2)
    options = dict(max_new_tokens=4, do_sample=False, use_cache=True)
    assert torch.equal(model.generate(tokens[:, :8], **options), reference.generate(tokens[:, :8], **options))
    assert counters["stats"]["unique_graphs"] == 0
