"""A model's call whose output transformers fails to assemble after the model's head made the logits: Llama 4's
image-text forward reads ``image_outputs`` off its language model's output, which has none, on every batch (text or
images; transformers 5.24). The step itself ran: what it computed is judged (the coverage report) and traced (the
strategy's probe), from the head's output."""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers.modeling_outputs import CausalLMOutput


def call_for_logits(model: nn.Module, inputs: dict[str, Any]) -> Any:
    """``model(**inputs)``; where that raises an AttributeError after the output embeddings (the head) ran, an
    output holding the head's last output as its logits. Any other failure is raised as is."""
    made: list[Any] = []
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    hook = head.register_forward_hook(lambda _module, _args, output: made.append(output)) if head is not None else None
    try:
        return model(**inputs)
    except AttributeError:
        if not made:
            raise
        return CausalLMOutput(logits=made[-1])
    finally:
        if hook is not None:
            hook.remove()
