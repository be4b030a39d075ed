"""What is specific to Hugging Face models and torch does not know: where a model's decoder layers are, which
parameters are tied or fused, PEFT's LoRA layers, tiny replicas of any config, and building, initialising and
loading a model on the meta device the way transformers would, each rank only its shards.

Every import of the package runs this first (the package's ``__init__`` starts with ``hf``): torchao's import notice
is filtered before the first import of transformers, which imports torchao."""

from lightning_automodel.hf.torchao_notice import drop_torchao_extensions_notice

drop_torchao_extensions_notice()
