"""What the parallelizer reads of a model before any plan: its decoder layers, blocks sharing parameters or
recomputed outside their call, the probe's step, the strategy registered for it, checkpointing modes, and initial
weights of a model built on the meta device. No process group."""

import threading
import weakref

import pytest
import torch

from lightning_automodel import ParallelDims
from lightning_automodel.hf.decoder_layers import layers_sharing_parameters, named_decoder_layers
from lightning_automodel.parallel import (
    DefaultParallelizationStrategy,
    ParallelizationStrategy,
    ParallelOptions,
    decoder_layers,
    parallelize,
    register_parallelization_strategy,
)
from lightning_automodel.parallel.parallelizer import parallelization_strategy_for
from lightning_automodel.parallel.preflight import (
    blocks_recomputed_outside_calls,
    check_before_collectives,
    probe_unsharded,
)
from lightning_automodel.planning.simulation import fake_world
from lightning_automodel.testing.coverage_report.model_types import coverage_model
from lightning_automodel.testing.models import tiny_model


def test_decoder_layers_are_the_items_of_the_outermost_lists():
    """StableLM's per-head norms sit in a ModuleList inside each block: part of the block, not blocks."""
    model = coverage_model("stablelm", qk_layernorm=True)
    assert isinstance(model.model.layers[0].self_attn.q_layernorm.norms, torch.nn.ModuleList)
    layers = range(model.config.num_hidden_layers)
    assert [name for name, _ in named_decoder_layers(model)] == [f"model.layers.{i}" for i in layers]


def test_layers_sharing_parameters_are_found():
    """Zamba ties the shared attention of every hybrid layer to the first one's: those layers cannot be FSDP units
    of their own; its Mamba layer can."""
    model = coverage_model("zamba")
    layers = decoder_layers(model)
    assert [type(layer).__name__ for layer in layers_sharing_parameters(model, layers)] == ["ZambaHybridLayer"] * 2
    assert layers_sharing_parameters(tiny_model(), decoder_layers(tiny_model())) == []


def test_a_block_recomputed_outside_its_call_is_held_by_the_root():
    """Reformer's reversible layers run without autograd in forward and are recomputed in backward by hand: the
    root's FSDP unit holds them, gathered through backward; resharding the root after forward, or checkpointing
    them, is refused before any collective."""
    with torch.device("meta"):
        model = coverage_model("reformer")
    layers = tuple(name for name, _ in named_decoder_layers(model))
    assert blocks_recomputed_outside_calls(model, probe_unsharded(model, tp=1)) == layers
    assert blocks_recomputed_outside_calls(tiny_model(), probe_unsharded(tiny_model(), tp=1)) == ()
    with fake_world(2):
        mesh = ParallelDims(dp_shard=2).resolve(2).build_mesh("cpu")
        assert check_before_collectives(model, mesh).held_by_root == layers
        for option, named in (
            ("reshard_after_forward", "reshard_after_forward=True"),
            ("activation_checkpointing", "activation checkpointing"),
        ):
            with pytest.raises(ValueError, match=f"runs reformer.encoder.layers.0 without autograd.*{named} would"):
                check_before_collectives(model, mesh, **{option: True})


def test_the_probe_finds_the_one_length_reformer_trains_on(monkeypatch, caplog):
    """Reformer with 64 positions trains on the 16 tokens its axial position embeddings tile alone (4 x 6: 24, no
    power of two): the probe runs at that length and finds its reversible layers. A model it cannot run at any
    length is named in a warning at tp=1, saying what cannot be found."""
    from lightning_automodel.parallel import preflight

    monkeypatch.setattr(preflight, "_WARNED_UNPROBED", weakref.WeakSet())  # warned once a class: not yet here
    with torch.device("meta"):
        model = coverage_model("reformer:local_64_positions")
        wider = coverage_model("reformer:local_64_positions", axial_pos_shape=(4, 6))
    layers = tuple(name for name, _ in named_decoder_layers(model))
    for reformer, length in ((model, 16), (wider, 24)):
        trace = probe_unsharded(reformer, tp=1)
        assert trace.tokens == length and blocks_recomputed_outside_calls(reformer, trace) == layers
    monkeypatch.setattr(preflight, "sequence_lengths", lambda model, tp, images: [5 * tp])
    with fake_world(2):
        mesh = ParallelDims(dp_shard=2).resolve(2).build_mesh("cpu")
        assert check_before_collectives(model, mesh).held_by_root == ()
    assert "ReformerModelWithLMHead on the meta device failed at every sequence length tried" in caplog.text
    assert "(reversible layers), which FSDP2 must leave to the root's unit, cannot be found" in caplog.text


