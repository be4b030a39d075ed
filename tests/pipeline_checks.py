"""Pipeline-parallel checks inside gloo workers: a real Trainer against one process, and the refusals."""

from __future__ import annotations

import torch
import torch.distributed as dist
from loading_checks import remove, saved_checkpoint
from lora_checks import peft_model
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM

from lightning_automodel import AutoModelParallelStrategy, ParallelDims, from_pretrained, parallelize
from lightning_automodel.hf.initialization import materialize_hf_model
from lightning_automodel.hf.loading import materialize_pretrained
from lightning_automodel.parallel.parallelized import Parallelized
from lightning_automodel.parallel.pipeline import PipelineOptions, pipeline_of
from lightning_automodel.testing.models import batch, tiny_model
from lightning_automodel.testing.parity import FP32_TOLERANCE, full, relative_error
from lightning_automodel.testing.trainer_checks import PIPELINE_LAYERS as LAYERS
from lightning_automodel.testing.trainer_parity import (
    GLOBAL_BATCH,
    CausalLM,
    HFLossCausalLM,
    assert_experts_distributed,
    compare_training,
    data,
    hf_loss,
    reference_run,
    trainer,
)


def check_pipeline_accumulation_and_clipping(pp: int, family: str = "gemma3", ep: int = 1) -> dict:
    """accumulate_grad_batches=2 over half batches and gradient_clip_val under pp, with a tied embedding (Gemma 3), or
    experts distributed over ``ep`` ranks (their norm over the experts' mesh). With SGD every update is lr times the
    clipped gradient, so a norm missing a stage, an expert or counting the tied copy twice moves every weight wrong,
    and so does a micro-step's gradient lost or counted twice."""
    lr = 10.0
    module = HFLossCausalLM(tiny_model(family, num_hidden_layers=LAYERS), optimizer=torch.optim.SGD, lr=lr)
    dp = dist.get_world_size() // pp
    tokens, labels = batch(GLOBAL_BATCH)
    halves = DataLoader(TensorDataset(tokens, labels), batch_size=GLOBAL_BATCH // dp // 2)
    strategy = AutoModelParallelStrategy(pp=pp, ep=ep, pp_schedule="GPipe", pp_microbatches=2)
    options = dict(accumulate_grad_batches=2, gradient_clip_val=0.1, gradient_clip_algorithm="norm")
    trainer(strategy, **options).fit(module, halves)
    assert_experts_distributed(module.model, ep=ep)
    pairs = zip(module.losses[::2], module.losses[1::2], strict=True)
    module.losses = [(first + second) / 2 for first, second in pairs]
    reference = tiny_model(family, num_hidden_layers=LAYERS)
    sgd = lambda model: [torch.optim.SGD(model.parameters(), lr=lr)]  # noqa: E731
    steps = reference_run(reference, optimizers=sgd, clip=0.1, loss=hf_loss)
    return compare_training(module, reference, steps, stages=True)


def check_loss_from_logits_is_refused(pp: int) -> str:
    """A training_step computing its loss from the logits stops at its first step, naming the way that works."""
    module = CausalLM(tiny_model(num_hidden_layers=LAYERS))
    try:
        trainer(AutoModelParallelStrategy(pp=pp)).fit(module, data(dist.get_world_size() // pp))
    except ValueError as error:
        assert "self.model(input_ids=..., labels=...).loss" in str(error) and "pp_loss_fn" in str(error), error
        return str(error).split(":")[0]
    raise AssertionError("a loss computed from the logits under pp was not refused")


def check_pipeline_refusals(pp: int) -> list[str]:
    """Bad input is refused on every rank, before any collective, naming the fix."""
    refused = []
    cases = [
        (dict(pp=pp, pp_schedule="Bogus"), "Bogus"),
        (dict(pp=pp, pp_schedule="Interleaved1F1B"), "set pp_stages_per_rank=2"),
        (dict(pp=pp, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2, pp_layers_per_stage=[1] * pp), "one per"),
        (dict(pp=pp, pp_microbatches=pp - 1), "at least as many"),
        (dict(pp=pp, pp_layers_per_stage=[1] * (pp + 1)), "one per stage"),
    ]
    for options, expected in cases:
        try:
            AutoModelParallelStrategy(**options)
        except ValueError as error:
            assert expected in str(error), error
            refused.append(str(error))
        else:
            raise AssertionError(f"{options} was not refused")
    fits = [
        (AutoModelParallelStrategy(pp=pp), tiny_model(num_hidden_layers=pp - 1), f"fewer than the {pp} stages"),
        (
            AutoModelParallelStrategy(pp=pp, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2),
            tiny_model(num_hidden_layers=2 * pp - 1),
            f"fewer than the {2 * pp} stages",
        ),
        (
            AutoModelParallelStrategy(
                pp=pp, pp_schedule="InterleavedZeroBubble", pp_stages_per_rank=2, activation_checkpointing=True
            ),
            tiny_model(num_hidden_layers=2 * pp),
            "recomputes a checkpointed layer twice",
        ),
        (AutoModelParallelStrategy(pp=pp, pp_microbatches=3), tiny_model(num_hidden_layers=LAYERS), "divide"),
        (
            AutoModelParallelStrategy(pp=pp, pp_layers_per_stage=[1] * pp),
            tiny_model(num_hidden_layers=LAYERS),
            "sums to",
        ),
    ]
    for strategy, model, expected in fits:
        try:
            trainer(strategy).fit(HFLossCausalLM(model), data(dist.get_world_size() // pp))
        except ValueError as error:
            assert expected in str(error), error
            refused.append(str(error))
        else:
            raise AssertionError(f"{expected!r} was not refused")
    return [message[:60] for message in refused]


def check_pipeline_loaded_weights(pp: int, family: str, stages_per_rank: int = 1, **config: object) -> dict:
    """A model built on the meta device by ``from_pretrained`` and split at pp (one layer per stage; with several
    stages per rank, Interleaved1F1B): each rank holds its stages' layers only (and the embedding's copy as the tied
    head), each weight equal to transformers' own load; one schedule step's loss and this rank's gradients equal
    transformers' model's, and so do the logits of a call without labels in eval mode (on the last stage's rank; None
    on the others). ``config``: overrides of the family's tiny config."""
    directory = saved_checkpoint(family, num_hidden_layers=pp * stages_per_rank, **config)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model = from_pretrained(directory, dtype=torch.float32)
    schedule = "Interleaved1F1B" if stages_per_rank > 1 else "1F1B"
    options = PipelineOptions(schedule, stages_per_rank=stages_per_rank)
    parallelized = parallelize(
        model, ParallelDims(pp=pp).resolve(dist.get_world_size()).build_mesh("cpu"), pipeline=options
    )
    materialize_pretrained(model, torch.device("cpu"))
    parallelized.after_weights_loaded()
    expected = reference.state_dict()
    held = model.state_dict()
    stages = options.stages_of_rank(dist.get_rank(), pp)
    layers = {int(name.split(".")[2]) for name in held if name.startswith("model.layers.")}
    assert layers == set(stages), f"stages {stages} hold layers {layers}"
    result = {"weights": max((full(t) - expected[n]).abs().max().item() for n, t in held.items())}
    tokens, labels = batch(GLOBAL_BATCH)
    result |= _step_against(parallelized, reference, tokens, labels)
    model.eval()  # without labels, outside training: the forward-only schedule, the logits on the last stage
    with torch.no_grad():
        logits, expected_logits = model(input_ids=tokens).logits, reference(input_ids=tokens).logits
    result["logits"] = relative_error(logits, expected_logits) if pipeline_of(model).last else 0.0
    assert logits is not None or not pipeline_of(model).last, "the last stage returned no logits"
    assert result["weights"] == 0.0 and max(result.values()) < FP32_TOLERANCE, result
    remove(directory)
    return result


def _step_against(parallelized: Parallelized, reference: torch.nn.Module, tokens, labels) -> dict[str, float]:
    """One training call of the pipelined model (its tied copies' gradients summed) against one process's: the loss
    and this rank's every gradient."""
    model = parallelized.model
    loss = model(input_ids=tokens, labels=labels).loss
    loss.backward()
    parallelized.after_backward()
    reference_loss = hf_loss(reference, tokens, labels)
    reference_loss.backward()
    grads = dict(reference.named_parameters())
    return {
        "loss": abs(loss.item() - reference_loss.item()) / reference_loss.item(),
        "grads": max(relative_error(full(p.grad), grads[n].grad) for n, p in model.named_parameters()),
    }


def check_meta_build_stays_tied(pp: int, stages_per_rank: int = 2) -> dict:
    """A tied model (Gemma 3) built on the meta device, split at pp with two stages per rank (views of the model) and
    initialised on each rank, then ``after_weights_loaded``: the last stage's copy of the embedding holds the first
    stage's values, and one step's loss and every gradient (the two copies' summed by ``after_backward``) equal one
    process's on the weights the ranks hold."""
    with torch.device("meta"):
        model = tiny_model("gemma3", num_hidden_layers=LAYERS)
    options = PipelineOptions("Interleaved1F1B", stages_per_rank=stages_per_rank)
    mesh = ParallelDims(pp=pp).resolve(dist.get_world_size()).build_mesh("cpu")
    parallelized = parallelize(model, mesh, pipeline=options)
    materialize_hf_model(model, torch.device("cpu"))
    parallelized.after_weights_loaded()
    reference = tiny_model("gemma3", num_hidden_layers=LAYERS)
    held = [{name: full(tensor) for name, tensor in model.state_dict().items()}]
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, held[0])
    first_stage = every_rank[0]["model.embed_tokens.weight"]
    result = {"copy": (held[0]["model.embed_tokens.weight"] - first_stage).abs().max().item()}
    reference.load_state_dict({name: t for state in reversed(every_rank) for name, t in state.items()}, strict=False)
    result |= _step_against(parallelized, reference, *batch(GLOBAL_BATCH))
    assert result["copy"] == 0.0 and max(result.values()) < FP32_TOLERANCE, result
    return result


def check_pipeline_lora(pp: int, tp: int, sp: bool, schedule: str = "1F1B", stages_per_rank: int = 1) -> dict:
    """A PEFT model (LoRA on every projection; the base frozen) under pp x tp through the Trainer: the adapters'
    gradients at each step and their weights after 3 AdamW steps match one process."""
    config = dict(num_hidden_layers=LAYERS)
    module = HFLossCausalLM(peft_model(seed=dist.get_rank(), config=config))
    strategy = AutoModelParallelStrategy(tp, sp=sp, pp=pp, pp_schedule=schedule, pp_stages_per_rank=stages_per_rank)
    trainer(strategy).fit(module, data(dist.get_world_size() // pp // tp))
    assert len(pipeline_of(module.model).stage_modules()) == stages_per_rank
    reference = peft_model(config=config)
    return compare_training(module, reference, reference_run(reference, loss=hf_loss), stages=True)


def check_pipeline_batch_shapes(pp: int) -> list[float]:
    """Batches of other shapes one after another (8 rows, 4 rows, then shorter rows: a last batch, dynamic padding):
    the stages size their transfers again, and every step's gradients (Gemma 3, tied) equal one process's. A second
    backward of one loss is refused (it would add the schedule's gradients again)."""
    model, reference = (tiny_model("gemma3", num_hidden_layers=LAYERS) for _ in range(2))
    parallelized = parallelize(model, ParallelDims(pp=pp).resolve(dist.get_world_size()).build_mesh("cpu"))
    errors = []
    for rows, length in ((8, 16), (4, 16), (4, 12)):
        tokens, labels = (tensor[:, :length] for tensor in batch(rows))
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        model(input_ids=tokens, labels=labels).loss.backward()
        parallelized.after_backward()
        hf_loss(reference, tokens, labels).backward()
        expected = dict(reference.named_parameters())
        errors.append(max(relative_error(p.grad, expected[n].grad) for n, p in model.named_parameters()))
    assert max(errors) < FP32_TOLERANCE, errors
    loss = model(input_ids=tokens, labels=labels).loss
    loss.backward()
    try:
        loss.backward()
    except RuntimeError as error:
        assert "A second backward of one pipelined loss" in str(error), error
    else:
        raise AssertionError("a second backward of a pipelined loss was not refused")
    return errors


def check_accumulation_around_forward_only_calls(pp: int) -> dict:
    """Two training calls accumulating their gradients with a forward-only call (logits, no labels, no gradients)
    between them: the gradients equal one process's sum of both. torch's schedules prepare their stages for forward
    only or training when they switch, so a forward-only schedule sharing the training one's stages left them
    prepared for forward only (the second call's gradients lost), and FSDP2 mixed the gradients held from the first
    call into the forward-only pass."""
    model, reference = (tiny_model("llama", num_hidden_layers=LAYERS) for _ in range(2))
    parallelize(model, ParallelDims(pp=pp).resolve(dist.get_world_size()).build_mesh("cpu"))
    tokens, labels = batch(GLOBAL_BATCH)
    errors = []
    for _ in range(2):
        model(input_ids=tokens, labels=labels).loss.backward()
        hf_loss(reference, tokens, labels).backward()
        expected = dict(reference.named_parameters())
        errors.append(max(relative_error(full(p.grad), expected[n].grad) for n, p in model.named_parameters()))
        with torch.no_grad():
            logits = model(input_ids=tokens).logits
        if pipeline_of(model).last:
            errors.append(relative_error(logits, reference(input_ids=tokens).logits))
    assert max(errors) < FP32_TOLERANCE, errors
    return {"errors": errors}
