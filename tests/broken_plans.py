"""Plans and mechanisms broken on purpose, which the coverage check must judge wrong (tests/test_coverage.py):
each runs, every shape fits, and only the numbers can tell."""

from functools import partial

from torch.distributed.tensor.parallel import ColwiseParallel

from lightning_automodel.testing.coverage_report.check import coverage_check


def plain_gate_up(model, sp):
    """Moshi's derived plan with its fused [gate; up] fc1 split the plain way: rank 0 holds all of gate, rank 1 all of
    up. Every shape fits, so only the numbers can tell."""
    from lightning_automodel.parallel.tensor.plans.derived import derived_plan

    plan = derived_plan(model)
    return {**plan, **{name: ColwiseParallel() for name in plan if name.endswith("mlp.fc1")}}


def rotary_key_gradient_left_partial(model, sp):
    """DeepSeek-V3's plan with its latent key/value projection kept whole but its rotary key's gradient, partial on
    each rank (it meets this rank's heads only), not summed."""
    from lightning_automodel.parallel.tensor.plans.selection import select_tp_plan
    from lightning_automodel.parallel.tensor.styles.projections import KeptWhole, LatentKeyValueProjection

    plan = select_tp_plan(model, sp=sp).plan
    return {key: KeptWhole() if isinstance(style, LatentKeyValueProjection) else style for key, style in plan.items()}


def rotary_key_norm_unsummed(model, sp):
    """Dots3's plan with the rotary key's gradient summed at the latent projection's output, as for DeepSeek-V3: its
    norm of the rotary key, between them, then gets a partial gradient on each rank."""
    from lightning_automodel.parallel.tensor.plans.selection import select_tp_plan
    from lightning_automodel.parallel.tensor.styles.parameters import OutputGradientSummed
    from lightning_automodel.parallel.tensor.styles.projections import KeptWhole, LatentKeyValueProjection

    plan = select_tp_plan(model, sp=sp).plan
    rotary = LatentKeyValueProjection(rotary_width=model.config.qk_rope_head_dim)
    return {
        key: rotary if isinstance(style, KeptWhole) and key.endswith("kv_a_proj_with_mqa") else style
        for key, style in plan.items()
        if not isinstance(style, OutputGradientSummed)
    }


def broken_experts(model_type: str, broken: str) -> dict:
    """The coverage check with one mechanism of expert tensor parallel taken out (see BROKEN_MECHANISMS)."""
    from unittest import mock

    from torch.distributed.tensor import Shard

    from lightning_automodel.parallel.tensor.styles.parameters import summed_gradient

    replacements = {
        # gate and up split the plain way: rank 0 holds every expert's gate, rank 1 every expert's up
        "_StridedShard": lambda dim, split_factor: Shard(dim),
        # the router's gradient through the routing weights left partial on each rank
        "_whole_input": lambda value, mesh: value,
        # GPT-OSS's down_proj bias added whole by every rank (its gradient summed as the code does): its initial
        # value is zero, so only the gradient, counted tp times, can tell
        "_this_ranks_part": lambda param, mesh: (
            summed_gradient(param.to_local(), mesh=mesh) if param.placements[0].is_replicate() else param.to_local()
        ),
    }
    with mock.patch(f"lightning_automodel.parallel.tensor.styles.experts.{broken}", replacements[broken]):
        return coverage_check(model_type, "tp2")


def naive_stream_split(model_type: str) -> dict:
    """The coverage check with the sequence-parallel stream split as each rank's slice of a whole tensor: the
    gradient of the tensor it was cut from would then hold this rank's slice only, not the gathered whole."""
    from unittest import mock

    from torch.distributed.tensor import DTensor, Shard

    def naive(stream, *, mesh):
        local = stream.tensor_split(mesh.size(), dim=1)[mesh.get_local_rank()]
        return DTensor.from_local(local, mesh, [Shard(1)], run_check=False)

    with mock.patch("lightning_automodel.parallel.tensor.styles.stream._sequence_shard", naive):
        return coverage_check(model_type, "tp2_sp")


# The check catches a plan that runs and is wrong.
PLAIN_GATE_UP = partial(coverage_check, "moshi", "tp2", tp_plan="broken_plans.plain_gate_up")
BROKEN_MECHANISMS = [
    partial(broken_experts, "qwen3_moe", "_StridedShard"),
    partial(broken_experts, "qwen3_moe", "_whole_input"),
    partial(broken_experts, "gpt_oss", "_this_ranks_part"),
    partial(broken_experts, "dbrx", "_StridedShard"),  # each rank whole experts, read as halves of all of them
    partial(coverage_check, "deepseek_v3", "tp2", tp_plan="broken_plans.rotary_key_gradient_left_partial"),
    partial(naive_stream_split, "bert"),
    partial(coverage_check, "dots3_note_text", "tp2", tp_plan="broken_plans.rotary_key_norm_unsummed"),
]
