"""Pipeline parallel: a Hugging Face decoder split into stages by its decoder layers, run by torch's schedules.

Each pp rank keeps its stage of the model in place and drops the rest: the embedding on the first stage, the final
norm and the head on the last, rotary embeddings everywhere, the decoder layers in between split so that every stage
gets an even share of the work (the embedding and the head count as one layer each). The layers a stage keeps stay
under their Hugging Face names (``model.layers.5`` stays ``model.layers.5``): meta-device init, shard-by-shard
loading, checkpoints and the export see the names they always see, each rank holding only its stage's.

The model's own forward computes each stage: the first from ``input_ids``, the others from the previous stage's
hidden states given as ``inputs_embeds`` (positions and masks are built as in one process); non-last stages stop at
the decoder (their final norm is an identity), the last runs the whole head (soft-capping, logit scales). Whether a
model class composes that way is checked on a shrunk replica in this process (:func:`stage_split_problem`): a model
that transforms ``inputs_embeds`` itself is refused there. The module that loops over the layers gets a copy of the
config with the per-layer settings of the layers it holds, since models read them by loop position.

A rank may hold several stages (virtual stages, for torch's interleaved schedules): stage s of pp x v goes to rank
s mod pp. The model then keeps the layers of all of them, and each stage is a view of it (:func:`stage_view`) that
FSDP makes a root of its own, as torch's multi-stage schedules expect one module per stage.

A tied input and output embedding stays tied: the last stage holds a copy of the embedding as its head, and the
gradients of the two copies are summed over the pp ranks before each optimizer step
(:meth:`Pipeline.sum_tied_gradients`), so both copies take the same steps as the single tied weight would.

With tensor parallel, stages hand each other their shard of the hidden states, which the next stage receives as the
DTensor the embedding would have made (:meth:`Pipeline.receive_stream_as`).

Called as usual (``model(input_ids=..., labels=...)``), the model runs one step of the schedule: forward and backward
of every micro-batch when training, forward only otherwise. The loss is the next-token cross-entropy summed on the
last stage and divided by the token count of the whole global batch (micro-batches x data-parallel ranks), as in one
process; it reaches every rank. The schedule runs backward itself; what it computes is held back and added to the
gradients when the returned loss's backward runs (a leaf, whose backward does only that), so a training loop that
zeroes gradients between its forward and its backward (Lightning's) and scales the loss (gradient accumulation) gets
what it expects.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
    _PipelineSchedule,
    get_schedule_class,
)
from torch.distributed.pipelining.stage import InferenceMode
from torch.distributed.tensor import DTensor, Placement, Shard

from lightning_automodel.hf.decoder_layers import named_decoder_layers
from lightning_automodel.hf.shrink import layers_kept, shrunk_config
from lightning_automodel.parallel.fsdp.sharding import view_outputs_allowed
from lightning_automodel.parallel.loss import causal_lm_loss_sum, next_token_hits, next_token_targets
from lightning_automodel.parallel.mesh import axis_size, reduction_mesh
from lightning_automodel.parallel.model_calls import (
    ParallelCausalLMOutput,
    own_forward,
    take_over_calls,
    taken_over,
    training_call,
)

FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "final_norm", "ln_f", "norm_f", "ln_final")
MODEL_INPUTS = ("attention_mask", "position_ids")  # split into micro-batches and given to every stage
VIRTUAL_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """How to pipeline: ``schedule`` is a name of torch's (``get_schedule_class``); ``microbatches`` per step
    (default: the pp size); ``layers_per_stage`` a manual split (decoder layers of each stage, in order);
    ``stages_per_rank``: virtual stages each rank holds, for the schedules that interleave them (Interleaved1F1B,
    LoopedBFS, InterleavedZeroBubble: rank r holds stages r, r + pp, ...). ``loss_fn``: a loss of your own, which
    the last stage applies to each micro-batch: ``loss_fn(logits, labels)`` returns the micro-batch's loss summed
    over its tokens (labels as the model's call got them, unshifted), and the pipeline divides it by the global
    batch's scored tokens (next-token labels other than -100); default: the next-token cross-entropy."""

    schedule: str = "1F1B"
    microbatches: int | None = None
    layers_per_stage: Sequence[int] | None = None
    stages_per_rank: int = 1
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None

    def validate(self, pp: int, *, num_layers: int | None = None) -> None:
        """Refuse a schedule torch lacks, a number of stages per rank it does not run, too few micro-batches, and a
        manual split not of ``num_layers`` decoder layers (when given)."""
        multi = self._schedule_runs_several_stages()
        per_rank = self.stages_per_rank
        if not isinstance(per_rank, int) or isinstance(per_rank, bool) or per_rank < 1:
            raise ValueError(f"pp_stages_per_rank={self.stages_per_rank!r} must be a positive integer.")
        if multi and self.stages_per_rank < 2:
            raise ValueError(
                f"pp_schedule={self.schedule!r} runs several stages on every rank: set pp_stages_per_rank=2 (or more)."
            )
        if not multi and self.stages_per_rank > 1:
            raise ValueError(
                f"pp_stages_per_rank={self.stages_per_rank} needs a schedule that runs several stages per rank:"
                f" {', '.join(VIRTUAL_STAGE_SCHEDULES)}; {self.schedule!r} runs one."
            )
        if self.microbatches is not None and (isinstance(self.microbatches, bool) or self.microbatches < 1):
            raise ValueError(f"pp_microbatches={self.microbatches!r} must be a positive integer.")
        microbatches = self.microbatches_for(pp)
        if self.schedule.lower() == "1f1b" and microbatches < pp:
            raise ValueError(
                f"pp_microbatches={microbatches} with pp={pp}: the 1F1B schedule needs at least as many"
                f" micro-batches as stages. Use pp_microbatches >= {pp}, or pp_schedule='GPipe'."
            )
        rounds = max(1, microbatches // pp)  # torch's interleaved schedules run the micro-batches in equal rounds
        if self._runs_rounds() and microbatches % rounds:
            raise ValueError(
                f"pp_microbatches={microbatches} with pp={pp}: {self.schedule} runs the micro-batches in"
                f" pp_microbatches // pp = {rounds} rounds of equal size, which {microbatches} does not split into:"
                f" use a multiple of pp (e.g. {rounds * pp}), or fewer micro-batches than pp."
            )
        stages = pp * self.stages_per_rank
        if self.layers_per_stage is not None and (
            len(self.layers_per_stage) != stages or any(count < 1 for count in self.layers_per_stage)
        ):
            raise ValueError(
                f"pp_layers_per_stage={list(self.layers_per_stage)}: give {stages} positive layer counts, one per stage"
                f" (pp={pp} x pp_stages_per_rank={self.stages_per_rank})."
            )
        if num_layers is not None:
            stage_layers(num_layers, stages, self.layers_per_stage)

    def _schedule_runs_several_stages(self) -> bool:
        try:
            schedule_class = get_schedule_class(self.schedule)
        except ValueError as error:
            raise ValueError(f"pp_schedule={self.schedule!r}: {error}") from None
        if inspect.isabstract(schedule_class) or schedule_class in (PipelineScheduleSingle, PipelineScheduleMulti):
            raise ValueError(
                f"pp_schedule={self.schedule!r} is a base class of torch's schedules: use 'GPipe', '1F1B' or one of"
                f" {', '.join(VIRTUAL_STAGE_SCHEDULES)}."
            )
        if schedule_class in (ScheduleZBVZeroBubble, ScheduleDualPipeV):
            # torch 2.13's runtime hands the input gradient between the two adjacent stages of the V's middle rank
            # in steps without backward too (validate, test, predict), and fails there (PipelineStage.
            # get_local_bwd_output: "can't steal_bwd_input if this stage doesn't have backward").
            raise ValueError(
                f"pp_schedule={self.schedule!r} places a rank's two stages in a V, whose forward-only steps (validate,"
                f" test, predict) fail in torch's runtime: use one of {', '.join(VIRTUAL_STAGE_SCHEDULES)}."
            )
        return not issubclass(schedule_class, PipelineScheduleSingle)

    def microbatches_for(self, pp: int) -> int:
        return self.microbatches if self.microbatches is not None else pp

    def _runs_rounds(self) -> bool:
        return issubclass(get_schedule_class(self.schedule), ScheduleInterleaved1F1B | ScheduleInterleavedZeroBubble)

    def splits_backward(self) -> bool:
        """Whether the schedule computes the weights' gradients apart from the inputs' (zero bubble): each runs the
        layer's backward, so a checkpointed layer would be recomputed twice."""
        return issubclass(get_schedule_class(self.schedule), ScheduleInterleavedZeroBubble)

    def stages_of_rank(self, rank: int, pp: int) -> list[int]:
        """The stages pp rank ``rank`` holds, in order: ``rank``, ``rank + pp``, ... (torch's looped placement)."""
        return [rank + pp * round_ for round_ in range(self.stages_per_rank)]


def stage_layers(num_layers: int, pp: int, layers_per_stage: Sequence[int] | None = None) -> list[range]:
    """The decoder layers of each stage: ``layers_per_stage`` if given, else an even split of the work, where the
    embedding (first stage) and the head (last stage) count as one layer each."""
    if layers_per_stage is not None:
        if sum(layers_per_stage) != num_layers:
            raise ValueError(
                f"pp_layers_per_stage={list(layers_per_stage)} sums to {sum(layers_per_stage)}; the model has"
                f" {num_layers} decoder layers."
            )
        counts = list(layers_per_stage)
    else:
        work = num_layers + 2  # the embedding is work unit 0, the head the last one
        bounds = [round(stage * work / pp) for stage in range(pp + 1)]
        spans = zip(bounds, bounds[1:], strict=False)
        counts = [len(range(max(start, 1), min(end, num_layers + 1))) for start, end in spans]
        if min(counts) < 1:  # few layers: one stage would hold only the embedding or the head
            counts = [num_layers // pp + (stage < num_layers % pp) for stage in range(pp)]
    starts = [sum(counts[:stage]) for stage in range(pp)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


def pipeline_problem(model: nn.Module, *, pp: int, stages_per_rank: int = 1) -> str | None:
    """Why ``model`` cannot be split into ``pp`` x ``stages_per_rank`` stages (None if it can), found without any
    collective."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return f"{type(model).__name__} is not a Hugging Face model; pipeline parallel splits those only"
    if getattr(model.config, "is_encoder_decoder", False):
        return f"{type(model).__name__} is an encoder-decoder model; pipeline parallel splits decoder-only models"
    if model.get_output_embeddings() is None or model.base_model is model:
        return f"{type(model).__name__} has no language-model head over a base model to split"
    lists = {name.rsplit(".", 1)[0] for name, _ in named_decoder_layers(model)}
    if len(lists) != 1:
        return (
            f"{type(model).__name__} has {len(lists)} lists of blocks ({sorted(lists)}); pipeline parallel splits one"
        )
    owner, _ = _blocks_owner(model)
    if _final_norm_name(owner) is None:
        return (
            f"{type(model).__name__} has no final norm beside its blocks (one named one of {FINAL_NORM_NAMES}, or the"
            " one child whose class is a norm)"
        )
    if getattr(model.config, "output_router_logits", False):
        return (
            f"{type(model).__name__} adds its experts' load-balancing loss (output_router_logits=True), over the layers"
            " of the last stage only under pp: set output_router_logits=False"
        )
    layers, stages = len(named_decoder_layers(model)), pp * stages_per_rank
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
    """Parameters of the model outside its blocks, input embedding, final norm and head, by name: every stage view
    of a rank would hold them."""
    owner, attribute = _blocks_owner(model)
    parts = [getattr(owner, attribute), model.get_input_embeddings(), model.get_output_embeddings()]
    parts.append(getattr(owner, _final_norm_name(owner)))
    placed = {id(param) for part in parts if part is not None for param in part.parameters()}
    return [name for name, param in model.named_parameters() if id(param) not in placed]


def stage_split_problem(model: nn.Module) -> str | None:
    """Whether the model's class computes the same logits split in two stages as whole, on a shrunk replica of it
    (its config made tiny, at least two decoder layers, random weights), in this process; None if it does. A class
    whose replica cannot be built or split is refused with what it raised."""
    try:
        error = _split_error(model)
    except Exception as failure:  # noqa: BLE001 - the model's own code, whatever it raises, refuses the split
        return (
            f"{type(model).__name__} fails split into stages on a shrunk replica ({type(failure).__name__}: {failure})"
        )
    if not error < 1e-5:
        return (
            f"{type(model).__name__} computes other logits split into stages than whole (relative error {error:.2g}"
            " on a shrunk replica): its forward transforms inputs_embeds or reads per-layer settings it does not hold"
        )
    return None


def _split_error(model: nn.Module) -> float:
    """The largest difference of the logits of a shrunk replica of ``model`` split in two stages and whole, relative
    to the largest logit."""
    config = shrunk_config(model.config)
    config.num_hidden_layers = max(2, config.num_hidden_layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        whole = type(model)(config).eval()
        first, last = copy.deepcopy(whole), copy.deepcopy(whole)
        tokens = torch.randint(0, config.vocab_size, (2, 8))
    with torch.no_grad():
        expected = whole(input_ids=tokens, use_cache=False).logits
        layers = stage_layers(len(named_decoder_layers(whole)), 2)
        split_into_stage(first, layers=layers[0], first=True, last=False)
        split_into_stage(last, layers=layers[1], first=False, last=True)
        hidden = first.base_model(input_ids=tokens, use_cache=False).last_hidden_state
        actual = last(inputs_embeds=hidden, use_cache=False).logits
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def split_into_stage(
    model: nn.Module, *, layers: Sequence[int], first: bool, last: bool, config: Any | None = None
) -> None:
    """Keep this stage of ``model`` in place: its decoder ``layers`` under their names, the embedding on the first
    stage (and on the last when the head is tied to it), the final norm and the head on the last. ``config``: the
    whole model's config of the module looping over the layers (default: that module's own)."""
    owner, attribute = _blocks_owner(model)
    blocks = getattr(owner, attribute)
    kept = nn.ModuleList()
    for index in layers:  # a ModuleList iterates its values: the model's own loop runs these layers only
        kept.add_module(str(index), blocks._modules[str(index)])
    setattr(owner, attribute, kept)
    owner.config = _config_of_layers(config if config is not None else owner.config, list(layers))
    if not first and not (last and is_tied(model)):
        model.base_model.set_input_embeddings(None)
    if not last:
        setattr(owner, _final_norm_name(owner), nn.Identity())
        model.set_output_embeddings(None)


def stage_view(model: nn.Module, *, layers: Sequence[int], first: bool, last: bool, config: Any) -> nn.Module:
    """One of the stages a rank holds when it holds several (virtual stages): a module computing ``layers`` of
    ``model`` (already split to this rank's layers) as :func:`split_into_stage` would keep them, sharing every
    submodule with ``model``. Only the modules on the way to the blocks are copied, with their own children and
    hooks (FSDP makes each view a root of its own) and the same parameters and buffers (none of their own:
    :func:`pipeline_problem`); ``model`` stays what checkpoints, loading and the export see. ``config``: the whole
    model's config of the module looping over the layers. Made after tensor parallel, whose hooks the copies keep:
    hooks registered on those modules later reach the model only, and casts or moves of the model after FSDP reach
    the views' units only through :meth:`Pipeline.adopt_weights`."""
    view = _copy_along(model, [name for name, _ in _path_to_blocks(model)][1:])
    split_into_stage(view, layers=layers, first=first, last=last, config=config)
    return view


def _copy_along(module: nn.Module, path: list[str]) -> nn.Module:
    """A shallow copy of ``module`` whose children and hooks are its own, and so on along ``path`` (module names
    inside ``module``, shortest first)."""
    clone = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, dict | set) and key not in ("_parameters", "_buffers"):
            clone.__dict__[key] = copy.copy(value)
    if path:
        child = path[0].rsplit(".", 1)[-1]
        clone._modules[child] = _copy_along(module._modules[child], path[1:])
    return clone


def _path_to_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model`` and the modules between it and its list of blocks (their owner last), by name."""
    owner_name = name_of(model, _blocks_owner(model)[0])
    parts = owner_name.split(".") if owner_name else []
    names = ["", *(".".join(parts[: depth + 1]) for depth in range(len(parts)))]
    return [(name, model.get_submodule(name)) for name in names]


def _config_of_layers(config: Any, layers: list[int]) -> Any:
    """A copy of ``config`` describing ``layers`` alone (per-layer settings cut and renumbered), for the module whose
    loop runs them: models read ``config.layer_types[i]`` by loop position (Gemma 3). The model's own config, which
    the export writes, stays whole."""
    stage_config = copy.deepcopy(config)
    for name, value in layers_kept(config.to_dict(), layers).items():
        setattr(stage_config, name, value)
    return stage_config


def name_of(model: nn.Module, module: nn.Module) -> str:
    """The name of ``module`` inside ``model``."""
    return next(name for name, candidate in model.named_modules() if candidate is module)


def is_tied(model: nn.Module) -> bool:
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embedding is not None and head.weight is embedding.weight


def _blocks_owner(model: nn.Module) -> tuple[nn.Module, str]:
    """The module holding the model's list of decoder blocks, and the list's attribute name."""
    list_path = named_decoder_layers(model)[0][0].rsplit(".", 1)[0]
    owner, _, attribute = list_path.rpartition(".")
    return (model.get_submodule(owner) if owner else model), attribute


def _final_norm_name(owner: nn.Module) -> str | None:
    """The final norm beside the blocks: by its usual names, else the one child whose class is a norm. A wrong guess
    cannot pass :func:`stage_split_problem`."""
    named = next((name for name in FINAL_NORM_NAMES if isinstance(getattr(owner, name, None), nn.Module)), None)
    norms = [name for name, child in owner.named_children() if "norm" in type(child).__name__.lower()]
    return named or (norms[0] if len(norms) == 1 else None)


class Pipeline:
    """One rank's stages of a model and the schedule that runs them (built at the first step, once weights exist).

    With one stage per rank the model itself is the stage; with several (virtual stages) the model holds the layers
    of all of them and each stage is a view of it (:func:`stage_view`), which FSDP makes a root of its own."""

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        options: PipelineOptions,
        *,
        layers: dict[int, range],
        tied: bool,
        blocks_config: Any,
    ) -> None:
        """``layers``: the decoder layers of each stage this rank holds, by stage index; ``blocks_config``: the whole
        model's config of the module looping over them (its stage views cut theirs from it)."""
        self.model = model
        self.mesh = mesh
        self.options = options
        self.pp = axis_size(mesh, "pp")
        self.num_stages = self.pp * options.stages_per_rank
        self.layers = layers
        self._blocks_config = blocks_config
        self.stage_indices = sorted(layers)
        self.first, self.last = 0 in layers, self.num_stages - 1 in layers
        self._stage_of_view = {id(model): self.stage_indices[0]}
        self.tied = tied
        self.in_schedule = False
        self._loss_scale = torch.tensor(1.0)
        self._views: list[nn.Module] | None = None
        self._stages: list[PipelineStage] | None = None
        self._schedules: dict[bool, _PipelineSchedule] = {}
        self._batch_shape: tuple[int, ...] | None = None
        self._tied_layout: tuple[tuple[int, ...], torch.dtype] | None = None
        self._totals: list[Tensor] = []
        self._stream_layout: tuple[DeviceMesh, tuple[Placement, ...]] | None = None
        self._computed: dict[str, Tensor] = {}
        self._parameters: dict[str, nn.Parameter] | None = None
        self._told_stream: Tensor | None = None

    def stage_modules(self) -> list[nn.Module]:
        """The module each of this rank's stages runs, in stage order: the model itself when it holds one stage, else
        views of it (made at the first call: after tensor parallel and before FSDP, which makes each a root)."""
        if self._views is None:
            self._views = (
                [self.model] if len(self.stage_indices) == 1 else [self._view(index) for index in self.stage_indices]
            )
        return self._views

    def _view(self, stage: int) -> nn.Module:
        first, last = stage == 0, stage == self.num_stages - 1
        view = stage_view(self.model, layers=self.layers[stage], first=first, last=last, config=self._blocks_config)
        self._stage_of_view[id(view)] = stage
        return view

    def _sync_view_modes(self) -> None:
        """Give the modules copied for the views the training mode of those they copy (the rest they share)."""
        if len(self.stage_indices) > 1:
            for view in self.stage_modules():
                for name, module in _path_to_blocks(view):
                    module.training = self.model.get_submodule(name).training

    def _fsdp_units(self) -> list[FSDPModule]:
        """The FSDP units of the model and of its stage views (whose copied modules may be units of their own)."""
        modules = [*self.model.modules(), *(module for view in self.stage_modules() for module in view.modules())]
        return list({id(module): module for module in modules if isinstance(module, FSDPModule)}.values())

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh["pp"].get_group()

    def schedule(self, *, with_loss: bool) -> _PipelineSchedule:
        """The schedule over this rank's stages (the same stages, two schedules): with the loss (training, evaluating
        with labels) or forward only (logits without labels). Built at first use, once the weights exist."""
        if with_loss not in self._schedules:
            if self._stages is None:
                self._stages = [
                    PipelineStage(module, index, self.num_stages, self._device(), group=self.group, **self._told(index))
                    for module, index in zip(self.stage_modules(), self.stage_indices, strict=True)
                ]
            schedule_class = get_schedule_class(self.options.schedule)
            stages = self._stages if issubclass(schedule_class, PipelineScheduleMulti) else self._stages[0]
            loss = dict(loss_fn=self._loss, scale_grads=False) if with_loss else {}
            schedule = schedule_class(stages, self.options.microbatches_for(self.pp), **loss)
            if self._told_stream is not None:
                schedule._warmup_p2p = _every_stage_told
            self._schedules[with_loss] = schedule
        return self._schedules[with_loss]

    def tell_shapes(self, *, batch_shape: tuple[int, int], hidden_size: int, dtype: torch.dtype) -> None:
        """Tell this rank's stages what they hand each other for batches of ``batch_shape`` (rows, tokens), instead
        of their exchanging it at their first step: the hidden states of a micro-batch, [rows, tokens (this rank's
        share under sp), ``hidden_size``] in ``dtype``. A fake process group needs it, whose messages carry nothing:
        the activation estimate runs the schedule in one (:mod:`~lightning_automodel.planning.activation_memory`)."""
        rows, tokens = batch_shape
        shape = [rows // self.options.microbatches_for(self.pp), tokens, hidden_size]
        if self._stream_layout is not None:
            mesh, placements = self._stream_layout
            for mesh_dim, placement in enumerate(placements):
                if isinstance(placement, Shard):
                    shape[placement.dim] //= mesh.size(mesh_dim)
        self._told_stream = torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)
        self._stages, self._schedules, self._batch_shape = None, {}, (rows, tokens)

    def _told(self, stage: int) -> dict[str, Tensor]:
        """The static metadata of ``stage`` (torch's ``input_args`` and ``output_args``), where shapes were told. A
        last stage's outputs go to the loss, not to another stage: torch reads their metadata for their count only."""
        stream = self._told_stream
        if stream is None:
            return {}
        rows, tokens = stream.shape[0], self._batch_shape[1]
        inputs = torch.empty(rows, tokens, dtype=torch.long, device="meta") if stage == 0 else stream
        return dict(input_args=inputs, output_args=stream)

    def receive_stream_as(self, mesh: DeviceMesh, placements: tuple[Placement, ...] | None) -> None:
        """Stages send their part of the hidden states (a DTensor's local shard); a stage that did not embed them
        itself receives them as a DTensor of ``placements`` on ``mesh`` (the tp mesh: how the embedding leaves them
        under sequence parallel), so that the model's code sees the whole sequence; None: as a whole tensor."""
        self._stream_layout = (mesh, placements) if placements is not None else None

    def stage_forward(self, module: nn.Module, stream: Tensor, **inputs: Any) -> Tensor:
        """The part of the model a stage's ``module`` computes: token ids (first stage) or hidden states in, hidden
        states or logits out."""
        stage = self._stage_of_view[id(module)]
        if stage > 0 and self._stream_layout is not None:
            stream = DTensor.from_local(stream, *self._stream_layout, run_check=False)
        given = {"input_ids": stream} if stage == 0 else {"inputs_embeds": stream}
        if stage == self.num_stages - 1:
            return own_forward(module, PipelinedModel)(**given, **inputs, use_cache=False).logits
        return _local(module.base_model(**given, **inputs, use_cache=False).last_hidden_state)

    def run(self, input_ids: Tensor, *, labels: Tensor | None, **inputs: Tensor) -> ParallelCausalLMOutput:
        """One schedule step over the whole batch. Trains (forward and backward) when gradients are enabled and the
        model is in training mode; otherwise runs forward only. With labels, the loss and its totals reach every
        rank; the logits exist on the last stage only (None elsewhere), and only when not training."""
        microbatches = self.options.microbatches_for(self.pp)
        if input_ids.size(0) % microbatches:
            raise ValueError(
                f"pp_microbatches={microbatches} does not divide this batch of {input_ids.size(0)} rows: make the"
                " batch size a multiple of it (or drop the last, smaller batch: DataLoader(drop_last=True))."
            )
        training = training_call(
            self.model,
            labels,
            why="Under pipeline parallel (pp > 1) the model's call runs forward and backward of every micro-batch, and"
            " the last stage computes the loss, from logits that exist there only, one micro-batch at a time",
            instead=" For a loss of your own, give the strategy pp_loss_fn=f, f(logits, labels) returning a"
            " micro-batch's loss summed over its tokens: the last stage applies it.",
        )
        self._check_sequence_split(input_ids)
        if labels is not None:
            self._loss_scale = self._global_token_scale(labels)
        if tuple(input_ids.shape) != self._batch_shape:  # a stage sizes what it receives at its first step
            if self._told_stream is not None:
                raise ValueError(f"Shapes were told for batches of {self._batch_shape}; got {tuple(input_ids.shape)}.")
            self._stages, self._schedules, self._batch_shape = None, {}, tuple(input_ids.shape)
        self._sync_view_modes()
        schedule = self.schedule(with_loss=labels is not None)
        args = (input_ids,) if self.first else ()
        targets = {"target": labels} if self.last and labels is not None else {}
        self._totals = []
        self.in_schedule = True
        try:
            # A stage sends the local shard of its DTensor output, a view; the schedule writes to none in place.
            with view_outputs_allowed(*(type(module).__name__ for module in self.stage_modules())):
                if training:
                    with self._gradients_held_back():
                        logits = schedule.step(*args, **targets, return_outputs=False, **inputs)
                else:
                    logits = schedule.eval(*args, **targets, **inputs)
        finally:
            self.in_schedule = False
        if labels is None:
            return ParallelCausalLMOutput(logits=logits)
        loss_sum, tokens, hits = self._totals_on_every_rank()
        loss = loss_sum * self._loss_scale
        if training:
            loss = self._backward_applies_gradients(loss)
        return ParallelCausalLMOutput(loss=loss, logits=logits, loss_sum=loss_sum, num_tokens=tokens, num_hits=hits)

    @contextmanager
    def _gradients_held_back(self) -> Iterator[None]:
        """Run the schedule's backward beside the gradients the parameters hold, and keep what it computes for the
        loss's backward (a training loop may zero the gradients between its forward and its backward: Lightning's
        does). By name, on the sharded parameters: see :meth:`_sharded_parameters`."""
        held = {name: p.grad for name, p in self._sharded_parameters().items()}
        for p in self._sharded_parameters().values():
            p.grad = None
        try:
            yield
        finally:
            params = self._sharded_parameters()
            self._computed = {name: p.grad for name, p in params.items() if p.grad is not None}
            for name, grad in held.items():
                params[name].grad = grad

    def _backward_applies_gradients(self, loss: Tensor | None) -> Tensor:
        """A leaf holding the loss, whose backward adds the gradients the schedule computed (times the gradient
        it is given: 1 / accumulate_grad_batches under Lightning)."""
        loss = (loss if loss is not None else torch.zeros((), device=self._device())).requires_grad_()
        computed, self._computed = self._computed, {}
        applied = []

        def add_computed_gradients(scale: Tensor) -> None:
            if applied:
                raise RuntimeError(
                    "A second backward of one pipelined loss: the schedule computed the step's gradients once, in the"
                    " model's call, and the first backward added them. Call the model again for another backward."
                )
            applied.append(True)
            params = self._sharded_parameters()
            for name, grad in computed.items():
                grad.mul_(scale)  # the schedule's own tensor, scaled where it lies
                params[name].grad = grad if params[name].grad is None else params[name].grad + grad

        loss.register_hook(add_computed_gradients)
        return loss

    def _sharded_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters that hold the gradients (and that the optimizer steps), by name: FSDP's sharded ones. The
        module may have other objects registered in their place: FSDP keeps the root's weights gathered from forward
        to backward and swaps them back only at the end of the next autograd backward. Read from FSDP's state, as
        torch's own pipeline stage does to reduce the gradients."""
        if self._parameters is None:
            names = {id(module): name for name, module in self.model.named_modules()}
            self._parameters = {}
            for unit in self._fsdp_units():
                for fsdp_param in (fsdp_param for group in _param_groups(unit) for fsdp_param in group.fsdp_params):
                    owner = fsdp_param._module_info
                    prefix = names[id(owner.module)]
                    name = f"{prefix}.{owner.param_name}" if prefix else owner.param_name
                    self._parameters[name] = fsdp_param.sharded_param
        return self._parameters

    def _check_sequence_split(self, input_ids: Tensor) -> None:
        """Stages send their even share of a sequence-sharded stream: the sequence must split evenly over tp."""
        if self._stream_layout is None:
            return
        mesh, _ = self._stream_layout
        if input_ids.size(1) % mesh.size():
            raise ValueError(
                f"A sequence of {input_ids.size(1)} tokens does not split evenly over tp={mesh.size()}, as sequence"
                " parallel under pp needs: pad the rows to a multiple of tp (or use sp=False)."
            )

    def _loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """A micro-batch's share of the global token mean; its summed loss, tokens and next-token hits are kept."""
        if self.options.loss_fn is None:
            loss_sum, tokens = causal_lm_loss_sum(logits, labels)
        else:
            loss_sum, tokens = self.options.loss_fn(logits, labels), (next_token_targets(labels) != -100).sum()
        hits, _ = next_token_hits(logits, labels)
        self._totals.append(torch.stack([_local(loss_sum).detach(), tokens.float(), hits.float()]))
        return loss_sum * self._loss_scale

    def _global_token_scale(self, labels: Tensor) -> Tensor:
        """dp / the global batch's scored tokens: a micro-batch's summed loss times it is its share of the global
        token mean, which FSDP's mean over the dp ranks turns into the single-process gradient."""
        tokens = (next_token_targets(labels) != -100).sum().float()
        group = reduction_mesh(self.mesh).get_group()
        dist.all_reduce(tokens, group=group)
        return dist.get_world_size(group) / tokens.clamp_min(1)

    def _totals_on_every_rank(self) -> Tensor:
        """This rank's batch's summed loss, scored tokens and next-token hits, from the last stage to every stage.
        Those of the micro-batches only: at its first step a schedule infers the stages' shapes by running the stages
        and the loss once more, before them."""
        microbatches = self.options.microbatches_for(self.pp)
        totals = torch.stack(self._totals[-microbatches:]).sum(0) if self.last else torch.zeros(3)
        return self.from_last_stage(totals)

    def from_last_stage(self, tensor: Tensor) -> Tensor:
        """The last stage's ``tensor`` (fp32, of the same shape on every stage) on every stage of the pipeline."""
        tensor = tensor.to(device=self._device(), dtype=torch.float32)
        dist.broadcast(tensor, group=self.group, group_src=self.pp - 1)
        return tensor

    def sum_tied_gradients(self) -> None:
        """Sum the gradients of the tied embedding's two copies (first and last stage) over the pp ranks; the stages
        in between add zeros. Call once per optimizer step, after the last backward."""
        if self.tied:
            dist.all_reduce(self._tied_local(gradient=True), group=self.group)

    def copies(self) -> list[nn.Parameter]:
        """Parameters another stage holds too (the last stage's copy of a tied embedding): a norm over all stages
        counts them once, on the first stage."""
        return [self._embedding_weight()] if self.tied and self.last and not self.first else []

    def _embedding_weight(self) -> nn.Parameter:
        """The (sharded) parameter of the input embedding's weight, under whatever name it has (a PEFT layer's
        ``base_layer.weight``)."""
        embedding = self.model.get_input_embeddings()
        module = name_of(self.model, embedding)
        key = next(key for key, param in embedding.named_parameters() if param is embedding.weight)
        return self._sharded_parameters()[f"{module}.{key}" if module else key]

    def adopt_weights(self) -> None:
        """Once the weights exist (materialized from the meta device, or loaded): the last stage's copy of a tied
        embedding takes the first stage's values, and the stage views take the parameters
        (:meth:`adopt_view_weights`)."""
        self.adopt_view_weights()
        if self.tied:
            with torch.no_grad():
                dist.broadcast(self._tied_local(gradient=False), group=self.group, group_src=0)

    def adopt_view_weights(self) -> None:
        """The FSDP units of stage views (several stages per rank) that the model's ``to_empty`` does not reach (the
        views' copied modules) take the parameters it registered."""
        in_model = {id(module) for module in self.model.modules()}
        for unit in self._fsdp_units():
            if id(unit) not in in_model:
                for fsdp_param in (param for group in _param_groups(unit) for param in group.fsdp_params):
                    fsdp_param.reset_sharded_param()
        self._parameters = None

    def _tied_local(self, *, gradient: bool) -> Tensor:
        """This rank's shard of the tied embedding's weight (or gradient), or zeros of its shape and dtype on middle
        stages, which the first stage tells them once."""
        weight = self._embedding_weight() if self.first or self.last else None
        tensor = None if weight is None else weight.grad if gradient else weight
        tensor = _local(tensor) if tensor is not None else None
        if self._tied_layout is None:
            layouts = [(tuple(tensor.shape), tensor.dtype) if tensor is not None else None]
            dist.broadcast_object_list(layouts, group=self.group, group_src=0)
            self._tied_layout = layouts[0]
        if tensor is None:
            shape, dtype = self._tied_layout
            tensor = torch.zeros(shape, dtype=dtype, device=self._device())
        return tensor

    def _device(self) -> torch.device:
        return next(iter(self.model.parameters())).device


def _every_stage_told(stages: list[PipelineStage], has_backward: bool, p2p_done: bool) -> None:
    """What torch's schedules decide at their first step by a vote over the stages' process group (its
    ``_warmup_p2p``), where every stage was told its shapes: each takes them as told."""
    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC


def _param_groups(unit: FSDPModule) -> list:
    """The parameter groups FSDP's state keeps for ``unit`` (torch's pipeline stage reads them too)."""
    return unit._get_fsdp_state()._fsdp_param_groups


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class PipelinedModel(nn.Module):
    """The forward of a pipelined model (see :func:`take_over_calls`): called by the schedule, it computes this
    rank's stage; called by anyone else, it runs one schedule step."""

    pipeline: Pipeline

    def forward(self, input_ids: Tensor | None = None, *args: Any, labels: Tensor | None = None, **inputs: Any) -> Any:
        if self.pipeline.in_schedule:
            return self.pipeline.stage_forward(self, input_ids, *args, **inputs)
        unknown = [name for name, value in inputs.items() if value is not None and name not in MODEL_INPUTS]
        if args or input_ids is None or unknown:
            raise ValueError(
                "Under pipeline parallel (pp > 1) the model takes input_ids, labels and"
                f" {', '.join(MODEL_INPUTS)} as keywords (got {len(args)} more positional arguments and"
                f" {unknown or 'no other'} keywords{'' if input_ids is not None else ', no input_ids'})."
            )
        given = {name: value for name, value in inputs.items() if value is not None}
        return self.pipeline.run(input_ids, labels=labels, **given)


def pipeline_model(model: nn.Module, mesh: DeviceMesh, options: PipelineOptions) -> Pipeline:
    """Keep this rank's stage of ``model`` (see :func:`split_into_stage`) and make its calls run the schedule.

    Done before tensor parallel and FSDP: they then shard only what the stage holds, and FSDP's root is the stage
    the schedule calls (torch's stage defers FSDP's gradient reduction to the last micro-batch for it)."""
    pp = axis_size(mesh, "pp")
    stages = stage_layers(len(named_decoder_layers(model)), pp * options.stages_per_rank, options.layers_per_stage)
    layers = {stage: stages[stage] for stage in options.stages_of_rank(mesh["pp"].get_local_rank(), pp)}
    tied, blocks_config = is_tied(model), _blocks_owner(model)[0].config
    held = [index for stage in sorted(layers) for index in layers[stage]]
    split_into_stage(model, layers=held, first=0 in layers, last=len(stages) - 1 in layers)
    pipeline = Pipeline(model, mesh, options, layers=layers, tied=tied, blocks_config=blocks_config)
    take_over_calls(model, PipelinedModel, prefix="Pipelined", pipeline=pipeline)
    return pipeline


def pipeline_of(model: nn.Module) -> Pipeline | None:
    """The pipeline of a model :func:`pipeline_model` split (a PEFT model's base), or None."""
    return taken_over(model, PipelinedModel, "pipeline")


def bubble_fraction(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle share of a schedule's step with ``stages_per_rank`` (v) stages per rank: (p - 1) / (v m + p - 1); a
    rank waits for p - 1 stages' worth of work, each a v-th of its share."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


__all__ = [
    "Pipeline",
    "PipelineOptions",
    "PipelinedModel",
    "bubble_fraction",
    "pipeline_model",
    "pipeline_of",
    "pipeline_problem",
    "stage_layers",
    "stage_split_problem",
]
