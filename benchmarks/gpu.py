"""The GPU check: speed, MFU and memory of ours against the peers, Float8, flex attention under cp, and the planner's
memory (the activation estimate, layout="auto"'s choice) against the allocator, in one command and one table.

    PYTHONPATH=. python benchmarks/gpu.py              # one H100: about 7 minutes (or: python -m benchmarks.gpu)
    PYTHONPATH=. python benchmarks/gpu.py --dry-run    # CPU: tiny shapes, the same code (tests/test_gpu_benchmark.py)

Every measurement runs in a fresh process (nothing compiled or allocated leaks into the next), killed after
``--timeout`` seconds; a failure is a row of the table, not the end of the run. Sections:

- throughput: a Llama of about 1B parameters (Llama 3.2 1B's shape) in bf16-mixed at 2 x 4096 tokens a step: ours
  eager, compiled, compiled + Float8 (tensorwise), compiled + the chunked loss (8 chunks); Lightning's stock
  ModelParallelStrategy with an expert's configure_model (FSDP2 per block, each block compiled). torchtitan's
  trainer is not carried to the GPU machine yet: its row says so (benchmarks/torchtitan_peer.py runs it beside ours).
  Tokens/s over the steps after the warm-up, MFU (the model's FLOPs per token, ``planning.flops``, x tokens/s over
  the peak of a 8192^3 bf16 matmul measured on the same GPU, printed), and the allocator's peak;
- float8 at scale: compiled bf16 against compiled + Float8 on the largest Llama the one GPU trains (about 3B, full
  activation checkpointing): small matrices gain less, so each ratio names its shape;
- cp: flex attention against SDPA at cp=2, two ranks on the one GPU (gloo with CUDA tensors: NCCL refuses two ranks
  on one device): a training step's loss and every gradient against cp=1 in the same process, and the step time;
- activations: ``plan --activations``' estimate (``planning.memory.activations``) of each checkpointing mode (and of
  attention dropout, which the estimate counts as a GPU's fused kernel holds it) against
  ``torch.cuda.max_memory_allocated`` of the same step above what the step held before (benchmarks/gpu_memory.py);
- auto: ``layout="auto"`` training the 3B shape through a Trainer, the memory it chose by against the allocator's
  peak over the run (benchmarks/gpu_memory.py).

Targets (issue 34): compiled >= torchtitan's (else stock Lightning's) tokens/s; Float8 >= 1.2x compiled bf16 at 3B;
MFU compiled >= 0.40; the estimate within 5% of the allocator (issue 38: layout="auto"'s too).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.gpu_memory import activation_row, auto_layout_row, measure_activations, measure_auto_layout
from benchmarks.throughput import random_tokens, step_timer

SHAPES = {  # Llama-shaped: Llama 3.2 1B, and a 3B that trains on one 80 GB GPU with full checkpointing
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, heads=32, kv_heads=8, vocab=128256),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, heads=24, kv_heads=8, vocab=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, heads=4, kv_heads=2, vocab=256),
}
THROUGHPUT = {  # name: (shape, what it runs)
    "eager": ("1b", {}),
    "compiled": ("1b", {"compile": True}),
    "compiled_float8": ("1b", {"compile": True, "float8": True}),
    "compiled_chunked_loss": ("1b", {"compile": True, "loss_chunks": 8}),
    "lightning_expert": ("1b", {"expert": True, "compile": True}),
    "3b_compiled": ("3b", {"compile": True, "activation_checkpointing": True}),
    "3b_compiled_float8": ("3b", {"compile": True, "activation_checkpointing": True, "float8": True}),
}
RATIOS = {  # each row's tokens/s over another's
    "compiled": "eager",
    "compiled_float8": "compiled",
    "compiled_chunked_loss": "compiled",
    "lightning_expert": "compiled",
    "3b_compiled_float8": "3b_compiled",
}
# (checkpointing, attention dropout): with dropout, CPU's SDPA keeps the scores; the estimate counts a GPU's kernel
ACTIVATIONS = ((False, 0.0), ("full", 0.0), ("selective", 0.0), (False, 0.1))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, a few steps, the same code")
    parser.add_argument("--sections", default="throughput,cp,activations,auto")
    parser.add_argument("--timeout", type=float, default=150, help="seconds before one measurement is killed")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: one measurement, as JSON
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.steps, args.warmup, args.rows, args.seq_len = 3, 1, 2, 64
    return args


def config(shape: str, seq_len: int) -> dict[str, Any]:
    s = SHAPES[shape]
    return {
        "model_type": "llama",
        "hidden_size": s["hidden_size"],
        "intermediate_size": s["intermediate_size"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "vocab_size": s["vocab"],
        "max_position_embeddings": seq_len,
    }


def device_settings(args: argparse.Namespace, asked: dict[str, Any]) -> dict[str, Any]:
    """What the dry run changes on CPU: compile without inductor's code generation, Float8 emulated (tensorwise, as
    on the GPU: one rank runs no float8 collective)."""
    options = dict(asked)
    if args.dry_run and options.get("compile"):
        options["compile"] = {"backend": "aot_eager"}
    if args.dry_run and options.get("float8"):
        options["float8"] = {"emulate": True}
    return options


# ------------------------------------------------------------------------------------------ measurements (children)


def measure_throughput(args: argparse.Namespace, name: str) -> dict[str, Any]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from lightning_automodel import AutoModelParallelStrategy
    from lightning_automodel.lm import CausalLMModule
    from lightning_automodel.planning.flops import flops_per_token

    shape, asked = THROUGHPUT[name]
    options = device_settings(args, asked)
    cuda = torch.cuda.is_available()
    shape = "tiny" if args.dry_run else shape
    model_config = config(shape, args.seq_len)
    L.seed_everything(0, verbose=False)
    loss_chunks = options.pop("loss_chunks", 1)
    if options.pop("expert", False):
        module, strategy = _expert_module(model_config, options), _stock_strategy()
    else:
        module = CausalLMModule(config=model_config, schedule="constant", loss_chunks=loss_chunks)
        strategy = AutoModelParallelStrategy(**options)
    steps = args.steps
    data = DataLoader(random_tokens(steps * args.rows, args.seq_len, model_config["vocab_size"]), batch_size=args.rows)
    timer = step_timer(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[timer],
    )
    trainer.fit(module, data)
    timed = len(timer.ends) - args.warmup
    seconds = timer.ends[-1] - timer.ends[args.warmup - 1]
    tokens_per_s = timed * args.rows * args.seq_len / seconds
    return {
        "shape": shape,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token(module.model, args.seq_len),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "losses": timer.losses[:3],
    }


def _stock_strategy():
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy()


def _expert_module(model_config: dict[str, Any], options: dict[str, Any]):
    """What an expert writes for Lightning's stock ModelParallelStrategy on one GPU: the model built in
    configure_model, each block compiled and FSDP2-wrapped, then the root (torchtitan's order)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_automodel.lm import CausalLMModule

    class ExpertModule(CausalLMModule):
        def configure_model(self) -> None:
            if self.model is not None:
                return
            hf_config = AutoConfig.for_model(**model_config)
            self.model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
            mesh = self.device_mesh["data_parallel"]
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            layers = self.model.model.layers
            for index, layer in enumerate(layers):
                layer.compile(**(options["compile"] if isinstance(options["compile"], dict) else {}))
                fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=index < len(layers) - 1)
            fully_shard(self.model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)

    return ExpertModule(config=model_config, schedule="constant")


