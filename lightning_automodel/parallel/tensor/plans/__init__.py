"""Tensor-parallel plans and the choice among them (:mod:`.selection`): the user's ``tp_plan``, else the first
candidate that shards every decoder block (:mod:`.sharded_weights`) of the family plan registered for the model's
class (:mod:`.family`), its own Hugging Face plan (:mod:`.hf_plan`), the default Llama-style plan and a plan derived
from its data flow (:mod:`.derived`). All but the family plan are completed with experts and latent attention
(:mod:`.completion`) and, with sp, given a sequence-parallel layout where they have none (:mod:`.sequence_parallel`).
Plan keys are module patterns (:mod:`.patterns`).
"""
