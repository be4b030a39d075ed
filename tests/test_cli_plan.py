"""`lightning-automodel plan`: the report of a config (the examples' layouts, pipeline stages, context parallel),
its activation estimate, --verify, --fit's table of the layouts that fit, a vision-language model's images, and no
warnings."""

from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest

from lightning_automodel.cli import main
from lightning_automodel.cli.config import configured
from lightning_automodel.cli.plan import plan_for_config
from lightning_automodel.strategy.module_hints import adamw_of, loss_chunks_of

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_plan_of_a_config(no_pytest_argv):
    """`plan` reads the same YAML and overrides as fit: the 8B example at tp=4 with sp x dp_shard=2, with no GPU
    (the config asks for GPUs), then at another world size and tp."""
    report = str(plan_for_config(str(EXAMPLES / "llama_tp_fsdp.yaml")))
    assert "ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=4, ep=1)" in report
    assert "model.layers.*.mlp.down_proj             RowwiseParallel x32" in report
    assert "8,030,261,248 in all, 1,003,882,496 per rank (12.50%; ideal 1/8)" in report
    other = plan_for_config(str(EXAMPLES / "llama_tp_fsdp.yaml"), "--trainer.strategy.init_args.tp=8", world_size=32)
    assert "ParallelDims(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=8, ep=1)" in str(other)
    # The config's seed_everything must not seed this process: Lightning would re-seed every later run from it.
    assert "PL_GLOBAL_SEED" not in os.environ


def test_plan_of_the_128k_context_example(no_pytest_argv):
    """The 32-GPU long-context example: cp=4 x tp=8, FSDP over dp_shard x cp, and the keys and values each rank
    receives per token and layer: 2 (K, V) x 1 KV head (8 / tp) x 128 x 4 bytes x 3/4 of the row."""
    report = str(plan_for_config(str(EXAMPLES / "llama8b_128k_cp_tp.yaml")))
    assert "ParallelDims(pp=1, dp_replicate=1, dp_shard=1, cp=4, tp=8, ep=1)" in report
    assert "context parallel: cp=4, each rank holds 1/4 of every sequence (chunks i and 7-i of 8" in report
    assert "768 bytes received per token of a row, per layer and rank" in report
    assert "8,030,261,248 in all, 251,003,904 per rank (3.13%; ideal 1/32)" in report


def test_plan_of_the_70b_pipeline_example(no_pytest_argv):
    """The 64-GPU example planned with 8 of its 80 layers (the whole takes 80 s here; its memory ratios are in
    benchmarks/pipeline.py): 4 stages, the embedding and the head counted as one layer each."""
    report = plan_for_config(str(EXAMPLES / "llama70b_pp_tp_fsdp.yaml"), "--model.config.num_hidden_layers=8")
    assert "ParallelDims(pp=4, dp_replicate=1, dp_shard=2, cp=1, tp=8, ep=1)" in str(report)
    assert "schedule 1F1B, 16 micro-batches per step; idle (bubble) fraction (p-1)/(m+p-1) = 15.8%" in str(report)
    stages = [(stage.layers, stage.ranks) for stage in report.stages]
    assert stages == [
        ({0: range(0, 1)}, "0-15"),
        ({1: range(1, 4)}, "16-31"),
        ({2: range(4, 7)}, "32-47"),
        ({3: range(7, 8)}, "48-63"),
    ]
    held = sum(stage.parameters_per_rank for stage in report.stages) * 16
    assert held == pytest.approx(report.total_parameters, rel=1e-3)


@pytest.mark.sweep
def test_plan_of_the_70b_pipeline_example_with_two_stages_per_rank(no_pytest_argv):
    """The same example with 14 layers, Interleaved1F1B over 2 stages per rank: each pp rank's stages and their
    layers, and the smaller bubble (the suite keeps the 1F1B plan above)."""
    interleaved = plan_for_config(
        str(EXAMPLES / "llama70b_pp_tp_fsdp.yaml"),
        "--model.config.num_hidden_layers=14",
        "--trainer.strategy.init_args.pp_schedule=Interleaved1F1B",
        "--trainer.strategy.init_args.pp_stages_per_rank=2",
    )
    assert "pp=4 x 2 stages per rank, schedule Interleaved1F1B, 16 micro-batches per step" in str(interleaved)
    assert "(p-1)/(vm+p-1) = 8.6%" in str(interleaved)
    assert interleaved.stages[0].layers == {0: range(0, 1), 4: range(7, 9)}, interleaved.stages[0]
    assert interleaved.stages[3].layers == {3: range(5, 7), 7: range(13, 14)}, interleaved.stages[3]
    assert "pp rank 3 (ranks 48-63): stage 3: layers 5-6; stage 7: layer 13, norm, head;" in str(interleaved)


