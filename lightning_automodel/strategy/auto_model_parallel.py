"""AutoModelParallelStrategy: the Lightning glue around :func:`lightning_automodel.parallel.parallelize`.

Lightning keeps the loop, logging, callbacks and checkpoint I/O; this class builds the 5D mesh, finds the
Hugging Face models inside the LightningModule and parallelizes them before any optimizer exists.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import ExitStack
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import loss_parallel
from typing_extensions import override

from lightning_automodel.hf.models import find_hf_models
from lightning_automodel.parallel.activation_checkpointing import ACMode, ac_mode
from lightning_automodel.parallel.compile import CompileSpec
from lightning_automodel.parallel.context_parallel import CPAttention
from lightning_automodel.parallel.float8 import Float8Spec, float8_options
from lightning_automodel.parallel.fsdp.options import FSDPOptions
from lightning_automodel.parallel.initial_weights import is_meta
from lightning_automodel.parallel.mesh import axis_size, data_mesh
from lightning_automodel.parallel.options import ParallelOptions
from lightning_automodel.parallel.parallelized import Parallelized
from lightning_automodel.parallel.parallelizer import parallelize
from lightning_automodel.parallel.pipeline import Pipeline, PipelineOptions, pipeline_of
from lightning_automodel.parallel.tensor.plans.selection import PlanSpec
from lightning_automodel.planning.search.fitting import LayoutChoice
from lightning_automodel.strategy.argument_docs import with_argument_docs
from lightning_automodel.strategy.auto_layout import apply_accumulation, choose_for_trainer, require_memory_to_plan
from lightning_automodel.strategy.checkpointing_strategy import CheckpointingStrategy
from lightning_automodel.strategy.epoch_end_resume import EpochEndResume
from lightning_automodel.strategy.faults.monitor import FaultMonitor, report_failure, stop_watching, watch_stage
from lightning_automodel.strategy.faults.preemption import Preemption
from lightning_automodel.strategy.faults.stragglers import point_flight_recorder
from lightning_automodel.strategy.lightning_patches import (
    clip_across_meshes,
    evaluate_without_inference_mode,
    log_local_values,
    to_local,
)
from lightning_automodel.strategy.options import GivenLayout, StrategyOptions
from lightning_automodel.strategy.parallelized_models import (
    PARALLELIZED_BY_US,
    convert_keeping_pinned_fp32,
    materialize,
    models_to_parallelize,
    refuse_fsdp1,
)
from lightning_automodel.strategy.plan_verification import VerifiedPlans
from lightning_automodel.strategy.predict_batches import require_equal_batch_counts
from lightning_automodel.strategy.reductions import MeshReductions

if TYPE_CHECKING:
    import lightning.pytorch as pl


class AutoModelParallelStrategy(EpochEndResume, MeshReductions, CheckpointingStrategy):
    """Lightning's ModelParallelStrategy that parallelizes the LightningModule's Hugging Face models itself.

    Over a 5D mesh: pipeline (pp), HSDP and FSDP2 (dp_replicate, dp_shard), context (cp), tensor and sequence (tp,
    sp) and expert (ep) parallel. Each argument sets a field of ``self.options``, documented there (``--help`` shows
    its first sentence). ``layout="auto"`` chooses the sizes not given at setup; ``self.layout_choice`` holds it::

        trainer = L.Trainer(strategy=AutoModelParallelStrategy(tp=2, sp=True, activation_checkpointing=True))
    """

    strategy_name = "automodel"

    @with_argument_docs
    def __init__(
        self,
        tp: int | None = None,
        *,  # AutoModelParallelStrategy(2, 2) would read as the parent's (data_parallel_size, tensor_parallel_size)
        sp: bool | None = None,
        dp_replicate: int | None = None,
        dp_shard: int | Literal["auto"] = "auto",
        cp: int | None = None,
        cp_attention: CPAttention = "auto",
        pp: int | None = None,
        ep: int = 1,
        pp_schedule: str = "1F1B",
        pp_microbatches: int | None = None,
        pp_layers_per_stage: list[int] | None = None,
        pp_stages_per_rank: int = 1,
        pp_loss_fn: Callable[[Tensor, Tensor], Any] | None = None,  # Any: --help lists no Tensor subclasses
        layout: Literal["auto"] | None = None,
        gpu_memory: float | None = None,
        layout_batch: tuple[int, int] | None = None,
        layout_images_per_row: int | None = None,
        layout_image_tokens: int | None = None,
        layout_expert_imbalance: float | None = None,
        tp_plan: PlanSpec | None = None,
        allow_unsharded_linears: bool = False,
        freeze: list[str] | None = None,
        verify_plans: bool = False,
        activation_checkpointing: bool | ACMode | None = None,
        compile: CompileSpec = False,
        float8: Float8Spec = False,
        mp_policy: MixedPrecisionPolicy | None = None,
        cpu_offload: bool = False,
        reshard_after_forward: bool | None = None,
        forward_prefetch: int = 0,
        backward_prefetch: int = 1,
        save_trainable_only: bool = False,
        save_distributed_checkpoint: bool = True,
        async_save: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        data_parallel_size: int | Literal["auto"] | None = None,
        tensor_parallel_size: int | Literal["auto"] | None = None,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        given = GivenLayout(
            pp=pp,
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            cp=cp,
            tp=tp,
            ep=ep,
            sp=sp,
            checkpointing=None if activation_checkpointing is None else ac_mode(activation_checkpointing),
            pipeline=PipelineOptions(
                schedule=pp_schedule,
                microbatches=pp_microbatches,
                layers_per_stage=pp_layers_per_stage,
                stages_per_rank=pp_stages_per_rank,
                loss_fn=pp_loss_fn,
            ),
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
        )
        parallel = ParallelOptions(
            tp_plan=tp_plan,
            allow_unsharded_linears=allow_unsharded_linears,
            compile=compile,
            float8=float8_options(float8),
            cp_attention=cp_attention,
            freeze=tuple(freeze or ()),
            fsdp=FSDPOptions(
                mp_policy=mp_policy,
                reshard_after_forward=reshard_after_forward,
                forward_prefetch=forward_prefetch,
                backward_prefetch=backward_prefetch,
            ),
        )
        dims, parallel, search = given.placed(parallel, layout=layout)
        self.options = StrategyOptions(
            dims=dims,
            parallel=parallel,
            search=search,
            tp_per_node=given.tp_per_node,
            gpu_memory=gpu_memory,
            layout_batch=tuple(layout_batch) if layout_batch is not None else None,
            layout_images_per_row=layout_images_per_row,
            layout_image_tokens=layout_image_tokens,
            layout_expert_imbalance=layout_expert_imbalance,
            verify_plans=verify_plans,
            cpu_offload=cpu_offload,
            save_trainable_only=save_trainable_only,
            save_distributed_checkpoint=save_distributed_checkpoint,
            async_save=async_save,
        )
        self.layout_choice: LayoutChoice | None = None  # layout="auto"'s, once made
        self._accumulating = False  # the Trainer accumulates the batches the choice needs
        self._verified_plans = VerifiedPlans()
        self._loss_parallel = ExitStack()
        self._models: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._fault_monitor: FaultMonitor | None = None
        self._stopped_alone = False  # the stage failed on this rank, not in a stop every rank agreed

    @override
    def setup_environment(self) -> None:
        # Resolve and validate the sizes and precision before the first collective, identically on every rank.
        self.options = self.options.at_setup(
            devices_per_node=self.num_processes, num_nodes=self.num_nodes, precision=self.precision_plugin.precision
        )
        assert self.lightning_module is not None
        require_memory_to_plan(self.options, self.root_device)
        if self.root_device.type == "cuda":  # nccl: its flight recorder dumps the last collectives at a timeout
            point_flight_recorder(self.lightning_module.trainer.default_root_dir)
        self._setup_distributed()
        # Later stages (validate after fit) reuse the mesh the model lives on.
        if self._device_mesh is None and self.options.search is None:
            self._device_mesh = self.options.dims.build_mesh(self.root_device.type, timeout=self._timeout)
        self.lightning_module._device_mesh = self._device_mesh  # layout="auto": None until setup chose the layout
        self._fault_monitor = watch_stage(self)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """TP and CP peers read the same batch: the sampler's replicas are the data-parallel ranks only."""
        if self._device_mesh is None and self.options.search is not None:
            raise RuntimeError(
                'layout="auto" knows the data-parallel ranks once it has chosen the layout, in the strategy\'s setup'
                " (after configure_model): read the data-parallel place from on_fit_start on, not in setup hooks."
            )
        mesh = data_mesh(self.device_mesh)
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # ModelParallelStrategy.setup, less its demand that configure_model parallelizes the model itself.
        assert self.model is not None
        assert self.accelerator is not None
        refuse_fsdp1(self.model)
        self.accelerator.setup(trainer)
        self._preemption = Preemption(trainer, self._fault_monitor)
        # "bf16-true"/"16-true" cast the module: done before sharding, so FSDP shards and gathers the low-precision
        # weights it will compute with (and materializes them directly in that dtype).
        self.model = convert_keeping_pinned_fp32(self.model, self.precision_plugin.convert_module)
        if self.options.search is not None:
            self._choose_layout(trainer)
        if self.layout_choice is not None and not self._accumulating:  # chosen at validate, applied at fit
            self._accumulating = apply_accumulation(self.layout_choice, trainer)
        self._parallelize_models()
        clip_across_meshes(self.precision_plugin, self._pipelines)
        evaluate_without_inference_mode(trainer)
        _materialize_distributed_module(self.model, self.root_device)
        self.model_to_device()
        self.barrier()

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _choose_layout(self, trainer: pl.Trainer) -> None:
        """layout="auto": the sizes, checkpointing and micro-batches chosen, the same on every rank, then the mesh."""
        self.layout_choice = choose_for_trainer(self.options, trainer, devices_per_node=self.num_processes)
        rank_zero_info(str(self.layout_choice))
        self.options = self.options.with_layout(self.layout_choice.candidate)
        self._device_mesh = self.options.dims.build_mesh(self.root_device.type, timeout=self._timeout)
        self.lightning_module._device_mesh = self._device_mesh

    def _parallelize_models(self) -> None:
        """Parallelize every Hugging Face model the LightningModule holds, unless the user already did; a later stage
        (validate after fit) finds the models parallelized by us and only re-enters loss_parallel."""
        module = self.lightning_module
        assert module is not None
        log_local_values(module)
        models = models_to_parallelize(module, strategy_name=type(self).__name__, previous=self._models)
        if models is None:
            return
        for model in models:
            if model not in PARALLELIZED_BY_US:
                self._parallelize(model)
                PARALLELIZED_BY_US.add(model)
        self._models = weakref.WeakSet(models)
        if axis_size(self.device_mesh, "tp") > 1:
            # lm_head leaves the logits sharded on the vocabulary: cross-entropy and its backward need
            # loss_parallel, entered once per stage for every step (training, validation, manual backward).
            self._loss_parallel.enter_context(loss_parallel())

    def _parallelize(self, model: nn.Module) -> None:
        on_meta = is_meta(model)
        if self.options.verify_plans:
            self._verified_plans.verify_once(model, tp=axis_size(self.device_mesh, "tp"), options=self.options.parallel)
        parallelized = parallelize(model, self.device_mesh, self.options.parallel)
        if on_meta:
            materialize(model, torch.device("cpu") if self.options.cpu_offload else self.root_device)
        parallelized.after_weights_loaded()

    @override
    def model_to_device(self) -> None:
        if not self.options.cpu_offload:  # offloaded FSDP shards must stay in CPU memory
            super().model_to_device()

    @property
    def _parallelized_models(self) -> list[nn.Module]:
        """The models we parallelized, in the module's order (the same on every rank)."""
        assert self.lightning_module is not None
        return [model for model in find_hf_models(self.lightning_module) if model in self._models]

    @property
    def _pipelines(self) -> list[Pipeline]:
        """The pipelines of the models we parallelized (each sums its tied gradients in a collective of its own)."""
        return [pipeline for model in self._parallelized_models if (pipeline := pipeline_of(model)) is not None]

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Each parallelized model's duties (:class:`~lightning_automodel.parallel.parallelized.Parallelized`) once
        the step's last backward ran, before anything reads the gradients (hooks, clipping, the optimizer), and after
        the optimizer step; each may be a collective: in the module's order on every rank."""
        parallelized = [Parallelized(each) for each in self._parallelized_models]

        def closure_then_after_backward() -> Any:
            result = closure()
            for each in parallelized:
                each.after_backward()
            return result

        result = super().optimizer_step(optimizer, closure_then_after_backward, model, **kwargs)
        for each in parallelized:
            each.after_optimizer_step()
        assert self._preemption is not None
        self._preemption.agree()  # a signal stops every rank after the same step
        return result

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._preemption is not None:
            self._preemption.begin_batch()
        return to_local(super().training_step(*args, **kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return to_local(super().validation_step(*args, **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return to_local(super().test_step(*args, **kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return to_local(super().predict_step(*args, **kwargs))

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Every rank must take part in every forward pass of a sharded model: predict batches dealt unevenly are
        refused here, before the predict loop could leave a rank without batches."""
        assert self.lightning_module is not None
        if self.lightning_module.trainer.predicting:
            require_equal_batch_counts(dataloader, world_size=self.world_size)
        return super().process_dataloader(dataloader)

    @override
    def on_exception(self, exception: BaseException) -> None:
        report_failure(self._fault_monitor, exception)
        together = self._preemption is not None and self._preemption.leave(exception)
        self._stopped_alone = not together  # no collective at teardown: the other ranks may be elsewhere

    @override
    def teardown(self) -> None:
        try:
            self._close_saves(collective=not self._stopped_alone)
        finally:
            self._stopped_alone = False
            stop_watching(self._fault_monitor)
            self._loss_parallel.close()
            super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        description = "Automatic PP, HSDP/FSDP2, CP, TP/SP and EP for Hugging Face models"
        strategy_registry.register(cls.strategy_name, cls, description=description, override=True)


AutoModelParallelStrategy.register_strategies(StrategyRegistry)
