"""Expert parallel: bytes moved by token dispatch against the analytic minimum, and expert memory per rank against
1/(ep x efsdp) of the experts, side by side for several layouts of one world.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/expert_parallel.py      # about 1 minute on 2 CPU cores

A Qwen3-MoE of 2 layers, 8 experts, top-2, on 4 gloo ranks, one forward and backward of 4 x 64 tokens per rank.
Dispatch bytes are what a rank sends to other ranks in one layer's forward (tokens out, outputs back; backward moves
the same again), mean over ranks. The minimum sends each token once to each other rank holding one of its
experts (and its output back once): dispatch sends it once per chosen expert there, so the ratio is how often a
token's choices share a remote rank. Expert memory is this rank's share of the experts' parameters after expert
parallel and FSDP, over the whole experts' size divided by ep x efsdp (1.00 is an even split).
"""

from functools import partial

import torch
from transformers import Qwen3MoeConfig

from lightning_automodel.testing.harness import run_checks

CONFIG = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
)
TOKENS = (4, 64)


def measure(ep: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from lightning_automodel import ParallelDims, parallelize
    from lightning_automodel.parallel.experts import expert_parallel

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**CONFIG))
    experts = [module for _, module in expert_parallel.experts_modules(model)]
    whole = sum(p.numel() * p.element_size() for module in experts for p in module.parameters())
    mesh = ParallelDims(ep=ep).resolve(dist.get_world_size()).build_mesh("cpu")
    parallelize(model, mesh)
    sent, minimum = [], []
    owners = ep if ep > 1 else 1

    def count_minimum(module, args):
        _, index, _ = args
        rank = mesh["ep"].get_local_rank() if ep > 1 else 0
        owner = index // (CONFIG["num_experts"] // owners)
        remote = [len(set(row.tolist()) - {rank}) for row in owner]
        minimum.append(2 * sum(remote) * CONFIG["hidden_size"] * 4)

    real_exchange = expert_parallel._exchange

    def counting_exchange(rows, *, sizes, split_sizes, group):
        rank = dist.get_rank(group)
        sent.append((sum(split_sizes) - split_sizes[rank]) * rows[0].numel() * rows.element_size() if len(rows) else 0)
        return real_exchange(rows, sizes=sizes, split_sizes=split_sizes, group=group)

    expert_parallel._exchange = counting_exchange
    for module in experts:
        module.register_forward_pre_hook(count_minimum)
    tokens = torch.randint(0, CONFIG["vocab_size"], TOKENS, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=tokens, labels=tokens).loss.backward()
    expert_parallel._exchange = real_exchange
    local = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for module in experts
        for p in module.parameters()
    )
    layers = len(experts)
    forward_sent = sum(sent[: 2 * layers]) / layers if ep > 1 else 0.0  # forward: two exchanges per layer
    return {
        "sent": forward_sent,
        "minimum": sum(minimum) / layers if ep > 1 else 0.0,
        "memory": local / (whole / dist.get_world_size()),
    }


def main() -> None:
    print(
        "| layout (4 ranks) | dispatch bytes per layer (forward) | analytic minimum | ratio | expert memory / ideal |"
    )
    print("|---|---|---|---|---|")
    for ep in (4, 2, 1):
        results = run_checks(4, [partial(measure, ep)], timeout=600)
        ranks = next(iter(results.values()))
        sent, minimum = sum(r["sent"] for r in ranks) / 4, sum(r["minimum"] for r in ranks) / 4
        memory = max(r["memory"] for r in ranks)
        ratio = f"{sent / minimum:.2f}" if minimum else "-"
        print(
            f"| ep={ep}, efsdp={4 // ep} | {sent / 1024:.1f} KiB | {minimum / 1024:.1f} KiB | {ratio} | {memory:.2f} |"
        )


if __name__ == "__main__":
    main()
