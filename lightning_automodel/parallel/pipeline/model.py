"""A model made pipelined in place: this rank's stages kept, and its calls running the schedule."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_automodel.hf.decoder_layers import named_language_layers, named_multimodal_parts
from lightning_automodel.parallel.experts.load_balancing_loss import balancing_of
from lightning_automodel.parallel.mesh import axis_size, reduction_mesh
from lightning_automodel.parallel.model_calls import take_over_calls, taken_over
from lightning_automodel.parallel.pipeline.calls import PipelinedModel
from lightning_automodel.parallel.pipeline.images import StageImages
from lightning_automodel.parallel.pipeline.load_balancing import PipelineBalancing
from lightning_automodel.parallel.pipeline.options import PipelineOptions, stage_layers
from lightning_automodel.parallel.pipeline.runtime import Pipeline
from lightning_automodel.parallel.pipeline.stage_split import blocks_owner, is_tied, split_into_stage


def pipeline_model(model: nn.Module, mesh: DeviceMesh, options: PipelineOptions) -> Pipeline:
    """Keep this rank's stage of ``model`` (see :func:`split_into_stage`) and make its calls run the schedule.

    Done before tensor parallel and FSDP: they then shard only what the stage holds, and FSDP's root is the stage
    the schedule calls (torch's stage defers FSDP's gradient reduction to the last micro-batch for it)."""
    pp = axis_size(mesh, "pp")
    stages = stage_layers(len(named_language_layers(model)), pp * options.stages_per_rank, options.layers_per_stage)
    layers = {stage: stages[stage] for stage in options.stages_of_rank(mesh["pp"].get_local_rank(), pp)}
    tied, blocks_config = is_tied(model), blocks_owner(model)[0].config
    balancing = balancing_of(model)
    images = StageImages(model) if named_multimodal_parts(model) else None
    held = [index for stage in sorted(layers) for index in layers[stage]]
    split_into_stage(model, layers=held, first=0 in layers, last=len(stages) - 1 in layers)
    if balancing is not None:
        groups = [mesh["pp"].get_group(), reduction_mesh(mesh).get_group()]
        balancing = PipelineBalancing(balancing, groups=groups, data_parallel=reduction_mesh(mesh).size())
    pipeline = Pipeline(
        model,
        mesh,
        options,
        layers=layers,
        tied=tied,
        blocks_config=blocks_config,
        balancing=balancing,
        images=images,
    )
    take_over_calls(model, PipelinedModel, prefix="Pipelined", pipeline=pipeline)
    return pipeline


def pipeline_of(model: nn.Module) -> Pipeline | None:
    """The pipeline of a model :func:`pipeline_model` split (a PEFT model's base), or None."""
    return taken_over(model, PipelinedModel, "pipeline")
