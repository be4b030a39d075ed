"""Context parallel: activation memory per rank, step time and the keys and values all-gathered per layer, at cp=1,
2 and 4 on one long sequence, measured side by side in one run; ratios against 1/cp and the analytic K/V volume.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/context_parallel.py [TOKENS]   # about a minute on 2 CPU cores

A Llama of 4 layers (hidden 256, 8 heads, 2 KV heads) on one row of TOKENS tokens (default 4096), cp gloo processes
(cp=4 shares the 2 cores, so step times there measure contention as much as work: the ratio that matters is memory).
Activation memory: the bytes of the tensors autograd saves for backward during the forward (storages counted once),
the memory a step holds at its peak beside weights and optimizer state. The ideal is 1/cp of cp=1's; above it: each
layer's gathered keys and values (the whole row's, which attention saves for its backward) and the attention bias
of the rank's queries against every key ([rows, S/cp, S], one for all layers), where cp=1 uses SDPA's causal kernel
without one. Gathered:
the bytes each rank receives per layer (the attention function counted through transformers' registry), against
the analytic 2 x KV heads x head_dim x (cp - 1)/cp x tokens x 4 bytes. Time: the median forward + backward of 3 steps
after one warm-up, over cp=1's.

Then the kernels at cp=2 in one evaluation call (flex attention has no backward on CPU): the logits of
``cp_attention="flex"`` against ``"sdpa"``'s, and the mask each keeps for a call: the dense bias ([rows, S/cp, S] of
the compute dtype) against flex attention's block mask (block indices, linear in S^2 / 128^2). Flex attention runs
uncompiled on CPU (its fused kernels are GPUs'): its speed is not measured here.
"""

import sys
import time
from functools import partial

import torch

from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.saved_activations import saved_activations

CONFIG = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1 << 20,
    tie_word_embeddings=False,
)
STEPS, WARMUP = 3, 1


def measure(tokens: int) -> dict:
    """This rank's saved-activation bytes, received K/V bytes per layer and median step seconds."""
    import torch.distributed as dist
    from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig

    from lightning_automodel import ParallelDims, parallelize
    from lightning_automodel.parallel.context_parallel import ATTENTION, context_parallel_attention

    cp = dist.get_world_size()
    received = []

    def counted(module, query, key, value, *args, **kwargs):
        received.append(2 * key.numel() * key.element_size() * (cp - 1))  # keys and values of the other ranks
        return context_parallel_attention(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(ATTENTION, counted)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG, attn_implementation="sdpa"))
    if cp > 1:
        parallelize(model, ParallelDims(cp=cp).resolve(cp).build_mesh("cpu"))
    ids = torch.randint(1, CONFIG["vocab_size"], (1, tokens))
    times, saved = [], 0
    for step in range(WARMUP + STEPS):
        received.clear()
        start = time.perf_counter()
        with saved_activations() as storages:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
        saved = sum(storages.values())
        model.zero_grad(set_to_none=True)
    per_layer = received[0] if received else 0
    return {"saved": saved, "received_per_layer": per_layer, "seconds": sorted(times)[len(times) // 2]}


def compare_kernels(tokens: int) -> dict:
    """At cp = world size, one evaluation call under each kernel: the largest logit difference relative to the
    largest logit; and the bytes of the mask each builds for such a call."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_automodel import ParallelDims, parallelize
    from lightning_automodel.parallel.context_parallel import context_parallel_of

    cp = dist.get_world_size()
    ids = torch.randint(1, CONFIG["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0))
    logits = {}
    for kernel in ("sdpa", "flex"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG, attn_implementation="sdpa")).eval()
        parallelize(model, ParallelDims(cp=cp).resolve(cp).build_mesh("cpu"), cp_attention=kernel)
        with torch.no_grad():
            logits[kernel] = model(input_ids=ids).logits
    split = context_parallel_of(model).split(torch.arange(tokens)[None], torch.ones_like(ids, dtype=torch.bool), tokens)
    like = torch.empty(0)
    return {
        "error": ((logits["flex"] - logits["sdpa"]).abs().max() / logits["sdpa"].abs().max()).item(),
        "bias_bytes": _mask_bytes(split.bias(None, like=like)),
        "block_mask_bytes": _mask_bytes(split.block_mask(None, like=like)),
    }


def _mask_bytes(mask: object) -> int:
    """The bytes of a dense bias, or of the tensors a block mask holds."""
    if isinstance(mask, torch.Tensor):
        return mask.numel() * mask.element_size()
    tensors = [value for value in vars(mask).values() if isinstance(value, torch.Tensor)]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    results = {}
    for cp in (1, 2, 4):
        results[cp] = next(iter(run_checks(cp, [partial(measure, tokens)], timeout=900).values()))
    base = results[1][0]
    kv_heads, head_dim = CONFIG["num_key_value_heads"], CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    print(f"one row of {tokens} tokens, Llama of {CONFIG['num_hidden_layers']} layers; ratios against cp=1")
    print(
        "| cp | saved activations per rank (MiB, worst rank) | over cp=1 | ideal 1/cp | received K/V per layer (KiB) |"
        " analytic (KiB) | step time over cp=1 |"
    )
    print("|---|---|---|---|---|---|---|")
    for cp, ranks in results.items():
        saved = max(rank["saved"] for rank in ranks)
        received = max(rank["received_per_layer"] for rank in ranks)
        analytic = 2 * kv_heads * head_dim * tokens * (cp - 1) / cp * 4
        seconds = max(rank["seconds"] for rank in ranks)
        print(
            f"| {cp} | {saved / 2**20:.1f} | {saved / base['saved']:.3f} | {1 / cp:.3f} | {received / 1024:.1f} |"
            f" {analytic / 1024:.1f} | {seconds / base['seconds']:.2f} |"
        )
    kernels = next(iter(run_checks(2, [partial(compare_kernels, tokens)], timeout=900).values()))
    print(f"\ncp=2, one evaluation call of {tokens} tokens: flex against sdpa")
    print("| logits, relative difference | dense bias (KiB) | block mask (KiB) | block mask over bias |")
    print("|---|---|---|---|")
    worst = max(kernels, key=lambda rank: rank["error"])
    print(
        f"| {worst['error']:.1e} | {worst['bias_bytes'] / 1024:.0f} | {worst['block_mask_bytes'] / 1024:.1f} |"
        f" {worst['block_mask_bytes'] / worst['bias_bytes']:.4f} |"
    )


if __name__ == "__main__":
    main()
