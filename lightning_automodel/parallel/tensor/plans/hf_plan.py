"""The model's own Hugging Face tensor-parallel plan, its style strings translated to torch ``ParallelStyle`` objects.

Strings needing Hugging Face's own machinery (expert-parallel routing, local-tensor modules) are refused with the
module they were meant for, so a plan is never applied half-understood.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from lightning_automodel.parallel.tensor.plans.patterns import pattern_matches
from lightning_automodel.parallel.tensor.sizes import model_config
from lightning_automodel.parallel.tensor.styles.experts import ExpertTensorParallel
from lightning_automodel.parallel.tensor.styles.projections import LatentKeyValueProjection, PackedColwiseParallel

# Hugging Face style string -> the torch style with the same layout. Covers transformers 4.4x to 5.x.
_TRANSLATIONS: dict[str, Callable[[], ParallelStyle | None]] = {
    "colwise": ColwiseParallel,
    "local_colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "local_rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "sequence_parallel": lambda: SequenceParallel(use_local_output=True),
    # Hugging Face uses it for q/k norms over head_dim, which see only this rank's heads. Nothing to shard: the probe
    # finds every module computing on sharded activations and sums its gradients (tensor/sharded_activations.py).
    "replicated_with_grad_allreduce": lambda: None,
    "packed_colwise": lambda: PackedColwiseParallel(parts=2),
    "moe_tp_experts": ExpertTensorParallel,
    # Kept whole on every rank: nothing to shard.
    "replicate": lambda: None,
    "local": lambda: None,
}

# Understood, but they need Hugging Face's own runtime (expert routing, local-parameter forwards).
_UNSUPPORTED = {
    "packed_rowwise": "mixture-of-experts experts",
    "local_packed_rowwise": "mixture-of-experts experts",
    "moe_identity_expert": "mixture-of-experts identity experts",
    "grouped_gemm": "mixture-of-experts experts",
    "ep_router": "expert-parallel routing",
    "ep_dispatch_experts": "expert-parallel routing",
    "isolated": "expert-parallel routing",
    "gather": "expert-parallel routing",
    "all_reduce": "mixture-of-experts shared experts",
    "local_params": "modules that run on local parameters",
}

# The vocab-parallel lm_head every plan of this package ends with: logits stay sharded for loss_parallel.
_VOCAB_PARALLEL_STYLES = {"colwise", "colwise_rep", "colwise_gather_output"}


def translate_style(style: str, module_name: str, *, model: nn.Module | None = None) -> ParallelStyle | None:
    """The torch style for Hugging Face's ``style`` string on ``module_name`` of ``model``; None: keep it whole.
    ``model`` is read for the width of latent attention's rotary key only."""
    if style == "mla_kv_a_proj":
        rotary_width = getattr(model_config(model), "qk_rope_head_dim", None) if model is not None else None
        if not isinstance(rotary_width, int):
            raise ValueError(
                f"The Hugging Face tensor-parallel style 'mla_kv_a_proj' of {module_name!r} is for multi-head latent"
                " attention, whose config gives the rotary key's width (qk_rope_head_dim); this model's does not."
                " Pass tp_plan= with torch ParallelStyles for this model, or use tp=1."
            )
        return LatentKeyValueProjection(rotary_width=rotary_width)
    if style in _TRANSLATIONS:
        return _TRANSLATIONS[style]()
    if style in _UNSUPPORTED:
        raise ValueError(
            f"The Hugging Face tensor-parallel style {style!r} of {module_name!r} is for {_UNSUPPORTED[style]},"
            " which needs transformers' own runtime; lightning_automodel does not apply it. Pass tp_plan= with"
            " torch ParallelStyles for this model, or use tp=1."
        )
    raise ValueError(
        f"Unknown Hugging Face tensor-parallel style {style!r} for module {module_name!r}. Known styles:"
        f" {sorted(_TRANSLATIONS) + sorted(_UNSUPPORTED)}."
    )


def hf_style_strings(model: nn.Module) -> dict[str, str]:
    """Hugging Face's plan for ``model`` as pattern -> style string, with nested models' prefixes added.

    transformers 5 merges the class ``_tp_plan`` and every base model's ``base_model_tp_plan`` into the root
    instance's ``_tp_plan``; 4.4x keeps them apart, so each nested model's plan is prefixed with its path.
    """
    from transformers import PreTrainedModel

    plan: dict[str, str] = dict(getattr(type(model), "_tp_plan", None) or {})
    for path, module in model.named_modules():
        if not isinstance(module, PreTrainedModel):
            continue
        own = getattr(module, "_tp_plan", None) or (
            getattr(module.config, "base_model_tp_plan", None) if path else None
        )
        prefix = f"{path}." if path else ""
        plan.update({f"{prefix}{pattern}": style for pattern, style in (own or {}).items()})
    return plan


def hf_tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The model's Hugging Face plan as torch styles, with a vocab-parallel embedding and lm_head.

    Raises a ValueError if the model has no plan. Hugging Face plans carry no sequence-parallel layout for the
    residual stream (see :mod:`lightning_automodel.parallel.tensor.plans.sequence_parallel`).
    """
    strings = hf_style_strings(model)
    if not strings:
        raise ValueError(f"{type(model).__name__} has no Hugging Face tensor-parallel plan (_tp_plan).")
    plan: dict[str, ParallelStyle] = {}
    experts = [pattern for pattern, style in strings.items() if style == "moe_tp_experts"]
    for pattern, style in strings.items():
        if pattern.rpartition(".")[0] in experts:
            continue  # a parameter of experts split whole by ExpertTensorParallel
        if pattern.rpartition(".")[2] == "lm_head" and style in _VOCAB_PARALLEL_STYLES:
            plan[pattern] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
            continue
        translated = translate_style(style, pattern, model=model)
        if translated is not None:
            plan[pattern] = translated
    embedding = model.get_input_embeddings()
    for name, module in model.named_modules():
        if module is not embedding or not isinstance(module, nn.Embedding):
            continue
        if _weight_read_directly(model, attribute=name.rpartition(".")[2]):
            plan.pop(name, None)
            head = model.get_output_embeddings()
            if getattr(head, "weight", None) is module.weight:  # tied: the head stays whole with it
                head_name = next(name for name, candidate in model.named_modules() if candidate is head)
                plan = {pattern: style for pattern, style in plan.items() if not pattern_matches(pattern, head_name)}
        elif name not in strings:
            plan[name] = RowwiseParallel(input_layouts=Replicate())  # vocab-parallel: saves vocab x hidden
    return plan


def _weight_read_directly(model: nn.Module, *, attribute: str) -> bool:
    """Whether the model's own code reads ``<...>.{attribute}.weight`` outside the module's call (Gemma 4's multimodal
    model takes the pad token's row of ``embed_tokens.weight``): split over the vocabulary, that row would be a
    DTensor meeting plain tensors, so the embedding stays whole (and an lm_head tied to it)."""
    classes = {type(module) for module in model.modules() if type(module).__module__.startswith("transformers.models.")}
    return any(attribute in _weights_read(klass) for klass in classes)


@functools.cache
def _weights_read(klass: type) -> frozenset[str]:
    """The attributes ``x`` whose ``x.weight`` the source of ``klass`` reads (none where its source is unavailable)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    return frozenset(
        node.value.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "weight" and isinstance(node.value, ast.Attribute)
    )
