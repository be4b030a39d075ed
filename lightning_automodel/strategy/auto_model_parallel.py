"""AutoModelParallelStrategy: the Lightning glue around :func:`lightning_automodel.parallel.parallelize`.

Lightning keeps the loop, logging, callbacks and checkpoint I/O; this class builds the 5D mesh, finds the
Hugging Face models inside the LightningModule and parallelizes them before any optimizer exists.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Generator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_automodel.hf.initialization import materialize_hf_model
from lightning_automodel.hf.loading import materialize_pretrained, pretrained_checkpoint
from lightning_automodel.hf.models import find_hf_models
from lightning_automodel.io.atomic_directory import atomic_directory, check_save_path
from lightning_automodel.io.lightning_checkpoint import (
    check_checkpoint,
    explain_save_failure,
    load_sharded_checkpoint,
    not_checkpoint_files,
    only_trainable,
    split_packed,
)
from lightning_automodel.parallel import parallelize
from lightning_automodel.parallel.activation_checkpointing import ACMode, validate_ac_mode
from lightning_automodel.parallel.compile import CompileSpec, check_compile, compile_options
from lightning_automodel.parallel.context_parallel import CPAttention, attention_kernel, check_cp_with_pp
from lightning_automodel.parallel.fsdp.dtypes import keep_pinned_fp32
from lightning_automodel.parallel.fsdp.precision import mixed_precision_policy
from lightning_automodel.parallel.fsdp.sharding import validate_prefetch
from lightning_automodel.parallel.grad_norm import clip_grad_norm_
from lightning_automodel.parallel.mesh import ParallelDims, axis_size, data_mesh, reduction_mesh
from lightning_automodel.parallel.parallelizer import fp32_pinned_names, is_meta
from lightning_automodel.parallel.pipeline import Pipeline, PipelineOptions, pipeline_of
from lightning_automodel.parallel.tensor.plans import PlanSpec
from lightning_automodel.planning.verify import plan_unregistered, verify_plan
from lightning_automodel.strategy.faults import (
    FaultMonitor,
    notify_sigterm_locally,
    report_failure,
    stop_watching,
    watch_stage,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

# Models this package parallelized, so a later stage on the same module does not mistake them for the user's.
_PARALLELIZED_BY_US: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class AutoModelParallelStrategy(ModelParallelStrategy):
    """Tensor, sequence and fully sharded data parallelism for unmodified Hugging Face models.

    Args:
        tp: tensor-parallel size (ranks that split every layer's weights).
        sp: sequence parallel: also split norms and the residual stream on the sequence (needs ``tp > 1``).
        dp_replicate: replicas of the whole sharded model (HSDP across nodes).
        dp_shard: FSDP shard-group size; ``"auto"`` takes what the world size leaves.
        cp: context-parallel size: every sequence is split over cp ranks (2 cp chunks, rank i holding chunks i and
            2 cp - 1 - i), and attention all-gathers keys and values over them. The model's call takes the whole
            batch and returns this rank's share of the loss: training_step returns the model's own loss
            (``self.model(input_ids=..., labels=...).loss``). FSDP shards over dp_shard x cp.
        cp_attention: the attention kernel at cp > 1: "flex" (flex attention over a block mask: the masked blocks
            skipped, nothing quadratic in the sequence stored; trains on GPUs only, torch has no CPU backward),
            "sdpa" (SDPA over a dense [S / cp, S] mask a row: any device, memory quadratic in the sequence) or
            "auto" (default: flex on GPUs, sdpa elsewhere).
        ep: expert-parallel size: each of ep ranks holds 1/ep of every mixture-of-experts layer's experts, and tokens
            travel to their experts by all-to-all. ep borrows its ranks from dp_shard x cp (it must divide it); FSDP
            shards the experts over what dp_shard x cp leaves, and with tp > 1 each expert is also split over tp.
        pp: pipeline-parallel size: each of pp ranks holds a stage of every model (consecutive decoder layers, the
            embedding on the first, the head on the last), and a schedule of torch.distributed.pipelining runs
            forward and backward of every micro-batch. training_step returns the model's own loss
            (``self.model(input_ids=..., labels=...).loss``): the last stage computes it, and it reaches every rank.
            Composes with tp (and sp), dp_shard, dp_replicate, ep, activation checkpointing and LoRA; not with cp yet.
        pp_schedule: "1F1B" (default), "GPipe", or with pp_stages_per_rank >= 2 "Interleaved1F1B", "LoopedBFS" or
            "InterleavedZeroBubble" (torch's schedule names).
        pp_microbatches: micro-batches per step (default: pp); must divide the batch, and be >= pp for "1F1B".
        pp_layers_per_stage: a manual split, the number of decoder layers of each stage (pp x pp_stages_per_rank
            stages); default: an even split in which the embedding and the head count as one layer each.
        pp_stages_per_rank: stages each rank holds (virtual stages) for the interleaved schedules: rank r holds
            stages r, r + pp, ...; the bubble shrinks to (pp - 1) / (pp_stages_per_rank x m + pp - 1).
        pp_loss_fn: a loss of your own under pp (in YAML, its import path): ``f(logits, labels)`` returns a
            micro-batch's loss summed over its tokens, which the last stage computes and the pipeline divides by the
            global batch's scored tokens; default: the next-token cross-entropy.
        tp_plan: a dict of module pattern -> ParallelStyle, an import path to one, or a function
            ``(model, sp) -> dict``; default: the first of the family's registered plan, the model's Hugging Face
            plan and the default Llama-style plan that shards every decoder block.
        allow_unsharded_linears: accept a plan that leaves large weights of the decoder blocks whole on every tp
            rank (the candidate sharding the largest share of them then wins).
        verify_plans: before parallelizing a model whose class no family plan is registered for (or with
            ``tp_plan`` given), verify its plan once per class with :func:`~lightning_automodel.verify_plan`: one
            step of a shrunk replica, tp simulated on CPU, against one process. A plan that trains wrong raises on
            every rank before any collective. Costs seconds per class (a child process on every rank).
        activation_checkpointing: recompute activations in backward: True or "full" (whole decoder layers),
            "selective" (keep attention and every other matmul output) or "submodule" (attention and MLP apart).
        compile: compile every decoder block's forward with torch.compile after tensor parallel and activation
            checkpointing, before FSDP2: False (default), True (torch's defaults) or a dict of torch.compile's
            keyword arguments (e.g. ``{"fullgraph": True, "mode": "max-autotune-no-cudagraphs"}``). The blocks share
            one graph; composes with activation_checkpointing="full" (the other modes are refused).
        mp_policy: FSDP2 MixedPrecisionPolicy; default: derived from ``Trainer(precision=...)``.
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory.
        reshard_after_forward: None (default): free every decoder layer's gathered weights after its forward but
            the last's, and keep the root's; under pp, free none (torch's pipeline stage keeps them gathered from a
            micro-batch's backward to the last one: freed after each forward, they would be gathered again for each
            micro-batch); True: free all (least memory); False: free none (no all-gather in backward).
        forward_prefetch: following decoder layers each layer all-gathers before its forward (0: none ahead).
        backward_prefetch: preceding decoder layers each layer all-gathers in backward (1: FSDP's default).
        save_trainable_only: checkpoints hold the trainable parameters only (LoRA adapters) with the optimizer and
            loop state; resuming takes the frozen rest from the model as built (its pretrained weights or seed).
        save_distributed_checkpoint, process_group_backend, timeout: as in Lightning's ModelParallelStrategy.
            ``timeout`` also bounds every sub-group of the mesh.
        data_parallel_size, tensor_parallel_size: Lightning's ModelParallelStrategy names for ``dp_shard`` and
            ``tp``, so that its configurations run unchanged (``tensor_parallel_size="auto"``: the devices of one
            node, as there); giving both names with different values is an error.

    Every argument but ``tp`` is keyword-only: ``AutoModelParallelStrategy(2, 2)`` would otherwise read as
    Lightning's ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)`` yet mean something else.
    """

    strategy_name = "automodel"

    def __init__(
        self,
        tp: int = 1,
        *,
        sp: bool = False,
        dp_replicate: int = 1,
        dp_shard: int | Literal["auto"] = "auto",
        cp: int = 1,
        cp_attention: CPAttention = "auto",
        pp: int = 1,
        ep: int = 1,
        pp_schedule: str = "1F1B",
        pp_microbatches: int | None = None,
        pp_layers_per_stage: list[int] | None = None,
        pp_stages_per_rank: int = 1,
        pp_loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
        tp_plan: PlanSpec | None = None,
        allow_unsharded_linears: bool = False,
        verify_plans: bool = False,
        activation_checkpointing: bool | ACMode = False,
        compile: CompileSpec = False,
        mp_policy: MixedPrecisionPolicy | None = None,
        cpu_offload: bool = False,
        reshard_after_forward: bool | None = None,
        forward_prefetch: int = 0,
        backward_prefetch: int = 1,
        save_trainable_only: bool = False,
        save_distributed_checkpoint: bool = True,
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
        _require_bools(
            sp=sp,
            allow_unsharded_linears=allow_unsharded_linears,
            verify_plans=verify_plans,
            cpu_offload=cpu_offload,
            save_trainable_only=save_trainable_only,
            save_distributed_checkpoint=save_distributed_checkpoint,
        )
        tp = _parent_size("tensor_parallel_size", tensor_parallel_size, "tp", tp, unset=1)
        dp_shard = _parent_size("data_parallel_size", data_parallel_size, "dp_shard", dp_shard, unset="auto")
        self._tp_per_node = tensor_parallel_size == "auto"  # as in the parent: the devices of one node
        self.parallel_dims = ParallelDims(
            pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=1 if self._tp_per_node else tp, ep=ep
        )
        check_cp_with_pp(cp=cp, pp=pp)
        attention_kernel(cp_attention, "cpu")  # a name it does not know is refused here
        self.cp_attention = cp_attention
        if pp > 1 and cpu_offload:
            raise ValueError(f"pp={pp} with cpu_offload=True is not supported yet: use one of them.")
        pipeline = PipelineOptions(pp_schedule, pp_microbatches, pp_layers_per_stage, pp_stages_per_rank, pp_loss_fn)
        self.pipeline = pipeline if pp > 1 else None
        if self.pipeline is not None:
            self.pipeline.validate(pp)
        _require_tp_for_sp(sp=sp, tp=tp)
        validate_ac_mode(activation_checkpointing)
        compile_options(compile)
        check_compile(compile=compile, activation_checkpointing=activation_checkpointing, ep=ep)
        validate_prefetch(forward_prefetch, backward_prefetch)
        if save_trainable_only and not save_distributed_checkpoint:
            raise ValueError(
                "save_trainable_only=True writes sharded checkpoints; it needs save_distributed_checkpoint=True."
            )
        self.sp = sp
        self.tp_plan = tp_plan
        self.allow_unsharded_linears = allow_unsharded_linears
        self.verify_plans = verify_plans
        self._verified_classes: set[type] = set()
        self.activation_checkpointing = activation_checkpointing
        self.compile = compile
        self.mp_policy = mp_policy
        self.cpu_offload = cpu_offload
        self.fsdp_options = dict(
            reshard_after_forward=reshard_after_forward,
            forward_prefetch=forward_prefetch,
            backward_prefetch=backward_prefetch,
        )
        self.save_trainable_only = save_trainable_only
        self._loss_parallel = ExitStack()
        self._models: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._fault_monitor: FaultMonitor | None = None

    @override
    def setup_environment(self) -> None:
        # Resolve and validate the sizes and precision before the first collective, identically on every rank.
        if self._tp_per_node:
            self.parallel_dims = dataclasses.replace(self.parallel_dims, tp=self.num_processes)
            _require_tp_for_sp(sp=self.sp, tp=self.num_processes)
        self.parallel_dims = self.parallel_dims.resolve(self.num_nodes * self.num_processes)
        self._mixed_precision_policy()
        self._setup_distributed()
        if self._device_mesh is None:  # later stages (validate after fit) reuse the mesh the model lives on
            self._device_mesh = self.parallel_dims.build_mesh(self.root_device.type, timeout=self._timeout)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        self._fault_monitor = watch_stage(self)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """TP and CP peers read the same batch: the sampler's replicas are the data-parallel ranks only."""
        mesh = data_mesh(self.device_mesh)
        return {"num_replicas": mesh.size(), "rank": mesh.get_local_rank()}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # ModelParallelStrategy.setup, less its demand that configure_model parallelizes the model itself.
        assert self.model is not None
        assert self.accelerator is not None
        _refuse_fsdp1(self.model)
        self.accelerator.setup(trainer)
        notify_sigterm_locally(trainer, self._fault_monitor)

        # "bf16-true"/"16-true" cast the module: do it before sharding, so FSDP shards and gathers the low-precision
        # weights it will compute with (and materializes them directly in that dtype). What a model pins to fp32
        # stays fp32, as in Hugging Face's from_pretrained(dtype=torch.bfloat16).
        with ExitStack() as pinned:
            for model in find_hf_models(self.model):
                pinned.enter_context(keep_pinned_fp32(model, fp32_pinned_names(model)))
            self.model = self.precision_plugin.convert_module(self.model)
        self._parallelize_models()
        _clip_across_meshes(self.precision_plugin, self._pipelines)
        _evaluate_without_inference_mode(trainer)
        _materialize_distributed_module(self.model, self.root_device)
        self.model_to_device()
        self.barrier()

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize_models(self) -> None:
        """Parallelize every Hugging Face model the LightningModule holds, unless the user already did.

        A later stage (validate after fit) finds the models parallelized by us and only re-enters loss_parallel.
        """
        module = self.lightning_module
        assert module is not None
        models = find_hf_models(module)
        _log_local_values(module)
        ours = bool(models) and all(model in _PARALLELIZED_BY_US for model in models)
        if not ours and _is_parallelized(module):
            log.info(
                "%s is already parallelized (DTensor or FSDP2 parameters); leaving it as it is.", type(module).__name__
            )
            return
        if not models:
            raise TypeError(
                f"{type(self).__name__} found no Hugging Face model (transformers.PreTrainedModel) in"
                f" {type(module).__name__}. Assign the model to an attribute in __init__ or configure_model"
                " (e.g. self.model = AutoModelForCausalLM.from_config(config)), or parallelize it yourself in"
                " configure_model."
            )
        if self._models and not any(model in self._models for model in models):
            rank_zero_warn(
                f"{type(module).__name__} holds a new model in this stage: the one trained before was replaced"
                " (configure_model runs at every stage). Guard it with `if self.model is not None: return`."
            )
        for model in models:
            if model not in _PARALLELIZED_BY_US:
                self._parallelize(model)
                _PARALLELIZED_BY_US.add(model)
        self._models = weakref.WeakSet(models)
        if axis_size(self.device_mesh, "tp") > 1:
            # lm_head leaves the logits sharded on the vocabulary: cross-entropy and its backward need
            # loss_parallel, entered once per stage for every step (training, validation, manual backward).
            self._loss_parallel.enter_context(loss_parallel())

    def _parallelize(self, model: nn.Module) -> None:
        meta = is_meta(model)
        if self.verify_plans:
            self._verify_plan_once(model)
        parallelize(
            model,
            self.device_mesh,
            sp=self.sp,
            tp_plan=self.tp_plan,
            allow_unsharded_linears=self.allow_unsharded_linears,
            activation_checkpointing=self.activation_checkpointing,
            mp_policy=self._mixed_precision_policy(),
            offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.cpu_offload else None,
            pipeline=self.pipeline,
            cp_attention=self.cp_attention,
            compile=self.compile,
            **self.fsdp_options,
        )
        if meta:
            device = torch.device("cpu") if self.cpu_offload else self.root_device
            if pretrained_checkpoint(model) is not None:
                materialize_pretrained(model, device)
            else:
                materialize_hf_model(model, device)
        if (pipeline := pipeline_of(model)) is not None:
            pipeline.adopt_weights()

    def _verify_plan_once(self, model: nn.Module) -> None:
        """Verify the plan of a class met for the first time whose plan no family registered (``verify_plans``).

        Every rank verifies on its own, in a child process (verify_plan's simulation needs a process group of its
        own): the step is seeded and deterministic, so every rank should reach the same verdict. A child can still
        fail on one rank only (out of memory, killed), so the ranks then exchange their outcomes, all of them
        reaching that one collective, and every rank raises the first failure, before parallelize's first collective.
        """
        hf_model = model.get_base_model() if hasattr(model, "get_base_model") else model
        tp = axis_size(self.device_mesh, "tp")
        if tp == 1 or type(hf_model) in self._verified_classes or not plan_unregistered(hf_model, self.tp_plan):
            return
        verification, failure = None, None
        try:
            verification = verify_plan(
                hf_model, tp=tp, sp=self.sp, tp_plan=self.tp_plan, allow_unsharded_linears=self.allow_unsharded_linears
            )
        except Exception as error:  # noqa: BLE001 - raised below on every rank, once all know
            failure = error
        outcomes = [None] * self.world_size
        dist.all_gather_object(outcomes, None if failure is None else f"{type(failure).__name__}: {failure}")
        failed = [(rank, message) for rank, message in enumerate(outcomes) if message is not None]
        if failure is not None:
            raise failure
        if failed:
            rank, message = failed[0]
            raise ValueError(
                f"verify_plans: verifying the plan of {type(hf_model).__name__} failed on rank {rank}: {message}"
            )
        self._verified_classes.add(type(hf_model))
        rank_zero_info(f"The plan of {type(hf_model).__name__} is verified:\n{verification}")

    @override
    def model_to_device(self) -> None:
        if not self.cpu_offload:  # offloaded FSDP shards must stay in CPU memory
            super().model_to_device()

    def _mixed_precision_policy(self) -> MixedPrecisionPolicy | None:
        policy = mixed_precision_policy(self.precision_plugin.precision)
        return self.mp_policy if self.mp_policy is not None else policy

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        state = only_trainable(state, self.model) if self.save_trainable_only else state
        return split_packed(state) if self._save_distributed_checkpoint else state

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        return split_packed(state) if self._save_distributed_checkpoint else state

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Sharded checkpoints are written beside their path and swapped in once every rank has written its part:
        a save that fails midway (a full disk, a killed job) leaves the previous checkpoint at that path whole.

        A save replaces a previous checkpoint at its path and nothing else: a path holding other files (a user's
        folder, a dataset) is refused on every rank, where the parent would delete them or write among them."""
        path = Path(self.broadcast(filepath))
        if not self._save_distributed_checkpoint:
            check_save_path(path, unowned=not_checkpoint_files)
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        with atomic_directory(path, unowned=not_checkpoint_files) as staging, explain_save_failure(path):
            super().save_checkpoint(checkpoint, staging, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        check_checkpoint(path)
        if not self.save_trainable_only and not _is_sharded_checkpoint(path):
            return super().load_checkpoint(path, weights_only=weights_only)
        assert self.lightning_module is not None
        return load_sharded_checkpoint(
            path,
            self.model,
            self.optimizers,
            trainable_only=self.save_trainable_only,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
        )

    @property
    def _pipelines(self) -> list[Pipeline]:
        """The pipelines of the models we parallelized, in the module's order (the same on every rank: each sums its
        tied gradients in a collective of its own)."""
        assert self.lightning_module is not None
        models = [model for model in find_hf_models(self.lightning_module) if model in self._models]
        return [pipeline for model in models if (pipeline := pipeline_of(model)) is not None]

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Under pp, the two copies of a tied embedding sum their gradients once the step's last backward ran, before
        anything reads them (hooks, clipping, the optimizer)."""

        def closure_then_sum_tied_gradients() -> Any:
            result = closure()
            for pipeline in self._pipelines:
                pipeline.sum_tied_gradients()
            return result

        return super().optimizer_step(optimizer, closure_then_sum_tied_gradients, model, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return _to_local(super().training_step(*args, **kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return _to_local(super().validation_step(*args, **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return _to_local(super().test_step(*args, **kwargs))

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return _to_local(super().predict_step(*args, **kwargs))

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulating micro-batches: FSDP keeps the unsharded gradients and reduce-scatters them once, on the
        last micro-batch, instead of once per micro-batch (Lightning blocks only DDP's sync itself)."""
        assert self.model is not None
        units = [module for module in self.model.modules() if isinstance(module, FSDPModule)]
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)

    @override
    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor:
        """Reduce over the data-parallel ranks (dp_replicate x dp_shard x cp) unless a group is given.

        TP peers hold the same value; reducing over them too would count it tp times in a sum.
        """
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self._device_mesh is not None:  # before setup, as the parent: the world, if any
            group = reduction_mesh(self.device_mesh).get_group()
        return _sync_ddp_if_available(_to_local(tensor), group, reduce_op=reduce_op)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Every rank must take part in every forward pass of a sharded model, and Lightning deals predict batches
        unevenly (no padding, so that each row is predicted once): a rank with a batch more would wait for its
        peers forever. Refuse that on every rank before the first batch (this hook runs before the predict loop
        could leave a rank without batches)."""
        assert self.lightning_module is not None
        if self.lightning_module.trainer.predicting and self.world_size > 1 and hasattr(dataloader, "__len__"):
            counts = [0] * self.world_size
            torch.distributed.all_gather_object(counts, len(dataloader))
            if len(set(counts)) > 1:
                raise ValueError(
                    f"predict: the ranks hold different numbers of batches ({counts}), and a sharded model needs"
                    " every rank in every forward pass. Give the predict DataLoader a DistributedSampler(dataset,"
                    " shuffle=False, **trainer.distributed_sampler_kwargs) (it pads by repeating rows), or make the"
                    " number of rows a multiple of the data-parallel size times the batch size."
                )
        return dataloader

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agree over every rank (Lightning compares the sum with the world size)."""
        count = torch.tensor(int(decision), device=self.root_device)
        count = _sync_ddp_if_available(count, _group.WORLD, reduce_op=ReduceOp.SUM)
        return bool(count == self.world_size) if all else bool(count)

    @override
    def on_exception(self, exception: BaseException) -> None:
        report_failure(self._fault_monitor, exception)

    @override
    def teardown(self) -> None:
        stop_watching(self._fault_monitor)
        self._loss_parallel.close()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Automatic TP/SP/FSDP2 for Hugging Face models", override=True
        )


def _require_bools(**flags: Any) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r}: {name} is a flag, True or False.")


def _require_tp_for_sp(*, sp: bool, tp: int | Literal["auto"]) -> None:
    if sp and tp == 1:
        raise ValueError("sp=True (sequence parallel) splits activations over the tp ranks; it needs tp > 1.")


def _parent_size(parent_name: str, parent_value: Any, name: str, value: Any, *, unset: Any) -> Any:
    """The size a user gave under Lightning's ModelParallelStrategy's name (``parent_name``) or ours (``name``);
    giving both with different values is an error, not a guess. ``unset`` is our argument's default."""
    if parent_value is None:
        return value
    if value != unset and value != parent_value:
        raise ValueError(
            f"{name}={value!r} and {parent_name}={parent_value!r} disagree: {parent_name} is Lightning's"
            f" ModelParallelStrategy name for {name}. Give one of them."
        )
    return parent_value


def _refuse_fsdp1(module: nn.Module) -> None:
    """FSDP1 (``FullyShardedDataParallel``) wraps parameters in flat buffers that tensor parallel and FSDP2 cannot
    shard underneath; refused as Lightning's ModelParallelStrategy refuses it."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(child, FullyShardedDataParallel) for child in module.modules()):
        raise TypeError(
            f"{type(module).__name__} holds modules wrapped in torch.distributed.fsdp.FullyShardedDataParallel"
            " (FSDP1). AutoModelParallelStrategy shards with FSDP2 itself: remove the wrapper and set dp_shard /"
            " dp_replicate on the strategy, or apply FSDP2's fully_shard in configure_model yourself."
        )


def _is_parallelized(module: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


def _to_local(output: Any) -> Any:
    """Hand Lightning plain tensors where a step returned DTensors (a loss from vocab-sharded logits, the logits
    themselves); gradients still flow through ``full_tensor``."""
    return apply_to_collection(output, DTensor, DTensor.full_tensor)


def _clip_across_meshes(precision: Precision, pipelines: list[Pipeline]) -> None:
    """Route Trainer(gradient_clip_val=...) with the "norm" algorithm to a clip that handles gradients on
    several meshes (torch's fails on the mix) and, under pp, on several stages (a tied embedding's copy on the last
    stage counted once). Precision plugins own clipping in Lightning, one class per precision flag, so the method is
    replaced on the instance rather than in a subclass of each."""

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: int | float) -> None:
        copies = [copy for pipeline in pipelines for copy in pipeline.copies()]
        stages = pipelines[0].group if pipelines else None
        clip_grad_norm_(precision.main_params(optimizer), clip_val, stage_group=stages, counted_elsewhere=copies)

    precision.clip_grad_by_norm = clip_grad_by_norm


def _evaluate_without_inference_mode(trainer: pl.Trainer) -> None:
    """Evaluate under ``no_grad``, as Lightning already does in fit's validation and for its own FSDP strategy.

    FSDP2 allocates its all-gather buffers at the first unshard; made under ``inference_mode`` they are inference
    tensors, and every later unshard fails ("Inference tensors do not track version counter"). Measured on a GPU
    with ``trainer.validate`` as the first stage; on gloo Lightning uses ``no_grad`` anyway, so CPU runs never see it.
    """
    for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        loop.inference_mode = False


def _log_local_values(module: pl.LightningModule) -> None:
    """Make ``module.log`` store plain tensors: a DTensor would end up in callback_metrics and checkpoints
    (ModelCheckpoint's best score), which then hold a pickled device mesh. ``log_dict`` goes through it too."""
    if getattr(module.log, "logs_local_values", False):
        return
    log_value = module.log

    @functools.wraps(log_value)
    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        log_value(name, _to_local(value), *args, **kwargs)

    log.logs_local_values = True
    module.log = log


AutoModelParallelStrategy.register_strategies(StrategyRegistry)
