"""A tiny config of any model type of transformers, or of any config: the same architecture, a few dozen wide.

The config's values (a type's defaults, or a real model's) describe a full-size model. Every size field is shrunk
to a few dozen (hidden 64, 4 heads, vocabulary 128, 4 experts), and per-layer lists keep the first layer of each kind,
so that the model still holds every kind of block its architecture has. The shape of the architecture stays as the
values say: a model with as many KV heads as heads keeps as many, one with a single KV head (multi-query) keeps one; a
model with fewer heads than the tiny count keeps its own, and the hidden size stays a multiple of the heads kept.
Types that need more than these generic rules have an entry in :func:`overrides`.

It lives in the package, not the tests, because :func:`~lightning_automodel.planning.verify.verify_plan` shrinks the
config of the model it is asked about at run time; the coverage report and the tests shrink with the same rules.
"""

from __future__ import annotations

import functools
from typing import Any

from lightning_automodel.hf.layer_fields import LAYER_COUNTS, layer_fields

HEAD_SIZE = 16
HEADS = 4  # a tensor-parallel size that does not divide it gets more: see heads_for
VOCAB = 128


def heads_for(tp: int) -> int:
    """The head count of a tiny model that ``tp`` ranks split evenly, KV heads (half as many) included."""
    return max(HEADS, 2 * tp)


# Size fields, by the names config classes give them, under the size each gets (see tiny_sizes; never raised).
_SIZE_NAMES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "hidden",
        (
            "hidden_size", "d_model", "n_embd", "n_embed", "dim", "embed_dim", "model_dim", "hidden_dim",
            "word_embed_proj_dim", "embedding_size", "embedding_dim", "input_embedding_size", "output_embedding_size",
            "lru_width", "attention_hidden_size", "backbone_hidden_size", "mamba_d_ssm", "emb_dim",
        ),
    ),
    (
        "intermediate",
        (
            "intermediate_size", "n_inner", "ffn_dim", "d_ff", "dff", "dim_ff", "ffn_hidden_size", "decoder_ffn_dim",
            "encoder_ffn_dim", "feed_forward_size", "intermediate_size_mlp", "dense_intermediate_size", "d_inner",
        ),
    ),
    (
        "half hidden",
        (
            "moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
            "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size", "expert_ffn_hidden_size",
            "kv_lora_rank", "q_lora_rank", "o_lora_rank",
        ),
    ),
    (
        "head size",
        (
            "head_dim", "attention_head_dim", "attention_head_size", "kv_channels", "dim_head", "d_head",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_head_dim", "swa_head_dim", "index_head_dim", "mamba_d_state", "ssm_state_size", "state_size",
            "mamba_headdim", "mamba_d_head", "mamba_dt_rank", "time_step_rank", "hidden_size_per_layer_input",
        ),
    ),
    ("window", ("rotary_dim", "sliding_window", "chunk_size", "mamba_chunk_size", "attention_chunk_size")),
    (
        "heads",
        (
            "num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
            "encoder_attention_heads", "linear_num_heads", "mamba_n_heads", "mamba_num_heads", "n_mamba_heads",
        ),
    ),
    ("experts", ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")),
    (
        "pair",
        (
            "num_experts_per_tok", "num_experts_per_token", "top_k_experts", "moe_k", "moe_topk",
            "linear_num_key_heads", "linear_num_value_heads", "num_kv_shared_layers",
        ),
    ),
    (
        "one",
        (
            "n_group", "num_expert_group", "topk_group", "n_groups", "mamba_n_groups", "mamba_ngroups",
            "n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "expand", "mamba_expand",
            "first_k_dense_replace",
        ),
    ),
    (
        "vocab",
        (
            "vocab_size", "vocab_size_per_layer_input", "decoder_vocab_size", "pronunciation_vocab_size",
            "shape_vocab_size", "encoder_hash_byte_group_vocab",
        ),
    ),
    (
        "positions",
        (
            "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_target_positions",
            "max_source_positions", "context_length",
        ),
    ),
)  # fmt: skip


@functools.cache
def tiny_sizes(heads: int = HEADS, *, experts: int = HEADS) -> dict[str, int]:
    """The tiny value of every size field of ``_SIZE_NAMES``, for a model of ``heads`` heads and ``experts``
    experts."""
    hidden = HEAD_SIZE * heads
    size = {
        "hidden": hidden,
        "intermediate": 2 * hidden,
        "half hidden": hidden // 2,
        "head size": HEAD_SIZE,
        "window": 8,
        "heads": heads,
        "experts": experts,
        "pair": 2,
        "one": 1,
        "vocab": VOCAB,
        "positions": 64,
    }
    return {name: size[kind] for kind, names in _SIZE_NAMES for name in names}


