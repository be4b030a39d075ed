"""Pipeline parallel (``pp``) against one process, through a real Trainer: 3 AdamW steps (the loss at each step, this
stage's gradients at each step, the weights after) and validate's loss, with torch's GPipe and 1F1B schedules and,
with two stages per rank, Interleaved1F1B, LoopedBFS and InterleavedZeroBubble; a tied embedding (Gemma 3: its two
copies' gradients summed); gradient accumulation and clipping; pp=2 x tp=2 with sp, pp=2 x dp_shard=2, pp=2 under
HSDP; expert parallel (ep=2) under pp; LoRA; pretrained loading; Lightning checkpoints resumed across pp, tp, ep and
stages per rank; a loss computed from the logits and every bad option refused on every rank."""

from functools import partial

import pytest
import torch
from lightning_checks import check_checkpoint_resume_across_layouts, check_validate_then_fit
from lm_checks import check_causal_lm_module_split
from pipeline_checks import (
    check_accumulation_around_forward_only_calls,
    check_loss_from_logits_is_refused,
    check_meta_build_stays_tied,
    check_pipeline_accumulation_and_clipping,
    check_pipeline_batch_shapes,
    check_pipeline_loaded_weights,
    check_pipeline_lora,
    check_pipeline_refusals,
)

from lightning_automodel import ParallelDims, parallelize
from lightning_automodel.parallel import decoder_layers
from lightning_automodel.parallel.pipeline import pipeline_problem, split_into_stage, stage_view
from lightning_automodel.planning.simulation import fake_world
from lightning_automodel.testing.exports import assert_exports_as_save_pretrained
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.models import tiny_config, tiny_model
from lightning_automodel.testing.trainer_checks import check_pipeline_trainer_parity

# Gemma 3 with layers of both kinds, placed so that a stage reading the per-layer settings of the rank's other stage
# (rank 0 holds layers 0 and 2) computes the wrong attention
INTERLEAVED = dict(pp=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2)
HSDP = dict(dp_replicate=2)  # x dp_shard=2
MIXED_LAYERS = dict(layer_types=["full_attention", "full_attention", "sliding_attention", "sliding_attention"])


def test_pipeline_two_stages_against_one_process():
    """World 2 at pp=2: Llama with 1F1B over 4 micro-batches, Gemma 3 (tied embeddings) with GPipe and FSDP2's CPU
    offload, and with
    accumulate_grad_batches=2 and gradient_clip_val; pretrained Llama and Gemma 3 loaded stage by stage; CausalLMModule
    unchanged (loss, accuracy, validation metrics), and with a mixture-of-experts model's load-balancing loss over
    every layer and token (Qwen3-MoE, pretrained); two training calls accumulating around a forward-only call;
    batches of other shapes one after another, and a second backward
    of one loss refused; a training_step
    computing its loss from the logits stops at its first step, naming the call and the hook that work; validate
    before fit with two stages per rank (the optimizer steps the sharded weights, not those validate left gathered);
    a loss of
    one's own (cross-entropy + z-loss, pp_loss_fn) on Qwen3. Two stages per rank: Llama with Interleaved1F1B, Gemma 3
    (tied, layers of both kinds) with LoopedBFS, and loaded stage by stage; Gemma 3 built on the meta device and
    initialised stage by stage, its embedding's two copies tied by what parallelize returns."""
    checks = [
        partial(check_pipeline_trainer_parity, 2, "1F1B", microbatches=4),
        partial(check_pipeline_trainer_parity, 2, "GPipe", "gemma3", cpu_offload=True),
        partial(check_pipeline_accumulation_and_clipping, 2),
        partial(check_pipeline_loaded_weights, 2, "llama"),
        partial(check_pipeline_loaded_weights, 2, "gemma3"),
        partial(check_causal_lm_module_split, pp=2, rows="packed"),
        partial(check_causal_lm_module_split, pp=2, family="qwen3_moe"),
        partial(check_accumulation_around_forward_only_calls, 2),
        partial(check_pipeline_batch_shapes, 2),
        partial(check_loss_from_logits_is_refused, 2),
        partial(check_validate_then_fit, 2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2),
        partial(check_pipeline_trainer_parity, 2, "Interleaved1F1B", microbatches=4, stages_per_rank=2),
        partial(check_pipeline_trainer_parity, 2, "1F1B", "qwen3", own_loss=True),
        partial(check_pipeline_trainer_parity, 2, "LoopedBFS", "gemma3", stages_per_rank=2, config=MIXED_LAYERS),
        partial(check_pipeline_loaded_weights, 2, "gemma3", 2, **MIXED_LAYERS),
        partial(check_meta_build_stays_tied, 2),
    ]
    run_checks(2, checks, timeout=400)


