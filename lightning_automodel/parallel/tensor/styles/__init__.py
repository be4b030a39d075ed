"""Parallel styles torch does not ship, each a small subclass of a torch ``ParallelStyle``: the sequence-sharded
residual stream (:mod:`.stream`), fused, Conv1D and vocabulary projections (:mod:`.projections`), parameters computing
on sharded activations (:mod:`.parameters`), arguments sliced with what they meet (:mod:`.inputs`), a mixture-of-experts
layer's experts split on their intermediate units (:mod:`.experts`), and the recurrent mixers (:mod:`.mixers` picks
one): state-space and short-convolution (:mod:`.state_space`), the gated delta rule (:mod:`.delta_rule`).
"""
