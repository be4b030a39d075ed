"""The models pipeline parallel refuses, found without any collective: what their structure lacks, and classes whose
logits split into stages differ from their logits whole (checked on a shrunk replica)."""

from __future__ import annotations

import copy

from torch import Tensor, nn
from transformers import PreTrainedModel

from lightning_automodel.hf.decoder_layers import named_language_layers, named_multimodal_parts
from lightning_automodel.hf.replica import replica_problem
from lightning_automodel.parallel.experts.load_balancing_loss import balancing_problem
from lightning_automodel.parallel.pipeline.images import images_problem
from lightning_automodel.parallel.pipeline.options import stage_layers
from lightning_automodel.parallel.pipeline.stage_split import (
    FINAL_NORM_NAMES,
    blocks_owner,
    final_norm_name,
    split_into_stage,
)


def pipeline_problem(model: nn.Module, *, pp: int, stages_per_rank: int = 1) -> str | None:
    """Why ``model`` cannot be split into ``pp`` x ``stages_per_rank`` stages (None if it can), found without any
    collective."""
    if not isinstance(model, PreTrainedModel):
        return f"{type(model).__name__} is not a Hugging Face model; pipeline parallel splits those only"
    if getattr(model.config, "is_encoder_decoder", False):
        return f"{type(model).__name__} is an encoder-decoder model; pipeline parallel splits decoder-only models"
    if model.get_output_embeddings() is None or model.base_model is model:
        return f"{type(model).__name__} has no language-model head over a base model to split"
    lists = {name.rsplit(".", 1)[0] for name, _ in named_language_layers(model)}
    if len(lists) != 1:
        return (
            f"{type(model).__name__} has {len(lists)} lists of blocks ({sorted(lists)}); pipeline parallel splits one"
        )
    owner, _ = blocks_owner(model)
    if final_norm_name(owner) is None:
        return (
            f"{type(model).__name__} has no final norm beside its blocks (one named one of {FINAL_NORM_NAMES}, or the"
            " one child whose class is a norm)"
        )
    if (problem := balancing_problem(model) or images_problem(model)) is not None:
        return problem
    layers, stages = len(named_language_layers(model)), pp * stages_per_rank
    if layers < stages:
        return (
            f"{type(model).__name__} has {layers} decoder layers, fewer than the {stages} stages (pp={pp} x"
            f" {stages_per_rank} per rank)"
        )
    if stages_per_rank > 1 and (shared := _parameters_beside_blocks(model)):
        return (
            f"{type(model).__name__} holds parameters beside its blocks, embedding, final norm and head"
            f" ({', '.join(shared)}), which a rank's virtual stages would share: use pp_stages_per_rank=1"
        )
    return None


def _parameters_beside_blocks(model: nn.Module) -> list[str]:
    """Parameters of the model outside its blocks, input embedding, final norm, head and vision parts (the first
    stage's alone), by name: every stage view of a rank would hold them."""
    owner, attribute = blocks_owner(model)
    parts = [getattr(owner, attribute), model.get_input_embeddings(), model.get_output_embeddings()]
    parts += [part for _, part in named_multimodal_parts(model)]
    parts.append(getattr(owner, final_norm_name(owner)))
    placed = {id(param) for part in parts if part is not None for param in part.parameters()}
    return [name for name, param in model.named_parameters() if id(param) not in placed]


def stage_split_problem(model: nn.Module) -> str | None:
    """Whether the model's class computes the same logits split in two stages as whole, on a shrunk replica of it
    (its config made tiny, at least two decoder layers, random weights), in this process; None if it does. A class
    whose replica cannot be split is refused with what it raised (a replica that cannot be built raises
    :class:`~lightning_automodel.hf.replica.ReplicaError`: the check failed, not the model)."""
    name = type(model).__name__
    return replica_problem(
        model,
        split_logits=_two_stage_logits,
        fails=f"{name} fails split into stages",
        differs=f"{name} computes other logits split into stages than whole",
        because="its forward transforms inputs_embeds or reads per-layer settings it does not hold",
        min_layers=2,
    )


def _two_stage_logits(replica: nn.Module, tokens: Tensor) -> Tensor:
    """The logits of two copies of ``replica``, one its first stage and one its last, one after the other."""
    first, last = copy.deepcopy(replica), copy.deepcopy(replica)
    layers = stage_layers(len(named_language_layers(replica)), 2)
    split_into_stage(first, layers=layers[0], first=True, last=False)
    split_into_stage(last, layers=layers[1], first=False, last=True)
    hidden = first.base_model(input_ids=tokens, use_cache=False).last_hidden_state
    return last(inputs_embeds=hidden, use_cache=False).logits
