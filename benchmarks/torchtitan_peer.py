"""torchtitan's own trainer beside ours, in the same processes: the same Llama, weights, rows, layout and optimizer.

    scripts/torchtitan_setup.sh    # once: torchtitan 0.3.0 into .torchtitan (or $1), the venv's torch untouched
    PYTHONPATH=$PWD:$PWD/.torchtitan .venv/bin/python benchmarks/torchtitan_peer.py    # every layout, a table each
    PYTHONPATH=$PWD:$PWD/.torchtitan .venv/bin/torchrun --nproc_per_node 4 benchmarks/torchtitan_peer.py --tp 2  # one

The layouts, model, batch and step of ours are peers.py's (lightning_automodel/testing/peer_setup.py: dp_shard=2 x tp=2
with sequence parallel, dp_shard=2, tp=2 with sequence parallel; gloo, fp32, AdamW at lr 1e-3 and torch's defaults).
torchtitan runs as its users run it: its ``Trainer`` built from ``Trainer.Config`` and stepped by ``train_step``, with
its Llama-3 model and ``parallelize_llama`` (tensor parallel with sequence parallel and loss parallel, FSDP2 per block),
its chunked cross-entropy (``ChunkedLossWrapper``: lm_head and the loss over 8 sequence chunks) and its AdamW container.
Set for a CPU: a fused q/k/v projection (its default); SDPA attention, as FlexAttention is always torch.compile'd; the
``partial_dtensor`` SPMD backend (model-parallel axes as DTensors), as its default ``spmd_types`` needs a torch nightly;
for-loop AdamW, what torch's AdamW (ours) runs on CPU; no activation checkpointing (its default is selective), as ours.
Its weights are the seeded Hugging Face model's, saved as safetensors and read by its checkpointer
(``initial_load_in_hf``); rms_norm eps and rope theta are Hugging Face's. Beyond ours, its step computes the global
gradient norm (max_norm 1e9: it never clips). Its Trainer turns Python's garbage collector off for the whole process,
ours included.

Ours runs twice, on two copies: with peers.py's step (the logits whole) and with the loss 8 sequence chunks at a time as
torchtitan's (``chunked_step``: ``CausalLMModule(loss_chunks=8)``'s loss). Each rank builds all three and alternates
their steps, each going first in turn after a barrier, on the same rows (the dp rank's share of peers.py's batch;
torchtitan's labels are the next tokens, the last position ignored, so all average the same 255 predictions a row). Per
layout: each one's first loss against one process on the whole batch (else its time is void); the step time over ours
(the logits whole), the median over steps of each step's ratio (a step's time is its slowest rank's), with the quartiles
of the ratios: the noise a difference must exceed; the bytes of each collective kind in one step on rank 0
(lightning_automodel/testing/collectives.py, around one more step after the timed ones); the peak memory of one more
step, the worst rank's (lightning_automodel/testing/peak_memory.py: every tensor alive at the step's highest point,
weights, gradients and AdamW state included; torch's MemTracker less its statistics by module, which refuse a loss
calling lm_head once a chunk).

CPU workarounds, each a function below that cites the torchtitan 0.3.0 line it works around:
- device type: tools/utils.py:55 falls back to "cuda"; resolved as "cpu" (torch.cpu, gloo) while torchtitan imports.
- triton: distributed/minimal_async_ep/kernels.py:10 imports it (MoE kernels, unused here); that module is stubbed.
- memory monitor: components/metrics.py:42-50 asks torch.cpu for CUDA's memory statistics; a monitor of zeros.
- gradient division: distributed/fsdp.py:41 makes FSDP2 reduce with PREMUL_SUM, which gloo rejects; plain SUM.
- attention: models/common/config_utils.py:97 refuses "sdpa"; SDPA is put into the built config, as its tests do.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from lightning_automodel.testing.collectives import CollectiveBytes
from lightning_automodel.testing.peak_memory import peak_bytes
from lightning_automodel.testing.peer_setup import (
    CONFIG,
    LAYOUTS,
    ROWS,
    STEPS,
    TOKENS,
    WARMUP,
    global_batch,
    one_process_loss,
    our_model,
    over_ours,
    seeded_model,
    step,
)

CHUNKED = "ours, loss_chunks=8"
PEERS = ("ours", CHUNKED, "torchtitan")
TOLERANCE = 1e-5  # relative: fp32 losses of the same weights and rows, summed in another order
KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="under torchrun: tp; dp_shard is the rest of the world")
    args = parser.parse_args()
    if importlib.util.find_spec("torchtitan") is None:
        sys.exit("torchtitan is not importable: run scripts/torchtitan_setup.sh and put its target on PYTHONPATH")
    if "LOCAL_RANK" in os.environ:
        compare(tp=args.tp)
    else:
        launch()


def launch() -> None:
    """Each layout in a torchrun of its own, one after another (they share the cores); rank 0 prints its table."""
    for dp, tp in LAYOUTS:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={dp * tp}"]
        subprocess.run([*command, __file__, f"--tp={tp}"], check=True)


def compare(*, tp: int) -> None:
    """On this rank: build torchtitan's trainer and ours, alternate their steps, report on rank 0."""
    dp = int(os.environ["WORLD_SIZE"]) // tp
    # the same path on every rank of this launch: no other launch on this host holds its port
    directory = os.path.join(tempfile.gettempdir(), f"torchtitan_peer_{os.environ['MASTER_PORT']}")
    trainer = torchtitan_trainer(dp=dp, tp=tp, directory=directory)  # initializes the default (gloo) process group
    save_seeded_weights(directory)
    trainer.checkpointer.load()
    losses = logged_losses(trainer)
    data = trainer.batch_generator(trainer.dataloader)
    ours, chunked = our_model((dp, tp)), our_model((dp, tp))
    rows = global_batch().chunk(dp)[dist.get_rank() // tp]
    steps = {
        "ours": lambda: step(*ours, rows),
        CHUNKED: lambda: chunked_step(*chunked, rows, chunks=8),
        "torchtitan": lambda: torchtitan_step(trainer, data),
    }
    seconds, first = alternate(steps)
    first = {"ours": mean_over_ranks(first["ours"]), CHUNKED: mean_over_ranks(first[CHUNKED]), "torchtitan": losses[0]}
    counted = {name: collective_bytes(run) for name, run in steps.items()}
    held = {"ours": ours, CHUNKED: chunked, "torchtitan": (*trainer.model_parts, *trainer.optimizers.optimizers)}
    peaks = {name: peak_bytes(run, *held[name]) for name, run in steps.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (seconds, counted, peaks))
    if dist.get_rank() == 0:
        report(everyone, first, dp=dp, tp=tp)
        shutil.rmtree(directory)
    trainer.close()
    dist.destroy_process_group()


def alternate(steps: dict) -> tuple[dict[str, list[float]], dict]:
    """Every step of each peer after a barrier, each going first in turn; the seconds of the timed ones, the first
    step's result."""
    seconds = {name: [] for name in steps}
    first = {}
    for index in range(WARMUP + STEPS):
        for name in PEERS[index % len(PEERS) :] + PEERS[: index % len(PEERS)]:
            dist.barrier()
            start = time.perf_counter()
            result = steps[name]()
            elapsed = time.perf_counter() - start
            first.setdefault(name, result)
            if index >= WARMUP:
                seconds[name].append(elapsed)
    return seconds, first


def collective_bytes(run) -> dict[str, int]:
    dist.barrier()
    with CollectiveBytes() as sent:
        run()
    return dict(sent.bytes)


def mean_over_ranks(loss: torch.Tensor) -> float:
    from torch.distributed.tensor import DTensor

    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss.clone()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def report(ranks: list[tuple[dict, dict, dict]], first: dict[str, float], *, dp: int, tp: int) -> None:
    """One layout's table: times and peak memory the worst rank's, collectives rank 0's."""
    reference, parameters = one_process_loss()
    slowest = {name: [max(seconds[name][i] for seconds, _, _ in ranks) for i in range(STEPS)] for name in PEERS}
    peak = {name: max(peaks[name] for _, _, peaks in ranks) for name in PEERS}
    sent = ranks[0][1]
    kinds = sorted(set().union(*sent.values()))
    print(f"\n**dp_shard={dp}{f' x tp={tp} + sp' if tp > 1 else ''}** (world {dp * tp}), {parameters:,} parameters,")
    print(f"{torch.get_num_threads()} threads a rank; one process's first loss {reference:.6f}\n")
    print("| peer | first loss vs one process | median step (s) | step time over ours (quartiles) |", end="")
    print("".join(f" {kind} (MiB) |" for kind in kinds), "peak memory (MiB) |")
    print("|---|---|---|---|" + "---|" * (len(kinds) + 1))
    for name in PEERS:
        error = abs(first[name] - reference) / reference
        over = over_ours(slowest[name], slowest["ours"])
        timing = f"{statistics.median(slowest[name]):.3f} | {over}" if error < TOLERANCE else "void | void"
        print(f"| {name} | {error:.1e} | {timing} |", end="")
        print("".join(f" {sent[name].get(kind, 0) / 2**20:.2f} |" for kind in kinds), f"{peak[name] / 2**20:.1f} |")


def save_seeded_weights(directory: str) -> None:
    """The model every peer starts from, as safetensors where torchtitan's checkpointer looks (rank 0 writes)."""
    if dist.get_rank() == 0:
        seeded_model().save_pretrained(directory)
    dist.barrier()


def chunked_step(model, optimizer, tokens: torch.Tensor, *, chunks: int) -> torch.Tensor:
    """peers.step with the loss ``chunks`` sequence chunks at a time, as ``CausalLMModule(loss_chunks=chunks)`` and
    torchtitan's chunked loss compute it: the same mean over every row's predicted tokens."""
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_automodel.parallel.chunked_loss import chunked_causal_lm_loss_sum

    optimizer.zero_grad(set_to_none=True)
    with loss_parallel():
        loss_sum, tokens_scored, _ = chunked_causal_lm_loss_sum(model, input_ids=tokens, labels=tokens, chunks=chunks)
        loss = loss_sum / tokens_scored
        loss.backward()
    optimizer.step()
    return loss.detach()


def torchtitan_step(trainer, data) -> None:
    """What ``Trainer.train`` does each step, less its profiler, checkpoint and validation hooks."""
    trainer.step += 1
    trainer.train_step(data)


def logged_losses(trainer) -> list[float]:
    """The losses ``train_step`` logs (it returns none): the global mean, on the first step and every log_freq."""
    losses = []
    log = trainer.metrics_processor.log

    def record(step: int, global_avg_loss: float, *args, **kwargs):
        losses.append(float(global_avg_loss))
        return log(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = record
    return losses


def torchtitan_trainer(*, dp: int, tp: int, directory: str):
    """torchtitan's Trainer over (dp_shard, tp) as ours, to load the Hugging Face weights from ``directory``."""
    import_torchtitan()
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.trainer import Trainer

    tokenizer, dataloader = data_components()
    config = Trainer.Config(
        model_spec=llama_spec(),
        hf_assets_path=None,
        dump_folder=directory,
        tokenizer=tokenizer,
        dataloader=dataloader,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=CONFIG["vocab_size"])),
        optimizer=replace(
            default_adamw(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01), implementation="for-loop"
        ),  # torch's AdamW defaults, as ours
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0),  # constant, as ours
        training=TrainingConfig(
            local_batch_size=ROWS // dp,
            seq_len=TOKENS,
            steps=WARMUP + STEPS + 2,  # the timed ones, then one counting collectives and one tracking memory
            max_norm=1e9,
            dtype="float32",
            mixed_precision_param="float32",
            disable_cuda_graphs=True,  # also: zero_grad(set_to_none=True), as ours
        ),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=dp,
            tensor_parallel_degree=tp,
            enable_sequence_parallel=True,
            spmd_backend="partial_dtensor",
        ),
        checkpoint=CheckpointManager.Config(
            enable=True,
            initial_load_path=directory,
            initial_load_in_hf=True,
            initial_load_model_only=True,
            interval=10**9,
        ),
        activation_checkpoint=None,  # its default is selective activation checkpointing; ours keeps activations
        metrics=MetricsProcessor.Config(log_freq=10**9),  # only the first step's loss: logging costs collectives
    )
    trainer = config.build()
    sum_reductions(trainer)
    return trainer


