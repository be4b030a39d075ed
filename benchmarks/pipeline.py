"""Pipeline parallel: each rank's idle share of a training step against the analytic bubble (p-1)/(vm+p-1), per
schedule, micro-batch count m and stages per rank v, measured side by side in one run; FSDP2 under pp, its weights
kept gathered for the step (the default) against freed after each forward (``reshard_after_forward=True``); and
parameter + AdamW memory per rank against 1/(pp x tp x dp_shard) of the whole, from the plan report of a 70B-shaped
model on 64 ranks.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/pipeline.py      # about 3 minutes on 2 CPU cores

Idle share: a Llama of 8 layers (hidden 256) split in pp=2 stages on 2 gloo processes, one process per core, 16 rows
of 64 tokens per step. A stage is busy while it computes a micro-batch's forward or backward (torch's
``forward_one_chunk`` and ``backward_one_chunk``, timed); the rest of the step it waits. The mean over the measured
steps (after two warm-up steps) is compared with (p-1)/(vm+p-1), which assumes equal stages and free communication:
the embedding and the head make stages unequal, and the stage with more work idles less.

FSDP2 under pp: the same model at pp=2 x dp_shard=2 on 4 gloo processes, both settings' steps alternating in one
run: the bytes all-gathered per step and rank (every gathered tensor whole) against the least, one gather of the
stage's weights; the step time over the default's (median of each step's ratio, the slowest rank's times); and the
activation estimate of each (``planning/memory/activations.py``).
"""

import contextlib
import time
from functools import partial

import torch

from lightning_automodel.testing.harness import run_checks

CONFIG = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
ROWS, TOKENS, STEPS, WARMUP = 16, 64, 6, 2
LAYOUTS = [("GPipe", 2, 1), ("GPipe", 8, 1), ("1F1B", 2, 1), ("1F1B", 8, 1), ("Interleaved1F1B", 8, 2)]


