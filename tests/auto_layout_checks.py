"""Checks run on every rank for test_auto_layout.py: a real Trainer with layout="auto" chooses its layout at setup,
the same on every rank, keeps the global batch by accumulating batches, and trains at parity with one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from memory_checks import MEMORY_MODEL, map_each_large_allocation, measured_activation_bytes
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.parallel.initial_weights import is_meta
from lightning_automodel.planning.search.fitting import NoLayoutFits
from lightning_automodel.testing.models import tiny_model
from lightning_automodel.testing.trainer_parity import (
    GLOBAL_BATCH,
    HFLossCausalLM,
    compare_training,
    data,
    hf_loss,
    reference_run,
    trainer,
)

TOKENS = 16  # testing.models.batch's rows
MEMORY_VOCAB = 8000  # memory_checks' model


def _per_step(losses: list[float], accumulation: int) -> list[float]:
    """A step's loss from its accumulated batches' (each the mean over its tokens, all of a size)."""
    return [sum(losses[i : i + accumulation]) / accumulation for i in range(0, len(losses), accumulation)]


def check_auto_layout_trains_at_parity(gpu_memory: float, **fixed) -> dict:
    """3 AdamW steps through Trainer.fit with layout="auto": each rank's loader gives GLOBAL_BATCH / world rows, so
    that every rank a data-parallel rank would train the whole batch a step; the chosen layout accumulates what keeps
    it. Losses, every gradient and the weights match one process stepping the whole batch."""
    world = dist.get_world_size()
    module = HFLossCausalLM(tiny_model(seed=dist.get_rank()))
    strategy = AutoModelParallelStrategy(
        layout="auto", gpu_memory=gpu_memory, layout_batch=(GLOBAL_BATCH // world, TOKENS), **fixed
    )
    fit = trainer(strategy)
    fit.fit(module, data(world))
    choice = strategy.layout_choice
    accumulation = choice.candidate.accumulation
    assert fit.accumulate_grad_batches == accumulation
    assert choice.candidate.dims.dp * accumulation * GLOBAL_BATCH // world == GLOBAL_BATCH
    module.losses = _per_step(module.losses, accumulation)
    reference = tiny_model()
    result = compare_training(
        module, reference, reference_run(reference, loss=hf_loss), stages=choice.candidate.dims.pp > 1
    )
    measured = [
        (candidate.name, candidate.checkpointing, getattr(outcome, "memory_bytes", outcome))
        for candidate, outcome in choice.record.measured()
    ]
    layout = (choice.candidate.name, choice.candidate.checkpointing)
    return {"choice": str(choice), "layout": layout, "measured": measured, **result}


def check_refusal_before_any_weight(gpu_memory: float) -> str:
    """Nothing fits: every rank raises the same refusal, naming the smallest shortfall, with the model still on the
    meta device."""
    module = _MetaModule()
    strategy = AutoModelParallelStrategy(layout="auto", gpu_memory=gpu_memory, layout_batch=(2, TOKENS))
    try:
        trainer(strategy).fit(module, data(dist.get_world_size()))
    except NoLayoutFits as refusal:
        assert is_meta(module.model), "a weight was allocated before the refusal"
        dist.barrier()  # no rank leaves while another still talks to the store the first one hosts
        return str(refusal)
    raise AssertionError("no refusal")


class _MetaModule(HFLossCausalLM):
    """The model built in configure_model, on the meta device, as CausalLMModule builds it."""

    def __init__(self) -> None:
        super().__init__(model=torch.nn.Identity())
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = tiny_model()


MEMORY_ROWS, MEMORY_TOKENS = 4, 256


def check_chosen_layout_memory(gpu_memory: float) -> dict:
    """layout="auto" for the memory test's model at ``gpu_memory``; then, on this rank, the state the Trainer holds
    after a step (parameters, gradients, AdamW's moments) and the resident memory a real step of the chosen layout
    adds at its peak (test_memory's measurement), beside the choice's estimates."""
    map_each_large_allocation()
    world = dist.get_world_size()
    module = HFLossCausalLM(tiny_model(vocab_size=MEMORY_VOCAB, **MEMORY_MODEL))
    batch = (MEMORY_ROWS, MEMORY_TOKENS)
    strategy = AutoModelParallelStrategy(layout="auto", gpu_memory=gpu_memory, layout_batch=batch)
    ids = torch.randint(MEMORY_VOCAB, (MEMORY_ROWS * world, MEMORY_TOKENS), generator=torch.Generator().manual_seed(0))
    fit = trainer(strategy, max_steps=1)
    fit.fit(module, DataLoader(TensorDataset(ids, ids), batch_size=MEMORY_ROWS))
    choice = strategy.layout_choice
    candidate = choice.candidate
    held = [*module.model.parameters(), *(p.grad for p in module.model.parameters() if p.grad is not None)]
    held += [value for state in fit.optimizers[0].state.values() for value in state.values()]
    state = sum(_local(tensor).numel() * tensor.element_size() for tensor in held)
    measured = measured_activation_bytes(
        candidate.dims,
        MEMORY_ROWS,
        MEMORY_TOKENS,
        sp=candidate.sp,
        activation_checkpointing=candidate.checkpointing,
        pipeline=candidate.pipeline,
    )
    return {
        "layout": candidate.name,
        "checkpointing": candidate.checkpointing,
        "index": choice.index,
        "estimated_memory": choice.outcome.memory_bytes,
        "estimated_state": choice.outcome.state_bytes,
        "estimated_activations": choice.outcome.activation_bytes,
        "measured_state": state,
        "measured_activations": measured,
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
