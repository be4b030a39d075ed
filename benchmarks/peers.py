"""Ours against what a user would pick instead, side by side in one run: the same Llama-shaped model, layout and data.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/peers.py   # about two minutes on 2 CPU cores

tp=2 with sequence parallel x dp_shard=2 (world 4), dp_shard=2 and tp=2 with sequence parallel (world 2); gloo, fp32,
AdamW. The peers:
- ours: ``parallelize(model, mesh, sp=True)``, the call AutoModelParallelStrategy makes;
- transformers' own: ``from_pretrained(distributed_config=DistributedConfig(tp_size, tp_plan="auto",
  enable_sequence_parallel=True, fsdp_size))``, in a plain loop;
- Lightning's ModelParallelStrategy with the plan an expert writes in ``configure_model`` (torchtitan's: q/k/v, gate
  and up column-parallel, o and down row-parallel onto the sequence-sharded stream, the norms sequence-parallel, the
  embedding's output and lm_head's input on the stream, attention's and the MLP's inputs gathered as DTensors (so
  that their gradients are reduce-scattered back onto the stream, not all-reduced), logits left sharded for loss
  parallel; FSDP2 per block over the data-parallel ranks, every block but the last resharded after forward, as ours).
  Lightning's strategy only builds the mesh and calls ``configure_model``, so the plan runs here on the same mesh
  shape, in the same loop.
Each rank builds every peer's model and alternates their steps, each peer going first in turn, so that load on the
shared cores and the cost of following another's step fall on all alike. For each: the first step's loss against one
process on the whole batch (else its time is void); the step time over ours, the median over steps of each step's
ratio (the slowest rank's times, same round) with the ratios' quartiles, the noise a difference must exceed; then,
after the timed steps, the bytes of each collective per step and rank (the whole tensor a collective gathers or
reduces, counted by a dispatch mode) against the analytic minimum of the layout, the activations autograd saves for
backward per rank (storages counted once), the peak memory per rank (torch's MemTracker on the real step: every
tensor alive at the peak, weights, gradients, AdamW state and unsharded weights included) and the parameter +
gradient + AdamW state bytes per rank against the ideal 1/(tp x dp_shard) of the model's. torchtitan's own trainer,
on its own Llama, is compared with ours in benchmarks/torchtitan_peer.py.

Analytic minimum per step and rank (fp32, b rows of S tokens per dp rank, hidden H, L layers, P parameters):
sequence parallel gathers the stream before attention and before the MLP and reduce-scatters it after each, in
forward and again in backward, and once more around the embedding and lm_head: (8 L + 4) x b S H x 4 bytes; FSDP
gathers each block's 1/tp of the weights in forward, again in backward for the resharded ones (L - 1 blocks: the
memory/traffic trade both make), and reduce-scatters the gradients once: P/tp x 4 bytes each way (+ the resharded
blocks' second gather); loss parallel all-reduces a few numbers per token. An all-reduce moves twice the bytes of a
reduce-scatter of the same tensor (it is one, then an all-gather).
"""

from __future__ import annotations

import time
from functools import partial

import torch

from lightning_automodel.testing.collectives import CollectiveBytes
from lightning_automodel.testing.harness import run_checks, shared_directory
from lightning_automodel.testing.peak_memory import peak_bytes
from lightning_automodel.testing.peer_setup import (
    CONFIG,
    LAYOUTS,
    ROWS,
    STEPS,
    TOKENS,
    WARMUP,
    adamw,
    global_batch,
    one_process_loss,
    our_model,
    over_ours,
    seeded_model,
    step,
)
from lightning_automodel.testing.saved_activations import saved_activations

PEERS = ("ours", "expert", "transformers")


