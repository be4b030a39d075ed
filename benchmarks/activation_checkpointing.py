"""Activation checkpointing modes side by side: memory kept for backward, and the step time it costs.

    .venv/bin/python benchmarks/activation_checkpointing.py

A Llama of 4 layers (hidden 512, MLP 2048, 8 heads) on 8 sequences of 512 tokens, on the CPU, one process per
mode so that each starts from a clean heap. "Activation memory" is how much the process grows during the
forward (what autograd keeps for backward); "step time" is forward + backward, the median of 3 steps after a
warm-up. Ratios are against no checkpointing, measured in the same run.
"""

import multiprocessing
import os
import statistics
import time

MODES = (False, "full", "selective", "submodule")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(mode) -> tuple[int, float]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_automodel.parallel import decoder_layers
    from lightning_automodel.parallel.activation_checkpointing import apply_activation_checkpointing

    torch.manual_seed(0)
    torch.set_num_threads(2)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        max_position_embeddings=512,
        use_cache=False,
    )
    model = AutoModelForCausalLM.from_config(config)
    if mode:
        apply_activation_checkpointing(model, decoder_layers(model), mode=mode)
    tokens = torch.randint(0, 1024, (8, 512))

    def step() -> int:
        before = _rss_bytes()
        loss = model(tokens, labels=tokens).loss
        grown = _rss_bytes() - before
        loss.backward()
        model.zero_grad(set_to_none=True)
        return grown

    step()  # warm-up: allocator and kernels
    times, memory = [], []
    for _ in range(3):
        start = time.perf_counter()
        memory.append(step())
        times.append(time.perf_counter() - start)
    return max(memory), statistics.median(times)


def main() -> None:
    # A fixed mmap threshold makes glibc return every freed tensor of 64 KiB or more to the OS, so the
    # process size follows the live tensors (by default the threshold grows and freed memory is reused).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    context = multiprocessing.get_context("spawn")
    results = {}
    for mode in MODES:
        with context.Pool(1) as pool:
            results[mode] = pool.apply(measure, (mode,))
    base_memory, base_time = results[False]
    print(f"{'mode':<12}{'activation memory':>20}{'ratio':>8}{'step time':>12}{'ratio':>8}")
    for mode, (memory, seconds) in results.items():
        name = mode or "none"
        print(
            f"{name:<12}{memory / 2**20:>16.0f} MiB{memory / base_memory:>8.2f}{seconds:>11.2f}s"
            f"{seconds / base_time:>8.2f}"
        )


if __name__ == "__main__":
    main()
