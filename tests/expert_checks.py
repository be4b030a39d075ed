"""Expert parallel checks inside gloo workers (see harness.py): uneven expert load, refusals."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning_checks import CausalLM, assert_experts_distributed, compare_training, data, reference_run, trainer
from loading_checks import remove, saved_checkpoint
from models import tiny_model

from lightning_automodel import AutoModelParallelStrategy, from_pretrained, parallelize
from lightning_automodel.hf.conversion import experts_of
from lightning_automodel.hf.loading import checkpoint_layout, held_experts
from lightning_automodel.mesh import ParallelDims


def check_uneven_expert_load(ep: int) -> dict:
    """GPT-OSS with every router biased to the first half of the experts: the ranks holding the other half receive
    no token in any layer, and send theirs all away. Training must neither hang nor differ from one process (the
    idle experts' gradients are zero in both)."""
    module = CausalLM(_biased_to_first_half(tiny_model("gpt_oss")))
    trainer(AutoModelParallelStrategy(ep=ep)).fit(module, data(dist.get_world_size()))
    assert_experts_distributed(module.model, ep=ep)
    reference = _biased_to_first_half(tiny_model("gpt_oss"))
    result = compare_training(module, reference, reference_run(reference))
    idle = [p.grad for p in reference.parameters() if p.ndim == 3 and p.grad is not None]
    assert idle and all(grad[grad.shape[0] // 2 :].abs().max() == 0 for grad in idle), "the idle experts trained"
    return result


def _biased_to_first_half(model: torch.nn.Module) -> torch.nn.Module:
    """Routers whose bias makes every token choose among the first half of the experts (top-k <= half of them)."""
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.mlp.router.bias
            half = bias.numel() // 2
            assert model.config.num_experts_per_tok <= half
            bias[:half], bias[half:] = 30.0, -30.0
    return model


def check_expert_parallel_refusals() -> dict:
    """ep on a model without experts, and ep that does not split the experts: refused before any collective."""
    mesh = ParallelDims(ep=dist.get_world_size()).resolve(dist.get_world_size()).build_mesh("cpu")
    result = {}
    models = {"llama": tiny_model("llama"), "qwen3_moe with 3 experts": tiny_model("qwen3_moe", num_experts=3)}
    for (name, model), expected in zip(
        models.items(), ("has no mixture-of-experts layer", "do not split"), strict=True
    ):
        with pytest.raises(ValueError, match=expected) as error:
            parallelize(model, mesh)
        result[name] = str(error.value)
    return result


def check_each_rank_reads_its_experts(ep: int) -> dict:
    """A Qwen3-MoE checkpoint stores each expert's projections apart: at ep, each rank reads its experts' only."""
    directory = saved_checkpoint("qwen3_moe")
    model = from_pretrained(directory)
    mesh = ParallelDims(ep=ep).resolve(dist.get_world_size()).build_mesh("cpu")
    parallelize(model, mesh)
    layout = checkpoint_layout(model)
    merged = {name: entry for name, entry in layout.items() if entry.is_merged}
    assert merged, "the checkpoint stores no expert apart"
    rank, state = mesh["ep"].get_local_rank(), model.state_dict()
    read = {}
    for name, entry in merged.items():
        first, last = held_experts(state[name])
        assert (first, last) == (rank * 4 // ep, (rank + 1) * 4 // ep), (name, first, last)
        read[name] = experts_of(entry, first=first, last=last)
        assert len(read[name]) * ep == len(entry.names), (name, read[name])
        assert all(first <= int(n.split(".experts.")[1].split(".")[0]) < last for n in read[name]), read[name]
    remove(directory)
    return {"read per merged tensor": len(read[next(iter(read))]), "stored": len(next(iter(merged.values())).names)}
