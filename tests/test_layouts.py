"""The layouts found by structure (docs/layouts_by_structure.md), each checked on two simulated ranks against one
process by verify_plan (with sp: -m sweep), and each broken once on purpose: the check must then fail.
tests/test_coverage.py checks the same models on two processes."""

from unittest import mock

import pytest
import torch
from torch import nn
from transformers import Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from lightning_automodel.hf.shrink import tiny_config
from lightning_automodel.parallel.tensor.plans.selection import select_tp_plan
from lightning_automodel.parallel.tensor.styles.parameters import rank_slice
from lightning_automodel.planning.verify import verify_plan

SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2, vocab_size=128)
STYLES = "lightning_automodel.parallel.tensor.styles"


def _no_sum(value, *, mesh):
    return value


def _slice_without_gather(self, value, *, mesh):
    """Each rank's slice cut out of the whole argument: the gradient of the rest stays zero on that rank."""
    return rank_slice(value, mesh=mesh, dim=self.dim % value.ndim)


# (config, the mechanism broken: what to patch and with what)
CASES = {
    # One key/value head: k_proj and v_proj whole, their gradient summed over tp.
    "multi-query": (LlamaConfig(num_key_value_heads=1, **SIZES), (f"{STYLES}.projections.summed_gradient", _no_sum)),
    # Gemma 3 1B's layout: the key head's norm sums the gradient instead of k_proj.
    "multi-query with a key norm": (
        Gemma3TextConfig(num_key_value_heads=1, head_dim=16, **SIZES),
        (f"{STYLES}.parameters.summed_gradient", _no_sum),
    ),
    # Mamba-2 with one group of B and C: the convolution's shared channels get their gradient summed.
    "mamba-2": (tiny_config("bamba"), (f"{STYLES}.state_space.summed_gradient", _no_sum)),
    # Mamba with Jamba's norms of dt, B and C: x_proj's whole output gets its gradient summed after them.
    "mamba": (tiny_config("jamba"), (f"{STYLES}.state_space.summed_gradient", _no_sum)),
    # OLMo-Hybrid's Gated DeltaNet: the gated norm's weight, shared by all heads, gets its gradient summed. Kimi's delta
    # attention (forget gate, low-rank gates) trains at parity in tests/test_loading.py, Qwen3-Next's layout below.
    "gated delta rule": (tiny_config("olmo_hybrid"), (f"{STYLES}.delta_rule.summed_gradient", _no_sum)),
    # Gemma 4's per-layer input: each rank's slice, the slices' gradients gathered.
    "per-layer input": (tiny_config("gemma4_text"), (f"{STYLES}.inputs.SplitArgument._slice", _slice_without_gather)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layout_trains_as_one_process_and_its_mechanism_matters(case):
    config, (target, broken) = CASES[case]
    verification = verify_plan(config, tp=2, raise_on_failure=False)
    assert verification.passed, verification.failure_message()
    with mock.patch(target, broken):
        verification = verify_plan(config, tp=2, raise_on_failure=False)
    assert not verification.passed, f"{case} passed with {target} broken:\n{verification}"
    print(case, max(verification.grad_errors.values()))


@pytest.mark.sweep  # tests/test_coverage.py checks Bamba's, GPT-BigCode's and Gemma 4's with sp on two processes
@pytest.mark.parametrize("case", list(CASES))
def test_layout_with_sequence_parallel(case):
    verification = verify_plan(CASES[case][0], tp=2, sp=True, raise_on_failure=False)
    assert verification.passed, verification.failure_message()


def test_a_gated_delta_rule_with_more_value_heads_than_key_heads():
    """Qwen3-Next's released proportions: two value heads per key head (each rank its key heads and the value heads
    that read them), its fused projections laid out key head by key head; as many value heads as each is wide, so the
    mixer's own per-head parameters have a norm's shape."""
    config = tiny_config("qwen3_next")
    config.linear_num_key_heads, config.linear_num_value_heads = 2, 4
    config.linear_key_head_dim, config.linear_value_head_dim = 8, 4
    verification = verify_plan(config, tp=2, raise_on_failure=False)
    assert verification.passed, verification.failure_message()


def test_a_gated_norm_over_one_group_sums_its_squares_over_tp():
    """Bamba's single group split over the ranks: without the sum each rank normalises by its own half."""
    with mock.patch(f"{STYLES}.state_space._SumOverRanks.apply", lambda tensor, group: tensor):
        verification = verify_plan(tiny_config("bamba"), tp=2, raise_on_failure=False)
    assert not verification.passed and max(verification.grad_errors.values()) > 1e-3, verification


def test_multi_query_attention_with_other_parameters_is_refused():
    """A module of a multi-query attention holding parameters, neither a projection nor a per-head norm, might compute
    on the whole key: every candidate is refused, naming it."""
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=1, **SIZES))
        for layer in model.model.layers:
            layer.self_attn.key_scale = nn.LayerNorm(16)
    with pytest.raises(ValueError, match="besides its projections and per-head norms .model.layers.0.self_attn.key_sc"):
        select_tp_plan(model, sp=False)
