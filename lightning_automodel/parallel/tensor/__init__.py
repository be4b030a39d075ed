"""Tensor (and sequence) parallel for Hugging Face models, with torch's ``ParallelStyle`` objects.

:mod:`.plans` chooses a model's plan; :mod:`.apply` checks it on a meta-device copy (:mod:`.head_counts`,
:mod:`.sharded_activations`) and shards the model with it; :mod:`.styles` holds the styles torch does not ship,
:mod:`.lora` makes any plan shard PEFT's LoRA layers. ``register_tp_plan`` and ``select_tp_plan`` are exported by
:mod:`lightning_automodel.parallel`. :mod:`lightning_automodel.parallel.experts` imports this package (the experts'
tensor-parallel style, :mod:`.styles.experts`); nothing here imports it.
"""
