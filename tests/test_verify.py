"""verify_plan: a shrunk replica, tp ranks simulated in this process, against one process; wrong plans caught."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import ColwiseParallel
from transformers import AutoModelForCausalLM, BertConfig, GraniteConfig, LlamaConfig, Qwen3Config

from lightning_automodel import ParallelDims, plan_report, verify_plan
from lightning_automodel.hf.shrink import heads_for, shrunk_config, tiny_config
from lightning_automodel.parallel.tensor.plans.selection import select_tp_plan
from lightning_automodel.parallel.tensor.sizes import validate_tp_sizes
from lightning_automodel.planning.verify import FP32_TOLERANCE
from lightning_automodel.testing.harness import free_port
from lightning_automodel.testing.models import tiny_model


def test_a_registered_family_plan_passes_with_sequence_parallel():
    verification = verify_plan(Qwen3Config(), tp=2, sp=True)  # a full-size config: verify_plan shrinks it
    assert verification.passed, verification
    assert verification.plan_source == "family plan for Qwen3ForCausalLM"
    # q_norm and k_norm act on heads the plan splits: the probe makes their gradients right, and that is measured.
    assert verification.grad_errors["model.layers.0.self_attn.q_norm.weight"] < FP32_TOLERANCE
    assert verification.replica_parameters < 500_000
    assert "PASSED" in str(verification)


def test_a_hugging_face_plan_passes():
    verification = verify_plan(GraniteConfig())
    assert verification.passed, verification
    assert verification.plan_source == "Hugging Face plan of GraniteForCausalLM"


def test_a_derived_plan_with_an_embedding_tied_whole_passes_with_sequence_parallel():
    """BERT's lm_head is tied to its embedding and both stay whole: loading the replica's weights keeps the tie
    (``to_empty`` alone gives each module a tensor of its own), and the stream is split inside its blocks."""
    verification = verify_plan(BertConfig(is_decoder=True), tp=2, sp=True)
    assert verification.passed, verification
    assert verification.grad_errors["bert.embeddings.word_embeddings.weight"] < FP32_TOLERANCE


def test_a_wrong_plan_is_caught_and_named():
    """Phi3 fuses gate and up into one projection: plain ColwiseParallel gives each rank gate or up, not half of
    each. It runs and trains wrong; the worst gradients are those of the MLP it breaks."""
    model = tiny_model("phi3")
    plan = select_tp_plan(model, sp=False).plan
    plan["model.layers.*.mlp.gate_up_proj"] = ColwiseParallel()
    with pytest.raises(ValueError, match="The user plan trains Phi3ForCausalLM wrong at tp=2") as raised:
        verify_plan(model, tp_plan=plan)
    message = str(raised.value)
    assert "register_tp_plan" in message and "FAILED" in message
    verification = verify_plan(model, tp_plan=plan, raise_on_failure=False)
    assert not verification.passed
    assert verification.logits_error > 1e-2
    worst = [name for name, _ in verification.worst_gradients[:6]]
    assert {"model.layers.0.mlp.gate_up_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"} <= set(worst), worst
    assert all(".mlp." in name or "post_attention_layernorm" in name for name in worst[:2]), worst


def test_a_refused_plan_is_refused_as_parallelize_refuses_it():
    attention_only = {f"model.layers.*.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    with pytest.raises(ValueError, match="leaves large weights of LlamaForCausalLM's decoder blocks unsharded"):
        verify_plan(LlamaConfig(), tp_plan=attention_only)


def test_inside_a_process_group_it_runs_in_a_child_and_leaves_the_group_alone():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        verification = verify_plan(Qwen3Config())
        assert verification.passed, verification
        assert dist.is_initialized() and dist.group.WORLD is group
    finally:
        dist.destroy_process_group()


def test_the_replica_has_heads_every_tp_rank_can_split():
    config = shrunk_config(LlamaConfig(num_attention_heads=32, num_key_value_heads=8), heads=heads_for(4))
    assert type(config) is LlamaConfig
    assert (config.num_attention_heads, config.num_key_value_heads, config.hidden_size) == (8, 4, 128)
    assert config.vocab_size == 128 and config.num_hidden_layers <= 3  # one of each kind (id2label reads as one)


def test_a_per_head_norm_left_plain_is_caught_by_its_gradient(monkeypatch):
    """Qwen3's q_norm and k_norm act per head on the heads the plan splits. Left plain (the probe that finds them
    switched off), the forward is still right, but each rank holds only its heads' part of their gradient: the
    logits pass and the gradients of exactly those norms fail."""
    from lightning_automodel.parallel.tensor import apply
    from lightning_automodel.parallel.tensor.sharded_activations import ShardedActivations

    monkeypatch.setattr(apply, "find_sharded_activations", lambda *a, **k: ShardedActivations({}, [], []))
    verification = verify_plan(Qwen3Config(), raise_on_failure=False)
    assert verification.logits_error < FP32_TOLERANCE and verification.loss_error < FP32_TOLERANCE
    assert not verification.passed
    assert {name.rsplit(".", 2)[-2] for name in verification.wrong_gradients} == {"q_norm", "k_norm"}


def gptj_plan(model, sp):
    """README's "Adding a plan" example: GPT-J, whose projections no family or Hugging Face plan names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    layer = "transformer.h.*"
    plan = {f"{layer}.attn.{p}_proj": ColwiseParallel() for p in "qkv"}
    plan |= {f"{layer}.attn.out_proj": RowwiseParallel(), f"{layer}.mlp.fc_in": ColwiseParallel()}
    plan |= {f"{layer}.mlp.fc_out": RowwiseParallel()}
    plan |= {"transformer.wte": RowwiseParallel(input_layouts=Replicate())}
    plan |= {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    return plan


def test_adding_a_plan_as_the_readme_shows(monkeypatch):
    from transformers import GPTJConfig

    from lightning_automodel.parallel.tensor.plans import family as family_plans

    # register_tp_plan, undone after the test
    monkeypatch.setitem(family_plans._FAMILY_PLANS, "GPTJForCausalLM", gptj_plan)
    verification = verify_plan(GPTJConfig())
    assert verification.passed and verification.plan_source == "family plan for GPTJForCausalLM", verification


def _per_layer_head_widths(**overrides: object):
    """Gemma 4 unified's config with its full-attention layer given heads twice as wide as the sliding ones (its
    ``global_head_dim``): a heterogeneous config, whose per-layer attributes transformers refuses to read globally."""
    config = tiny_config("gemma4_unified_text")
    fields = {name: value for name, value in config.to_dict().items() if name != "per_layer_config"}
    return type(config)(**{**fields, "global_head_dim": 2 * config.head_dim, **overrides})


@pytest.mark.parametrize("sp", [False, True])
def test_a_config_whose_layers_have_their_own_head_widths(sp):
    """Each attention's head counts and widths are its own layer's. Read globally they crashed
    (AmbiguousGlobalPerLayerAttributeError); read as one set, the full-attention layer's head width (32) is the
    sliding layers' width of two heads (2 x 16), and was halved: the probe of the sharded model refused it. Verified
    against one process on the shrunk replica, and planned on the tiny config itself, on the meta device."""
    config = _per_layer_head_widths()
    assert config.is_heterogeneous
    verification = verify_plan(config, tp=2, sp=sp)
    assert verification.passed, verification
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    report = plan_report(model, ParallelDims(tp=2).resolve(2), sp=sp)
    assert report.parameters_per_rank < report.total_parameters


def test_sizes_tp_does_not_divide_are_named_layer_by_layer():
    """A size of one layer only (the full-attention layer's key/value heads) that tp does not divide is named."""
    config = _per_layer_head_widths(num_global_key_value_heads=3, attention_k_eq_v=True)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"num_key_value_heads=\[2, 3\]"):
        validate_tp_sizes(model, 2)
