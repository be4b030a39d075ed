"""The probe's answers to value questions on the meta device (parallel/probe/meta_values.py): from the
values of tensors computed from CPU tensors alone, else zero; and the vision-language steps they let run on meta."""

import pytest
import torch
import transformers

from lightning_automodel.hf.decoder_layers import named_decoder_layers, named_multimodal_parts
from lightning_automodel.hf.vision.tiny import tiny_image_text_config
from lightning_automodel.parallel.probe.meta_values import AnswerDataQuestions
from lightning_automodel.parallel.probe.step import probe, sequence_lengths

IMAGE = 9


def test_a_mask_of_token_ids_selects_as_many_rows_as_it_sets():
    ids = torch.tensor([[1, IMAGE, IMAGE, 2], [IMAGE, 3, 4, 5]])
    with AnswerDataQuestions():
        hidden = torch.empty(2, 4, 8, device="meta")
        mask = (ids == IMAGE).to(hidden.device)
        assert hidden[mask].shape == (3, 8)
        hidden[mask] = torch.empty(3, 8, device="meta")
        assert mask.sum().item() == 3 and bool(mask.any())
        assert mask.sum(-1).tolist() == [2, 1]
        assert (ids == IMAGE).unsqueeze(-1).expand(2, 4, 8).to("meta")[..., 0].nonzero().shape == (3, 2)
        positions = torch.arange(4, device="meta")
        assert (positions * 2).tolist() == [0, 2, 4, 6]


def test_questions_of_unknown_values_are_answered_with_zero():
    with AnswerDataQuestions():
        hidden = torch.empty(2, 4, 8, device="meta")
        unknown = torch.empty(2, 4, dtype=torch.bool, device="meta")
        assert hidden[unknown].shape == (8, 8)  # every element taken as set
        assert unknown.sum().item() == 0 and not bool(unknown.any())
        assert unknown.long().sum(-1).tolist() == [0, 0]
        assert hidden.to("cpu").device.type == "meta"  # activations stay on meta
        known = torch.tensor([1, 2]).to("meta")
        known.add_(torch.empty(2, dtype=torch.long, device="meta"))  # written with unknown values: forgotten
        assert known.sum().item() == 0


@pytest.mark.parametrize(
    "model_type",
    [
        "qwen3_vl",  # its deepstack features added at hidden[image_mask]
        "idefics3",  # pixel_values[real_images] and features split by the real images a row holds
        "mistral3",  # image_sizes read with .tolist()
        "smolvlm",  # embeddings copied to the token ids' device
    ],
)
def test_the_step_with_images_runs_every_tower_block_on_meta(model_type):
    """These steps asked their meta tensors for values (a mask of placeholders, image sizes) and failed: their towers
    were kept whole on every tp rank. Now the probe runs them and calls every block of the tower."""
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(tiny_image_text_config(model_type))
    trace = probe(model, tokens=sequence_lengths(model, tp=2, images=True)[0], images=True)
    prefixes = tuple(f"{name}." for name, _ in named_multimodal_parts(model))
    blocks = [name for name, _ in named_decoder_layers(model) if name.startswith(prefixes)]
    assert blocks and all(trace.called(name) for name in blocks), [name for name in blocks if not trace.called(name)]
