"""``layout="auto"``: the strategy chooses its layout at setup, once the LightningModule's model exists and before any
weight is allocated, with :func:`~lightning_automodel.planning.search.fitting.choose_layout`.

The search runs in a child process on every rank (planning needs fake process groups of its own), each measuring one
candidate of every wave; the ranks exchange their outcomes, so every rank holds the same measurements and reaches the
same choice, and one rank's failure is raised on every rank. The GPU memory planned for is the smallest of the ranks'
devices (or ``gpu_memory``); the batch is the data module's ``batch_size`` x ``seq_len`` (or ``layout_batch``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lightning_automodel.hf.models import find_hf_models
from lightning_automodel.parallel.initial_weights import is_meta
from lightning_automodel.parallel.probe.step import meta_copy
from lightning_automodel.planning.child_process import ChildProcess
from lightning_automodel.planning.memory.step_options import StepOptions
from lightning_automodel.planning.search.fitting import LayoutChoice, choose_layout
from lightning_automodel.planning.search.layouts import Candidate, Outcome, SearchSpace, tensor_budget
from lightning_automodel.planning.search.throughput import Hardware
from lightning_automodel.planning.search.workers import Measurements, combined, jobs_of
from lightning_automodel.strategy.module_hints import adamw_of, loss_chunks_of
from lightning_automodel.strategy.options import StrategyOptions

if TYPE_CHECKING:
    import lightning.pytorch as pl


def choose_for_trainer(options: StrategyOptions, trainer: pl.Trainer, *, devices_per_node: int) -> LayoutChoice:
    """The layout for ``trainer``'s LightningModule, the same on every rank (collective: every rank must call it)."""
    assert options.search is not None
    module = trainer.lightning_module
    model = _the_model(module)
    batch_shape = _batch_shape(trainer, options)
    space = _with_accumulation(options.search, trainer)
    hardware = _hardware(options, trainer.strategy.root_device, gpus_per_node=devices_per_node)
    step = step_options(options, module)
    world_size = trainer.world_size
    planned = model if is_meta(model) else meta_copy(model)
    with _RankWorkers(planned, batch_shape=batch_shape, hardware=hardware, step=step) as workers:
        return choose_layout(
            planned,
            world_size,
            hardware=hardware,
            batch_shape=batch_shape,
            space=space,
            evaluate=workers,
            workers=world_size,
            step=step,
        )


def step_options(options: StrategyOptions, module: nn.Module) -> StepOptions:
    """How each layout's step is computed: the strategy's plan, precision (its FSDP2 policy, set at setup: the one
    given, else the Trainer's precision's), ``freeze``, images a row and experts' routing, and the module's loss
    chunks and AdamW."""
    images = (options.layout_images_per_row, options.layout_image_tokens)
    policy = options.parallel.fsdp.mp_policy
    return StepOptions.of(
        options.parallel,
        mp_policy=policy,
        loss_chunks=loss_chunks_of(module),
        adamw=adamw_of(module),
        images=images,
        expert_imbalance=options.layout_expert_imbalance,
    )


def apply_accumulation(choice: LayoutChoice, trainer: pl.Trainer) -> bool:
    """The Trainer accumulates the batches that keep the global batch, once it fits (evaluation steps no optimizer);
    whether it now does."""
    if trainer.state.fn != TrainerFn.FITTING:
        return False
    trainer.accumulate_grad_batches *= choice.candidate.accumulation
    return True


def _the_model(module: nn.Module) -> nn.Module:
    models = find_hf_models(module)
    if len(models) != 1:
        found = ", ".join(type(model).__name__ for model in models) or "none"
        raise ValueError(
            f'layout="auto" plans the memory of one Hugging Face model; {type(module).__name__} holds {len(models)}'
            f" ({found}). Give the sizes yourself (tp=, pp=, ...), planned with `lightning-automodel plan`."
        )
    return models[0]


