"""Compiled decoder blocks (``compile=``) inside gloo workers: a real Trainer against the eager single-process
model (loss, every gradient at each step, weights, validate), the graphs dynamo compiled, and the compile's cost.
``backend``: torch.compile's; "aot_eager" traces and differentiates the block as inductor does (dynamo, AOTAutograd:
where tensor subclasses, hooks and guards are handled) and runs the graph eagerly, without inductor's code
generation, which costs most of a compile on CPU."""

from __future__ import annotations

import time

import lightning as L
import torch
import torch.distributed as dist
from lightning_checks import fit_against_one_process
from lora_checks import fit_lora_against_one_process
from torch._dynamo.utils import counters

from lightning_automodel import AutoModelParallelStrategy

LAYERS = 4  # two per stage at pp=2


class GraphsAndTimes(L.Callback):
    """After each training step: how many graphs dynamo has compiled in this process, and the step's seconds."""

    def __init__(self) -> None:
        self.graphs: list[int] = []
        self.seconds: list[float] = []

    def on_train_batch_start(self, *args: object) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, *args: object) -> None:
        self.seconds.append(time.perf_counter() - self.start)
        self.graphs.append(counters["stats"]["unique_graphs"])

    def summary(self, training: int | None, evaluation: int | None) -> dict:
        """The first step compiles ``training`` graphs, the validation after it ``evaluation`` more (grad mode is one
        of dynamo's guards), later steps none. None: any number but none after the validation (a block with graph
        breaks compiles a graph per piece)."""
        assert self.graphs[0] > 0 and self.graphs[1] == self.graphs[2], self.graphs
        if training is not None:
            assert self.graphs == [training, *[training + evaluation] * 2], self.graphs
        return {"graphs": self.graphs[-1], "first_step_s": self.seconds[0], "later_step_s": max(self.seconds[1:])}


def check_compiled_trainer_parity(
    family: str = "llama", *, tp: int = 1, backend: str = "inductor", exact_graphs: bool = True, **options: object
) -> dict:
    """3 AdamW steps and a validation through Trainer.fit with every decoder block compiled match the eager model in
    one process. The blocks share one graph a grad mode (context parallel: two, the first block building the call's
    attention mask, the others finding it); ``exact_graphs=False``: any number, none after the first validation. The
    steps' seconds."""
    fresh_dynamo()
    strategy = AutoModelParallelStrategy(tp, compile={"backend": backend}, **options)
    dims = strategy.parallel_dims
    recorded = GraphsAndTimes()
    _, result = fit_against_one_process(
        strategy,
        family,
        dict(num_hidden_layers=LAYERS),
        dp=dist.get_world_size() // tp // dims.cp // dims.pp,
        callbacks=[recorded],
        stages=dims.pp > 1,
    )
    blocks_graphs = 2 if options.get("cp", 1) > 1 else 1  # cp: the first block builds the call's attention mask
    expected = blocks_graphs if exact_graphs else None
    return result | recorded.summary(training=expected, evaluation=expected)


def check_compiled_lora(tp: int = 1, sp: bool = False, backend: str = "inductor") -> dict:
    """A PEFT model (LoRA on every projection, the base frozen) with its blocks compiled, through the Trainer: the
    adapters' gradients at each step and their weights after 3 AdamW steps match the eager model in one process."""
    fresh_dynamo()
    recorded = GraphsAndTimes()
    strategy = AutoModelParallelStrategy(tp, sp=sp, compile={"backend": backend})
    dp = dist.get_world_size() // tp
    _, result = fit_lora_against_one_process(strategy, dp=dp, layers=LAYERS, validate=True, callbacks=[recorded])
    # the first block's input needs no gradient (the embedding is frozen), the others' do: a graph each in training
    return result | recorded.summary(training=2, evaluation=1)


def fresh_dynamo() -> None:
    """Forget what earlier checks in this process compiled: dynamo's recompile limit (8) counts the graphs of a code
    object over the process, and every check's blocks run the same forward."""
    torch._dynamo.reset()
    counters.clear()
