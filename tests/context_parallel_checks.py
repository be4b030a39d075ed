"""Context-parallel checks inside gloo workers: a real Trainer against one process, the model's call on packed and
padded rows, and the refusals."""

from __future__ import annotations

import torch
import torch.distributed as dist
from lora_checks import fit_lora_against_one_process
from torch.distributed.tensor.parallel import loss_parallel
from transformers import AutoModelForCausalLM

from lightning_automodel import AutoModelParallelStrategy, ParallelDims, parallelize
from lightning_automodel.hf import shrink
from lightning_automodel.parallel.context_parallel import context_parallel_model, context_parallel_of, token_indices
from lightning_automodel.parallel.pipeline import PipelineOptions, pipeline_of
from lightning_automodel.testing.models import CONFIGS, SHRUNK, batch, tiny_model
from lightning_automodel.testing.parity import FP32_TOLERANCE, full, relative_error
from lightning_automodel.testing.trainer_checks import CONTEXT_PARALLEL_LAYERS as LAYERS
from lightning_automodel.testing.trainer_checks import z_loss_sum
from lightning_automodel.testing.trainer_parity import CausalLM, HFLossCausalLM, data, trainer


def check_rows_split_over_cp(
    family: str, *, packed: bool, padded: bool, length: int, attention: str = "sdpa", **config: object
) -> dict:
    """The model's call at cp = world size on rows of ``length`` tokens (padded to a multiple of 2 cp inside the
    call when it is not one): packed documents (position ids restarting, so attention must not cross them) and
    right padding (an attention mask hiding the last tokens, labels ignoring them). The loss (the mean of the
    ranks' shares), each rank's logits and every gradient against one process on the whole rows. Flex attention
    (``attention="flex"``) has no backward on CPU: its call is compared without gradients, and training refused."""
    cp = dist.get_world_size()
    mesh = ParallelDims(cp=cp).resolve(cp).build_mesh("cpu")
    model, reference = any_model(family, **config), any_model(family, **config)
    tokens, labels = batch(4)
    tokens, labels = tokens[:, :length], labels[:, :length].clone()
    inputs = {}
    if packed:  # three documents a row
        cuts = [length // 3, length - 2 * (length // 3), length // 3]
        inputs["position_ids"] = torch.cat([torch.arange(cut) for cut in cuts]).expand(tokens.size(0), -1)
    if padded:
        inputs["attention_mask"] = torch.ones_like(tokens)
        inputs["attention_mask"][:, -3:] = 0
        labels[:, -3:] = -100
    context = context_parallel_model(model, mesh, attention=attention)
    trains = attention == "sdpa"
    if not trains:
        try:
            model(input_ids=tokens, labels=labels, **inputs)
        except ValueError as error:
            assert "cannot train on CPU" in str(error), error
        else:
            raise AssertionError("training with flex attention on CPU was not refused")
    with torch.set_grad_enabled(trains):
        outputs = model(input_ids=tokens, labels=labels, **inputs)
        expected = reference(input_ids=tokens, labels=labels, use_cache=False, **inputs)
    if trains:
        outputs.loss.backward()
        expected.loss.backward()
    loss = outputs.loss.detach().clone()
    dist.all_reduce(loss)
    held = token_indices(-(-length // (2 * cp)) * 2 * cp, cp, context.rank)
    real = held < length - (3 if padded else 0)  # neither the call's padding nor the rows' (whose logits are noise)
    logits, expected_logits = outputs.logits[:, real], expected.logits[:, held[real]]
    result = {
        "loss": abs(loss.item() / cp - expected.loss.item()) / expected.loss.item(),
        "logits": relative_error(logits, expected_logits),
    }
    if trains:
        reference_params = dict(reference.named_parameters())
        result["grads"] = 0.0
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad)  # each rank's share of the gradient, as FSDP's reduction over dp_shard x cp sums
            result["grads"] = max(result["grads"], relative_error(grad / cp, reference_params[name].grad))
    assert max(result.values()) < FP32_TOLERANCE, result
    return result


def any_model(family: str, **config: object) -> torch.nn.Module:
    """The tests' tiny model of ``family``, or the coverage report's tiny one of any other model type."""
    if family in CONFIGS or family in SHRUNK:
        return tiny_model(family, **config)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(shrink.tiny_config(family))


def check_context_parallel_refusals(cp: int) -> list[str]:
    """Refused on every rank before any collective, naming the fix: a loss of one's own under pp with cp, a model that
    computes other logits with its sequences split (Mamba: a state-space model, no attention to gather), a training
    step computing its loss from the logits (each rank holds its share of the sequence's logits only); calls the
    split cannot serve (a 4D mask, a cache, generation) and, in one small all-reduce, rows that differ between the cp
    peers."""
    refused = []
    try:
        AutoModelParallelStrategy(cp=cp, pp=2, pp_loss_fn=z_loss_sum)
    except ValueError as error:
        assert "pp_loss_fn with cp=2: the loss function shifts a micro-batch's labels itself" in str(error), error
        refused.append(str(error))
    else:
        raise AssertionError("pp_loss_fn with cp was not refused")
    fits = [
        (HFLossCausalLM(any_model("mamba")), "computes other logits with its sequences split than whole"),
        (CausalLM(tiny_model(num_hidden_layers=LAYERS)), "call the model with labels"),
    ]
    for module, expected in fits:
        try:
            trainer(AutoModelParallelStrategy(cp=cp)).fit(module, data(dist.get_world_size() // cp))
        except ValueError as error:
            assert expected in str(error), error
            refused.append(str(error))
        else:
            raise AssertionError(f"{expected!r} was not refused")
    model = fits[1][0].model.eval()  # parallelized before its first step failed
    tokens, labels = batch(2)
    calls = [
        (lambda: model(input_ids=tokens, attention_mask=torch.ones(2, 1, 16, 16)), "shape (2, 16), as input_ids"),
        (lambda: model(input_ids=tokens, past_key_values=object()), "past_key_values"),
        (lambda: model(input_ids=tokens, cache=object()), "cache"),  # the name since transformers 5.24
        (lambda: model.generate(tokens), "generate with cp=1"),
        (lambda: model(input_ids=tokens + dist.get_rank(), labels=labels), "other rows than its cp peers"),
    ]
    for call, expected in calls:
        try:
            with torch.no_grad():
                call()
        except ValueError as error:
            assert expected in str(error), error
            refused.append(str(error))
        else:
            raise AssertionError(f"{expected!r} was not refused")
    return [message[:80] for message in refused]


def check_context_parallel_lora(cp: int, tp: int = 1, sp: bool = False) -> dict:
    """A PEFT model (LoRA on every projection; the base frozen) with its sequences split over ``cp`` ranks through the
    Trainer: the adapters' gradients at each step and their weights after 3 AdamW steps match one process."""
    strategy = AutoModelParallelStrategy(tp, sp=sp, cp=cp)
    module, result = fit_lora_against_one_process(strategy, dp=dist.get_world_size() // cp // tp, layers=LAYERS)
    assert context_parallel_of(module.model) is not None
    return result


def check_rows_split_over_pp_and_cp(
    family: str,
    *,
    pp: int,
    schedule: str = "1F1B",
    stages_per_rank: int = 1,
    tp: int = 1,
    sp: bool = False,
    **config: object,
) -> dict:
    """The calls of a model pipelined over ``pp`` ranks with its sequences split over cp (the rest of the world) on
    rows of a length 2 cp does not divide, each row padded, then packed, its own way (each micro-batch's stages must
    get the split of its own rows): the losses (the mean of the cp ranks' shares), every gradient after both (FSDP's
    mean over cp) and, in evaluation, the last stage's logits against one process on the whole rows. ``config``:
    overrides of the family's tiny config (a mixture-of-experts model's load-balancing loss: transformers' loss
    includes it, over the real tokens of every layer)."""
    world, length = dist.get_world_size(), 15
    cp = world // pp // tp
    config = dict(config, num_hidden_layers=pp * stages_per_rank * 2)
    model, reference = any_model(family, **config), any_model(family, **config)
    pipeline_options = PipelineOptions(schedule, microbatches=4, stages_per_rank=stages_per_rank)
    parallelized = parallelize(
        model, ParallelDims(pp=pp, cp=cp, tp=tp).resolve(world).build_mesh("cpu"), sp=sp, pipeline=pipeline_options
    )
    pipeline, context = pipeline_of(model), context_parallel_of(model)
    result = {"loss": 0.0}
    for inputs in varied_rows(rows=4, length=length):
        with loss_parallel():  # vocabulary-sharded logits under tp (the strategy enters it around its steps)
            loss = model(**inputs).loss
            loss.backward()
        expected = reference(**inputs, use_cache=False)
        expected.loss.backward()
        dist.all_reduce(shares := loss.detach().clone(), group=context.group)
        result["loss"] = max(result["loss"], abs(shares.item() / cp - expected.loss.item()) / expected.loss.item())
    parallelized.after_backward()
    grads = dict(reference.named_parameters())
    result["grads"] = max(relative_error(full(p.grad), grads[n].grad) for n, p in model.named_parameters())
    model.eval()
    inputs.pop("labels")
    with torch.no_grad():
        logits, expected = model(**inputs).logits, reference(**inputs, use_cache=False).logits
    if pipeline.last:
        held = token_indices(context.padded_length(length), cp, context.rank)
        real = held < length
        result["logits"] = relative_error(full(logits)[:, real], expected[:, held[real]])
    assert max(result.values()) < FP32_TOLERANCE, result
    return result


def varied_rows(*, rows: int, length: int) -> list[dict[str, torch.Tensor]]:
    """Two batches of ``rows`` rows of ``length`` tokens, each row its own: row r hides its last r tokens (an
    attention mask; labels ignored there) in the first, and packs r + 1 documents in the second."""
    tokens, labels = batch(rows)
    tokens, labels = tokens[:, :length], labels[:, :length]
    mask, padded_labels, positions = torch.ones_like(tokens), labels.clone(), torch.empty_like(tokens)
    for row in range(rows):
        positions[row] = torch.arange(length) % -(-length // (row + 1))
        if row:
            mask[row, -row:] = 0
            padded_labels[row, -row:] = -100
    return [
        dict(input_ids=tokens, labels=padded_labels, attention_mask=mask),
        dict(input_ids=tokens, labels=labels, position_ids=positions),
    ]
