"""Hugging Face specifics that torch does not know: initialising a meta-device model the way transformers would."""