def build(kind: str, mesh_shape: tuple[int, int]):
    """The model of ``kind`` ("ours", "expert" or "transformers") parallelized over (dp_shard, tp)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DistributedConfig

    if kind == "ours":
        return our_model(mesh_shape)
    model = seeded_model()
    if kind == "transformers":  # its own tensor parallel, sequence parallel and FSDP2, applied while loading
        directory = shared_directory()
        if dist.get_rank() == 0:
            model.save_pretrained(directory)
        dist.barrier()
        dp, tp = mesh_shape
        layout = DistributedConfig(
            tp_size=tp if tp > 1 else None,
            tp_plan="auto" if tp > 1 else None,
            enable_sequence_parallel=tp > 1,
            fsdp_size=dp if dp > 1 else None,
        )
        model = AutoModelForCausalLM.from_pretrained(directory, distributed_config=layout, attn_implementation="sdpa")
    else:
        _expert_plan(model, mesh_shape)
    return model, adamw(model)


def _expert_plan(model, mesh_shape: tuple[int, int]) -> None:
    """What an expert writes in configure_model under Lightning's ModelParallelStrategy (torchtitan's Llama plan)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("data_parallel", "tensor_parallel"))
    if mesh_shape[1] > 1:
        _expert_tensor_parallel(model, mesh["tensor_parallel"])
    if mesh_shape[0] > 1:
        layers = model.model.layers
        for index, layer in enumerate(layers):
            fully_shard(layer, mesh=mesh["data_parallel"], reshard_after_forward=index < len(layers) - 1)
        fully_shard(model, mesh=mesh["data_parallel"], reshard_after_forward=False)


def _expert_tensor_parallel(model, tp) -> None:
    """torchtitan's Llama plan on Hugging Face's module names: tensor parallel with sequence parallel."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp,
        {
            # the stream stays a DTensor: the model derives positions and the mask from the embedding's output shape
            "model.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
            ),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )
    block_plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    for layer in model.model.layers:
        parallelize_module(layer, tp, block_plan)


def timings(mesh_shape: tuple[int, int]) -> dict:
    """On this rank: each peer's first loss (mean over dp) and the seconds of each step after the warm-up."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    peers = {kind: build(kind, mesh_shape) for kind in PEERS}
    rows = _rank_rows(mesh_shape)
    result = {kind: {"seconds": []} for kind in peers}
    for index in range(WARMUP + STEPS):
        for kind in PEERS[index % len(PEERS) :] + PEERS[: index % len(PEERS)]:  # each goes first in turn
            model, optimizer = peers[kind]
            dist.barrier()
            start = time.perf_counter()
            loss = step(model, optimizer, rows)
            elapsed = time.perf_counter() - start
            if index == 0:
                loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
                dist.all_reduce(loss)
                result[kind]["first_loss"] = loss.item() / dist.get_world_size()
            if index >= WARMUP:
                result[kind]["seconds"].append(elapsed)
    return result


def footprint(mesh_shape: tuple[int, int]) -> dict:
    """On this rank, each peer's second step, after every peer's first (which allocates for good what later steps
    reuse): the bytes of each collective, the activations saved for backward, the peak memory (every tensor alive at
    the step's peak, the weights and AdamW state it started with included, followed by torch's ``MemTracker``) and
    the parameter + gradient + AdamW state bytes. After the timed steps: counting slows a step."""
    peers = {kind: build(kind, mesh_shape) for kind in PEERS}
    for model, optimizer in peers.values():
        step(model, optimizer, _rank_rows(mesh_shape))
    result = {}
    for kind, (model, optimizer) in peers.items():
        with CollectiveBytes() as sent, saved_activations() as saved:
            peak = peak_bytes(partial(step, model, optimizer, _rank_rows(mesh_shape)), model, optimizer)
        result[kind] = {
            "collective_bytes": dict(sent.bytes),
            "saved_bytes": sum(saved.values()),
            "peak_bytes": peak,
            "state_bytes": _local_bytes(model.parameters()) * 2 + _local_bytes(_optimizer_state(optimizer)),
        }
    return result


