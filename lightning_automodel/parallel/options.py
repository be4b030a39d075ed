"""The options of :func:`~lightning_automodel.parallel.parallelize`: typed, and checked once when built.

Sizes are the mesh's (:class:`~lightning_automodel.parallel.mesh.ParallelDims`); checks that need them run in
``parallelize``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from lightning_automodel.parallel.activation_checkpointing import ACMode, validate_ac_mode
from lightning_automodel.parallel.compile import CompileSpec, compile_options
from lightning_automodel.parallel.context_parallel import CPAttention, attention_kernel
from lightning_automodel.parallel.float8 import Float8Options, Float8Spec, float8_options
from lightning_automodel.parallel.fsdp.options import FSDPOptions
from lightning_automodel.parallel.pipeline import PipelineOptions
from lightning_automodel.parallel.tensor.plans.selection import PlanSpec


@dataclass(frozen=True)
class ParallelOptions:
    """How each axis of the mesh is applied to a model."""

    sp: bool = False
    """Sequence parallel: also split norms and the residual stream on the sequence over the tp ranks (needs tp > 1)."""

    tp_plan: PlanSpec | None = None
    """A dict of module pattern -> ParallelStyle, an import path to one, or a function ``(model, sp) -> dict``;
    default: the first of the family's registered plan, the model's Hugging Face plan and the default Llama-style
    plan that shards every decoder block."""

    allow_unsharded_linears: bool = False
    """Accept a plan that leaves large weights of the decoder blocks whole on every tp rank (the candidate sharding
    the largest share of them then wins)."""

    activation_checkpointing: bool | ACMode = False
    """Recompute activations in backward: True or "full" (whole decoder layers), "selective" (keep attention and
    every other matmul output) or "submodule" (attention and MLP apart); see
    :mod:`~lightning_automodel.parallel.activation_checkpointing`."""

    compile: CompileSpec = False
    """Compile every decoder block's forward with torch.compile after tensor parallel and activation checkpointing,
    before FSDP2: False (default), True (torch's defaults) or a dict of torch.compile's keyword arguments (e.g.
    ``{"fullgraph": True, "mode": "max-autotune-no-cudagraphs"}``). The blocks share one graph; composes with every
    activation_checkpointing mode; see :mod:`~lightning_automodel.parallel.compile`."""

    float8: Float8Spec | Float8Options = False
    """Float8 matmuls in the decoder blocks' linear layers through torchao: False (default), True (tensorwise
    scaling) or a dict of :class:`~lightning_automodel.parallel.float8.Float8Options` (``recipe``: "tensorwise" or
    "rowwise"; ``emulate``; ``skip``); see :mod:`~lightning_automodel.parallel.float8`."""

    cp_attention: CPAttention = "auto"
    """The attention kernel at cp > 1: "flex" (flex attention over a block mask: the masked blocks skipped, nothing
    quadratic in the sequence stored; trains on GPUs only, torch has no CPU backward), "sdpa" (SDPA over a dense
    [S / cp, S] mask a row: any device, memory quadratic in the sequence) or "auto" (default: flex on GPUs, sdpa
    elsewhere); see :mod:`~lightning_automodel.parallel.context_parallel`."""

    pipeline: PipelineOptions | None = None
    """How the mesh's pp ranks split the model into stages and run them (default at pp > 1: :class:`PipelineOptions`'s;
    the strategy's ``pp_*`` arguments): ``pp_schedule`` "1F1B" (default), "GPipe", or with pp_stages_per_rank >= 2
    "Interleaved1F1B", "LoopedBFS" or "InterleavedZeroBubble" (torch's schedule names); ``pp_microbatches`` per step
    (default: pp), which must divide the batch, and be >= pp for "1F1B"; ``pp_layers_per_stage``, a manual split, the
    number of decoder layers of each stage (pp x pp_stages_per_rank stages; default: an even split in which the
    embedding and the head count as one layer each); ``pp_stages_per_rank``, virtual stages each rank holds for the
    interleaved schedules (rank r holds stages r, r + pp, ...; the bubble shrinks to (pp - 1) / (pp_stages_per_rank x
    m + pp - 1)); ``pp_loss_fn``, a loss of your own (in YAML, its import path): ``f(logits, labels)`` returns a
    micro-batch's loss summed over its tokens, which the last stage computes and the pipeline divides by the global
    batch's scored tokens (default: the next-token cross-entropy). Without the strategy, the loop calls the methods of
    what ``parallelize`` returns (:class:`~lightning_automodel.parallel.parallelized.Parallelized`); see
    :mod:`~lightning_automodel.parallel.pipeline`."""

    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    """How FSDP2 shards, gathers and computes (under pp, ``reshard_after_forward=None`` is False: a stage gathers its
    weights once a step)."""

    def __post_init__(self) -> None:
        attention_kernel(self.cp_attention, "cpu")  # a name it does not know is refused here
        validate_ac_mode(self.activation_checkpointing)
        _ = self.compile_kwargs  # parsed here: a compile= torch.compile does not take is refused when built
        object.__setattr__(self, "float8", float8_options(self.float8) or False)

    @cached_property
    def compile_kwargs(self) -> dict[str, Any] | None:
        """``compile`` as torch.compile's keyword arguments (None: no compile), parsed once, when the options are
        built."""
        return compile_options(self.compile)

    @classmethod
    def from_keywords(cls, **keywords: Any) -> ParallelOptions:
        """Options from flat keywords, FSDP2's among them (``mp_policy=...``), as :func:`parallelize` takes them."""
        flat = {name: keywords.pop(name) for name in _FSDP_FIELDS if name in keywords}
        if flat:  # beside fsdp=FSDPOptions(...), refused as a keyword given twice
            return cls(**keywords, fsdp=FSDPOptions(**flat))
        return cls(**keywords)


_FSDP_FIELDS = tuple(option.name for option in fields(FSDPOptions))