def test_pipeline_with_tensor_and_data_parallel(tmp_path):
    """World 4: Llama at pp=2 x tp=2 with sp (1F1B, 4 micro-batches); Qwen3 at pp=2 x dp_shard=2 with activation
    checkpointing; LoRA on every projection with two stages per rank (Interleaved1F1B) at pp=2 x tp=2 with sp;
    checkpoints saved at pp=2 x dp_shard=2 resumed at pp=2 x tp=2, at pp=2 with two stages per rank resumed at pp=4,
    saved under HSDP (dp_replicate=2 x dp_shard=2) resumed at pp=2; refusals before any collective; the checkpoints
    saved at pp=2, with two stages per rank and under HSDP exported shard by shard as save_pretrained writes them.
    Qwen3-MoE with its experts over ep=2 (pp=2 x dp_shard=2), two stages per rank. pp x cp:
    tests/test_context_parallel.py. More layouts: the sweep below."""
    pp2, pp2_tp2, pp4 = dict(pp=2), dict(pp=2, tp=2), dict(pp=4)
    checks = [
        partial(check_pipeline_trainer_parity, 2, "1F1B", microbatches=4, tp=2, sp=True),
        partial(check_pipeline_trainer_parity, 2, "1F1B", "qwen3", activation_checkpointing=True),
        partial(check_pipeline_lora, 2, 2, True, "Interleaved1F1B", 2),
        partial(
            check_checkpoint_resume_across_layouts,
            str(tmp_path),
            [(pp2, pp2_tp2), (INTERLEAVED, pp4), (HSDP, pp2)],
        ),
        partial(check_pipeline_refusals, 2),
        partial(check_pipeline_trainer_parity, 2, "Interleaved1F1B", "qwen3_moe", ep=2, stages_per_rank=2),
    ]
    run_checks(4, checks, timeout=400)
    saved_layouts = ("saved-pp2", "saved-pp2-pp_scheduleInterleaved1F1B-pp_stages_per_rank2", "saved-dp_replicate2")
    for saved in saved_layouts:  # exported shard by shard
        config = tiny_config("gemma3", num_hidden_layers=4)
        assert_exports_as_save_pretrained(tmp_path / saved, config, tmp_path / f"export-{saved}")