def test_plan_steps_as_the_module_computes_its_loss(no_pytest_argv):
    """The step `plan` and layout="auto" measure takes the LightningModule's loss_chunks and AdamW, asked through the
    strategy's ModuleHints and OptimizerHints (CausalLMModule answers; a module that does not computes the logits
    whole and steps foreach AdamW, torch's default on GPUs)."""
    config = configured(str(EXAMPLES / "demo.yaml"), "--model.loss_chunks=4", "--model.adamw=fused", world_size=2)
    assert (config.step_options().loss_chunks, config.step_options().adamw) == (4, "fused")
    assert (loss_chunks_of(L.LightningModule()), adamw_of(L.LightningModule())) == (1, "foreach")


def test_plan_takes_the_vocabulary_from_the_data(no_pytest_argv):
    """A config without vocab_size gets the tokenizer's, rounded up, as fit would."""
    report = plan_for_config(str(EXAMPLES / "demo.yaml"))
    assert "ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2, ep=1)" in str(report)
    assert report.total_parameters == 2 * 320 * 128 + 2 * (4 * 128 * 128 + 3 * 128 * 256 + 2 * 128) + 128


def test_plan_command_prints_no_warning(capsys, monkeypatch):
    """`plan` as run from the shell, sys.argv holding its command line: LightningCLI's warning against giving it
    both arguments and a command line was printed on every run."""
    assert _warnings_of_plan(["plan", f"--config={EXAMPLES / 'demo.yaml'}"], monkeypatch) == []
    assert "ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=2, ep=1)" in capsys.readouterr().out


def _warnings_of_plan(command: list[str], monkeypatch) -> list[str]:
    """The warnings a shell's user sees from ``command`` run with it in sys.argv: what Python shows by default, so no
    DeprecationWarning raised outside __main__ (jsonargparse's)."""
    monkeypatch.setattr(sys, "argv", ["lightning-automodel", *command])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(command)
    return [str(warning.message) for warning in caught if not issubclass(warning.category, DeprecationWarning)]


def test_plan_prints_each_finding_once_in_its_report(capsys, caplog, monkeypatch):
    """`plan` of a layout that parallelizes the model once a pipeline stage and once a checkpointing mode (pp=2, the
    activation estimate), over flattened mesh axes (HSDP: dp_replicate=2) with keys and values gathered (cp=2), of a
    plan with a pattern that matches no module: no warning and no log record of ours, torch's deprecations of its
    old mesh slicing and functional collective among them; the pattern named once, in the report."""
    command = [
        "plan",
        f"--config={EXAMPLES / 'demo.yaml'}",
        "--world_size=16",
        "--activations",
        "--trainer.strategy.init_args.pp=2",
        "--trainer.strategy.init_args.cp=2",
        "--trainer.strategy.init_args.dp_replicate=2",
        "--trainer.strategy.init_args.tp_plan=plan_checks.plan_with_a_stray_pattern",
    ]
    assert _warnings_of_plan(command, monkeypatch) == []
    assert [record.getMessage() for record in caplog.records if record.name.startswith("lightning_automodel")] == []
    out = capsys.readouterr().out
    assert out.startswith("LlamaForCausalLM on ParallelDims(pp=2, dp_replicate=2, dp_shard=1, cp=2, tp=2, ep=1)"), out
    assert out.count("no_such_proj") == 2, out  # its line in the plan (x0), and the patterns matching no module
    assert "patterns matching no module: model.layers.*.mlp.no_such_proj" in out


# The demo's model as a Phi3, whose fused gate_up_proj a plan can split wrong.
DEMO_AS_PHI3 = (
    '--model.config={"model_type": "phi3", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,'
    ' "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 128, "pad_token_id": 0}'
)


