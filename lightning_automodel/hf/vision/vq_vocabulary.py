"""The vocabulary map of a model that reads an image as the tokens of its VQ-GAN's codes (Chameleon, Emu3): which
token id each code is, by the token's name in the checkpoint's tokenizer. The config class leaves the map None (the
checkpoint's config holds the tokenizer's), and each model's code finds the codes by its own naming, so a tiny
config's map is written in that naming: the one thing here known by model type, because only the model's code
says it.

The codes take special ids, above the text's (Chameleon's head never predicts a code: its logits are the lowest
float, and a text of codes would have an infinite loss)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# A tiny VQ-GAN's codebook entries, and the side of the image it is built for.
CODES = 16
# A VQ-GAN's sizes that the generic rules do not know: its codebook, its convolutions' channels (normalised in
# groups of 32), the image side it is built for.
VQ_SIZES = {"num_embeddings": CODES, "codebook_size": CODES, "base_channels": 32, "latent_channels": 32}


def _chameleon_name(code: int) -> str:
    """Chameleon's: "IMGIMG", the code's digits as the letters A-J, "Z"."""
    return "IMGIMG" + "".join(chr(ord("A") + int(digit)) for digit in str(code)) + "Z"


def _emu3_name(code: int) -> str:
    return f"<|visual token {code:06d}|>"


# By model type: the code's token name, and the other tokens its code looks up by name.
_NAMING: dict[str, tuple[Callable[[int], str], tuple[str, ...]]] = {
    "chameleon": (_chameleon_name, ()),
    "emu3": (_emu3_name, ("<|extra_200|>",)),  # Emu3's end of each row of codes
}


def vocabulary_map(model_type: str, *, image_token_id: int, free_ids: list[int]) -> dict[str, Any]:
    """``{"vocabulary_map": ...}`` for a type whose code reads one (empty for any other): the image placeholder
    ``"<image>"`` at ``image_token_id``, the type's other named tokens, then its codes, at ``free_ids`` (special ids
    no other token takes), in order."""
    if model_type not in _NAMING:
        return {}
    name_of, named = _NAMING[model_type]
    names = [*named, *(name_of(code) for code in range(CODES))]
    if len(free_ids) < len(names):
        raise ValueError(f"{model_type}: {len(names)} named tokens and codes, only {len(free_ids)} free ids")
    return {"vocabulary_map": {"<image>": image_token_id, **dict(zip(names, free_ids, strict=False))}}
