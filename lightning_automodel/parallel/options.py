"""The options of :func:`~lightning_automodel.parallel.parallelize`: typed, and checked once when built.

Sizes are the mesh's (:class:`~lightning_automodel.parallel.mesh.ParallelDims`); checks that need them run in
``parallelize``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

from lightning_automodel.parallel.activation_checkpointing import AC_MODES, ACMode, ac_mode
from lightning_automodel.parallel.compile import CompileSpec, compile_options
from lightning_automodel.parallel.context_parallel import CPAttention, attention_kernel
from lightning_automodel.parallel.float8 import Float8Options, float8_options
from lightning_automodel.parallel.fsdp.options import FSDPOptions
from lightning_automodel.parallel.pipeline import PipelineOptions
from lightning_automodel.parallel.tensor.plans.selection import PlanSpec


@dataclass(frozen=True)
class ParallelOptions:
    """How each axis of the mesh is applied to a model."""

    sp: bool = False
    """Sequence parallel: also split norms and the residual stream on the sequence over the tp ranks (needs tp > 1)."""

    tp_plan: PlanSpec | None = None
    """A tensor-parallel plan of one's own: a dict of module pattern -> ParallelStyle, an import path to one, or a
    function ``(model, sp) -> dict``; default: the first of the family's registered plan, the model's Hugging Face
    plan and the default Llama-style plan that shards every decoder block."""

    allow_unsharded_linears: bool = False
    """Accept a plan that leaves large weights of the decoder blocks whole on every tp rank (the candidate sharding
    the largest share of them then wins)."""

    activation_checkpointing: ACMode = "off"
    """Recompute activations in backward: "full" or True (whole decoder layers), "selective" (keep attention and
    every other matmul output), "submodule" (attention and MLP apart), or "off" or False (none). Held as the mode's
    name; see :mod:`~lightning_automodel.parallel.activation_checkpointing`."""

    compile: CompileSpec = False
    """Compile every decoder block's forward with torch.compile after tensor parallel and activation checkpointing,
    before FSDP2: False (default), True (torch's defaults) or a dict of torch.compile's keyword arguments (e.g.
    ``{"fullgraph": True, "mode": "max-autotune-no-cudagraphs"}``). The blocks share one graph; composes with every
    activation_checkpointing mode; see :mod:`~lightning_automodel.parallel.compile`."""

    float8: Float8Options | None = None
    """Float8 matmuls in the decoder blocks' linear layers through torchao: False (default), True (tensorwise
    scaling) or a dict of Float8Options' fields (``recipe``: "tensorwise" or "rowwise"; ``emulate``; ``skip``). Held
    as :class:`~lightning_automodel.parallel.float8.Float8Options`, None when off; see
    :mod:`~lightning_automodel.parallel.float8`."""

    cp_attention: CPAttention = "auto"
    """The attention kernel at cp > 1: "flex" (flex attention over a block mask: the masked blocks skipped, nothing
    quadratic in the sequence stored; trains on GPUs only, torch has no CPU backward), "sdpa" (SDPA over a dense
    [S / cp, S] mask a row: any device, memory quadratic in the sequence) or "auto" (default: flex on GPUs, sdpa
    elsewhere). See :mod:`~lightning_automodel.parallel.context_parallel`."""

    pipeline: PipelineOptions | None = None
    """How the mesh's pp ranks split the model into stages and run them (default at pp > 1: :class:`PipelineOptions`'s;
    the strategy's ``pp_*`` arguments set its fields). Without the strategy, the loop calls the methods of what
    ``parallelize`` returns (:class:`~lightning_automodel.parallel.parallelized.Parallelized`); see
    :mod:`~lightning_automodel.parallel.pipeline`."""

    freeze: tuple[str, ...] = ()
    """Parts to train none of, frozen before anything is sharded: "vision_tower", "projector", "language_model" (of a
    vision-language model) or patterns of parameter names (``"model.layers.0.*"``). A frozen parameter gets no
    gradient, no reduction and no optimizer state; see :func:`~lightning_automodel.hf.freezing.freeze`."""

    fsdp: FSDPOptions = field(default_factory=FSDPOptions)
    """How FSDP2 shards, gathers and computes (under pp, ``reshard_after_forward=None`` is False: a stage gathers its
    weights once a step)."""

    def __post_init__(self) -> None:
        attention_kernel(self.cp_attention, "cpu")  # a name it does not know is refused here
        if self.activation_checkpointing not in AC_MODES:
            raise ValueError(
                f"activation_checkpointing={self.activation_checkpointing!r}: ParallelOptions holds one of"
                f" {', '.join(AC_MODES)} (ac_mode() reads True and False; parallelize's keywords take them)."
            )
        _ = self.compile_kwargs  # parsed here: a compile= torch.compile does not take is refused when built
        if not isinstance(self.freeze, tuple) or not all(isinstance(target, str) for target in self.freeze):
            raise ValueError(f"freeze={self.freeze!r}: a tuple of part names or patterns (parallelize takes a list).")
        if self.float8 is not None and not isinstance(self.float8, Float8Options):
            raise ValueError(
                f"float8={self.float8!r}: ParallelOptions holds Float8Options or None (float8_options() reads True,"
                " False and dicts; parallelize's keywords take them)."
            )

    @cached_property
    def compile_kwargs(self) -> dict[str, Any] | None:
        """``compile`` as torch.compile's keyword arguments (None: no compile), parsed once, when the options are
        built."""
        return compile_options(self.compile)

    @classmethod
    def from_keywords(cls, **keywords: Any) -> ParallelOptions:
        """Options from flat keywords, as :func:`parallelize` takes them: FSDP2's among them (``mp_policy=...``),
        ``activation_checkpointing`` as True, False or a mode, ``float8`` as True, False or a dict."""
        if "activation_checkpointing" in keywords:
            keywords["activation_checkpointing"] = ac_mode(keywords["activation_checkpointing"])
        if "float8" in keywords:
            keywords["float8"] = float8_options(keywords["float8"])
        if isinstance(keywords.get("freeze"), list | str):
            freeze = keywords["freeze"]
            keywords["freeze"] = (freeze,) if isinstance(freeze, str) else tuple(freeze)
        flat = {name: keywords.pop(name) for name in _FSDP_FIELDS if name in keywords}
        if flat:  # beside fsdp=FSDPOptions(...), refused as a keyword given twice
            return cls(**keywords, fsdp=FSDPOptions(**flat))
        return cls(**keywords)


def check_sequence_parallel(*, sp: bool, tp: int) -> None:
    """Sequence parallel splits activations over the tp ranks: refused without more than one."""
    if sp and tp == 1:
        raise ValueError("sp=True (sequence parallel) splits activations over the tp ranks; it needs tp > 1.")


_FSDP_FIELDS = tuple(option.name for option in fields(FSDPOptions))
