"""What a model can take, checked before it is asked to: token ids within its vocabulary, rows within its positions.

Past them an embedding lookup fails on CPU with a bare ``IndexError`` and, on a GPU, with a device-side assert
that kills the job without naming the id, the limit or the data. ``CausalLMModule`` checks the tokenizer and the
data module's ``seq_len`` against the model's config when it builds the model (every rank holds the same
tokenizer, config and ``seq_len``, so every rank refuses, before any collective), and each batch at the start of
its step (which only the rank holding a bad batch can see).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_automodel.data.rows import IGNORE_INDEX


def check_tokenizer(tokenizer: Any, config: Any, *, pretrained: str | None = None) -> None:
    """Refuse a tokenizer with more tokens than the model has embeddings; ``pretrained`` is the model's directory,
    whose vocabulary its checkpoint fixes."""
    tokens, vocab_size = len(tokenizer), config.get_text_config().vocab_size
    if tokens <= vocab_size:
        return
    name = repr(tokenizer.name_or_path) if tokenizer.name_or_path else "(built in code)"
    fix = (
        f"Use the model's own tokenizer (data tokenizer: {pretrained}), or one with at most {vocab_size:,} tokens."
        if pretrained is not None
        else f"Set vocab_size in the model's config (model.config.vocab_size) to at least {tokens}, or leave it"
        " out: it is then the tokenizer's, rounded up to a multiple of 64."
    )
    raise ValueError(
        f"The tokenizer {name} has {tokens:,} tokens but the model's vocab_size is {vocab_size:,}: ids from"
        f" {vocab_size:,} up have no embedding (on a GPU, a device-side assert with no message). {fix}"
    )


def check_seq_len(seq_len: int, config: Any) -> None:
    """Refuse rows longer than the model's ``max_position_embeddings``; a model without one takes any length."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if limit is None or seq_len <= limit:
        return
    raise ValueError(
        f"seq_len={seq_len} is longer than the model's max_position_embeddings={limit}: positions from {limit} up"
        " are past what the model was built for (learned position embeddings fail, on a GPU with a device-side"
        f" assert). Set the data's seq_len to at most {limit}, or raise max_position_embeddings in the model's"
        " config (model.config.max_position_embeddings; for a pretrained model only where its position encoding"
        " extends, e.g. RoPE with rope_scaling)."
    )


def check_batch(batch: Mapping[str, Tensor], config: Any) -> None:
    """Refuse a batch whose ``input_ids`` (or ``labels``, other than -100) fall outside the model's vocabulary, or
    whose rows are longer than its positions, naming the first offending element.

    It costs a comparison over the ids and, on a GPU, one wait for the device to read its result: Lightning's own
    progress bar reads the logged metrics back at every step already.
    """
    text_config = config.get_text_config()
    input_ids = batch["input_ids"]
    check_seq_len(input_ids.shape[-1], config)
    _check_ids(input_ids, name="input_ids", vocab_size=text_config.vocab_size)
    if batch.get("labels") is not None:
        _check_ids(batch["labels"], name="labels", vocab_size=text_config.vocab_size, ignored=IGNORE_INDEX)


def _check_ids(ids: Tensor, *, name: str, vocab_size: int, ignored: int | None = None) -> None:
    outside = (ids < 0) | (ids >= vocab_size)
    if ignored is not None:
        outside &= ids != ignored
    if not outside.any():
        return
    where = tuple(outside.nonzero()[0].tolist())
    allowed = f"0..{vocab_size - 1}" + (f" or {ignored}" if ignored is not None else "")
    raise ValueError(
        f"A batch's {name}{list(where)} is {ids[where].item()}, outside the model's vocabulary ({allowed};"
        f" vocab_size={vocab_size}): on a GPU, a device-side assert with no message. The data was tokenized for"
        " another model: tokenize it with this model's tokenizer, or give the model a vocab_size that covers it."
    )
