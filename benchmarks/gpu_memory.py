"""The GPU check's memory sections (benchmarks/gpu.py): the planner's figures against the allocator's peak.

- activations: the activation estimate (``planning.memory.activations``) of one checkpointing mode against the
  allocator's peak of the same step above what the step held before;
- auto: ``layout="auto"`` through a real Trainer on the one GPU, its memory read from the device: the memory it
  chose by (the state and the chosen checkpointing's activations) against the allocator's peak over the run. The
  estimate holds the gradients through the whole step, where Lightning frees them before each (an upper bound by up
  to their size: the state is printed beside it), and leaves out the temporaries of AdamW's step (foreach AdamW's
  are the size of the parameters' shards; no activation is held then): the row shows which of the two the run meets.

The allocator's peak is ``torch.cuda.max_memory_allocated``.

Each runs in a child of gpu.py's, given the model's config; on CPU (the dry run) the estimates alone.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from benchmarks.throughput import random_tokens

DRY_RUN_GPU_GIB = 1.0  # the memory the dry run plans for: the CPU has none to read


def measure_activations(args: argparse.Namespace, step: str, *, model_config: dict[str, Any]) -> dict[str, Any]:
    """The estimate of a checkpointing mode and an attention dropout (``step``: their JSON pair) against the
    allocator's peak of the same step, above what it held."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_automodel import ParallelDims
    from lightning_automodel.parallel import parallelize
    from lightning_automodel.planning.memory.activations import activation_bytes, training_step

    checkpointing, dropout = json.loads(step)
    hf_config = AutoConfig.for_model(**model_config, attention_dropout=dropout, attn_implementation="sdpa")
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(hf_config)
    dims = ParallelDims().resolve(1)
    estimate = activation_bytes(
        meta_model,
        dims,
        micro_batch=args.rows,
        seq_len=args.seq_len,
        activation_checkpointing=checkpointing,
    )
    result: dict[str, Any] = {"estimate_gib": estimate / 2**30, "measured_gib": None}
    if not torch.cuda.is_available():
        return result
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(int(os.environ.get("GPU_CHECK_PORT", "29533")) + 1))
    dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = dims.build_mesh("cuda")
    model = AutoModelForCausalLM.from_config(hf_config).cuda()
    parallelize(model, mesh, activation_checkpointing=checkpointing)
    tokens = torch.randint(hf_config.vocab_size, (args.rows, args.seq_len), device="cuda")
    training_step(model, input_ids=tokens, mesh=mesh)  # nothing allocated for the first time in the measured step
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    training_step(model, input_ids=tokens, mesh=mesh)
    torch.cuda.synchronize()
    result["measured_gib"] = (torch.cuda.max_memory_allocated() - held) / 2**30
    dist.destroy_process_group()
    return result


def measure_auto_layout(args: argparse.Namespace, *, model_config: dict[str, Any]) -> dict[str, Any]:
    """layout="auto" trains ``model_config`` for ``args.steps`` steps on one device: what it chose, the memory it chose
    by, and the allocator's peak over the run (parameters, gradients, AdamW's state and the step's activations)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_automodel import AutoModelParallelStrategy
    from lightning_automodel.lm import CausalLMModule

    cuda = torch.cuda.is_available()
    strategy = AutoModelParallelStrategy(
        layout="auto", gpu_memory=None if cuda else DRY_RUN_GPU_GIB, layout_batch=(args.rows, args.seq_len)
    )
    samples = random_tokens(args.steps * args.rows, args.seq_len, model_config["vocab_size"])
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(CausalLMModule(config=model_config, schedule="constant"), DataLoader(samples, batch_size=args.rows))
    choice = strategy.layout_choice
    return {
        "chosen": f"{choice.candidate.name} {choice.candidate.checkpointing}",
        "gpu_gib": choice.hardware.memory_gib,
        "state_gib": choice.outcome.state_bytes / 2**30,
        "estimate_gib": choice.outcome.memory_bytes / 2**30,
        "measured_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
    }


def activation_row(step: tuple[Any, float], result: dict[str, Any]) -> tuple[str, str, str]:
    checkpointing, dropout = step
    name = f"activations, checkpointing {checkpointing or 'off'}" + (f", attn dropout {dropout}" if dropout else "")
    if "failed" in result:
        return (name, f"FAILED ({result['failed']})", "")
    return (name, *_against_the_allocator(result))


def auto_layout_row(result: dict[str, Any]) -> tuple[str, str, str]:
    if "failed" in result:
        return ('layout="auto"', f"FAILED ({result['failed']})", "")
    shown, against = _against_the_allocator(result)
    state, reserved = result["state_gib"] * 1024, result["reserved_gib"]
    shown += f" (state {state:,.1f} MiB" + ("" if reserved is None else f"; reserved {reserved * 1024:,.1f} MiB") + ")"
    return (f'layout="auto", {result["gpu_gib"]:.0f} GiB', f"{result['chosen']}: {shown}", against)


def _against_the_allocator(result: dict[str, Any]) -> tuple[str, str]:
    estimate, measured = result["estimate_gib"], result["measured_gib"]
    shown = f"estimate {estimate * 1024:,.1f} MiB, allocator " + (
        "n/a" if measured is None else f"{measured * 1024:,.1f} MiB"
    )
    return shown, f"{estimate / measured:.3f}x the allocator's" if measured else "(no GPU: estimate only)"