def _rank_rows(mesh_shape: tuple[int, int]) -> torch.Tensor:
    """This rank's rows of the global batch (tp is the inner axis of every peer's mesh)."""
    import torch.distributed as dist

    dp, tp = mesh_shape
    return global_batch().chunk(dp)[dist.get_rank() // tp]


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def analytic(parameters: int, *, dp: int, tp: int) -> dict[str, float]:
    """The minimum bytes per step and rank of each collective kind, and what resharding every block but the last
    after forward adds (see the module docstring)."""
    layers, hidden = CONFIG["num_hidden_layers"], CONFIG["hidden_size"]
    stream = (4 * layers + 2) * ROWS // dp * TOKENS * hidden * 4 if tp > 1 else 0
    weights = parameters / tp * 4 if dp > 1 else 0
    block = (parameters - 2 * CONFIG["vocab_size"] * hidden - hidden) / layers / tp * 4 if dp > 1 else 0
    return {"all_gather": stream + weights, "reduce_scatter": stream + weights, "resharded": (layers - 1) * block}


def main() -> None:
    reference, parameters = one_process_loss()
    print(f"Llama of {CONFIG['num_hidden_layers']} layers, {parameters:,} parameters; {ROWS} x {TOKENS} tokens;")
    print(f"one process's first loss {reference:.6f}; gloo")
    for dp, tp in LAYOUTS:
        print(f"\n**dp_shard={dp}{f' x tp={tp} + sp' if tp > 1 else ''}** (world {dp * tp})\n")
        measured = run_checks(dp * tp, [partial(timings, (dp, tp)), partial(footprint, (dp, tp))], timeout=900)
        timed, footprints = (
            next(v for name, v in measured.items() if name.startswith(f"{f.__name__}(")) for f in (timings, footprint)
        )
        report(timed, footprints, dp=dp, tp=tp, reference=reference, parameters=parameters)


def report(timed: list[dict], footprints: list[dict], *, dp: int, tp: int, reference: float, parameters: int) -> None:
    """One layout's table, each figure the worst rank's but the collectives (rank 0's); a step's time is its slowest
    rank's (see :func:`over_ours`)."""
    ideal = parameters * 4 * 4 / (dp * tp)  # parameters, gradients, AdamW's two moments
    minimum = analytic(parameters, dp=dp, tp=tp)
    slowest = {kind: [max(rank[kind]["seconds"][i] for rank in timed) for i in range(STEPS)] for kind in PEERS}
    print(
        "| peer | first loss vs one process | step time over ours (quartiles) | all-gather (MiB) | reduce-scatter"
        " (MiB) | all-reduce (MiB) | saved activations (MiB) | peak memory (MiB) | state over ideal |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in PEERS:
        ratio = over_ours(slowest[kind], slowest["ours"]) if kind != "ours" else "1.00"
        sent = footprints[0][kind]["collective_bytes"]
        worst = {
            key: max(rank[kind][key] for rank in footprints) for key in ("state_bytes", "saved_bytes", "peak_bytes")
        }
        error = abs(timed[0][kind]["first_loss"] - reference) / reference
        print(
            f"| {kind} | {error:.1e} | {ratio} |"
            f" {sent.get('all_gather', 0) / 2**20:.1f} | {sent.get('reduce_scatter', 0) / 2**20:.1f} |"
            f" {sent.get('all_reduce', 0) / 2**20:.2f} | {worst['saved_bytes'] / 2**20:.1f} |"
            f" {worst['peak_bytes'] / 2**20:.1f} | {worst['state_bytes'] / ideal:.3f} |"
        )
    print(
        f"| analytic minimum | | | {minimum['all_gather'] / 2**20:.1f} (+{minimum['resharded'] / 2**20:.1f} resharded"
        f" blocks gathered again) | {minimum['reduce_scatter'] / 2**20:.1f} | 0 (a few numbers a token) | | | 1 |"
    )
    print("\nevery collective of rank 0 (bytes):", {kind: footprints[0][kind]["collective_bytes"] for kind in PEERS})


if __name__ == "__main__":
    main()