_HIDDEN_NAMES = dict(_SIZE_NAMES)["hidden"]  # the model's width first (hidden_size), then the others
HIDDEN_SIZES = frozenset(_HIDDEN_NAMES)


# Head sizes some config classes leave None although their models need a value.
REQUIRED_SIZES = ("head_dim",)
HEAD_COUNTS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
KV_HEAD_COUNTS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "num_query_groups")
# Token ids: padding is 0, as the verification batch pads; bos and eos move into the vocabulary when outside it.
PAD_TOKEN_ID = 0
TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2}
MIN_LAYERS = 2
# The rope a config gets whose defaults leave it empty.
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# Probabilities of random training-time behaviour (dropout, layer drop, stochastic depth, router jitter): zero, so
# that a parallel run and a single-process one compute the same function.
RANDOMNESS = ("dropout", "pdrop", "drop_prob", "layerdrop", "drop_path", "jitter")


def overrides(model_type: str, *, hidden: int, heads: int) -> dict[str, Any]:
    """Keyword arguments of the config class of the types the generic rules do not fit, applied last; sizes that
    follow the model's width are those of the shrunk config's ``hidden`` size and ``heads``."""
    qwen4_indexer = {  # None by default
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": HEAD_SIZE,
        "indexer_budget": 8,
        "indexer_compress_ratio": 2,
    }
    deepseek_ocr2 = {"num_hidden_layers": 2, "mlp_layer_types": ["dense", "sparse"], "num_experts_per_tok": 2}
    # Zamba's shared attention runs on [hidden states; embeddings], twice the hidden size.
    wide_attention = {"attention_hidden_size": 2 * hidden, "attention_head_dim": 2 * hidden // heads}
    by_type: dict[str, dict[str, Any]] = {
        "bamba": {"attn_layer_indices": [1]},  # by default no layer of the first two has attention
        # Its default attention config lacks rope_theta (and cannot build), and clamps q, k, v by clip_qkv, None.
        "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
        "deepseek_v2": {"num_experts_per_tok": 2},  # None by default
        # head_dim must be qk_nope_head_dim + qk_rope_head_dim.
        "dots3_note": {"text_config": {"head_dim": 2 * HEAD_SIZE}},
        "dots3_note_text": {"head_dim": 2 * HEAD_SIZE},
        # Which layers are mixtures of experts, and how many experts a token takes: None by default.
        "deepseek_ocr2": {"text_config": deepseek_ocr2},
        "deepseek_ocr2_text": deepseek_ocr2,
        "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},  # None by default
        "falcon_h1": {"mamba_d_head": HEAD_SIZE},  # mamba heads x head size = hidden size x expand (1)
        "granitemoehybrid": {"num_hidden_layers": 2, "layer_types": ["mamba", "attention"]},  # by default none
        "hrm_text": {"num_layers_per_stack": None},  # derived from num_hidden_layers, which it then rewrites
        "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
        "lfm2_moe": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
        "qwen4_exp": {"text_config": qwen4_indexer},
        "qwen4_exp_text": qwen4_indexer,
        "recurrent_gemma": {"num_hidden_layers": 3},  # blocks cycle recurrent, recurrent, attention
        "reformer": {  # a decoder needs is_decoder; axial position embeddings tile max_position_embeddings
            "is_decoder": True,
            "axial_pos_shape": [4, 4],
            "axial_pos_embds_dim": [hidden // 4, hidden - hidden // 4],
            "max_position_embeddings": 16,
            "local_attn_chunk_length": 8,
            "lsh_attn_chunk_length": 8,
        },
        # transformers' native chunkwise kernel needs q/k heads as wide as v's; its cache, written in place, breaks
        # backward (training builds none: parallel/model_calls.py).
        "xlstm": {"qk_dim_factor": 1.0, "use_cache": False},
        "xmod": {"default_language": "en_XX"},  # without it, forward needs lang_ids
        # Zamba ties the shared block of every hybrid layer to the first's, so it needs two of them.
        "zamba": {
            "num_hidden_layers": 3,
            "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
            **wide_attention,
        },
        "zamba2": wide_attention,
    }
    return by_type.get(model_type, {})


def tiny_config(model_type: str, *, heads: int = HEADS):
    """The type's config class, its defaults shrunk and one layer of each kind kept."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type](**tiny_values(model_type, heads=heads))


def tiny_values(model_type: str, *, heads: int = HEADS) -> dict[str, Any]:
    """:func:`tiny_config`'s values, before its class checks them (hf/vision/tiny.py shrinks images first)."""
    from transformers import CONFIG_MAPPING

    return _shrunk_values(CONFIG_MAPPING[model_type]().to_dict(), model_type=model_type, heads=heads)


def shrunk_config(config, *, heads: int = HEADS):
    """A config of the same class as ``config`` (a real model's, say), its values shrunk and one layer of each kind
    kept; what the generic rules leave of a real config's architecture is the same as for the type's defaults."""
    return type(config)(**_shrunk_values(config.to_dict(), model_type=config.model_type, heads=heads))


def _shrunk_values(values: dict[str, Any], *, model_type: str, heads: int) -> dict[str, Any]:
    """``values`` shrunk, then the type's overrides sized for the width and heads the shrunk config has (a config
    with fewer heads than ``heads`` keeps its own, and a narrower one its width)."""
    tiny = shrink(values, heads=heads)
    kept = heads_kept(values, heads=heads)
    hidden = next((tiny[name] for name in _HIDDEN_NAMES if isinstance(tiny.get(name), int)), HEAD_SIZE * kept)
    return merged(tiny, overrides(model_type, hidden=hidden, heads=kept))


def shrink(values: dict[str, Any], *, heads: int = HEADS) -> dict[str, Any]:
    """The config dict with every size field tiny; sub-configs (text, vision, audio) shrunk alike."""
    kept_heads = heads_kept(values, heads=heads)
    sizes = tiny_sizes(kept_heads, experts=heads)
    tiny = dict(values)
    for name, value in values.items():
        if isinstance(value, dict) and "model_type" in value:
            tiny[name] = shrink(value, heads=heads)
        elif name in sizes and value is None and name in REQUIRED_SIZES:
            tiny[name] = sizes[name]
        elif name in sizes:
            tiny[name] = _smaller(value, sizes[name], multiple_of=kept_heads if name in HIDDEN_SIZES else 1)
        elif any(word in name for word in RANDOMNESS) and isinstance(value, float):
            tiny[name] = 0.0
        elif name == "pad_token_id":
            tiny[name] = PAD_TOKEN_ID
        elif name in TOKEN_IDS and _out_of_vocabulary(value):
            tiny[name] = TOKEN_IDS[name]
    tiny.update(_kv_heads(values, tiny, heads=heads))
    tiny.update(_widths_of_hidden(values, tiny, sizes=sizes))
    if "qk_head_dim" in values:  # derived, and passed back explicitly: keep it the sum of its parts
        tiny["qk_head_dim"] = tiny["qk_nope_head_dim"] + tiny["qk_rope_head_dim"]
    tiny.update(_fewer_layers(tiny, heads=heads))
    tiny.update(_rope_where_none_given(tiny))
    return tiny


def _rope_where_none_given(values: dict[str, Any]) -> dict[str, Any]:
    """The default rope for a config whose defaults give an empty one (a checkpoint's config fills it; the model
    reads it): one for each layer type where the config has layer types (Cohere Compass reads it by type)."""
    if values.get("rope_parameters") != {}:
        return {}
    kinds = values.get("layer_types")
    if not isinstance(kinds, list):
        return {"rope_parameters": dict(DEFAULT_ROPE)}
    return {"rope_parameters": {kind: dict(DEFAULT_ROPE) for kind in dict.fromkeys(kinds)}}


def _widths_of_hidden(values: dict[str, Any], tiny: dict[str, Any], *, sizes: dict[str, int]) -> dict[str, int]:
    """Widths no size rule knows (``*_dim``) that equal the hidden size, kept equal to it: a validator may require
    it (WavTokenizer's ``codebook_dim``, with no projection around its quantizer)."""
    hidden = values.get("hidden_size")
    if not isinstance(hidden, int) or isinstance(hidden, bool):
        return {}
    return {
        name: tiny["hidden_size"]
        for name, value in values.items()
        if name.endswith("_dim") and name not in sizes and value == hidden and not isinstance(value, bool)
    }


def merged(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``values`` with ``overrides`` applied, sub-config by sub-config."""
    result = dict(values)
    for name, value in overrides.items():
        nested = isinstance(value, dict) and isinstance(values.get(name), dict)
        result[name] = merged(values[name], value) if nested else value
    return result


def heads_kept(values: dict[str, Any], *, heads: int) -> int:
    """The head count of the shrunk config dict: ``heads``, or the config's own count where it has fewer."""
    own = next((values[name] for name in HEAD_COUNTS if isinstance(values.get(name), int)), None)
    return own if own is not None and 0 < own < heads else heads


def _smaller(value: Any, tiny: int, *, multiple_of: int = 1) -> Any:
    """``value`` lowered to ``tiny``, never raised; a value kept below it rounded down to ``multiple_of`` (a hidden
    size the heads kept must divide), ``multiple_of`` at least."""
    if isinstance(value, list):
        return [_smaller(item, tiny, multiple_of=multiple_of) for item in value]
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    if value > tiny:
        return tiny
    return max(value - value % multiple_of, multiple_of) if value > 0 else value


def _out_of_vocabulary(value: Any) -> bool:
    values = value if isinstance(value, list) else [value]
    return any(isinstance(v, int) and v >= VOCAB for v in values)


def _kv_heads(values: dict[str, Any], tiny: dict[str, Any], *, heads: int) -> dict[str, int]:
    """KV head counts keep their relation to the heads as shrunk (a config with fewer heads than the tiny count
    keeps its own): as many (None: as many), one, or grouped (half as many)."""
    full_heads = next((values[name] for name in HEAD_COUNTS if isinstance(values.get(name), int)), None)
    heads = next((tiny[name] for name in HEAD_COUNTS if isinstance(tiny.get(name), int)), heads)
    kv = {}
    for name in KV_HEAD_COUNTS:
        if name not in values:
            continue
        kv_heads = values[name]
        if kv_heads is None or kv_heads == full_heads:
            kv[name] = heads
        else:
            kv[name] = 1 if kv_heads == 1 else max(1, heads // 2)
    return kv


def _fewer_layers(values: dict[str, Any], *, heads: int) -> dict[str, Any]:
    """Keep the first layer of each kind, at least ``MIN_LAYERS``.

    A layer's kind is its entry in every per-layer list (``layer_types``, ``mlp_layer_types``, ...), whether lists
    of layer indices (``full_attn_idxs``, ``hybrid_layer_ids``, ...) hold it, and its entry in dicts keyed by layer
    index (``per_layer_config``). Those lists and dicts are cut to the kept layers and renumbered.
    """
    fields = layer_fields(values)
    if fields is None:
        return {}
    count, index_lists, per_layer, by_layer = fields

    def kind(layer: int) -> tuple:
        return (
            *(str(value[layer]) for value in per_layer.values()),
            *(layer in value for value in index_lists.values()),
            *(str(_entry(value, layer, heads=heads)) for value in by_layer.values()),
        )

    kept: list[int] = []
    for layer in range(count):
        if kind(layer) not in {kind(k) for k in kept}:
            kept.append(layer)
    kept = sorted(kept + [layer for layer in range(count) if layer not in kept][: max(MIN_LAYERS - len(kept), 0)])
    return layers_kept(values, kept, heads=heads)


def layers_kept(values: dict[str, Any], kept: list[int], *, heads: int | None = None) -> dict[str, Any]:
    """The fields of a config dict that describe its layers, for the layers ``kept`` (in order) alone: the layer
    counts, per-layer lists, lists of layer indices (renumbered) and dicts keyed by layer index (renumbered; their
    entries shrunk to ``heads`` heads unless None)."""
    fields = layer_fields(values)
    if fields is None:
        return {}
    _, index_lists, per_layer, by_layer = fields
    changed: dict[str, Any] = {name: len(kept) for name in LAYER_COUNTS if isinstance(values.get(name), int)}
    changed.update({name: [value[layer] for layer in kept] for name, value in per_layer.items()})
    changed.update(
        {name: [kept.index(layer) for layer in value if layer in kept] for name, value in index_lists.items()}
    )
    changed.update(
        {
            name: {
                str(new): _entry(value, old, heads=heads)
                for new, old in enumerate(kept)
                if _entry(value, old, heads=heads) is not None
            }
            for name, value in by_layer.items()
        }
    )
    return changed


def _entry(by_layer: dict, layer: int, *, heads: int | None) -> Any:
    """The entry of ``layer`` in a dict keyed by layer index (as int, or as a string, possibly zero-padded)."""
    entry = next((v for k, v in by_layer.items() if int(k) == layer), None)
    return shrink(entry, heads=heads) if isinstance(entry, dict) and heads is not None else entry
