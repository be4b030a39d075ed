"""Checks run on every rank for test_chunked_loss.py: a chunked loss under tensor parallel, its gradients and what it
communicates against the whole logits'."""

from __future__ import annotations

import torch

from lightning_automodel import ParallelDims
from lightning_automodel.parallel.parallelizer import parallelize
from lightning_automodel.planning.memory.activations import training_step
from lightning_automodel.testing.collectives import CollectiveBytes
from lightning_automodel.testing.models import tiny_model
from lightning_automodel.testing.parity import FP32_TOLERANCE, full, relative_error


def check_collectives_of_the_whole_logits(sp: bool, tokens: int = 32) -> dict:
    """The whole logits' gradients, of a loss divided by the global token count after the chunks'; and a training
    step at tp=2 moves the same bytes by the same kinds of collective with the loss in 4 chunks as with
    the whole logits: under sp each chunk is gathered and its gradient reduce-scattered as the whole would be (a
    replicated chunk's gradient would be all-reduced: a [rows, tokens, hidden] all-reduce more). The chunked loss also
    counts its hits (the accuracy CausalLMModule logs), the whole logits' step here does not: one int64 a token. An
    odd number of ``tokens`` under sp leaves the ranks unequal shares: the chunks are cut from the whole sequence then,
    gathered once (their gradients all-reduced)."""
    model = tiny_model(vocab_size=512, max_position_embeddings=64)
    mesh = ParallelDims(tp=2).resolve(2).build_mesh("cpu")
    parallelize(model, mesh, sp=sp)
    input_ids = torch.randint(512, (2, tokens), generator=torch.Generator().manual_seed(0))
    sent, grads = {}, {}
    for chunks in (1, 4):
        with CollectiveBytes() as counted:
            training_step(model, input_ids=input_ids, mesh=mesh, loss_chunks=chunks)
        sent[chunks] = dict(counted.bytes)
        grads[chunks] = {name: full(p.grad) for name, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    sent[4]["all_reduce"] -= input_ids.numel() * torch.int64.itemsize
    assert sent[4] == sent[1] or (sp and tokens % 2), sent
    errors = {name: relative_error(grad, grads[1][name]) for name, grad in grads[4].items()}
    assert max(errors.values()) < FP32_TOLERANCE, errors
    return {"sent": sent, "gradients": max(errors.values())}


def check_head_alone_trained_is_refused() -> str:
    """dp_shard=2 with lm_head the only trained parameter: refused at the step, on every rank. Run, FSDP2 would
    never reduce the head's gradient (its backward starts from the hidden states, which need none here)."""
    model = tiny_model(vocab_size=512, max_position_embeddings=64)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith("lm_head."))
    mesh = ParallelDims(dp_shard=2).resolve(2).build_mesh("cpu")
    parallelize(model, mesh)
    input_ids = torch.randint(512, (2, 32), generator=torch.Generator().manual_seed(0))
    try:
        training_step(model, input_ids=input_ids, mesh=mesh, loss_chunks=4)
    except ValueError as error:
        assert "with lm_head the only trained part of LlamaForCausalLM" in str(error), error
        return str(error)
    raise AssertionError("a chunked loss training lm_head alone under FSDP2 was not refused")