def llama_spec():
    """torchtitan's Llama-3 (its own builders, as its debugmodel flavor) shaped and set as the Hugging Face model.

    SDPA attention: models/common/config_utils.py:97 refuses "sdpa" for language models, and FlexAttention is always
    torch.compile'd (models/common/attention.py:277). The SDPA module goes into the built config as torchtitan's own
    graph_trainer tests put it (experiments/graph_trainer/common_utils.py:66-70)."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from transformers import LlamaConfig

    hf = LlamaConfig(**CONFIG)
    dim, heads, vocab = hf.hidden_size, hf.num_attention_heads, hf.vocab_size
    rope = ComplexRoPE.Config(
        dim=dim // heads, max_seq_len=hf.max_position_embeddings, theta=hf.rope_parameters["rope_theta"], scaling="none"
    )
    layers = llama3._build_llama3_layers(
        n_layers=hf.num_hidden_layers,
        dim=dim,
        n_heads=heads,
        n_kv_heads=hf.num_key_value_heads,
        hidden_dim=hf.intermediate_size,
        fuse_qkv=True,
        rope=rope,
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = hf.rms_norm_eps
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=hf.rms_norm_eps, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=layers,
    )
    return replace(llama3.model_registry("debugmodel"), flavor="peers", model=model)


def data_components():
    """The configs of a tokenizer that is never used and of a loader of this rank's rows, the same every step."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.components.tokenizer import BaseTokenizer

    class NoTokenizer(BaseTokenizer):
        """The Trainer builds a tokenizer; the rows are tokens already."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config, *, tokenizer_path):
            super().__init__()

        def encode(self, *args, **kwargs):
            raise NotImplementedError

        def decode(self, *args, **kwargs):
            raise NotImplementedError

        def get_vocab_size(self) -> int:
            return CONFIG["vocab_size"]

    class RowsLoader(BaseDataLoader):
        """The dp rank's rows of peers.py's batch. torchtitan takes inputs and labels apart: the labels are the next
        tokens with the last position ignored, so that the loss averages the 255 predictions a row that ours does
        (feeding 255 tokens instead would break sequence parallel's divisibility)."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config, *, dp_world_size, dp_rank, **_):
            self.rows = global_batch().chunk(dp_world_size)[dp_rank]
            self.labels = torch.cat([self.rows[:, 1:], torch.full((len(self.rows), 1), IGNORE_INDEX)], dim=1)

        def __iter__(self):
            while True:
                yield {"input": self.rows.clone()}, self.labels.clone()

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    return NoTokenizer.Config(), RowsLoader.Config()


def import_torchtitan() -> None:
    """torchtitan's trainer and Llama-3, imported on a CPU-only torch."""
    with cpu_device_type():
        stub_triton_kernels()
        import torchtitan.models.llama3  # noqa: F401
        import torchtitan.trainer  # noqa: F401
    zero_memory_monitor()


@contextmanager
def cpu_device_type():
    """tools/utils.py:55 takes ``_get_available_device_type() or "cuda"`` at import: on a CPU-only torch the Trainer
    would set a CUDA device and pick NCCL. While torchtitan imports, the available device is "cpu" (torch.cpu, gloo)."""
    import torch._utils

    available = torch._utils._get_available_device_type
    torch._utils._get_available_device_type = lambda: "cpu"
    try:
        yield
    finally:
        torch._utils._get_available_device_type = available


def stub_triton_kernels() -> None:
    """distributed/minimal_async_ep/kernels.py:10 imports triton, which a CPU torch lacks; every model reaches it
    (models/common/token_dispatcher.py:17 -> minimal_async_ep/api.py:30) but only MoE expert parallelism runs its
    kernels. That module alone is stubbed: a fake triton would mislead torch's own imports of it."""
    if importlib.util.find_spec("triton") is not None:
        return

    def kernel(name: str):
        if name.startswith("__"):  # a module's own attributes (``__file__``...), which inspect looks up
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{name} needs triton")

        return unavailable

    module = types.ModuleType(KERNELS)
    module.__getattr__ = kernel
    sys.modules[KERNELS] = module


def zero_memory_monitor() -> None:
    """components/metrics.py:42-50: the device memory monitor asks torch.cpu for a device name, its properties and
    memory statistics, which it has not. A monitor of zeros instead (CPU has no allocator statistics)."""
    import torchtitan.components.metrics as metrics

    class CpuMemoryMonitor:
        device_name, device_capacity_gib = "cpu", 0.0

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self) -> None:
            pass

    metrics.build_device_memory_monitor = CpuMemoryMonitor


def sum_reductions(trainer) -> None:
    """distributed/fsdp.py:41 sets every FSDP module's gradient divide factor to 1.0 (the loss is already divided by
    the global token count), which torch's FSDP2 reduces with ReduceOp.PREMUL_SUM(1 / 1.0)
    (fsdp/_fully_shard/_fsdp_collectives.py:850), which gloo rejects. Plain SUM reductions compute the same."""
    from torch.distributed.fsdp import FSDPModule

    for part in trainer.model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


if __name__ == "__main__":
    main()
