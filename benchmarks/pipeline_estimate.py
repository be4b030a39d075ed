"""A pipeline candidate's activation estimate, extrapolated over micro-batches and stepped through every one: the
bytes of each (which must agree) and the CPU each took, for the 70B example's pp=4 x tp=8 x dp_shard=2 layout
(1F1B over 16 micro-batches of one 4,096-token row, full checkpointing, bf16 mixed precision) on each pp rank asked.

    PYTHONPATH=. .venv/bin/python benchmarks/pipeline_estimate.py [--stages 0,3]
"""

from __future__ import annotations

import argparse
import copy
import time
from unittest import mock

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.parallel.pipeline import PipelineOptions
from lightning_automodel.planning.memory import pipeline_extrapolation
from lightning_automodel.planning.memory.activations import activation_bytes

LLAMA_70B = dict(
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)


def estimate(model: torch.nn.Module, *, stage: int, dims: ParallelDims) -> tuple[int, float]:
    started = time.process_time()
    peak = activation_bytes(
        copy.deepcopy(model),
        dims,
        micro_batch=16,
        seq_len=4096,
        rank=stage * dims.ranks_per_stage,
        sp=True,
        activation_checkpointing="full",
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        pipeline=PipelineOptions(microbatches=16),
    )
    return peak, time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="0,1,2,3", help="the pp ranks to estimate, comma-separated")
    stages = [int(stage) for stage in parser.parse_args().stages.split(",")]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LLAMA_70B))
    dims = ParallelDims(pp=4, tp=8, dp_shard=2).resolve(64)
    print("| pp rank | extrapolated: bytes, CPU s | every micro-batch: bytes, CPU s | CPU ratio |")
    print("|---|---|---|---|")
    for stage in stages:
        fast, fast_seconds = estimate(model, stage=stage, dims=dims)
        with mock.patch.object(pipeline_extrapolation, "warm_up_microbatches", return_value=None):
            whole, whole_seconds = estimate(model, stage=stage, dims=dims)
        agree = "" if fast == whole else " (DIFFER)"
        print(
            f"| {stage} | {fast:,}, {fast_seconds:.1f} | {whole:,}, {whole_seconds:.1f}{agree} |"
            f" {whole_seconds / fast_seconds:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
