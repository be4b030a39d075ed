"""One rank's stages of a pipelined model, run by torch's schedules: a call of the model runs one schedule step. The
loss is summed on the last stage and divided by the global batch's token count (micro-batches x dp ranks, cp ranks
included), as in one process, and reaches every rank."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, _PipelineSchedule, get_schedule_class
from torch.distributed.tensor import DTensor, Placement

from lightning_automodel.parallel.fsdp.sharding import view_outputs_allowed
from lightning_automodel.parallel.loss import next_token_targets
from lightning_automodel.parallel.mesh import axis_size, reduction_mesh
from lightning_automodel.parallel.model_calls import ParallelCausalLMOutput, own_forward, training_call
from lightning_automodel.parallel.pipeline.calls import PipelinedModel
from lightning_automodel.parallel.pipeline.gradients import (
    backward_adds_gradients,
    gradients_held_back,
    param_groups,
    sharded_parameters,
)
from lightning_automodel.parallel.pipeline.images import StageImages
from lightning_automodel.parallel.pipeline.load_balancing import PipelineBalancing
from lightning_automodel.parallel.pipeline.options import PipelineOptions
from lightning_automodel.parallel.pipeline.stage_split import path_to_blocks, stage_view
from lightning_automodel.parallel.pipeline.step_loss import StepLoss
from lightning_automodel.parallel.pipeline.tied_embedding import TiedEmbedding
from lightning_automodel.parallel.pipeline.told_shapes import ToldShapes, every_stage_told, told_shapes

ROWS = "micro_batch_rows"  # the rows of the whole batch a stage's micro-batch holds (see Pipeline.run's row_inputs)
RowInputs = Callable[..., dict[str, Any]]  # row_inputs(rows, first=...): see Pipeline.run


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
        balancing: PipelineBalancing | None = None,
        images: StageImages | None = None,
    ) -> None:
        """``layers``: the decoder layers of each stage this rank holds, by stage index; ``blocks_config``: the whole
        model's config of the module looping over them (its stage views cut theirs from it); ``balancing``: a
        mixture-of-experts model's load-balancing loss (see :mod:`.load_balancing`); ``images``: a vision-language
        model's (see :mod:`.images`)."""
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
        self.tied_embedding = None
        if tied:
            self.tied_embedding = TiedEmbedding(
                model, group=self.group, first=self.first, last=self.last, parameters=self._sharded_parameters
            )
        self.in_schedule = False
        self.step_loss = StepLoss(options.loss_fn, group=reduction_mesh(mesh).get_group())
        self._views: list[nn.Module] | None = None
        self._schedules: dict[bool, _PipelineSchedule] = {}
        self._batch_shape: tuple[int, ...] | None = None
        self._stream_layout: tuple[DeviceMesh, tuple[Placement, ...]] | None = None
        self._parameters: dict[str, nn.Parameter] | None = None
        self._told: ToldShapes | None = None
        self._row_inputs: RowInputs | None = None
        self._token_mask: Tensor | None = None
        self._balancing_pass: str | None = None  # "counting", "training" or "evaluating" a load-balancing loss
        self.balancing = balancing
        self.images = images

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
                for name, module in path_to_blocks(view):
                    module.training = self.model.get_submodule(name).training

    def _fsdp_units(self) -> list[FSDPModule]:
        """The FSDP units of the model and of its stage views (whose copied modules may be units of their own)."""
        modules = [*self.model.modules(), *(module for view in self.stage_modules() for module in view.modules())]
        return list({id(module): module for module in modules if isinstance(module, FSDPModule)}.values())

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh["pp"].get_group()

    def schedule(self, *, with_loss: bool) -> _PipelineSchedule:
        """The schedule over this rank's stages: with the loss (training, evaluating with labels) or forward only
        (logits without labels; counting experts' assignments, see :mod:`.load_balancing`). Built at first use, once
        the weights exist. Each on stages of its own (the same modules): a torch schedule prepares its stages again
        when it switches between training and evaluating, but not when another schedule has prepared them since,
        and a training step on stages another prepared for forward only computes wrong gradients."""
        if with_loss not in self._schedules:
            stages = [
                PipelineStage(
                    module,
                    index,
                    self.num_stages,
                    self._device(),
                    group=self.group,
                    **(self._told.metadata(index) if self._told is not None else {}),
                )
                for module, index in zip(self.stage_modules(), self.stage_indices, strict=True)
            ]
            schedule_class = get_schedule_class(self.options.schedule)
            loss = dict(loss_fn=self.step_loss, scale_grads=False) if with_loss else {}
            self._schedules[with_loss] = schedule_class(
                stages if issubclass(schedule_class, PipelineScheduleMulti) else stages[0],
                self.options.microbatches_for(self.pp),
                **loss,
            )
            if self._told is not None and hasattr(self._schedules[with_loss], "_warmup_p2p"):
                self._schedules[with_loss]._warmup_p2p = every_stage_told
        return self._schedules[with_loss]

    def torch_stages(self, *, with_loss: bool = True) -> list[PipelineStage]:
        """The stages of torch a schedule runs (none before its first use)."""
        schedule = self._schedules.get(with_loss)
        if schedule is None:
            return []
        return list(schedule._stages) if isinstance(schedule, PipelineScheduleMulti) else [schedule._stage]

    def tell_shapes(self, *, batch_shape: tuple[int, int], hidden_size: int, dtype: torch.dtype) -> None:
        """Tell this rank's stages what they hand each other for batches of ``batch_shape`` (rows, tokens), instead
        of their exchanging it at their first step (see :mod:`.told_shapes`)."""
        self._told = told_shapes(
            batch_shape=batch_shape,
            microbatches=self.options.microbatches_for(self.pp),
            hidden_size=hidden_size,
            dtype=dtype,
            stream_layout=self._stream_layout,
        )
        self._schedules, self._batch_shape = {}, self._told.batch_shape

    def receive_stream_as(self, mesh: DeviceMesh, placements: tuple[Placement, ...] | None) -> None:
        """Stages send their part of the hidden states (a DTensor's local shard); a stage that did not embed them
        itself receives them as a DTensor of ``placements`` on ``mesh`` (the tp mesh: how the embedding leaves them
        under sequence parallel), so that the model's code sees the whole sequence; None: as a whole tensor."""
        self._stream_layout = (mesh, placements) if placements is not None else None

    def stage_forward(self, module: nn.Module, stream: Tensor, **inputs: Any) -> Tensor:
        """The part of the model a stage's ``module`` computes: token ids (first stage) or hidden states in, hidden
        states or logits out. A pass counting the experts' assignments runs no head: the last stage hands on a
        token's hidden state a row."""
        stage = self._stage_of_view[id(module)]
        rows = inputs.pop(ROWS)
        if self._row_inputs is not None:
            inputs.update(self._row_inputs(rows, first=stage == 0))
        if stage > 0 and self._stream_layout is not None:
            stream = DTensor.from_local(stream, *self._stream_layout, run_check=False)
        given = {"input_ids": stream} if stage == 0 else {"inputs_embeds": stream}
        if stage == self.num_stages - 1 and self._balancing_pass != "counting":
            outputs = own_forward(module, PipelinedModel)(**given, **inputs, use_cache=False)
            output = outputs.logits
        else:
            outputs = module.base_model(**given, **inputs, use_cache=False)
            output = _local(outputs.last_hidden_state)
            output = output[:, :1].clone() if stage == self.num_stages - 1 else output  # not the whole stream
        if self._balancing_pass is None:
            return output
        token_mask = self._token_mask[rows] if self._token_mask is not None else None
        statistics = self.balancing.record(outputs.router_logits, stage=stage, rows=rows, token_mask=token_mask)
        return self.balancing.with_gradient(output, statistics) if self._balancing_pass == "training" else output

    def run(
        self,
        input_ids: Tensor,
        *,
        labels: Tensor | None = None,
        targets: Tensor | None = None,
        token_mask: Tensor | None = None,
        row_inputs: RowInputs | None = None,
        **inputs: Tensor,
    ) -> ParallelCausalLMOutput:
        """One schedule step over the whole batch. Trains (forward and backward) when gradients are enabled and the
        model is in training mode; otherwise runs forward only. With ``labels`` (aligned with the input ids, as
        Hugging Face's) or ``targets`` (already shifted to the positions that predict them, as context parallel
        gives a rank's share of a sequence), the loss and its totals reach every rank; the logits exist on the last
        stage only (None elsewhere), and only when not training. ``token_mask``: the tokens a mixture-of-experts
        model's load-balancing loss counts (default: the attention mask's); ``row_inputs(rows)``: more keywords for
        every stage, made from the rows of the batch a micro-batch holds and whether the stage is the first (context
        parallel's sequence split; a vision-language model's images, split here from ``inputs``)."""
        microbatches = self.options.microbatches_for(self.pp)
        if input_ids.size(0) % microbatches:
            raise ValueError(
                f"pp_microbatches={microbatches} does not divide this batch of {input_ids.size(0)} rows: make the"
                " batch size a multiple of it (or drop the last, smaller batch: DataLoader(drop_last=True))."
            )
        scored = labels is not None or targets is not None
        training = training_call(
            self.model,
            labels if targets is None else targets,
            why="Under pipeline parallel (pp > 1) the model's call runs forward and backward of every micro-batch, and"
            " the last stage computes the loss, from logits that exist there only, one micro-batch at a time",
            instead=" For a loss of your own, give the strategy pp_loss_fn=f, f(logits, labels) returning a"
            " micro-batch's loss summed over its tokens: the last stage applies it.",
        )
        self._check_sequence_split(input_ids)
        if self.images is not None:
            inputs, row_inputs = self.images.split(input_ids, inputs, microbatches=microbatches)
        if labels is not None:
            targets = next_token_targets(labels)
        if scored:
            self.step_loss.start(targets)
        if tuple(input_ids.shape) != self._batch_shape:  # a stage sizes what it receives at its first step
            if self._told is not None:
                raise ValueError(f"Shapes were told for batches of {self._batch_shape}; got {tuple(input_ids.shape)}.")
            self._schedules, self._batch_shape = {}, tuple(input_ids.shape)
        self._sync_view_modes()
        args = (input_ids,) if self.first else ()
        inputs[ROWS] = torch.arange(input_ids.size(0))  # on the CPU: read without waiting for a GPU
        self._row_inputs = row_inputs
        self._token_mask = token_mask if token_mask is not None else inputs.get("attention_mask")
        balanced = self.balancing is not None and scored
        target = labels if self.options.loss_fn is not None else targets
        given = {"target": target} if self.last and scored else {}
        try:
            # Gradients held through every pass: FSDP2 would mix those of earlier calls (accumulation) into a pass's
            # own, even a forward-only one's, as under pp its stages keep their weights gathered between passes.
            with gradients_held_back(self._sharded_parameters) as computed:
                if balanced and training:
                    self._count_assignments(args, inputs)
                logits = self._step(args, given, inputs, training=training, scored=scored, balanced=balanced)
        finally:
            self._row_inputs = self._token_mask = self._balancing_pass = None
        if not scored:
            return ParallelCausalLMOutput(logits=logits)
        loss_sum, tokens, hits = self._totals_on_every_rank()
        loss, aux_loss = self.step_loss.scaled(loss_sum), None
        if balanced:
            balancing_totals = self.balancing.totals(loss.device)
            if training:
                self.balancing.check_routed_as_counted(balancing_totals)
            aux_loss = self.balancing.loss(balancing_totals)
            loss = loss + self.balancing.settings.weight * aux_loss
        if training:
            loss = backward_adds_gradients(loss, computed=computed, parameters=self._sharded_parameters)
        return ParallelCausalLMOutput(
            loss=loss, logits=logits, loss_sum=loss_sum, num_tokens=tokens, num_hits=hits, aux_loss=aux_loss
        )

    def _step(
        self, args: tuple, given: dict, inputs: dict, *, training: bool, scored: bool, balanced: bool
    ) -> Tensor | None:
        """One pass of the schedule: the last stage's logits when not training."""
        schedule = self.schedule(with_loss=scored)
        self._balancing_pass = ("training" if training else "evaluating") if balanced else None
        if balanced:
            self.balancing.start()
        with self._in_schedule():
            if training:
                return schedule.step(*args, **given, return_outputs=False, **inputs)
            return schedule.eval(*args, **given, **inputs)

    def _count_assignments(self, args: tuple, inputs: dict) -> None:
        """The counting pass before a training step of a model with a load-balancing loss (see
        :mod:`.load_balancing`): forward only, no gradients, the random state restored for the training pass."""
        self.balancing.start()
        self._balancing_pass = "counting"
        device = self._device()
        devices = dict(devices=[device], device_type=device.type) if device.type != "cpu" else dict(devices=[])
        with torch.random.fork_rng(**devices), torch.no_grad(), self._in_schedule():
            self.schedule(with_loss=False).eval(*args, return_outputs=False, **inputs)
        self.balancing.counted = self.balancing.totals(device)

    @contextmanager
    def _in_schedule(self) -> Iterator[None]:
        """While a schedule runs: the model's calls compute stages, whose outputs may be views."""
        self.in_schedule = True
        try:
            # A stage sends the local shard of its DTensor output, a view; the schedule writes to none in place.
            with view_outputs_allowed(*(type(module).__name__ for module in self.stage_modules())):
                yield
        finally:
            self.in_schedule = False

    def share_tower(self, mesh: DeviceMesh) -> None:
        """The first stage's vision tower, sharded by FSDP2 over ``mesh``: each micro-batch without images runs it
        on a stand-in image where another rank's has images (see :mod:`.images`)."""
        if self.first and self.images is not None:
            self.images.share_tower(self.stage_modules()[0], mesh)

    def _sharded_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters that hold the gradients, by name (see :func:`sharded_parameters`), found once."""
        if self._parameters is None:
            self._parameters = sharded_parameters(self.model, units=self._fsdp_units())
        return self._parameters

    def sequence_shards(self) -> int:
        """Over how many ranks the stream stages hand each other is split along the sequence: tp under sequence
        parallel, else 1."""
        return self._stream_layout[0].size() if self._stream_layout is not None else 1

    def _check_sequence_split(self, input_ids: Tensor) -> None:
        """Stages send their even share of a sequence-sharded stream: the sequence must split evenly over tp."""
        shards = self.sequence_shards()
        if input_ids.size(1) % shards:
            raise ValueError(
                f"A sequence of {input_ids.size(1)} tokens does not split evenly over tp={shards}, as sequence"
                " parallel under pp needs: pad the rows to a multiple of tp (or use sp=False)."
            )

    def _totals_on_every_rank(self) -> Tensor:
        """This rank's batch's summed loss, scored tokens and next-token hits, from the last stage to every stage."""
        microbatches = self.options.microbatches_for(self.pp)
        return self.from_last_stage(self.step_loss.totals(microbatches) if self.last else torch.zeros(3))

    def from_last_stage(self, tensor: Tensor) -> Tensor:
        """The last stage's ``tensor`` (fp32, of the same shape on every stage) on every stage of the pipeline."""
        tensor = tensor.to(device=self._device(), dtype=torch.float32)
        dist.broadcast(tensor, group=self.group, group_src=self.pp - 1)
        return tensor

    def sum_tied_gradients(self) -> None:
        """Sum the gradients of the tied embedding's two copies (first and last stage) over the pp ranks; the stages
        in between add zeros. Call once per optimizer step, after the last backward."""
        if self.tied_embedding is not None:
            self.tied_embedding.sum_gradients()

    def copies(self) -> list[nn.Parameter]:
        """Parameters another stage holds too (the last stage's copy of a tied embedding): a norm over all stages
        counts them once, on the first stage."""
        return self.tied_embedding.copies() if self.tied_embedding is not None else []

    def adopt_weights(self) -> None:
        """Once the weights exist (materialized from the meta device, or loaded): the last stage's copy of a tied
        embedding takes the first stage's values, and the stage views take the parameters
        (:meth:`adopt_view_weights`)."""
        self.adopt_view_weights()
        if self.tied_embedding is not None:
            self.tied_embedding.take_first_stage_values()

    def adopt_view_weights(self) -> None:
        """The FSDP units of stage views (several stages per rank) that the model's ``to_empty`` does not reach (the
        views' copied modules) take the parameters it registered."""
        in_model = {id(module) for module in self.model.modules()}
        for unit in self._fsdp_units():
            if id(unit) not in in_model:
                for fsdp_param in (param for group in param_groups(unit) for param in group.fsdp_params):
                    fsdp_param.reset_sharded_param()
        self._parameters = None

    def _device(self) -> torch.device:
        """Where the stages compute and hand each other activations: the mesh's device (FSDP2's CPU offload keeps the
        weights in CPU memory)."""
        device_type = self.mesh.device_type
        if device_type == "cpu":
            return torch.device("cpu")
        return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