def measure_cp(args: argparse.Namespace, attention: str) -> dict[str, Any]:
    """cp=2 on two processes sharing the one GPU (or the CPU): a training step's loss and gradients against cp=1."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(_cp_rank, args=(args.dry_run, args.seq_len, attention, directory), nprocs=2, join=True)
        return json.loads((Path(directory) / "rank0.json").read_text())


def _cp_rank(rank: int, dry_run: bool, seq_len: int, attention: str, directory: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_automodel import ParallelDims
    from lightning_automodel.parallel import parallelize
    from lightning_automodel.testing.parity import full, relative_error

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("GPU_CHECK_PORT", "29533"))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    sizes = config("tiny", seq_len) if dry_run else dict(config("1b", seq_len), num_hidden_layers=4)
    hf_config = AutoConfig.for_model(**sizes, attn_implementation="sdpa")
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config)).to(device)  # cp changes its model's config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config).to(device)
    mesh = ParallelDims(cp=2).resolve(2).build_mesh(device.type)
    parallelize(model, mesh, cp_attention=attention)
    tokens = torch.randint(hf_config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1)).to(device)
    expected = reference(input_ids=tokens, labels=tokens, use_cache=False).loss
    expected.backward()
    seconds = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss  # this rank's share: the cp ranks' sum over cp
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    dist.all_reduce(shares := loss.detach().clone())
    grads = dict(reference.named_parameters())
    worst = max(relative_error(full(p.grad), grads[name].grad) for name, p in model.named_parameters())
    result = {
        "loss_error": abs(shares.item() / 2 - expected.item()) / expected.item(),
        "grad_error": worst,
        "step_s": sorted(seconds)[1],
    }
    if rank == 0:
        (Path(directory) / "rank0.json").write_text(json.dumps(result))
    dist.barrier()  # rank 0 hosts the store: a rank that left first aborted the other at exit (1 run in 15)
    dist.destroy_process_group()


def matmul_peak() -> dict[str, Any]:
    """The bf16 FLOP/s of a large square matmul on this GPU: MFU's denominator, measured, not a datasheet's."""
    import torch

    if not torch.cuda.is_available():
        return {"flops": None}
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    started, runs = time.perf_counter(), 20
    for _ in range(runs):
        a @ b
    torch.cuda.synchronize()
    return {"flops": 2 * n**3 * runs / (time.perf_counter() - started), "device": torch.cuda.get_device_name()}


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    section, _, name = args.child.partition(":")
    if section == "throughput":
        return measure_throughput(args, name)
    if section == "cp":
        return measure_cp(args, name)
    if section == "activations":
        return measure_activations(args, name, model_config=config("tiny" if args.dry_run else "1b", args.seq_len))
    if section == "auto":
        return measure_auto_layout(args, model_config=config("tiny" if args.dry_run else "3b", args.seq_len))
    return matmul_peak()


# ----------------------------------------------------------------------------------------------- the parent


def spawn(child: str, argv: list[str], timeout: float, *, dry_run: bool) -> dict[str, Any]:
    """One measurement in a fresh process; in the dry run, in this one (the same code, without a process's imports
    each: the suite runs it)."""
    if dry_run:
        try:
            return run_child(parse_args([*argv, "--child", child]))
        except Exception:  # noqa: BLE001 - a failed measurement is a row of the table
            traceback.print_exc()
            return {"failed": "raised"}
    with tempfile.TemporaryDirectory() as directory:
        result = Path(directory) / "result.json"
        command = [sys.executable, "-m", "benchmarks.gpu", *argv, "--child", child, "--result", str(result)]
        started = time.perf_counter()
        try:
            code = subprocess.run(command, timeout=timeout, env=os.environ | {"PYTHONUNBUFFERED": "1"}).returncode
        except subprocess.TimeoutExpired:
            code = f"killed after {timeout:.0f} s"
        print(f"--- {child}: exit {code}, {time.perf_counter() - started:.0f} s", flush=True)
        if code != 0 or not result.exists():
            return {"failed": f"exit {code}"}
        return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        args.result.write_text(json.dumps(run_child(args)))
        return 0
    import torch

    sections = args.sections.split(",")
    measure = partial(spawn, argv=argv, timeout=args.timeout, dry_run=args.dry_run)
    peak = measure("peak")
    rows: list[tuple[str, str, str]] = []
    # the dry run's Trainers leave a process group, in which the estimate refuses to run: they go last
    if "activations" in sections:
        rows += [activation_row(step, measure(f"activations:{json.dumps(step)}")) for step in ACTIVATIONS]
    if "auto" in sections:  # its search runs in a child of its own: a process group left is no matter
        rows.append(auto_layout_row(measure("auto")))
    if "cp" in sections:  # flex attention has no backward on CPUs
        attentions = ("sdpa", "flex") if torch.cuda.is_available() else ("sdpa",)
        rows += [cp_row(attention, measure(f"cp:{attention}")) for attention in attentions]
    if "throughput" in sections:
        rows += throughput_rows({name: measure(f"throughput:{name}") for name in THROUGHPUT}, peak.get("flops"))
        if importlib.util.find_spec("torchtitan") is None:
            rows.append(("torchtitan", "not run: not installed here (benchmarks/torchtitan_peer.py runs it)", ""))
    device = peak.get("device", "CPU (dry run)" if args.dry_run else "CPU")
    print(f"\n{device}; torch {torch.__version__}; matmul peak bf16 {_num(peak.get('flops'), '.3g')} FLOP/s")
    print(f"{'measurement':<34}{'result':<60}{'vs':<40}")
    for name, result, against in rows:
        print(f"{name:<34}{result:<60}{against:<40}")
    return 1 if any(result.startswith("FAILED") for _, result, _ in rows) else 0


def throughput_rows(results: dict[str, dict[str, Any]], peak: float | None) -> list[tuple[str, str, str]]:
    rows = []
    for name, result in results.items():
        if "failed" in result:
            rows.append((name, f"FAILED ({result['failed']})", ""))
            continue
        mfu = result["flops_per_token"] * result["tokens_per_s"] / peak if peak else None
        shown = f"{result['shape']}: {result['tokens_per_s']:,.0f} tokens/s, MFU {_num(mfu, '.3f')}"
        shown += f", peak {_num(result['peak_gib'], '.1f')} GiB"
        base = results.get(RATIOS.get(name, ""), {})
        against = (
            f"{result['tokens_per_s'] / base['tokens_per_s']:.2f}x {RATIOS[name]}" if "tokens_per_s" in base else ""
        )
        rows.append((name, shown, against))
    return rows


def cp_row(attention: str, result: dict[str, Any]) -> tuple[str, str, str]:
    if "failed" in result:
        return (f"cp=2 {attention}", f"FAILED ({result['failed']})", "")
    shown = f"loss {result['loss_error']:.1e}, gradients {result['grad_error']:.1e} off cp=1"
    return (f"cp=2 {attention}", shown, f"step {result['step_s'] * 1e3:.1f} ms")


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


if __name__ == "__main__":
    sys.exit(main())
