"""Whether a model class computes its logits the same split as whole, found on a shrunk replica in this process.

Pipeline stages, context parallel's sequence split and the chunked loss compute a model's logits otherwise than its own
call; a class that does not compose that way is refused before any collective, with what it computed or raised. A
replica that cannot be built is this check's own failure, raised as a :class:`ReplicaError`, never a refusal of the
model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from lightning_automodel.hf.shrink import shrunk_config
from lightning_automodel.hf.vision.tiny import with_tiny_images

TOLERANCE = 1e-5  # the largest difference allowed, relative to the largest logit


class ReplicaError(RuntimeError):
    """A shrunk replica of the model could not be built: a defect of the check that needed it, not of the model."""


def shrunk_replica(model: nn.Module, *, min_layers: int | None = None) -> tuple[nn.Module, int]:
    """``model``'s class on its config shrunk (:func:`~lightning_automodel.hf.shrink.shrunk_config`), with
    ``min_layers`` decoder layers at least, with random weights from the current random state, in eval mode; and the
    size of its text vocabulary, the tokens a check may feed it. Raises :class:`ReplicaError` when it cannot be
    built."""
    try:
        config = shrunk_config(model.config)
        if isinstance(getattr(config, "vision_config", None), PretrainedConfig):  # its images made tiny too
            config = with_tiny_images(type(config), config.to_dict(), model_type=config.model_type)
        text = config.get_text_config()  # a multimodal config keeps its decoder's layers and vocabulary there
        if min_layers is not None and text.num_hidden_layers < min_layers:
            text.num_hidden_layers = min_layers
        return type(model)(config).eval(), text.vocab_size
    except Exception as failure:  # noqa: BLE001 - whatever the config or the class raises, the check failed
        raise ReplicaError(
            f"Internal error of lightning-automodel: the shrunk replica of {type(model).__name__} (its config made"
            f" tiny by lightning_automodel.hf.shrink) could not be built ({type(failure).__name__}: {failure}), so"
            " the check that runs on it could not run. This is a defect of the check, not of the model: please"
            " report it with the model's config."
        ) from failure


def replica_problem(
    model: nn.Module,
    *,
    split_logits: Callable[[nn.Module, Tensor], Tensor],
    fails: str,
    differs: str,
    because: str | None = None,
    length: int = 8,
    min_layers: int | None = None,
) -> str | None:
    """Why ``model``'s class cannot be split, or None: ``split_logits(replica, tokens)`` must equal the replica's own
    logits on two rows of ``length`` random tokens. The replica: the class on its config shrunk (with ``min_layers``
    decoder layers at least), random weights seeded 0; its tokens from the text config's vocabulary (a multimodal
    model's config has none of its own). A refusal starts with ``fails`` when the model's code raises, with
    ``differs`` (then ``because``) when the logits differ. A replica that cannot be built raises
    :class:`ReplicaError`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        replica, vocabulary = shrunk_replica(model, min_layers=min_layers)
        tokens = torch.randint(0, vocabulary, (2, length))
        try:
            error = _relative_error(replica, tokens, split_logits=split_logits)
        except Exception as failure:  # noqa: BLE001 - the model's own code, whatever it raises, refuses the split
            return f"{fails} on a shrunk replica ({type(failure).__name__}: {failure})"
    if not error < TOLERANCE:  # NaN included
        return f"{differs} (relative error {error:.2g} on a shrunk replica){f': {because}' if because else ''}"
    return None


def _relative_error(
    replica: nn.Module, tokens: Tensor, *, split_logits: Callable[[nn.Module, Tensor], Tensor]
) -> float:
    """The largest difference between the replica's logits split and whole, relative to the largest logit."""
    untouched = copy.deepcopy(replica)  # split as built: a forward may leave state in a model (caches, counters)
    with torch.no_grad():
        expected = replica(input_ids=tokens, use_cache=False).logits
        actual = split_logits(untouched, tokens)
    return ((actual - expected).abs().max() / expected.abs().max()).item()
