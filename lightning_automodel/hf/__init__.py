"""Hugging Face specifics: building on the meta device, initialising and loading weights, exporting."""
