"""The activation estimate of a mixture-of-experts step (planning.memory.activations under planning.memory.routing's
assumed routing) against real CPU steps of Qwen3-MoE and DeepSeek-V3 (latent attention) at tp=2 and ep=2: to the
byte where the real step routes as the estimate assumes, within 5% under the router's own routing; the routing
stated in the report, the option to plan for an imbalance, ``layout="auto"`` choosing for a Qwen3-MoE, and the
refusal of a model the estimate cannot step."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from moe_memory_checks import ROWS, TOKENS, measured_moe_activation_bytes, moe_model
from transformers import AutoModelForCausalLM

from lightning_automodel import ParallelDims, plan_report
from lightning_automodel.cli import main
from lightning_automodel.planning import Hardware, SearchSpace, StepOptions, choose_layout
from lightning_automodel.planning.memory.activations import UntraceableStep, activation_bytes
from lightning_automodel.planning.memory.routing import ExpertRouting
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.models import tiny_config

TOLERANCE = 0.05  # the issue's: the real step's routing is its router's (measured: within 3.3%, docs/planning.md)
QWEN_EP = ("qwen3_moe", ParallelDims(dp_shard=2, ep=2), {})
DEEPSEEK_TP = ("deepseek_v3", ParallelDims(tp=2), {})
SWEEP_LAYOUTS = [("qwen3_moe", ParallelDims(tp=2), dict(sp=True)), ("deepseek_v3", ParallelDims(dp_shard=2, ep=2), {})]
EXAMPLES = Path(__file__).parents[1] / "examples"


def _estimate(family: str, dims: ParallelDims, *, rows: int = ROWS, tokens: int = TOKENS, **options) -> int:
    return activation_bytes(moe_model(family, meta=True), dims.resolve(2), micro_batch=rows, seq_len=tokens, **options)


def test_the_estimate_matches_real_steps_at_tp_and_ep():
    """One launch: Qwen3-MoE at ep=2 and DeepSeek-V3 at tp=2, real steps under the router's own routing (within 5%),
    and Qwen3-MoE at ep=2 under the routing the estimate assumes (to the byte but a scalar, see SCALAR: what remains
    is routing alone)."""
    _assert_estimates_match_real_steps([QWEN_EP, DEEPSEEK_TP], assumed=[QWEN_EP])


@pytest.mark.sweep
def test_the_estimate_matches_real_steps_of_more_layouts():
    _assert_estimates_match_real_steps(SWEEP_LAYOUTS, assumed=SWEEP_LAYOUTS[1:])


def _assert_estimates_match_real_steps(layouts: list, *, assumed: list) -> None:
    checks = [partial(measured_moe_activation_bytes, family, dims, **options) for family, dims, options in layouts]
    checks += [
        partial(measured_moe_activation_bytes, family, dims, routing=ExpertRouting(), **options)
        for family, dims, options in assumed
    ]
    measured = list(run_checks(2, checks, timeout=600).values())
    for (family, dims, options), per_rank in zip(layouts, measured, strict=False):
        estimate = _estimate(family, dims, **options)
        for rank, peak in enumerate(per_rank):
            assert estimate == pytest.approx(peak["tensors"], rel=TOLERANCE), (family, dims, rank, estimate, peak)
    for (family, dims, options), per_rank in zip(assumed, measured[len(layouts) :], strict=True):
        estimate = _estimate(family, dims, **options)
        above = [peak["tensors"] - estimate for peak in per_rank]
        assert all(0 <= bytes_ <= SCALAR for bytes_ in above), (family, estimate, per_rank)


# A real step's peak may hold one 4-byte scalar more on a rank than the estimate, by when its gloo collectives
# complete (seen once in about ten runs: rank 1 at +4 bytes, rank 0 exact); a token's routing moves its hidden state,
# 512 bytes here, so the comparison stays one of routing alone.
SCALAR = 4


def test_an_imbalance_is_planned_for_on_the_rank_of_the_busiest_expert():
    """The busiest expert at twice its share, on the estimated rank: that rank receives (2 + 3 x 6/7) / 4 = 1.14 times
    a balanced rank's tokens (8 experts, 4 of them its own), and its experts' activations grow with them."""
    shape = dict(rows=1, tokens=128)
    balanced = _estimate("qwen3_moe", ParallelDims(dp_shard=2, ep=2), **shape)
    busier = _estimate("qwen3_moe", ParallelDims(dp_shard=2, ep=2), expert_imbalance=2.0, **shape)
    assert 1.02 < busier / balanced < 1.14, (balanced, busier)
    at_tp = _estimate("qwen3_moe", ParallelDims(tp=2), expert_imbalance=2.0, **shape)
    assert at_tp == _estimate("qwen3_moe", ParallelDims(tp=2), **shape)  # every rank computes every expert


@pytest.mark.parametrize("imbalance, tokens, top_k, experts", [(1.0, 64, 2, 8), (2.0, 64, 2, 8), (1.3, 37, 3, 5)])
def test_the_assumed_choices_route_as_stated(imbalance, tokens, top_k, experts):
    routing = ExpertRouting(imbalance)
    choices = routing.choices(tokens=tokens, top_k=top_k, experts=experts, busiest=1)
    assert choices.shape == (tokens, top_k)
    assert all(len(set(row.tolist())) == top_k for row in choices)  # a token's experts are distinct
    counts = torch.bincount(choices.flatten(), minlength=experts)
    balanced = tokens * top_k / experts
    assert counts[1] == max(counts) and counts[1] / balanced == pytest.approx(imbalance, abs=1 / balanced)
    rest = torch.cat([counts[:1], counts[2:]])
    assert int(rest.max() - rest.min()) <= 1


def test_an_imbalance_beyond_every_token_or_below_balanced_is_refused():
    with pytest.raises(ValueError, match="at most 4 for 8 experts choosing 2"):
        ExpertRouting(5.0).choices(tokens=16, top_k=2, experts=8)
    with pytest.raises(ValueError, match="expert_imbalance=0.5: the busiest expert's share"):
        StepOptions(expert_imbalance=0.5)


def test_the_report_and_the_search_state_the_routing_and_auto_chooses_for_qwen3_moe():
    def model():
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", num_experts=8))

    report = plan_report(model(), ParallelDims(dp_shard=2, ep=2).resolve(2), batch_shape=(2, 32))
    assert "expert routing balanced (each expert gets tokens x top_k / experts" in str(report)
    step = StepOptions(expert_imbalance=1.5)
    report = plan_report(model(), ParallelDims(tp=2).resolve(2), batch_shape=(2, 32), step=step)
    assert "expert routing the busiest expert 1.5x its balanced share" in str(report)
    choice = choose_layout(
        model(),
        4,
        space=SearchSpace(ep=2, pp=1),
        hardware=Hardware(0.05, gpus_per_node=4),
        batch_shape=(2, 32),
        step=step,
    )
    assert choice.candidate.dims.ep == 2 and choice.candidate.dims.world_size == 4
    assert "expert routing the busiest expert 1.5x" in str(choice)


def test_a_model_the_estimate_cannot_step_is_refused_naming_it(tmp_path, capsys, no_pytest_argv, monkeypatch):
    """A layer that selects by a mask of values (a size fake tensors cannot know): refused, naming the model and the
    operation, by the API and by `plan --activations` (its message, no traceback)."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    def by_mask(self, hidden_states):
        return hidden_states[hidden_states[..., 0] > 0].sum() * 0 + hidden_states

    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeRMSNorm, "forward", by_mask)
    with pytest.raises(UntraceableStep, match=r"Qwen3MoeForCausalLM \(qwen3_moe\).*aten.nonzero"):
        _estimate("qwen3_moe", ParallelDims(dp_shard=2, ep=2), rows=1, tokens=32)
    with pytest.raises(SystemExit) as exited:  # tp's plan would be refused first, by its own probe: at ep
        main(["plan", "--config", _moe_config(tmp_path), "--batch_size", "1", "--seq_len", "32"])
    out = capsys.readouterr().out
    assert exited.value.code == 1 and "Qwen3MoeForCausalLM (qwen3_moe): the memory estimate cannot run" in out, out


def test_plan_states_the_routing_it_was_given(tmp_path, capsys, no_pytest_argv):
    main(
        ["plan", "--config", _moe_config(tmp_path), "--batch_size", "1", "--seq_len", "32", "--expert_imbalance", "1.5"]
    )
    out = capsys.readouterr().out
    assert "  expert routing the busiest expert 1.5x its balanced share of every rank's choices" in out, out
    assert "checkpointing full" in out


def _moe_config(folder: Path) -> str:
    """The demo's config, its model a Qwen3-MoE of 4 experts (2 a token) at ep=2 over the demo's 4 CPU processes."""
    config = yaml.safe_load((EXAMPLES / "demo.yaml").read_text())
    config["trainer"]["strategy"]["init_args"] = {"ep": 2}
    config["model"]["config"] = {
        **config["model"]["config"],
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    path = folder / "moe.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)
