"""Mixture-of-experts layers over ranks: expert tensor parallel (:mod:`.expert_tensor_parallel`: every expert split on
its intermediate units over tp), expert parallel (:mod:`.expert_parallel`: whole experts spread over ep, tokens sent
to them by all-to-all), and the load-balancing loss over the global batch (:mod:`.load_balancing_loss`)."""
