"""Expert parallel checks inside gloo workers (see lightning_automodel.testing.harness): uneven expert load,
refusals."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from loading_checks import remove, saved_checkpoint
from transformers import AutoModelForCausalLM

from lightning_automodel import AutoModelParallelStrategy, from_pretrained, parallelize
from lightning_automodel.hf import loading
from lightning_automodel.hf.loading import checkpoint_layout, materialize_pretrained
from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.testing.models import tiny_model
from lightning_automodel.testing.parity import full
from lightning_automodel.testing.trainer_parity import (
    CausalLM,
    assert_experts_distributed,
    compare_training,
    data,
    reference_run,
    trainer,
)


def check_uneven_expert_load(ep: int) -> dict:
    """GPT-OSS with every router biased to the first half of the experts: the ranks holding the other half receive
    no token in any layer, and send theirs all away, with the eager experts loop (whose output on no token has no
    autograd history). Training must neither hang nor differ from one process (the idle experts' gradients are zero
    in both)."""
    module = CausalLM(_biased_to_first_half(tiny_model("gpt_oss")))
    trainer(AutoModelParallelStrategy(ep=ep)).fit(module, data(dist.get_world_size()))
    assert_experts_distributed(module.model, ep=ep)
    reference = _biased_to_first_half(tiny_model("gpt_oss"))
    result = compare_training(module, reference, reference_run(reference))
    idle = [p.grad for p in reference.parameters() if p.ndim == 3 and p.grad is not None]
    assert idle and all(grad[grad.shape[0] // 2 :].abs().max() == 0 for grad in idle), "the idle experts trained"
    return result


def _biased_to_first_half(model: torch.nn.Module) -> torch.nn.Module:
    """Routers whose bias makes every token choose among the first half of the experts (top-k <= half of them); the
    eager experts loop, which returns a tensor without autograd history when no token arrives."""
    model.config._experts_implementation = "eager"
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.mlp.router.bias
            half = bias.numel() // 2
            assert model.config.num_experts_per_tok <= half
            # A gap of 10 no token's logits cross (about 0.2 at initialisation). Not more: near 30 a float32 step is
            # 2e-6, and the routing weights' rounding then grows over the steps past the gradient tolerance on AVX-512
            # (1.4% at +-30, 0.14% at +-5).
            bias[:half], bias[half:] = 5.0, -5.0
    return model


def check_expert_parallel_refusals() -> dict:
    """ep on a model without experts, ep that does not split the experts, fp16 experts (whose gradients FSDP2 would
    scale wrong): refused before any collective."""
    mesh = ParallelDims(ep=dist.get_world_size()).resolve(dist.get_world_size()).build_mesh("cpu")
    result = {}
    models = {
        "llama": tiny_model("llama"),
        "qwen3_moe with 3 experts": tiny_model("qwen3_moe", num_experts=3),
        "qwen3_moe in fp16": tiny_model("qwen3_moe").half(),
    }
    expected_errors = ("has no mixture-of-experts layer", "do not split", "train in bf16")
    for (name, model), expected in zip(models.items(), expected_errors, strict=True):
        with pytest.raises(ValueError, match=expected) as error:
            parallelize(model, mesh)
        result[name] = str(error.value)
    return result


def check_each_rank_reads_its_experts(ep: int) -> dict:
    """A Qwen3-MoE checkpoint stores each expert's projections apart: at ep (FSDP splitting each rank's experts
    further over the rest), each rank reads its experts' tensors only, and every weight equals transformers' load."""
    directory = saved_checkpoint("qwen3_moe")
    model = from_pretrained(directory, dtype=torch.float32)
    mesh = ParallelDims(ep=ep).resolve(dist.get_world_size()).build_mesh("cpu")
    parallelize(model, mesh)
    merged = [entry for entry in checkpoint_layout(model).values() if entry.per_expert]
    assert merged, "the checkpoint stores no expert apart"
    stored_apart = {name for entry in merged for name in entry.names}
    with mock.patch.object(loading.dcp, "load", wraps=loading.dcp.load) as load:
        materialize_pretrained(model, torch.device("cpu"))
    read = {name for call in load.call_args_list for name in call.args[0] if name in stored_apart}
    experts = {int(name.split(".experts.")[1].split(".")[0]) for name in read}
    count = model.config.num_experts // ep
    first = mesh["ep"].get_local_rank() * count
    assert experts == set(range(first, first + count)), (experts, first, count)
    assert len(read) * ep == len(stored_apart), (len(read), len(stored_apart))
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
    result = {"weights": max((full(t) - reference[n]).abs().max().item() for n, t in model.state_dict().items())}
    assert result["weights"] == 0.0, result
    remove(directory)
    return {**result, "read": len(read), "stored apart": len(stored_apart)}