def test_a_model_the_probe_cannot_run_is_named_once_per_class(monkeypatch, caplog):
    """A plan report parallelizes a model once a pipeline stage and checkpointing mode, a layout search once a
    candidate: the warning that the probe failed at every length names each model class once."""
    from lightning_automodel.parallel import preflight

    monkeypatch.setattr(preflight, "_WARNED_UNPROBED", weakref.WeakSet())
    monkeypatch.setattr(preflight, "sequence_lengths", lambda model, tp, images: [5 * tp])
    with torch.device("meta"):
        models = [coverage_model("reformer:local_64_positions") for _ in range(2)]
    with fake_world(2):
        mesh = ParallelDims(dp_shard=2).resolve(2).build_mesh("cpu")
        for model in models:
            parallelize(model, mesh)
    warnings = [record for record in caplog.records if "failed at every sequence length" in record.getMessage()]
    assert len(warnings) == 1


def test_the_plan_left_out_of_the_log_nests_and_leaves_other_threads(caplog):
    """plan_not_logged leaves out what this thread logs about the plan until the outermost use ends; what other
    threads log passes."""
    from lightning_automodel.parallel.tensor.apply import log, plan_not_logged

    def told(message):
        log.warning(message)

    with plan_not_logged():
        with plan_not_logged():
            told("inner")
        told("outer, after an inner use")
        other = threading.Thread(target=told, args=("another thread",))
        other.start()
        other.join()
    told("after")
    assert [record.getMessage() for record in caplog.records] == ["another thread", "after"]


def test_a_registered_parallelization_strategy_takes_over_the_flow():
    calls = []

    class Family(torch.nn.Module):
        pass

    @register_parallelization_strategy("Family")
    class FamilyStrategy(ParallelizationStrategy):
        def parallelize(self, model, device_mesh, options):
            calls.append((model, device_mesh, options))
            return model

    model = Family()
    assert isinstance(parallelization_strategy_for(model), FamilyStrategy)
    assert parallelize(model, "mesh", sp=True).model is model
    assert calls == [(model, "mesh", ParallelOptions(sp=True))]
    assert isinstance(parallelization_strategy_for(tiny_model()), DefaultParallelizationStrategy)


def test_activation_checkpointing_modes_are_checked():
    from lightning_automodel.parallel.activation_checkpointing import apply_activation_checkpointing

    model = tiny_model()
    with pytest.raises(ValueError, match='activation_checkpointing=\'partial\': use False, True/"full", "selective"'):
        apply_activation_checkpointing(model, decoder_layers(model), mode="partial")
    with pytest.raises(ValueError, match='"submodule" found no attention or MLP block in Linear'):
        apply_activation_checkpointing(model, [torch.nn.Linear(2, 2)], mode="submodule")


def test_a_block_checkpointed_by_hugging_face_is_no_recomputation_outside_its_call():
    """Hugging Face's activation checkpointing recomputes each layer's modules in backward too, but runs the layer with
    autograd recording in forward, where FSDP2's hooks hold its weights gathered for the recomputation."""
    with torch.device("meta"):
        model = tiny_model()
    model.activation_checkpointing_enable()
    model.train()
    trace = probe_unsharded(model, tp=1)
    assert "model.layers.0.mlp" in trace.called_in_backward
    assert blocks_recomputed_outside_calls(model, trace) == ()


def test_parameters_no_init_sets_get_their_constructors_values():
    """A parameter its model's _init_weights never writes gets the value its module's constructor gives it, as in
    one process (xIELU's learned scalars; a parameter of our own here), instead of whatever the allocation held.
    One that neither sets is refused, named."""
    from lightning_automodel.hf.initialization import materialize_hf_model

    with torch.device("meta"):
        model = tiny_model()
        model.model.layers[0].self_attn.register_parameter("scale", torch.nn.Parameter(torch.full((4,), 0.5)))
    with pytest.raises(ValueError, match=r"\['model\.layers\.0\.self_attn\.scale'\] are neither initialised"):
        materialize_hf_model(model, torch.device("cpu"))  # the constructor of LlamaAttention makes no such parameter
    apertus = coverage_model("apertus")
    with torch.device("meta"):
        meta_apertus = type(apertus)(apertus.config)
    materialize_hf_model(meta_apertus, torch.device("cpu"))
    for name, param in apertus.named_parameters():
        if "act_fn" in name:
            assert torch.equal(meta_apertus.get_parameter(name), param), name
    assert not any(p.isnan().any() for p in meta_apertus.parameters())
