"""Mixture-of-experts layers over ranks: expert parallel (:mod:`.expert_parallel`: whole experts spread over ep,
tokens sent to them by all-to-all), the experts no token reached given a zero gradient for FSDP2
(:mod:`.unreached_experts`), and the load-balancing loss over the global batch (:mod:`.load_balancing_loss`). Expert
tensor parallel, every expert split on its intermediate units over tp, is a tensor-parallel style
(:mod:`lightning_automodel.parallel.tensor.styles.experts`)."""
