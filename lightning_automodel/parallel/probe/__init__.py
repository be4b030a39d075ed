"""The probe: one training step of a model on the meta device, recording what every module receives (:mod:`.step`),
its questions of values answered from those of the CPU tensors it was computed from (:mod:`.meta_values`)."""
