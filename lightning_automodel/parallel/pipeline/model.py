"""A model made pipelined in place: this rank's stages kept, and its calls running the schedule."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_automodel.hf.decoder_layers import named_decoder_layers
from lightning_automodel.parallel.mesh import axis_size
from lightning_automodel.parallel.model_calls import take_over_calls, taken_over
from lightning_automodel.parallel.pipeline.options import PipelineOptions, stage_layers
from lightning_automodel.parallel.pipeline.runtime import Pipeline, PipelinedModel
from lightning_automodel.parallel.pipeline.stage_split import blocks_owner, is_tied, split_into_stage


def pipeline_model(model: nn.Module, mesh: DeviceMesh, options: PipelineOptions) -> Pipeline:
    """Keep this rank's stage of ``model`` (see :func:`split_into_stage`) and make its calls run the schedule.

    Done before tensor parallel and FSDP: they then shard only what the stage holds, and FSDP's root is the stage
    the schedule calls (torch's stage defers FSDP's gradient reduction to the last micro-batch for it)."""
    pp = axis_size(mesh, "pp")
    stages = stage_layers(len(named_decoder_layers(model)), pp * options.stages_per_rank, options.layers_per_stage)
    layers = {stage: stages[stage] for stage in options.stages_of_rank(mesh["pp"].get_local_rank(), pp)}
    tied, blocks_config = is_tied(model), blocks_owner(model)[0].config
    held = [index for stage in sorted(layers) for index in layers[stage]]
    split_into_stage(model, layers=held, first=0 in layers, last=len(stages) - 1 in layers)
    pipeline = Pipeline(model, mesh, options, layers=layers, tied=tied, blocks_config=blocks_config)
    take_over_calls(model, PipelinedModel, prefix="Pipelined", pipeline=pipeline)
    return pipeline


def pipeline_of(model: nn.Module) -> Pipeline | None:
    """The pipeline of a model :func:`pipeline_model` split (a PEFT model's base), or None."""
    return taken_over(model, PipelinedModel, "pipeline")
