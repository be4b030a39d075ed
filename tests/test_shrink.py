"""Shrunk configs stay valid models: every head count keeps a hidden size it divides, and a replica that cannot be
built is the check's own failure, never a refusal of the model."""

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, GPT2Config, LlamaConfig

from lightning_automodel.hf.document_masking import packed_documents_problem
from lightning_automodel.hf.replica import ReplicaError
from lightning_automodel.hf.shrink import heads_for, shrunk_config
from lightning_automodel.testing.models import tiny_config

HEAD_COUNTS = [*range(1, 17), 24, 25, 40, 71, 96]


def kv_head_counts(heads: int) -> list[int]:
    """As many KV heads as heads, one, and a grouped count between (the largest proper divisor)."""
    grouped = max(d for d in range(1, heads) if heads % d == 0) if heads > 1 else 1
    return sorted({heads, 1, grouped})


def builds_and_runs(config) -> None:
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.randint(0, config.vocab_size, (2, 8)), use_cache=False).logits
    assert logits.shape == (2, 8, config.vocab_size) and logits.isfinite().all()


@pytest.mark.parametrize("heads", HEAD_COUNTS)
def test_every_head_count_shrinks_to_a_model_that_builds(heads):
    """Llama of ``heads`` heads (32 wide) with KV heads that divide them, and GPT-2 (no KV heads), shrunk as the
    replicas and verify_plan shrink them: each builds and runs; the heads kept divide the hidden size, and a head
    count under the tiny one is kept."""
    for tiny_heads in (heads_for(1), heads_for(4)):
        for kv_heads in kv_head_counts(heads):
            full = LlamaConfig(hidden_size=32 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads)
            config = shrunk_config(full, heads=tiny_heads)
            assert config.num_attention_heads == min(heads, tiny_heads), (heads, kv_heads, tiny_heads)
            assert config.hidden_size % config.num_attention_heads == 0
            assert config.num_attention_heads % config.num_key_value_heads == 0
            builds_and_runs(config)
        gpt2 = shrunk_config(GPT2Config(n_embd=32 * heads, n_head=heads), heads=tiny_heads)
        assert gpt2.n_embd % gpt2.n_head == 0, (heads, gpt2.n_embd, gpt2.n_head)
        builds_and_runs(gpt2)


def test_a_narrow_hidden_size_is_rounded_to_the_heads_kept():
    """A config already narrower than the tiny one (5 heads of 2) keeps its width, rounded down to a multiple of
    the 4 heads kept."""
    config = shrunk_config(LlamaConfig(hidden_size=10, num_attention_heads=5, num_key_value_heads=5, head_dim=2))
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (8, 4, 4)
    builds_and_runs(config)


@pytest.mark.parametrize("heads", [1, 2, 3])
@pytest.mark.parametrize("model_type", ["reformer", "zamba", "zamba2", "falcon_h1"])
def test_overrides_follow_the_heads_kept(model_type, heads):
    """The types whose overrides follow the model's width (Reformer's axial position embeddings sum to the hidden
    size, Zamba's shared attention is twice as wide, Falcon-H1's mamba heads span it), from a config of fewer heads
    than the tiny count: the heads are kept, the width 16 a head, and the shrunk config builds and runs."""
    config = shrunk_config(CONFIG_MAPPING[model_type](**_heads(model_type, heads)))
    assert (config.num_attention_heads, config.hidden_size) == (heads, 16 * heads)
    builds_and_runs(config)


@pytest.mark.parametrize("model_type", ["reformer", "zamba", "falcon_h1"])
def test_overrides_follow_a_narrow_width_kept(model_type):
    """A config narrower than the tiny one (3 heads of 8) keeps its width, and the overrides follow it."""
    config = shrunk_config(CONFIG_MAPPING[model_type](**_heads(model_type, 3), hidden_size=24))
    assert (config.num_attention_heads, config.hidden_size) == (3, 24)
    builds_and_runs(config)


def _heads(model_type: str, heads: int) -> dict[str, int]:
    """A valid config's head counts: ``heads``, and as many KV heads where the type's default has other counts."""
    return {"num_attention_heads": heads} | (
        {"num_key_value_heads": heads} if model_type in ("zamba", "falcon_h1") else {}
    )


def test_three_heads_of_32_keep_their_documents_apart():
    """A Llama of 3 heads, hidden 96: its shrunk replica builds (3 heads, hidden 48) and keeps packed documents
    apart, so packing its data is not refused."""
    model = AutoModelForCausalLM.from_config(tiny_config(hidden_size=96, num_attention_heads=3, num_key_value_heads=3))
    assert packed_documents_problem(model) is None


def test_a_replica_that_cannot_be_built_is_the_checks_failure(monkeypatch):
    """A shrunk config the class rejects raises an internal error naming the replica, not a refusal of the model."""
    from lightning_automodel.hf import replica

    def invalid(config, **_):
        values = config.to_dict() | {"hidden_size": 64, "num_attention_heads": 3, "num_key_value_heads": 3}
        return type(config)(**values)

    monkeypatch.setattr(replica, "shrunk_config", invalid)
    internal_error = r"(?s)shrunk replica of LlamaForCausalLM .* could not be built .*hidden size \(64\).* not of the"
    with pytest.raises(ReplicaError, match=internal_error):
        packed_documents_problem(AutoModelForCausalLM.from_config(tiny_config()))
