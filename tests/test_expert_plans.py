"""Tensor-parallel plans of mixture-of-experts layers: the experts' placements in each layout, plans completed with
experts, latent attention and shared experts, and what is refused."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lightning_automodel.parallel.tensor.plans.selection import select_tp_plan
from lightning_automodel.testing.coverage_report.model_types import coverage_model


def test_expert_placements_follow_each_layout():
    """[gate; up] halves split block by block, GPT-OSS's interleaved (in, out) experts and their biases, and Llama 4's
    (in, out) experts, which carry no layout flags."""
    from torch.distributed.tensor.placement_types import _StridedShard

    from lightning_automodel.parallel.tensor.styles.experts import expert_placements

    def placements(model_type, path):
        with torch.device("meta"):
            return expert_placements(coverage_model(model_type).get_submodule(path), tp=2)

    assert placements("qwen3_moe", "model.layers.0.mlp.experts") == {
        "gate_up_proj": _StridedShard(1, split_factor=2),
        "down_proj": Shard(2),
    }
    assert placements("gpt_oss", "model.layers.0.mlp.experts") == {
        "gate_up_proj": Shard(2),
        "gate_up_proj_bias": Shard(1),
        "down_proj": Shard(1),
        "down_proj_bias": Replicate(),
    }
    assert placements("llama4_text", "model.layers.0.feed_forward.experts") == {
        "gate_up_proj": _StridedShard(2, split_factor=2),
        "down_proj": Shard(1),
    }
    with torch.device("meta"), pytest.raises(ValueError, match="do not split as two halves over 3 tp ranks"):
        expert_placements(coverage_model("qwen3_moe").model.layers[0].mlp.experts, tp=3)


def test_plans_are_completed_with_experts_latent_attention_and_shared_experts():
    """DeepSeek-V3's Hugging Face plan names its MLP only: completed with latent attention (low-rank projections kept
    whole, the rotary key's gradient summed) and its shared experts. GPT-OSS's names lm_head only: measured by one
    expert's matrix, its attention weights are large, and the completed Llama-style plan wins."""
    from lightning_automodel.parallel.tensor.styles.experts import ExpertTensorParallel
    from lightning_automodel.parallel.tensor.styles.projections import KeptWhole, LatentKeyValueProjection

    with torch.device("meta"):
        deepseek, gpt_oss = coverage_model("deepseek_v3"), coverage_model("gpt_oss")
    choice = select_tp_plan(deepseek, sp=False)
    assert choice.source == "Hugging Face plan of DeepseekV3ForCausalLM" and not choice.unsharded_weights
    layer = "model.layers.*"
    assert isinstance(choice.plan[f"{layer}.self_attn.kv_a_proj_with_mqa"], LatentKeyValueProjection)
    assert type(choice.plan[f"{layer}.self_attn.q_a_proj"]) is KeptWhole
    assert isinstance(choice.plan[f"{layer}.self_attn.kv_b_proj"], ColwiseParallel)
    assert isinstance(choice.plan[f"{layer}.mlp.experts"], ExpertTensorParallel)
    assert isinstance(choice.plan[f"{layer}.mlp.shared_experts.down_proj"], RowwiseParallel)
    choice = select_tp_plan(gpt_oss, sp=False)
    assert choice.source == "default Llama-style plan", choice
    assert "model.layers.0.self_attn.q_proj" in choice.reason, choice.reason
    assert isinstance(choice.plan[f"{layer}.mlp.experts"], ExpertTensorParallel)


def test_lora_on_experts_is_refused_at_tp_and_ep():
    """peft's adapters on expert parameters (target_parameters) wrap the experts in layers neither tp nor ep can
    split yet."""
    from peft import LoraConfig, get_peft_model

    from lightning_automodel.parallel.experts.expert_parallel import expert_parallel_problem

    config = LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])
    model = get_peft_model(coverage_model("qwen3_moe"), config).base_model.model
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.base_layer carries LoRA adapters"):
        select_tp_plan(model, sp=False)
    problem = expert_parallel_problem(model, ep=2)
    assert "layers.0.mlp.experts.base_layer carries LoRA adapters" in problem and "expert parallel" in problem


def test_experts_computing_more_than_their_weighted_sum_are_refused():
    """Longcat-Flash's identity experts would be summed over tp like partial outputs: refused, named."""
    from lightning_automodel.parallel.tensor.styles.experts import experts_problem

    with torch.device("meta"):
        experts = coverage_model("longcat_flash").model.layers[0].mlp.experts
    assert "computes more than its experts' weighted sum (['identity_expert'])" in experts_problem(experts)
    with torch.device("meta"):
        assert experts_problem(coverage_model("qwen3_moe").model.layers[0].mlp.experts) is None
