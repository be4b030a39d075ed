"""Pipeline parallel: a Hugging Face decoder split into stages by its decoder layers, run by torch's schedules. Each
pp rank keeps its stages in place (:mod:`.stage_split`), under the layers' Hugging Face names, and the model's own
forward computes each stage: the first from ``input_ids``, the others from the previous stage's hidden states as
``inputs_embeds``. A call of the model runs one schedule step (:mod:`.runtime`); models whose class does not compose
that way are refused before any collective (:mod:`.problems`). See docs/pipeline.md."""

from lightning_automodel.parallel.pipeline.calls import PipelinedModel
from lightning_automodel.parallel.pipeline.model import pipeline_model, pipeline_of
from lightning_automodel.parallel.pipeline.options import PipelineOptions, bubble_fraction, stage_layers
from lightning_automodel.parallel.pipeline.problems import pipeline_problem, stage_split_problem
from lightning_automodel.parallel.pipeline.runtime import Pipeline
from lightning_automodel.parallel.pipeline.stage_split import blocks_owner, name_of, split_into_stage, stage_view

__all__ = [
    "Pipeline",
    "PipelineOptions",
    "PipelinedModel",
    "blocks_owner",
    "bubble_fraction",
    "name_of",
    "pipeline_model",
    "pipeline_of",
    "pipeline_problem",
    "split_into_stage",
    "stage_layers",
    "stage_split_problem",
    "stage_view",
]
