"""The activation estimate of a vision-language model's step (planning.memory.activations), its rows holding images,
against the peak a real CPU step reaches (torch's count of live tensors): LLaVA and Qwen2-VL in one process and at
tp=2 + sp x dp_shard=2 (LLaVA's behind -m sweep), Qwen2-VL at cp=2; the estimate without the images, which misses the
tower's activations, off by more than the tolerance; and a frozen tower's."""

from __future__ import annotations

import contextlib
from functools import partial

import pytest
import torch
import torch.distributed as dist
from vision_memory_checks import IMAGES, ROWS, TOKENS, measured_vision_activation_bytes, memory_vision_model

from lightning_automodel import ParallelDims, plan_report
from lightning_automodel.planning import Hardware, SearchSpace, StepOptions, choose_layout
from lightning_automodel.planning.memory.activations import activation_bytes
from lightning_automodel.planning.search.layouts import tensor_budget
from lightning_automodel.testing.harness import free_port, run_checks
from lightning_automodel.testing.models import tiny_model

TOLERANCE = 0.02  # the issue asks for 5%; measured: to the byte on every layout here (docs/planning.md)
ONE_PROCESS = [("llava", dict(activation_checkpointing=False)), ("qwen2_vl", dict(activation_checkpointing="full"))]
DISTRIBUTED = {"llava": dict(sp=True), "qwen2_vl": dict(sp=True, activation_checkpointing="selective")}
TP_SP_FSDP = ParallelDims(tp=2, dp_shard=2)
CP_FSDP = ParallelDims(cp=2, dp_shard=2)


def _estimate(family: str, dims: ParallelDims, **options) -> int:
    model = memory_vision_model(family, meta=True)
    return activation_bytes(model, dims, micro_batch=ROWS, seq_len=TOKENS, **{**IMAGES[family], **options})


@contextlib.contextmanager
def _one_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family, options", ONE_PROCESS)
def test_the_estimate_counts_the_tower_and_the_image_tokens_in_one_process(family, options):
    dims = ParallelDims().resolve(1)
    estimate = _estimate(family, dims, **options)
    text_alone = _estimate(family, dims, **options, images_per_row=0)
    with _one_process_group():
        measured = measured_vision_activation_bytes(family, ParallelDims(), **options)
    assert estimate == pytest.approx(measured, rel=TOLERANCE), (estimate, measured)
    assert abs(text_alone / measured - 1) > TOLERANCE, (text_alone, measured)  # the images are what it counts


def test_the_estimate_counts_the_tower_and_the_image_tokens_at_tp_sp_and_cp_with_fsdp():
    """Qwen2-VL at tp=2 + sp x dp_shard=2 with selective checkpointing, and at cp=2 x dp_shard=2."""
    cases = [("qwen2_vl", TP_SP_FSDP, DISTRIBUTED["qwen2_vl"]), ("qwen2_vl", CP_FSDP, {})]
    _assert_estimates_match_on_four_ranks(cases)


@pytest.mark.sweep
def test_the_estimate_counts_the_tower_and_the_image_tokens_of_llava_at_tp_sp_with_fsdp():
    """LLaVA at tp=2 + sp x dp_shard=2 (a launch of its own: the suite keeps Qwen2-VL's)."""
    _assert_estimates_match_on_four_ranks([("llava", TP_SP_FSDP, DISTRIBUTED["llava"])])


def _assert_estimates_match_on_four_ranks(cases: list[tuple[str, ParallelDims, dict]]) -> None:
    """Each case's estimate is every rank's measured peak within the tolerance; the text alone's is not."""
    checks = [partial(measured_vision_activation_bytes, family, dims, **options) for family, dims, options in cases]
    measured = run_checks(4, checks, timeout=600)
    for (family, dims, options), per_rank in zip(cases, measured.values(), strict=True):
        estimate = _estimate(family, dims.resolve(4), **options)
        text_alone = _estimate(family, dims.resolve(4), **options, images_per_row=0)
        for rank, peak in enumerate(per_rank):
            assert estimate == pytest.approx(peak, rel=TOLERANCE), (family, rank, estimate, peak)
            assert abs(text_alone / peak - 1) > TOLERANCE, (family, rank, text_alone, peak)


