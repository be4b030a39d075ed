"""What is specific to Hugging Face models and torch does not know: where a model's decoder layers are, which
parameters are tied or fused, PEFT's LoRA layers, tiny replicas of any config, and building, initialising and
loading a model on the meta device the way transformers would, each rank only its shards."""
