"""The loss a sequence chunk at a time (``parallel/chunked_loss.py``) in one process: the whole logits' loss, hits and
gradients, however the loss is scaled after; a peak without the whole logits; models whose logits are more than their
head refused; at tp=2, no collective more than the whole logits'. Its parity under tp x dp with sequence parallel,
through CausalLMModule: test_lm.py."""

from functools import partial

import pytest
import torch
from chunked_loss_checks import check_collectives_of_the_whole_logits, check_head_alone_trained_is_refused
from transformers import AutoModelForCausalLM

from lightning_automodel.hf.shrink import tiny_config as coverage_config
from lightning_automodel.parallel.chunked_loss import chunked_causal_lm_loss_sum, chunking_problem
from lightning_automodel.parallel.loss import causal_lm_loss_sum, next_token_hits
from lightning_automodel.testing.harness import run_checks
from lightning_automodel.testing.models import tiny_config, tiny_model
from lightning_automodel.testing.parity import FP32_TOLERANCE, relative_error
from lightning_automodel.testing.peak_memory import peak_bytes


def _padded(rows: int, tokens: int, vocab: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, vocab, (rows, tokens), generator=generator)
    real = torch.arange(tokens) < torch.randint(3, tokens + 1, (rows, 1), generator=generator)
    return {"input_ids": input_ids, "attention_mask": real.long(), "labels": input_ids.masked_fill(~real, -100)}


def _whole(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss_sum, tokens = causal_lm_loss_sum(logits, batch["labels"])
    return loss_sum, tokens, next_token_hits(logits, batch["labels"])[0]


def _chunked(model, batch, *, chunks: int):
    return chunked_causal_lm_loss_sum(model, chunks=chunks, **batch)


@pytest.mark.parametrize("tied", [False, True])
def test_the_whole_logits_loss_hits_and_gradients_however_scaled(tied):
    """15 tokens in 4 chunks (4, 4, 4, 3) on right-padded rows: the same summed loss, scored tokens and hits, and,
    for a loss scaled after it (as Lightning scales it under gradient accumulation), every gradient of the whole
    logits' loss: the gradients forward computes for a loss gradient of 1 are scaled by the actual one. Tied: the
    embedding's gradient from the head's use adds to its own."""
    model = tiny_model(tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    batch = _padded(3, 15, model.config.vocab_size)
    results, grads = {}, {}
    for name, loss_of in (("whole", _whole), ("chunked", partial(_chunked, chunks=4))):
        model.zero_grad(set_to_none=True)
        loss_sum, tokens, hits = loss_of(model, batch)
        (0.25 * loss_sum / tokens).backward()
        results[name] = (loss_sum.detach(), tokens, hits)
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    (whole_loss, whole_tokens, whole_hits), (loss, tokens, hits) = results["whole"], results["chunked"]
    assert relative_error(loss, whole_loss) < 1e-6 and tokens == whole_tokens and hits == whole_hits
    errors = {name: relative_error(grad, grads["whole"][name]) for name, grad in grads["chunked"].items()}
    assert max(errors.values()) < FP32_TOLERANCE, errors


def test_the_logits_never_exist_whole():
    """A vocabulary of 8,192 at 4 x 256 tokens (fp32 logits: 32 MiB): the step's peak without chunks holds the
    logits, their log-softmax and, in backward, their gradients at once; in 8 chunks it holds one chunk's."""
    model = tiny_model(vocab_size=8192, max_position_embeddings=256)
    batch = _padded(4, 256, 8192)
    logits_bytes = 4 * 256 * 8192 * 4

    def step(loss_of) -> None:
        loss_sum, tokens, _ = loss_of(model, batch)
        (loss_sum / tokens).backward()
        model.zero_grad(set_to_none=True)

    peaks = {
        1: peak_bytes(partial(step, _whole), model),
        8: peak_bytes(partial(step, partial(_chunked, chunks=8)), model),
    }
    assert peaks[1] - peaks[8] > 2 * logits_bytes, {chunks: peak / 2**20 for chunks, peak in peaks.items()}


def _uncapped_gemma2():
    config = coverage_config("gemma2")
    config.final_logit_softcapping = None
    return config


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        (tiny_config("llama"), None),
        (tiny_config("granite"), None),  # a scale after its linear head: the head of the scaled hidden states
        (coverage_config("gemma2"), "soft-caps its logits"),
        (_uncapped_gemma2(), None),
        (tiny_config("qwen3_moe", output_router_logits=True), "router's auxiliary loss"),
    ],
)
def test_models_whose_logits_are_more_than_their_head_are_refused(config, fragment):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    problem = chunking_problem(model)
    assert problem is None if fragment is None else fragment in problem, problem


def test_a_head_the_replica_computes_otherwise_is_refused(monkeypatch):
    """Whatever a class does after its head, the shrunk replica's logits against its head on the hidden states
    decide: a difference (here a soft-capping the config does not name) is refused with its size."""
    from transformers.models.llama import modeling_llama

    forward = modeling_llama.LlamaForCausalLM.forward

    def soft_capped(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        output.logits = torch.tanh(output.logits / 0.5) * 0.5
        return output

    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", soft_capped)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert "logits are more than its lm_head on its last hidden states (relative error" in chunking_problem(model)


def test_no_collective_more_than_the_whole_logits():
    """At tp=2, with and without sequence parallel: the whole logits' gradients, by the same collectives to the byte;
    also for a sequence that sp splits unequally (31 tokens), gathered whole. Under FSDP2, lm_head trained alone is
    refused."""
    layouts = [partial(check_collectives_of_the_whole_logits, sp) for sp in (True, False)]
    uneven = partial(check_collectives_of_the_whole_logits, True, tokens=31)
    print(run_checks(2, [*layouts, uneven, check_head_alone_trained_is_refused], timeout=120))


def test_a_second_backward_is_refused():
    """The gradients forward computed are freed by the first backward: a second one (retain_graph=True) raises
    rather than give nothing to the head and the decoder; so does a backward building a graph (create_graph=True),
    whose gradients would have none."""
    model = tiny_model()
    loss_sum, _, _ = _chunked(model, _padded(2, 9, model.config.vocab_size), chunks=2)
    loss_sum.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="A second backward through a chunked loss"):
        loss_sum.backward()
    loss_sum, _, _ = _chunked(model, _padded(2, 9, model.config.vocab_size), chunks=2)
    with pytest.raises(RuntimeError, match="or one building a graph of its own"):
        torch.autograd.grad(loss_sum, list(model.parameters()), create_graph=True)