def test_plan_verify_passes_on_the_demo_and_fails_on_a_wrong_plan(capsys, no_pytest_argv):
    """`plan --verify` prints the plan and its verification; a plan that trains wrong exits with 1."""
    main(["plan", f"--config={EXAMPLES / 'demo.yaml'}", "--verify"])
    out = capsys.readouterr().out
    assert "verify_plan: LlamaForCausalLM at tp=2, sp=True, with the family plan for LlamaForCausalLM" in out
    assert "PASSED" in out
    wrong = ["--trainer.strategy.init_args.tp_plan=plan_checks.naive_fused_plan", DEMO_AS_PHI3]
    with pytest.raises(SystemExit) as exited:
        main(["plan", f"--config={EXAMPLES / 'demo.yaml'}", "--verify", *wrong])
    assert exited.value.code == 1
    out = capsys.readouterr().out
    assert re.search(r"model\.layers\.0\.mlp\.gate_up_proj\.weight +1\.\de\+00  WRONG", out), out
    assert "FAILED" in out


def test_plan_refuses_rows_longer_than_the_positions(no_pytest_argv):
    with pytest.raises(ValueError, match="seq_len=256 is longer than the model's max_position_embeddings=128"):
        plan_for_config(str(EXAMPLES / "demo.yaml"), "--data.init_args.seq_len=256")


def test_plan_command_estimates_at_the_config_batch(capsys, no_pytest_argv):
    main(["plan", "--config", str(EXAMPLES / "demo.yaml"), "--batch_size", "2", "--seq_len", "64"])
    out = capsys.readouterr().out
    assert "activations per rank, 2 rows x 64 tokens a step" in out
    assert "checkpointing full" in out


def test_plan_command_lists_the_layouts_that_fit(capsys, no_pytest_argv):
    config = str(EXAMPLES / "demo.yaml")
    main(["plan", "--config", config, "--world_size", "2", "--fit", "0.05", "--batch_size", "2", "--seq_len", "64"])
    out = capsys.readouterr().out
    assert "layouts that fit 0.05 GiB per GPU" in out
    assert "2 rows x 64 tokens a batch" in out
    assert "throughput model: 989 TFLOP/s" in out
    assert re.search(r"^ +1 +1 +1 +2 +1  (off|selective|submodule|full) ", out, re.MULTILINE), out  # dp_shard=2 fits
    winner = re.search(r"^ +(\d+) +(\d+) +(\d+) +(\d+) +(\d+)  (\w+) ", out, re.MULTILINE).groups()
    pp, tp, cp, dp_shard, dp_replicate, checkpointing = winner
    overrides = out.split("or as fit's overrides:\n")[1].splitlines()[0].split()
    assert f"--trainer.strategy.init_args.tp={tp}" in overrides and f"--trainer.strategy.init_args.pp={pp}" in overrides
    assert (
        f"      dp_shard: {dp_shard}" in out and "    class_path: lightning_automodel.AutoModelParallelStrategy" in out
    )
    # The overrides pasted into fit give the layout the table's first row names.
    config = configured(config, *overrides, world_size=2)
    dims = config.dims
    assert (dims.pp, dims.tp, dims.cp, dims.dp_shard, dims.dp_replicate) == tuple(map(int, winner[:5])), dims


def test_plan_command_counts_the_images_of_a_vision_language_model(capsys, no_pytest_argv):
    """The vision demo's LLaVA: the tower's parameters per rank, the images of the estimated step and what they add
    to each mode's peak."""
    config = str(EXAMPLES / "vision_demo.yaml")
    main(["plan", "--config", config, "--batch_size", "2", "--images_per_row", "2"])
    out = capsys.readouterr().out
    assert re.search(r"vision tower and projector: .* per rank \(\d+\.\d% of the rank's\)", out), out
    assert "activations per rank, 2 rows x 80 tokens a step" in out
    assert "2 images a row of 16 tokens each (images_per_row=, image_tokens=)" in out
    assert re.search(r"checkpointing full +\d+\.\d\d GiB \(images \d+\.\d\d GiB\)", out), out
