"""The plan report: a fake world of any size, in this process, on meta-device models."""

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from lightning_automodel import ParallelDims, plan_report
from lightning_automodel.parallel.pipeline import PipelineOptions
from lightning_automodel.planning import StepOptions
from lightning_automodel.testing.models import tiny_config

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
)


def on_meta(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_an_8b_model_on_32_ranks():
    report = plan_report(on_meta(LlamaConfig(**LLAMA_8B)), ParallelDims(tp=8, dp_shard=4).resolve(32), sp=True)
    assert report.total_parameters == 8_030_261_248
    # Everything is sharded 32 ways but the norms (replicated over tp, sharded over dp): within 0.1% of ideal.
    assert report.parameters_per_rank == pytest.approx(report.total_parameters / 32, rel=1e-3)
    assert report.training_bytes_per_rank == 4 * 4 * report.parameters_per_rank  # fp32 param, grad, 2 AdamW states
    text = str(report)
    for fragment in [
        "family plan for LlamaForCausalLM",
        "model.layers.*.mlp.down_proj",
        "RowwiseParallel x32",
        "SequenceParallelAllGather x32",
        "8,030,261,248 in all",
        "ideal 1/32",
        "GiB with gradients and AdamW state",
    ]:
        assert fragment in text, (fragment, text)


def test_a_mixture_of_experts_at_ep_times_tp_on_16_ranks():
    """Qwen3-MoE (128 experts) at tp=2 x dp_shard=8 with ep=4: experts split over ep x efsdp x tp = 16 as the
    rest of the model is over dp_shard x tp."""
    config = tiny_config(
        "qwen3_moe", num_experts=128, hidden_size=256, moe_intermediate_size=128, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, num_hidden_layers=2,
    )  # fmt: skip
    report = plan_report(on_meta(config), ParallelDims(tp=2, ep=4).resolve(16))
    assert "expert parallel: ep=4, each rank holds 1/4 of every layer's experts, FSDP-sharded over efsdp=2" in str(
        report
    )
    assert report.parameters_per_rank == pytest.approx(report.total_parameters / 16, rel=2e-2)


@pytest.mark.sweep  # the 70B example's plan (test_cli_plan.py) reports pipeline stages by default
def test_pipeline_stages_of_an_8b_model_on_64_ranks():
    """Llama-3-8B at pp=2 x tp=8 x dp_shard=4 with sp (1F1B, 16 micro-batches): each stage's layers, ranks and memory
    (the second stage parallelized in a fake world of its own, after the first's), and the bubble; every parameter
    held by one stage, sharded 32 ways within it."""
    dims = ParallelDims(pp=2, tp=8, dp_shard=4).resolve(64)
    report = plan_report(on_meta(LlamaConfig(**LLAMA_8B)), dims, sp=True, pipeline=PipelineOptions("1F1B", 16))
    text = str(report)
    for fragment in [
        "pipeline: pp=2 stages, schedule 1F1B, 16 micro-batches per step; idle (bubble) fraction (p-1)/(m+p-1) = 5.9%",
        "stage 0 (ranks 0-31): embedding, layers 0-15;",
        "stage 1 (ranks 32-63): layers 16-31, norm, head;",
        "family plan for LlamaForCausalLM",
    ]:
        assert fragment in text, (fragment, text)
    held = sum(stage.parameters_per_rank for stage in report.stages) * 32
    assert held == pytest.approx(report.total_parameters, rel=1e-3)


def test_unmatched_patterns_and_whole_linears_are_reported():
    plan = {
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "model.layers.*.self_attn.qkv": ColwiseParallel(),
    }
    step = StepOptions(tp_plan=plan, allow_unsharded_linears=True)
    report = plan_report(on_meta(tiny_config()), ParallelDims(tp=2).resolve(4), step=step)
    assert report.plan_source == "user plan"
    assert report.unmatched_patterns == ["model.layers.*.self_attn.qkv"]
    assert "model.layers.0.self_attn.o_proj" in report.unsharded_weights
    assert "patterns matching no module: model.layers.*.self_attn.qkv" in str(report)


def test_fsdp_only():
    model = on_meta(tiny_config())
    total = sum(p.numel() for p in model.parameters())
    report = plan_report(model, ParallelDims().resolve(4))
    assert "tensor parallel: off" in str(report)
    assert report.parameters_per_rank == pytest.approx(total / 4, rel=0.01)


def test_a_model_with_weights_is_refused():
    with pytest.raises(ValueError, match="needs a model on the meta device"):
        plan_report(AutoModelForCausalLM.from_config(tiny_config()), ParallelDims().resolve(2))


class ScaledMLP(LlamaMLP):
    """An MLP whose own code scales the sharded hidden units by a parameter of its own: the module receives the whole
    hidden states, so no style of it can sum that parameter's partial gradients."""

    def __init__(self, config):
        super().__init__(config)
        self.scale = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.down_proj(self.scale * self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_a_parameter_on_sharded_activations_in_its_modules_own_code_is_refused():
    model = on_meta(tiny_config())
    with torch.device("meta"):
        for layer in model.model.layers:
            layer.mlp = ScaledMLP(model.config)
    with pytest.raises(ValueError) as error:
        plan_report(model, ParallelDims(tp=2).resolve(2))
    assert "model.layers.0.mlp.scale" in str(error.value) and "no style of that module can sum it" in str(error.value)
