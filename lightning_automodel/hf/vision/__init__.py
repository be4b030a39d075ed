"""What is specific to Hugging Face vision-language models: their image inputs built from a config, and their
multi-part (M-RoPE) positions."""
