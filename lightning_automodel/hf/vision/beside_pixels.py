"""What some vision-language models take with an image beside its pixels, built from the config and the forward's
signature (:func:`~lightning_automodel.hf.vision.image_inputs.image_inputs` adds them):

* images whose placeholders no token id marks: a mask marks them (Kosmos-2's ``image_embeds_position_mask``, as many
  as its resampler's ``latent_query_num`` queries), or they take none (zero placeholders), their features read
  beside the text: by cross-attention (BLIP's text decoder; Idefics', which takes ``image_attention_mask``: which
  tokens see which image) or as a prefix of the sequence (GIT, whose logits then count the image's tokens first);
* a Q-Former's text input (InstructBLIP's ``qformer_input_ids``: the instruction its queries read, one row an image).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

QFORMER_TOKENS = 4  # the length of a Q-Former's instruction
# Fields that name an image's (or a video's) placeholder token: a config with none of them marks no placeholder by id.
PLACEHOLDER_FIELDS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")


def unmarked_token_count(model: nn.Module) -> int | None:
    """Placeholders per image of a model whose config names no placeholder token: ``latent_query_num`` where a mask
    marks them, 0 where its config has no placeholder field at all (the features are read beside the text); None
    where the config names one but leaves it unset."""
    config = model.config
    if "image_embeds_position_mask" in forward_arguments(model):
        return getattr(config, "latent_query_num", None)
    if any(hasattr(config, name) for name in PLACEHOLDER_FIELDS):
        return None
    return 0


def beside_pixels(
    model: nn.Module, *, placeholders: torch.Tensor, starts: list[int], images: int
) -> dict[str, torch.Tensor]:
    """The inputs ``model``'s forward takes with its images beside the pixels: ``placeholders`` (rows, tokens) marks
    each image's placeholders, ``starts`` the position of each image of a row (its first placeholder), ``images``
    counts them all (a Q-Former's instruction has one row each)."""
    accepted = forward_arguments(model)
    found = {}
    if "image_embeds_position_mask" in accepted:
        found["image_embeds_position_mask"] = placeholders.long()
    if "image_attention_mask" in accepted:  # (rows, tokens, images): a token sees the images up to it
        seen = torch.zeros(*placeholders.shape, len(starts), dtype=torch.long)
        for image, start in enumerate(starts):
            seen[:, start:, image] = 1
        found["image_attention_mask"] = seen
    if "qformer_input_ids" in accepted:
        vocab = model.config.qformer_config.vocab_size
        generator = torch.Generator().manual_seed(0)
        found["qformer_input_ids"] = torch.randint(1, vocab, (images, QFORMER_TOKENS), generator=generator)
    return found


def prefix_logits(logits: torch.Tensor, *, tokens: int) -> torch.Tensor:
    """The logits of a row's ``tokens`` text tokens, where the model also gave logits for an image's features it
    placed before them (GIT): the last ``tokens``."""
    return logits[:, -tokens:] if logits.shape[1] > tokens else logits


def forward_arguments(model: nn.Module) -> set[str]:
    """The argument names of ``model``'s forward (none where its signature cannot be read)."""
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()
