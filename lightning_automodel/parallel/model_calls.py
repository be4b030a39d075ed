"""Models whose call the strategy takes over to split its batch (pipeline stages, context-parallel ranks): their
class gains a forward of ours (a class made for each model class, as FSDP2 makes its own), and what it returns."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from lightning_automodel.hf.peft import unwrap_peft


@dataclasses.dataclass
class ParallelCausalLMOutput(CausalLMOutputWithPast):
    """``loss``: this rank's share of the global token mean (the mean over the data-parallel ranks, cp included, is
    the global batch's loss), and the totals it came from: ``loss_sum`` (summed next-token cross-entropy),
    ``num_tokens`` (scored tokens), ``num_hits`` (tokens whose target the logits rank first), of this rank's batch
    (pipeline: on every rank) or of this rank's share of the sequences (context parallel). ``logits``: what this
    rank computed (pipeline: the last stage's, when not training; None elsewhere); ``aux_loss``: the load-balancing
    loss of a mixture-of-experts model adding one (``output_router_logits``), over the global batch, which ``loss``
    includes with the model's weight."""

    loss_sum: Tensor | None = None
    num_tokens: Tensor | None = None
    num_hits: Tensor | None = None
    aux_loss: Tensor | None = None  # a mixture-of-experts model's load-balancing loss over the global batch


def take_over_calls(model: nn.Module, forward: type[nn.Module], *, prefix: str, **attributes: Any) -> None:
    """Make ``model``'s class a subclass of ``forward`` (whose ``forward`` runs first) and of its own, named
    ``prefix`` + its name, and give the model ``attributes`` (what that forward reads)."""
    model.__class__ = type(f"{prefix}{type(model).__name__}", (forward, type(model)), {})
    for name, value in attributes.items():
        setattr(model, name, value)


def taken_over(model: nn.Module, forward: type[nn.Module], attribute: str) -> Any:
    """``attribute`` of a model whose calls :func:`take_over_calls` gave to ``forward`` (a PEFT model's base), or
    None."""
    hf_model = unwrap_peft(model)
    return getattr(hf_model, attribute, None) if isinstance(hf_model, forward) else None


def training_call(model: nn.Module, labels: Tensor | None, *, why: str, instead: str = "") -> bool:
    """Whether this call trains (gradients on, the model in training mode); one without labels is refused: ``why``
    says why the logits cannot make the loss outside the call, ``instead`` what else works."""
    training = torch.is_grad_enabled() and model.training
    if training and labels is None:
        raise ValueError(
            f"{why}: call the model with labels, as `self.model(input_ids=..., labels=...).loss` (or"
            f" `self.model(**batch).loss`), and return that loss from training_step.{instead}"
        )
    return training


def own_forward(model: nn.Module, forward: type[nn.Module]) -> Any:
    """The forward of ``model``'s own class, past the ``forward`` :func:`take_over_calls` put before it."""
    return super(forward, model).forward


def build_no_cache(model: nn.Module) -> None:
    """Make ``model``'s calls build no key/value cache unless asked (``use_cache=False`` in its config, and in its
    text model's for a multimodal one): training and a loss never read one, and recomputation (activation
    checkpointing) or compilation (dynamo guards on the cache's state, layer by layer) suffer from one. ``generate``
    asks for its cache itself (its generation config's ``use_cache``). Saved with the model's config."""
    config = getattr(model, "config", None)
    text_config = getattr(config, "get_text_config", None)
    for each in (config, text_config(decoder=True) if text_config is not None else None):
        if hasattr(each, "use_cache"):
            each.use_cache = False
