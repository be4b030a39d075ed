"""Compiled decoder blocks (``compile=``) of a PEFT model inside gloo workers: a real Trainer against the eager
single-process model, and the graphs dynamo compiled (a plain model's: lightning_automodel.testing.trainer_checks).
``backend``: torch.compile's; "aot_eager" traces and differentiates the block as inductor does (dynamo, AOTAutograd:
where tensor subclasses, hooks and guards are handled) and runs the graph eagerly, without inductor's code
generation, which costs most of a compile on CPU."""

from __future__ import annotations

import torch.distributed as dist
from lora_checks import fit_lora_against_one_process

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.testing.trainer_checks import COMPILED_LAYERS, GraphsAndTimes, fresh_dynamo


def check_compiled_lora(tp: int = 1, sp: bool = False, backend: str = "inductor") -> dict:
    """A PEFT model (LoRA on every projection, the base frozen) with its blocks compiled, through the Trainer: the
    adapters' gradients at each step and their weights after 3 AdamW steps match the eager model in one process."""
    fresh_dynamo()
    recorded = GraphsAndTimes()
    strategy = AutoModelParallelStrategy(tp, sp=sp, compile={"backend": backend})
    dp = dist.get_world_size() // tp
    _, result = fit_lora_against_one_process(
        strategy, dp=dp, layers=COMPILED_LAYERS, validate=True, callbacks=[recorded]
    )
    # the first block's input needs no gradient (the embedding is frozen), the others' do: a graph each in training
    return result | recorded.summary(training=2, evaluation=1)
