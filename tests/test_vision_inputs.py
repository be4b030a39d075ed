"""The image-input builder's kinds beyond placeholder tokens and fixed-size towers (hf/vision/beside_pixels.py,
hf/vision/patch_sequences.py), in one process: each kind's tiny model runs on its rows, its images change its logits
and its tower trains; and what the planner does with them (a derived plan following a step with images, a tower kept
whole without the Hugging Face plan's entries for it)."""

import copy

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel
from transformers import AutoModelForImageTextToText

from lightning_automodel.hf.shrink import VOCAB
from lightning_automodel.hf.vision.image_inputs import image_token, image_token_count
from lightning_automodel.hf.vision.tiny import SPECIAL_IDS_FROM, tiny_image_text_config
from lightning_automodel.testing.coverage_report.kinds import NoImageInputs, image_loss, image_rows

# One type of each kind: the inputs beside its pixels, or its layout of them.
KINDS = {
    "blip-2": {"pixel_values"},  # Q-Former queries at an unset placeholder the tiny config sets
    "instructblip": {"pixel_values", "qformer_input_ids"},  # ... and the Q-Former's instruction
    "kosmos-2": {"pixel_values", "image_embeds_position_mask"},  # placeholders a mask marks
    "git": {"pixel_values"},  # no placeholder: the image's tokens before the text
    "blip": {"pixel_values"},  # no placeholder: a cross-attending text decoder
    "lfm2_vl": {"pixel_values", "spatial_shapes", "pixel_attention_mask"},  # NaFlex
    "gemma4": {"pixel_values", "image_position_ids", "mm_token_type_ids"},  # patches at positions, optional tower
    "fuyu": {"pixel_values"},  # no tower: a stream of patches
    "kimi_k25": {"pixel_values", "image_grid_thw"},  # merged patches, each an image of its own
}


def tiny(model_type: str, **changes) -> torch.nn.Module:
    config = tiny_image_text_config(model_type)
    for name, value in changes.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config)


@pytest.mark.parametrize("model_type", list(KINDS))
def test_each_kind_runs_on_its_rows_and_its_tower_trains(model_type):
    """The coverage rows (each half of the batch alone gives its logits, other pixels other logits: asserted in
    image_rows) and one step whose gradients reach every part of the model: the tower, the projector (and the
    Q-Former), the language model."""
    model = tiny(model_type)
    rows = image_rows(model)
    assert set(rows) - {"input_ids", "labels"} == KINDS[model_type], sorted(rows)
    loss, logits = image_loss(model, rows)
    assert logits.shape[:2] == rows["input_ids"].shape
    loss.backward()
    base = model.base_model
    parts = {name: part for name, part in base.named_children() if any(True for _ in part.parameters())}
    silent = [name for name, part in parts.items() if not any(_trained(p) for p in part.parameters())]
    assert len(parts) > 1 and not silent, (sorted(parts), silent)


def _trained(parameter: torch.nn.Parameter) -> bool:
    return parameter.grad is not None and bool(parameter.grad.abs().sum() > 0)


def test_unset_placeholders_and_queries_are_made_tiny():
    """BLIP-2's image_token_index (None by default, a checkpoint's sets it) gets a free id of its own, and its
    Q-Former's queries are as few as the placeholders an image gets."""
    config = tiny_image_text_config("blip-2")
    assert SPECIAL_IDS_FROM <= config.image_token_index < VOCAB
    assert config.num_query_tokens == 4 == image_token_count(tiny("blip-2"))
    assert image_token(tiny_image_text_config("instructblipvideo")) is not None  # its video placeholder
    assert tiny_image_text_config("gemma4").vision_config is not None  # an optional tower, built


def test_images_the_step_never_sees_are_refused():
    """Idefics' gated cross-attention opens at zero (its default): its logits ignore the images, and with its gates
    frozen its gradients too, so the rows built for it would measure nothing of them. Trainable gates read them in
    their gradients; the tiny config opens them, as a checkpoint has them, so that the logits read them too."""
    model = tiny("idefics", alpha_initializer="zeros")
    image_rows(model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("alpha" not in name and parameter.requires_grad)
    with pytest.raises(NoImageInputs, match="do not change with the pixels"):
        image_rows(model)
    image_rows(tiny("idefics"))


def test_the_derived_plan_follows_a_step_with_images():
    """GIT counts its tower's blocks among its decoder blocks, which a text-only step never runs; BLIP-2 takes no
    step without pixel_values: the derived plan follows a step with images for both."""
    from lightning_automodel.parallel.tensor.plans.derived import derived_plan

    for model_type, projection in [
        ("git", "git.image_encoder.vision_model.encoder.layers.*.self_attn.q_proj"),
        ("blip-2", "language_model.model.decoder.layers.*.self_attn.q_proj"),
    ]:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(tiny_image_text_config(model_type))
        plan = derived_plan(model)
        assert isinstance(plan.get(projection), ColwiseParallel), (model_type, sorted(plan))


def test_a_tower_kept_whole_keeps_no_entry_of_the_language_models_plan():
    """Gemma 4's Hugging Face plan covers its tower; a tower kept whole (no probe step ran it) must not be split by
    it: its per-head norms would miss their gradients' sum over tp."""
    from lightning_automodel.parallel.tensor.plans.selection import PlanChoice
    from lightning_automodel.parallel.tensor.plans.tower import kept_whole_for

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(copy.deepcopy(tiny_image_text_config("gemma4")))
    tower = "model.vision_tower.encoder.layers.*.self_attn.q_proj.linear"
    text = "model.language_model.layers.*.self_attn.q_proj"
    choice = PlanChoice({tower: ColwiseParallel(), text: ColwiseParallel()}, "Hugging Face plan", "test")
    kept = kept_whole_for(model, choice, reason="no probe step ran the model's images")
    assert set(kept.plan) == {text} and "model.vision_tower" in kept.kept_whole


def test_a_pipeline_refuses_images_no_placeholder_marks():
    from lightning_automodel.parallel.pipeline.images import StageImages

    model = tiny("git")
    rows = image_rows(model)
    with pytest.raises(ValueError, match="marks its images by no token"):
        StageImages(model)._image_rows(rows["input_ids"], {"pixel_values": rows["pixel_values"]})
