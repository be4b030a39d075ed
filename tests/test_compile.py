"""Compiled decoder blocks (``compile=``) against the eager model in one process, through a real Trainer: 3 AdamW
steps (the loss and every gradient at each step, the weights after) and validate's loss, at tp=2 with sp and full
activation checkpointing (inductor), and traced by dynamo and AOTAutograd as inductor's are (the "aot_eager" backend:
inductor's code generation is most of a compile's cost on CPU) at cp=2, pp=2, LoRA over dp_shard=2, bf16-mixed, and
selective checkpointing inside the compiled blocks (which keep fewer activations for it; submodule checkpointing and
ERNIE-4.5-MoE's fp32 router units under bf16-mixed with -m sweep), and Qwen3-MoE at ep=2 (the token exchange eager
between the blocks' graphs); no graph compiled after the first step and its validation; the options refused;
generation (a call with a cache) runs the blocks eagerly. scripts/compile_sweep.py runs every layout with inductor."""

from copy import deepcopy
from functools import partial

import pytest
import torch
from compile_checks import check_compiled_lora
from torch._dynamo.utils import counters

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.hf.decoder_layers import named_decoder_layers
from lightning_automodel.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_automodel.parallel.compile import apply_compile
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.models import batch, tiny_model
from lightning_automodel.testing.trainer_checks import check_bf16_trainer, check_compiled_trainer_parity

AOT_EAGER = {"backend": "aot_eager"}


def test_compiled_blocks_on_two_ranks():
    checks = [
        partial(check_compiled_trainer_parity, tp=2, sp=True, activation_checkpointing=True),
        partial(check_compiled_trainer_parity, cp=2, backend="aot_eager"),
        partial(check_compiled_lora, backend="aot_eager"),
        partial(check_compiled_trainer_parity, activation_checkpointing="selective", backend="aot_eager"),
    ]
    run_checks(2, checks, timeout=600)


@pytest.mark.sweep  # compiled blocks under pp and ep (28 s of the launch); tp, cp, LoRA and checkpointing in the suite
def test_compiled_blocks_at_pp_and_ep():
    checks = [
        partial(check_compiled_trainer_parity, pp=2, backend="aot_eager"),
        partial(check_compiled_trainer_parity, "qwen3_moe", ep=2, backend="aot_eager", exact_graphs=False),
    ]
    run_checks(2, checks, timeout=600)


@pytest.mark.sweep  # the same function checkpoints every mode inside a compiled block (selective: in the suite)
def test_compiled_blocks_with_more_checkpointing_modes():
    checks = [
        partial(check_compiled_trainer_parity, activation_checkpointing="submodule", backend="aot_eager"),
        partial(check_bf16_trainer, 1, "bf16-mixed", compile=AOT_EAGER),
        partial(
            check_bf16_trainer, 1, "bf16-mixed", "ernie_moe", compile=AOT_EAGER, activation_checkpointing="selective"
        ),
    ]
    run_checks(2, checks, timeout=600)


def test_checkpointing_inside_compiled_blocks_keeps_fewer_activations():
    """Selective and submodule checkpointing go inside a compiled block's forward (torch.utils.checkpoint, traced by
    dynamo): the step keeps fewer activations for backward than the compiled block without checkpointing (bytes
    autograd saves, counted by its saved-tensor hooks), and full checkpointing fewer still. Measured: 3.55 MB
    without, 2.73 MB selective, 2.45 MB submodule, 0.33 MB full."""
    saved = {mode: _saved_bytes(mode) for mode in (False, "selective", "submodule", "full")}
    assert saved[False] > saved["selective"] > saved["submodule"] > saved["full"], saved


def _saved_bytes(mode: str | bool) -> int:
    torch._dynamo.reset()
    model = tiny_model(num_hidden_layers=2, hidden_size=128, intermediate_size=512)
    layers = [layer for _, layer in named_decoder_layers(model)]
    if mode:
        apply_activation_checkpointing(model, layers, mode=mode, compiled=True)
    apply_compile(model, layers, {"backend": "aot_eager"})
    tokens, labels = batch(4)
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=tokens, labels=labels).loss
    loss.backward()
    return sum(saved)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(compile="yes"), "use False, True or a dict"),
        (dict(compile={"fullgraf": True}), "fullgraf not among torch.compile's keyword arguments"),
        (dict(compile=True, ep=2, activation_checkpointing="selective"), "run every block eagerly, compiling nothing"),
        (dict(compile=True, ep=2, activation_checkpointing="submodule"), "run every block eagerly, compiling nothing"),
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
