"""Tensor (and sequence) parallel for Hugging Face models, with torch's ``ParallelStyle`` objects.

A model's plan is chosen in :mod:`.plan_selection`: the user's ``tp_plan``, else the first candidate that shards every
decoder block (:mod:`.plan_coverage`) of the family plan registered for its class (:mod:`.family_plans`), its own
Hugging Face plan (:mod:`.hf_plan`), the default Llama-style plan and a plan derived from its data flow
(:mod:`.derived_plan`). All but the family plan are completed with experts and latent attention
(:mod:`.plan_completion`); with sp, the Hugging Face and derived plans get a sequence-parallel layout
(:mod:`.sequence_parallel`). :mod:`.apply` then checks the plan on a meta-device copy (:mod:`.head_counts`,
:mod:`.sharded_activations`) and shards the model with it. The styles torch does not ship are in
:mod:`.projection_styles`, :mod:`.stream_styles` and :mod:`.parameter_styles`. ``register_tp_plan`` and
``select_tp_plan`` are exported by :mod:`lightning_automodel.parallel`: re-exported here, they would make importing
:mod:`lightning_automodel.parallel.experts` (which uses this package's styles) import itself half-way.
"""
