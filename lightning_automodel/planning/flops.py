"""Model FLOPs per token, for Lightning's ThroughputMonitor (tokens/s and MFU).

``measure_flops`` would trace the model on the meta device; for a decoder-only transformer the count is known
in closed form (the one MFU is conventionally reported with), and it holds for the parallelized model, whose
DTensor parameters report their global sizes.
"""

from __future__ import annotations

from torch import nn

from lightning_automodel.hf.layer_configs import attention_shapes
from lightning_automodel.parallel.tensor.styles.experts import is_experts


def flops_per_token(model: nn.Module, seq_len: int, *, training: bool = True) -> int:
    """FLOPs per token. Training: 6 per trainable weight (forward, input and weight gradients), 4 per frozen one
    (no weight gradient: LoRA's base), plus attention's score and value products (12 x layers x width x seq_len).
    Evaluation: the forward alone, a third of that for every term.

    Embedding lookups do no arithmetic and are left out; a tied lm_head counts once, as the output matmul. A
    mixture of experts' expert weights count for the experts a token is routed to, ``num_experts_per_tok`` of
    ``num_experts`` (all of them where the config does not say). A vision-language model's attention is its language
    model's; its tower's weights count as if each token ran them (an estimate: the tower runs once an image patch).
    """
    embeddings = {id(p) for module in model.modules() if isinstance(module, nn.Embedding) for p in module.parameters()}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = {id(output.weight)} if output is not None else set()
    routed = _routed_share(model)
    trainable = frozen = 0.0
    for parameter in model.parameters():
        if id(parameter) in embeddings and id(parameter) not in tied:
            continue
        used = parameter.numel() * routed.get(id(parameter), 1.0)
        if parameter.requires_grad:
            trainable += used
        else:
            frozen += used
    attention = 12 * _attention_width(model.config.get_text_config()) * seq_len
    if not training:
        return round(2 * (trainable + frozen)) + attention // 3
    return round(6 * trainable + 4 * frozen) + attention


def _routed_share(model: nn.Module) -> dict[int, float]:
    """The share of each expert weight a token runs: its config's experts a token over the experts a module holds."""
    top_k = getattr(model.config.get_text_config(), "num_experts_per_tok", None)
    if not top_k:
        return {}
    return {
        id(parameter): min(1.0, top_k / module.num_experts)
        for module in model.modules()
        if is_experts(module) and getattr(module, "num_experts", None)
        for parameter in module.parameters()
    }


def _attention_width(config) -> int:
    """The query width of every layer, summed (a heterogeneous config's layers each their own)."""
    shapes = attention_shapes(config)
    per_layer = [heads * head_dim for heads, _, head_dim in shapes]
    return sum(per_layer) if len(shapes) > 1 else per_layer[0] * config.num_hidden_layers