def test_a_frozen_tower_holds_no_gradient_optimizer_state_or_saved_activations():
    """``freeze=["vision_tower"]`` (the strategy's, a step option of the planner): the report's state per rank counts
    no gradient or AdamW state for the tower, and the step keeps none of its activations for backward, as a real
    step does."""
    dims, frozen = ParallelDims().resolve(1), dict(freeze=("vision_tower",))
    report = plan_report(memory_vision_model("llava", meta=True), dims, step=StepOptions(**frozen))
    tower_bytes = 4 * report.tower.parts["model.vision_tower"]  # fp32, one process
    assert report.trainable_bytes_per_rank == report.parameter_bytes_per_rank - tower_bytes
    assert report.training_bytes_per_rank == 4 * report.parameter_bytes_per_rank - 3 * tower_bytes
    assert "frozen, without either" in str(report)
    estimate = _estimate("llava", dims, **frozen)
    with _one_process_group():
        measured = measured_vision_activation_bytes("llava", ParallelDims(), **frozen)
    assert estimate == pytest.approx(measured, rel=TOLERANCE), (estimate, measured)
    assert estimate < 0.9 * _estimate("llava", dims)


def test_layout_auto_chooses_with_the_images_counted():
    """At a GPU memory that two data-parallel ranks' step without checkpointing fits as text alone and not with its
    images, the search picks no checkpointing for the text and recomputes for the images, naming them."""
    model, space = memory_vision_model("llava", meta=True), SearchSpace(tp=1, pp=1)
    search = dict(batch_shape=(ROWS, TOKENS), space=space)
    as_text = dict(step=StepOptions(images_per_row=0), **search)
    roomy = choose_layout(model, 2, hardware=Hardware(64, gpus_per_node=2), **as_text)
    assert roomy.candidate.checkpointing == "off" and roomy.candidate.dims.dp_shard == 2
    hardware = Hardware(1.01 * roomy.outcome.memory_bytes / tensor_budget(1), gpus_per_node=2)  # just fits
    text = choose_layout(model, 2, hardware=hardware, **as_text)
    images = choose_layout(model, 2, hardware=hardware, step=StepOptions(**IMAGES["llava"]), **search)
    assert (text.candidate.name, text.candidate.checkpointing) == ("tp=1 cp=1 dp_shard=2", "off")
    assert images.candidate.name == "tp=1 cp=1 dp_shard=2" and images.candidate.checkpointing != "off"
    assert "2 images a row of 64 tokens each" in str(images)


def test_what_a_step_with_images_cannot_run_is_refused_before_any_step():
    """Rows too short for their images, images for a text model or of another size than the config fixes, and the
    chunked loss (no image inputs)."""
    step = dict(micro_batch=ROWS, seq_len=TOKENS)
    refusals = [
        ("llava", ParallelDims(), dict(seq_len=2 * 64 + 1, images_per_row=2), "cannot hold 2 images a row of 64"),
        ("llava", ParallelDims(), dict(image_tokens=16), "images are 64 tokens each"),
        ("llava", ParallelDims(), dict(loss_chunks=2), "the chunked loss takes no image inputs"),
    ]
    for family, dims, options, message in refusals:
        with pytest.raises(ValueError, match=message):
            activation_bytes(memory_vision_model(family, meta=True), dims.resolve(2), **{**step, **options})
    with pytest.raises(ValueError, match="takes no images the planner can build"):
        with torch.device("meta"):
            activation_bytes(tiny_model(), ParallelDims().resolve(1), images_per_row=1, **step)
