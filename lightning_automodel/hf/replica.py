"""Whether a model class computes its logits the same split as whole, found on a shrunk replica in this process.

Pipeline stages, context parallel's sequence split and the chunked loss compute a model's logits otherwise than its own
call; a class that does not compose that way is refused before any collective, with what it computed or raised.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn

from lightning_automodel.hf.shrink import shrunk_config

TOLERANCE = 1e-5  # the largest difference allowed, relative to the largest logit


def replica_problem(
    model: nn.Module,
    *,
    split_logits: Callable[[nn.Module, Tensor], Tensor],
    fails: str,
    differs: str,
    because: str | None = None,
    length: int = 8,
    min_layers: int | None = None,
    text_vocabulary: bool = False,
) -> str | None:
    """Why ``model``'s class cannot be split, or None: ``split_logits(replica, tokens)`` must equal the replica's own
    logits on two rows of ``length`` random tokens. The replica: the class on its config shrunk (with ``min_layers``
    decoder layers at least), random weights seeded 0; its tokens from the text config's vocabulary if
    ``text_vocabulary`` (a multimodal model's). A refusal starts with ``fails`` when the model's code raises, with
    ``differs`` (then ``because``) when the logits differ."""
    try:
        error = _relative_error(
            model, split_logits=split_logits, length=length, min_layers=min_layers, text_vocabulary=text_vocabulary
        )
    except Exception as failure:  # noqa: BLE001 - the model's own code, whatever it raises, refuses the split
        return f"{fails} on a shrunk replica ({type(failure).__name__}: {failure})"
    if not error < TOLERANCE:  # NaN included
        return f"{differs} (relative error {error:.2g} on a shrunk replica){f': {because}' if because else ''}"
    return None


def _relative_error(
    model: nn.Module,
    *,
    split_logits: Callable[[nn.Module, Tensor], Tensor],
    length: int,
    min_layers: int | None,
    text_vocabulary: bool,
) -> float:
    """The largest difference between the replica's logits split and whole, relative to the largest logit."""
    config = shrunk_config(model.config)
    if min_layers is not None:
        config.num_hidden_layers = max(min_layers, config.num_hidden_layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        replica = type(model)(config).eval()
        vocabulary = (config.get_text_config() if text_vocabulary else config).vocab_size
        tokens = torch.randint(0, vocabulary, (2, length))
    untouched = copy.deepcopy(replica)  # split as built: a forward may leave state in a model (caches, counters)
    with torch.no_grad():
        expected = replica(input_ids=tokens, use_cache=False).logits
        actual = split_logits(untouched, tokens)
    return ((actual - expected).abs().max() / expected.abs().max()).item()