def _batch_shape(trainer: pl.Trainer, options: StrategyOptions) -> tuple[int, int]:
    if options.layout_batch is not None:
        return options.layout_batch
    data = trainer.datamodule
    rows, tokens = getattr(data, "batch_size", None), getattr(data, "seq_len", None)
    if not isinstance(rows, int) or not isinstance(tokens, int):
        raise ValueError(
            'layout="auto" sizes the training step from the data module\'s batch_size and seq_len, and this run has'
            f" {'no data module' if data is None else type(data).__name__ + ', without them'}: pass"
            " layout_batch=(rows a batch, tokens a row) to the strategy."
        )
    return rows, tokens


def _with_accumulation(space: SearchSpace, trainer: pl.Trainer) -> SearchSpace:
    """The space with the reason the optimizer cannot accumulate batches, where it cannot (layouts that would train
    a smaller global batch are then refused)."""
    reason = None
    if not trainer.lightning_module.automatic_optimization:
        reason = "the LightningModule steps its optimizer itself (manual optimization): Lightning accumulates nothing"
    elif any(isinstance(callback, GradientAccumulationScheduler) for callback in trainer.callbacks):
        reason = "a GradientAccumulationScheduler sets the Trainer's accumulation itself"
    if reason is None:
        return space
    return dataclasses.replace(space, no_accumulation=reason)


def require_memory_to_plan(options: StrategyOptions, device: torch.device) -> None:
    """Refused before any collective: a search on devices whose memory it cannot read, without ``gpu_memory``."""
    if options.search is not None and device.type != "cuda" and options.gpu_memory is None:
        raise ValueError(
            f'layout="auto" on {device.type} devices: pass gpu_memory=, the GiB per device to plan for (the search'
            " reads a GPU's memory from the GPU)."
        )


def _hardware(options: StrategyOptions, device: torch.device, *, gpus_per_node: int) -> Hardware:
    """The GPU planned for: ``gpu_memory`` GiB, else the smallest device of the ranks (collective)."""
    if device.type != "cuda":
        return Hardware(options.gpu_memory, gpus_per_node=gpus_per_node)
    name = torch.cuda.get_device_name(device)
    if options.gpu_memory is not None:
        return Hardware.named(name, memory_gib=options.gpu_memory, gpus_per_node=gpus_per_node)
    total = torch.tensor(float(torch.cuda.get_device_properties(device).total_memory), device=device)
    dist.all_reduce(total, op=dist.ReduceOp.MIN)
    return Hardware.named(name, memory_gib=total.item() / 2**30, gpus_per_node=gpus_per_node)


class _RankWorkers:
    """This rank's child process, measuring the rank's job of each wave (a candidate, or one pp rank's stages of
    one); the ranks exchange the outcomes."""

    def __init__(self, model: nn.Module, *, batch_shape: tuple[int, int], hardware: Hardware, step: StepOptions):
        self.measurements = Measurements(
            model, batch_shape=batch_shape, budget=tensor_budget(hardware.memory_gib), step=step
        )
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        ranks_per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", hardware.gpus_per_node))
        threads = max(1, (os.cpu_count() or 1) // ranks_per_machine)
        self.child = ChildProcess(purpose='layout="auto"', threads=threads)

    def __call__(self, wave: list[Candidate]) -> list[Outcome | str]:
        jobs = jobs_of(wave)  # no more than the ranks: the search sizes its waves so
        outcome, failure = None, None
        if self.rank < len(jobs):
            index, pp_rank = jobs[self.rank]
            try:
                self.measurements.submit(self.child, wave[index], pp_rank=pp_rank)
                outcome = self.child.result()
            except Exception as error:  # noqa: BLE001 - raised below on every rank, once all know
                failure = f"{type(error).__name__}: {error}"
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (outcome, failure))
        failed = [(rank, message) for rank, (_, message) in enumerate(gathered) if message is not None]
        if failed:
            rank, message = failed[0]
            raise RuntimeError(f'layout="auto": measuring {wave[jobs[rank][0]].name} failed on rank {rank}: {message}')
        return combined(wave, jobs, [outcome for outcome, _ in gathered[: len(jobs)]])

    def __enter__(self) -> _RankWorkers:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.child.close()