def idle_share(schedule: str, microbatches: int, stages_per_rank: int) -> dict:
    """This rank's idle share of a step, mean over the measured steps."""
    import torch.distributed as dist
    from torch.distributed.pipelining import stage as stages
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_automodel import ParallelDims, parallelize
    from lightning_automodel.parallel.pipeline import PipelineOptions, bubble_fraction, pipeline_of

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
    mesh = ParallelDims(pp=2).resolve(dist.get_world_size()).build_mesh("cpu")
    parallelize(model, mesh, pipeline=PipelineOptions(schedule, microbatches, stages_per_rank=stages_per_rank))
    busy = [0.0]
    originals = {}
    for name in ("forward_one_chunk", "backward_one_chunk"):
        original = originals[name] = getattr(stages._PipelineStageBase, name)

        def timed(self, *args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - start

        setattr(stages._PipelineStageBase, name, timed)
    tokens = torch.randint(0, CONFIG["vocab_size"], (ROWS, TOKENS))
    shares = []
    try:
        for step in range(STEPS):
            dist.barrier()
            busy[0], start = 0.0, time.perf_counter()
            model(input_ids=tokens, labels=tokens).loss.backward()
            elapsed = time.perf_counter() - start
            if step >= WARMUP:
                shares.append(1 - busy[0] / elapsed)
    finally:
        for name, original in originals.items():
            setattr(stages._PipelineStageBase, name, original)
    analytic = bubble_fraction(2, microbatches, stages_per_rank)
    return {"stages": pipeline_of(model).stage_indices, "idle": sum(shares) / len(shares), "analytic": analytic}


FSDP_MICROBATCHES = (2, 8)


def fsdp_under_pp(microbatches: int) -> dict:
    """All-gathered bytes and step times of this rank, weights kept gathered (the default) and freed after forward."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_automodel import ParallelDims, parallelize
    from lightning_automodel.parallel.pipeline import PipelineOptions, pipeline_of
    from lightning_automodel.testing.collectives import CollectiveBytes

    mesh = ParallelDims(pp=2, dp_shard=2).resolve(dist.get_world_size()).build_mesh("cpu")
    models = {}
    for name, reshard in (("kept", None), ("freed", True)):
        torch.manual_seed(0)
        models[name] = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
        parallelize(models[name], mesh, pipeline=PipelineOptions("1F1B", microbatches), reshard_after_forward=reshard)
    tokens = torch.randint(0, CONFIG["vocab_size"], (ROWS, TOKENS))
    times, gathered = {name: [] for name in models}, {}
    for step in range(STEPS):
        for name in models if step % 2 else reversed(models):
            dist.barrier()
            counted = CollectiveBytes() if step == WARMUP else None
            start = time.perf_counter()
            with counted if counted is not None else contextlib.nullcontext():
                models[name](input_ids=tokens, labels=tokens).loss.backward()
            times[name].append(time.perf_counter() - start)
            models[name].zero_grad(set_to_none=True)
            if counted is not None:
                gathered[name] = counted.bytes["all_gather"]
    stage = pipeline_of(models["kept"]).model
    least = sum(p.numel() * p.element_size() for p in stage.parameters())  # a DTensor's numel is the whole's
    return {"times": {name: ts[WARMUP:] for name, ts in times.items()}, "gathered": gathered, "least": least}


def fsdp_estimates(microbatches: int) -> dict[str, int]:
    """The activation estimate of the first stage's ranks, weights kept gathered and freed after forward."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_automodel import ParallelDims
    from lightning_automodel.parallel.pipeline import PipelineOptions
    from lightning_automodel.planning.memory.activations import activation_bytes

    estimates = {}
    for name, reshard in (("kept", None), ("freed", True)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
        estimates[name] = activation_bytes(
            model,
            ParallelDims(pp=2, dp_shard=2).resolve(4),
            micro_batch=ROWS,
            seq_len=TOKENS,
            pipeline=PipelineOptions("1F1B", microbatches),
            reshard_after_forward=reshard,
        )
    return estimates


def memory_ratios() -> list[tuple[str, float]]:
    """Largest stage's parameters + AdamW state per rank over 1/(pp x tp x dp_shard) of the whole model's."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_automodel import ParallelDims, plan_report
    from lightning_automodel.parallel.pipeline import PipelineOptions

    config = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    ratios = []
    for pp, tp, dp_shard in ((4, 8, 2), (8, 8, 1), (2, 8, 4)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        dims = ParallelDims(pp=pp, tp=tp, dp_shard=dp_shard).resolve(64)
        report = plan_report(model, dims, sp=True, pipeline=PipelineOptions("1F1B", 4 * pp))
        ideal = report.total_parameters / (pp * tp * dp_shard)
        ratios.append((f"pp={pp} x tp={tp} x dp_shard={dp_shard}", report.parameters_per_rank / ideal))
    return ratios


def main() -> None:
    print("idle share of a step per rank (pp=2, 8 layers), measured against (p-1)/(vm+p-1):")
    results = run_checks(2, [partial(idle_share, *layout) for layout in LAYOUTS], timeout=600)
    for (schedule, microbatches, v), per_rank in zip(LAYOUTS, results.values(), strict=True):
        analytic = per_rank[0]["analytic"]
        ranks = ", ".join(f"stages {r['stages']} {r['idle']:.2f} ({r['idle'] / analytic:.2f}x)" for r in per_rank)
        print(f"  {schedule:15} m={microbatches} v={v}: analytic {analytic:.2f}; {ranks}")
    print("FSDP2 under pp (pp=2 x dp_shard=2, 1F1B): weights kept gathered a step (default), or freed after forward:")
    results = run_checks(4, [partial(fsdp_under_pp, m) for m in FSDP_MICROBATCHES], timeout=600)
    for microbatches, per_rank in zip(FSDP_MICROBATCHES, results.values(), strict=True):
        slowest = {
            name: [max(step) for step in zip(*(r["times"][name] for r in per_rank), strict=True)]
            for name in ("kept", "freed")
        }
        ratios = sorted(freed / kept for kept, freed in zip(slowest["kept"], slowest["freed"], strict=True))
        estimates = fsdp_estimates(microbatches)
        rank = per_rank[0]
        print(
            f"  m={microbatches}: all-gathered MiB per step (rank 0) kept {rank['gathered']['kept'] / 2**20:.1f},"
            f" freed {rank['gathered']['freed'] / 2**20:.1f}, least {rank['least'] / 2**20:.1f}; step time freed over"
            f" kept {ratios[len(ratios) // 2]:.2f}; estimated activations MiB kept {estimates['kept'] / 2**20:.1f},"
            f" freed {estimates['freed'] / 2**20:.1f}"
        )
    print("largest stage's parameters + AdamW state per rank, over 1/(pp x tp x dp_shard) of a 70B-shaped Llama:")
    for layout, ratio in memory_ratios():
        print(f"  {layout}: {ratio:.3f}")


if __name__ == "__main__":
    main()
