"""The AdamW step's temporaries (planning.memory.optimizer_step) against a real step's, and the rule the plan report
and the layout search add them by: a rank's state with the larger of the activations and the temporaries, which a
real training step followed by its optimizer step reaches (no processes: real tensors in a fake process group)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_automodel import ParallelDims, plan_report
from lightning_automodel.lm.optimization import adamw_with_schedule
from lightning_automodel.parallel.parallelizer import parallelize
from lightning_automodel.parallel.pipeline import PipelineOptions
from lightning_automodel.planning.memory.activations import TotalsTracker, training_step
from lightning_automodel.planning.memory.optimizer_step import optimizer_step_bytes
from lightning_automodel.planning.memory.step_options import StepOptions
from lightning_automodel.planning.simulation import fake_world
from lightning_automodel.testing.models import tiny_config

_CPU = torch.device("cpu")
SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=344)


def _model(*, meta: bool, layers: int):
    with torch.device("meta" if meta else "cpu"):
        return AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=layers, **SHAPE))


def _real_step(dims: ParallelDims, *, layers: int, adamw: str, batch: tuple[int, int] | None = None, **options):
    """A real model parallelized as rank 0 of ``dims`` in a fake process group, CausalLMModule's optimizer (its
    state made by a first step): the bytes its rank held, and what it allocated above them at the peak of a training
    step of ``batch`` (none: the optimizer step alone) and the optimizer step after it."""
    model = _model(meta=False, layers=layers)
    with fake_world(dims.world_size, rank=0):
        mesh = dims.build_mesh("cpu")
        parallelize(model, mesh, **options)
        trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
        for parameter in trained:
            parameter.grad = torch.zeros_like(parameter)
        schedule = dict(warmup_steps=0, schedule="constant", min_lr_ratio=1.0, total_steps=float("inf"))
        hparams = dict(learning_rate=1e-3, betas=(0.9, 0.95), weight_decay=0.1, implementation=adamw)
        optimizer = adamw_with_schedule(trained, **hparams, **schedule)["optimizer"]
        optimizer.step()
        with TotalsTracker() as tracker:
            tracker.track_external(model, optimizer)
            held = tracker.get_tracker_snapshot()[_CPU]["Total"]
            if batch is not None:
                ids = torch.randint(SHAPE["vocab_size"], batch, generator=torch.Generator().manual_seed(0))
                training_step(model, input_ids=ids, mesh=mesh)
            optimizer.step()
            peak = tracker.get_tracker_snapshot("peak")[_CPU]["Total"]
    return held, peak - held


@pytest.mark.parametrize(
    "adamw, dims, options",
    [
        ("foreach", ParallelDims(dp_shard=1).resolve(1), {}),
        ("foreach", ParallelDims(tp=2).resolve(2), dict(sp=True)),
        ("foreach", ParallelDims(pp=2).resolve(2), dict(pipeline=PipelineOptions())),
        ("fused", ParallelDims(dp_shard=2).resolve(2), {}),
    ],
)
def test_the_estimate_is_a_real_steps_temporaries(adamw, dims, options):
    """Eleven alike layers, estimated from three, four and five on fake tensors (under pp, the rank's stage cut to
    them): foreach's temporaries are a real step's to the byte (its largest param group's shards on the rank: 8.1 MiB
    whole, 4.1 MiB at tp=2, 3.7 MiB on the first of two stages); fused allocates none."""
    _, real = _real_step(dims, layers=11, adamw=adamw, **options)
    estimate = optimizer_step_bytes(_model(meta=True, layers=11), dims, implementation=adamw, **options)
    assert estimate == real
    assert (estimate > 2**21) if adamw == "foreach" else (estimate == 0)


@pytest.mark.parametrize("batch, larger", [((1, 8), "optimizer"), ((2, 64), "activations")])
def test_a_rank_peaks_at_its_state_and_the_larger_of_activations_and_temporaries(batch, larger):
    """The plan report's total is the state with the larger of the activations and the foreach step's temporaries,
    which a real training step followed by its optimizer step reaches (to 1 KiB: a few scalars, the loss): for a
    batch of 8 tokens the temporaries, for 2 rows of 64 the activations (fused AdamW's, which allocates none:
    test_fitting's search)."""
    dims = ParallelDims(dp_shard=1).resolve(1)
    report = plan_report(_model(meta=True, layers=6), dims, batch_shape=batch)
    sizes = {"activations": report.activation_bytes["off"], "optimizer": report.optimizer_bytes}
    assert max(sizes, key=sizes.get) == larger
    _, real = _real_step(dims, layers=6, adamw="foreach", batch=batch)
    total = report.total_bytes("off")
    assert total == report.training_bytes_per_rank + sizes[larger]
    assert abs(total - report.training_bytes_per_rank - real) <= 1024, (total, report.training_bytes_per_rank, real)
    assert "AdamW step (foreach): " in str(report) and "the total takes the larger" in str(report)


def test_an_adamw_the_module_does_not_offer_is_refused():
    with pytest.raises(ValueError, match="adamw='sgd' is not one of 'foreach', 'fused'"):
        StepOptions(adamw="sgd")