@pytest.mark.sweep
def test_pipeline_sweep(tmp_path):
    """World 4: Llama with two stages per rank (Interleaved1F1B) at pp=2 x tp=2 with sp; Llama at pp=2 under HSDP
    (dp_replicate=2); Gemma 3 (tied, its embedding vocabulary-parallel) at pp=2 x tp=2 with sp (GPipe); LoRA at pp=2
    x tp=2 with sp (1F1B); checkpoints saved at pp=1 resumed at pp=2 x tp=2, saved at pp=4 resumed at pp=2 with two
    stages per rank, saved at pp=2 resumed at pp=1, Lightning's single file from one device resumed at pp=2 with two
    stages per rank; Qwen3-MoE's accumulation and clipping at pp=2 x ep=2 (the experts' norm over their own mesh),
    its checkpoint saved at pp=2 x ep=2 resumed at pp=1, and its single file from one device resumed at pp=2 x
    ep=2."""
    pp2_tp2, pp4 = dict(pp=2, tp=2), dict(pp=4)
    checks = [
        partial(check_pipeline_trainer_parity, 2, "Interleaved1F1B", microbatches=4, tp=2, sp=True, stages_per_rank=2),
        partial(check_pipeline_trainer_parity, 2, "GPipe", dp_replicate=2),
        partial(check_pipeline_trainer_parity, 2, "GPipe", "gemma3", tp=2, sp=True),
        partial(check_pipeline_lora, 2, 2, True),
        partial(
            check_checkpoint_resume_across_layouts,
            str(tmp_path),
            [({}, pp2_tp2), (pp4, INTERLEAVED), (dict(pp=2), {}), (None, INTERLEAVED)],
        ),
        partial(check_pipeline_accumulation_and_clipping, 2, "qwen3_moe", ep=2),
        partial(
            check_checkpoint_resume_across_layouts,
            str(tmp_path / "moe"),
            [(dict(pp=2, ep=2), dict(ep=2)), (None, dict(pp=2, ep=2))],
            "qwen3_moe",
        ),
    ]
    run_checks(4, checks, timeout=400)
    assert_exports_as_save_pretrained(tmp_path / "moe" / "saved-pp2-ep2", tiny_config("qwen3_moe"), tmp_path / "moe")


def test_stage_views_share_the_model_and_refuse_shared_parameters():
    """Two stages on one rank are views of one model: their blocks, embedding and head are the model's own modules,
    each view loops over its layers only (with the per-layer settings of those), and the model keeps every layer
    under its name. Parameters beside the blocks, embedding, norm and head (held directly or by another child),
    which both views would hold, refuse virtual stages."""
    model = tiny_model("gemma3", num_hidden_layers=4, **MIXED_LAYERS)
    split_into_stage(model, layers=[0, 2], first=True, last=False)
    whole_config = tiny_model("gemma3", num_hidden_layers=4, **MIXED_LAYERS).model.config
    first, later = (
        stage_view(model, layers=[index], first=index == 0, last=False, config=whole_config) for index in (0, 2)
    )
    assert list(model.model.layers._modules) == ["0", "2"] and model.model.layers is not first.model.layers
    views_layers = [dict(view.model.layers.named_children()) for view in (first, later)]
    assert views_layers == [{"0": model.model.layers._modules["0"]}, {"2": model.model.layers._modules["2"]}]
    assert first.model.embed_tokens is model.model.embed_tokens and later.model.embed_tokens is None
    assert later.model.config.layer_types == ["sliding_attention"], later.model.config.layer_types
    assert model.model.config.layer_types == ["full_attention", "sliding_attention"]
    with_scale = tiny_model(num_hidden_layers=4)
    with_scale.model.register_parameter("scale", torch.nn.Parameter(torch.ones(1)))
    assert pipeline_problem(with_scale, pp=2) is None
    with_scale.model.add_module("extra", torch.nn.Linear(2, 2, bias=False))
    assert "(model.scale, model.extra.weight), which a rank's virtual stages would share" in pipeline_problem(
        with_scale, pp=2, stages_per_rank=2
    )


@pytest.mark.parametrize("reshard_after_forward, expected", [(None, False), (True, True)])
def test_a_stage_keeps_its_weights_gathered_for_the_step(reshard_after_forward, expected):
    """Under pp, FSDP2 frees no unit's gathered weights after its forward unless asked: torch's stage keeps them
    gathered from a micro-batch's backward to the last, and freeing them after each forward would gather them again
    for every micro-batch (benchmarks/pipeline.py: 8.5x the all-gathered bytes at 8 micro-batches). Asked, every unit
    frees them."""
    with torch.device("meta"):
        model = tiny_model(num_hidden_layers=4)
    with fake_world(4, rank=0):
        mesh = ParallelDims(pp=2, dp_shard=2).resolve(4).build_mesh("cpu")
        parallelize(model, mesh, reshard_after_forward=reshard_after_forward)
        units = [*decoder_layers(model), model]
        frees = [unit._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None for unit in units]
    assert frees == [expected] * 3, frees
