"""layout="auto": the search for the fastest layout that fits (its waves, prunes and refusal, on made-up measurements
and on a real model's), the global batch kept by accumulation, the sizes given kept, and the strategy choosing at
setup on gloo ranks: the same choice on every rank, parity with one process, the refusal before any weight, and the
chosen layout's estimate against the measured peak of a real step."""

import dataclasses
import re
from functools import partial
from unittest import mock

import pytest
import torch
from auto_layout_checks import (
    check_auto_layout_trains_at_parity,
    check_chosen_layout_memory,
    check_refusal_before_any_weight,
)
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from transformers import AutoModelForCausalLM

from lightning_automodel import AutoModelParallelStrategy, ParallelDims
from lightning_automodel.cli import main
from lightning_automodel.parallel.pipeline import PipelineOptions
from lightning_automodel.planning.search.fitting import NoLayoutFits
from lightning_automodel.planning.search.layouts import Candidate, Outcome, SearchSpace, candidates, tensor_budget
from lightning_automodel.planning.search.throughput import Hardware
from lightning_automodel.planning.search.waves import chosen_fit, search_layout, tie_ordered
from lightning_automodel.planning.search.workers import combined, jobs_of
from lightning_automodel.strategy.auto_layout import _with_accumulation, step_options
from lightning_automodel.testing.harness import check_name, run_checks
from lightning_automodel.testing.models import tiny_config

ROWS, TOKENS = 2, 64
GIB = 2**30


def _on_meta():
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(vocab_size=512, hidden_size=128, intermediate_size=256))


def _made_up(sizes: list[tuple[int, str, float, float]]) -> tuple[list[Candidate], dict]:
    """Candidates of made-up layouts (tp, setting, tokens/s, GiB), ranked as given, and their outcomes."""
    ranked, outcomes = [], {}
    for tp, setting, speed, gib in sizes:
        candidate = Candidate(ParallelDims(tp=tp, dp_shard=8 // tp).resolve(8), setting, speed, tp, tp > 1, None)
        ranked.append(candidate)
        outcomes[candidate] = gib if isinstance(gib, str) else Outcome(int(gib * GIB), 0)
    return ranked, outcomes


class _Replay:
    """Measures a wave by looking the outcomes up, and remembers the waves."""

    def __init__(self, outcomes: dict) -> None:
        self.outcomes, self.waves = outcomes, []

    def __call__(self, wave: list[Candidate]) -> list:
        self.waves.append([(c.dims.tp, c.checkpointing) for c in wave])
        return [self.outcomes[candidate] for candidate in wave]


MADE_UP = [
    (1, "off", 100, 90),
    (2, "off", 95, "tp=2 does not divide the 3 KV heads"),
    (1, "selective", 90, 80),
    (2, "selective", 85, 70),
    (4, "off", 80, 60),
    (1, "submodule", 78, 75),
    (1, "full", 77, 74),  # too large with full: tp=1 is out of reach from here
    (4, "selective", 70, 40),
    (8, "off", 60, 30),
]


def test_the_search_measures_from_the_top_until_the_first_fit_is_known():
    """Budget 65 GiB: the first fit in the ranking is tp=4 "off" (index 4). One worker measures the candidates one
    by one, tp=1's full checkpointing brought forward once its "off" is too large (it rules out two settings), tp=2's
    skipped once its plan is refused, and stops there; four measure the first four, then the next four still in
    reach: the same choice, every candidate ranked above it measured or out of reach. Of two fits measured in one wave,
    the better ranked wins."""
    ranked, outcomes = _made_up(MADE_UP)
    budget = 65 * GIB
    one = _Replay(outcomes)
    record = search_layout(ranked, budget=budget, evaluate=one, workers=1)
    # tp=1 too large without checkpointing, two settings still to measure: its full checkpointing first (too large too).
    assert one.waves == [[(1, "off")], [(1, "full")], [(2, "off")], [(4, "off")]]
    four = _Replay(outcomes)
    assert search_layout(ranked, budget=budget, evaluate=four, workers=4).outcomes.keys() >= {0, 2, 4}
    first, second = [(1, "off"), (2, "off"), (1, "selective"), (2, "selective")], [(4, "off"), (1, "submodule")]
    assert four.waves == [first, [*second, (1, "full"), (4, "selective")]]  # workers left idle measure ahead
    assert ranked.index(next(c for c in ranked if (c.dims.tp, c.checkpointing) == (4, "off"))) == 4
    assert not record.fits(0) and record.fits(4)
    # Two fits in one wave: the better ranked wins, not the smaller (tp=2 "selective" at 41 GiB, ranked below).
    cheaper = {**outcomes, ranked[2]: Outcome(60 * GIB, 0), ranked[3]: Outcome(41 * GIB, 0)}
    assert _choice(ranked, cheaper, budget=budget, workers=4) == (1, "selective")
    # The full checkpointing of tp=1 measured too large prunes tp=1's remaining settings.
    pruned = _Replay({**outcomes, ranked[6]: Outcome(74 * GIB, 0)})
    search_layout([ranked[6], ranked[5], ranked[8]], budget=budget, evaluate=pruned, workers=1)
    assert pruned.waves == [[(1, "full")], [(8, "off")]]


def test_a_pipeline_candidate_is_measured_one_pp_rank_a_worker():
    """Each pp rank's stages of a pp candidate are a job of their own, measured beside the others: a wave holds the
    candidates whose jobs fill the workers (pp=4 takes four), and a candidate's outcome is its largest rank's (or its
    first refusal), measured in the time of its slowest job."""
    ranked = [
        Candidate(ParallelDims(pp=pp, dp_shard=8 // pp).resolve(8), "off", speed, 1, False, PipelineOptions())
        for pp, speed in ((4, 100), (1, 90), (2, 80), (2, 70))
    ]
    ranked[3] = dataclasses.replace(ranked[3], checkpointing="full")
    outcomes = {candidate: Outcome(100 * GIB, 0) for candidate in ranked[:3]} | {ranked[3]: Outcome(GIB, 0)}
    replay = _Replay(outcomes)
    search_layout(ranked, budget=65 * GIB, evaluate=replay, workers=4)
    assert [len(wave) for wave in replay.waves] == [1, 2, 1]  # pp=4; pp=1 and pp=2; pp=2
    assert jobs_of(ranked[:2]) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, None)]
    stages = [Outcome(GIB, 2 * GIB, 0, 3.0), Outcome(GIB, 5 * GIB, 0, 1.0), Outcome(GIB, GIB, 0, 2.0)]
    jobs = [(0, 0), (0, 1), (1, 0)]
    assert combined(ranked[2:], jobs, stages) == [Outcome(GIB, 5 * GIB, 0, 3.0), Outcome(GIB, GIB, 0, 2.0)]
    assert combined(ranked[2:], jobs, [stages[0], "refused", stages[2]]) == ["refused", stages[2]]


def test_estimates_within_one_percent_tie_and_recomputing_less_then_holding_less_wins():
    """tp=1 "selective" fits first (ranked second), but tp=2 "off" is estimated 0.6% slower: a tie, which the search
    measures too and wins by recomputing nothing; of two tied fits of one setting the smaller wins; 1.5% behind is
    no tie. ``plan --fit``'s table orders its rows by the same rule."""
    ranked, outcomes = _made_up(
        [(1, "off", 100, 90), (1, "selective", 99.5, 60), (2, "off", 98.9, 64), (4, "off", 97, 30)]
    )
    assert _choice(ranked, outcomes, budget=65 * GIB, workers=1) == (2, "off")
    record = search_layout(ranked, budget=65 * GIB, evaluate=_Replay(outcomes), workers=1)
    assert sorted(record.outcomes) == [0, 1, 2]  # tp=4, 2.5% behind the first fit, is never measured
    assert tie_ordered(record, [1, 2]) == [2, 1]
    smaller, smaller_outcomes = _made_up([(1, "off", 100, 64), (2, "off", 99.2, 50), (4, "off", 98.5, 20)])
    assert _choice(smaller, smaller_outcomes, budget=65 * GIB, workers=1) == (2, "off")
    apart, apart_outcomes = _made_up([(1, "selective", 100, 60), (2, "off", 98.5, 64)])
    assert _choice(apart, apart_outcomes, budget=65 * GIB, workers=1) == (1, "selective")


def test_a_replicated_twin_of_a_layout_too_large_is_not_measured():
    """FSDP over 8 too large without checkpointing: HSDP's 2 replicas of 4 take the same step with twice the state, so
    its "off", ranked second, is never measured; the search ends at FSDP's "full", which fits."""
    fsdp, hsdp = (ParallelDims(dp_shard=8 // r, dp_replicate=r).resolve(8) for r in (1, 2))
    ranked = [
        Candidate(dims, setting, speed, 1, False, None)
        for setting, speed in (("off", 2), ("full", 1))
        for dims in (fsdp, hsdp)
    ]
    outcomes = dict(
        zip(
            ranked,
            [Outcome(90 * GIB, 0), Outcome(99 * GIB, 0), Outcome(40 * GIB, 0), Outcome(50 * GIB, 0)],
            strict=True,
        )
    )
    replay = _Replay(outcomes)
    record = search_layout(ranked, budget=65 * GIB, evaluate=replay, workers=1)
    assert [ranked[index].name for index in record.outcomes] == ["tp=1 cp=1 dp_shard=8", "tp=1 cp=1 dp_shard=8"]
    assert chosen_fit(record) == 2  # FSDP with full checkpointing: the replicated twin ranks below it anyway


def _choice(ranked, outcomes, *, budget, workers):
    record = search_layout(ranked, budget=budget, evaluate=_Replay(outcomes), workers=workers)
    chosen = ranked[chosen_fit(record)]
    return chosen.dims.tp, chosen.checkpointing


def test_sizes_given_stay_fixed_and_the_global_batch_is_kept():
    """tp=2 given: every candidate has it; each accumulates pp x tp x cp / 2 batches (the global batch of every other
    rank a data-parallel rank). Where the optimizer cannot accumulate, the layouts that would shrink the global batch
    are refused, saying so."""
    hardware, shape = Hardware(memory_gib=80, gpus_per_node=8), (4, TOKENS)
    ranked, _ = candidates(_on_meta(), 8, space=SearchSpace(tp=2), hardware=hardware, batch_shape=shape)
    assert ranked and {c.dims.tp for c in ranked} == {2}
    assert all(c.accumulation == c.dims.pp * c.dims.cp for c in ranked)
    assert {c.dims.pp for c in ranked} == {1, 2, 4}  # pp=4 with 4 rows: 1F1B over 4 micro-batches of one
    free, _ = candidates(_on_meta(), 8, space=SearchSpace(), hardware=hardware, batch_shape=shape)
    assert {c.accumulation for c in free if c.dims.dp == 8} == {1} and max(c.accumulation for c in free) == 8
    manual = SearchSpace(no_accumulation="the module steps its optimizer itself")
    kept, refused = candidates(_on_meta(), 8, space=manual, hardware=hardware, batch_shape=shape)
    assert {(c.dims.pp, c.dims.tp, c.dims.cp) for c in kept} == {(1, 1, 1)}
    assert "it would train a global batch 2 times smaller than the one given" in refused["tp=2 cp=1 dp_shard=4"]
    assert refused["tp=2 cp=1 dp_shard=4"].endswith("the module steps its optimizer itself")
    # Checkpointing given: that setting alone.
    fixed, _ = candidates(_on_meta(), 8, space=SearchSpace(checkpointing="full"), hardware=hardware, batch_shape=shape)
    assert {c.checkpointing for c in fixed} == {"full"}


def test_nothing_fits_names_the_smallest_shortfall_and_what_would_fit():
    """Every candidate too large: the refusal names the smallest (its state, activations and optimizer step's
    temporaries) and the sizes that would make it fit, scaled from its estimate: GPUs for the state, rows or tokens for
    the activations; none of the latter where the temporaries, which stay, leave no room."""
    ranked, outcomes = _made_up([(1, "off", 100, 90), (2, "full", 50, 50)])
    outcomes[ranked[1]] = Outcome(25 * GIB, 25 * GIB, 4 * GIB)  # 50 GiB: 20 over a budget of 30
    memory_gib = 30 / 0.9
    record = search_layout(ranked, budget=tensor_budget(memory_gib), evaluate=_Replay(outcomes), workers=2)
    assert chosen_fit(record) is None and len(record.outcomes) == 2
    shape = (4, TOKENS)
    message = str(NoLayoutFits.of(record, {}, hardware=Hardware(memory_gib), batch_shape=shape, world_size=8))
    assert (
        "no layout of 8 GPUs fits 33.3333 GiB per GPU (30.00 GiB for tensors) at 4 rows x 64 tokens a batch" in message
    )
    assert (
        "The smallest: tp=2 cp=1 dp_shard=4 with full checkpointing needs 50.00 GiB per GPU, 20.00 GiB more" in message
    )
    assert (
        "parameters, gradients and AdamW state 25.00 GiB, the larger of activations 25.00 GiB and the AdamW step's"
        " temporaries 4.00 GiB" in message
    )
    assert "more GPUs: about 40" in message  # the state sharded until it fits beside the activations: 8 x 25 / 5
    assert "a shorter sequence: 12 tokens a row" in message  # the activations scaled to the 5 GiB left: 64 x 5 / 25
    assert "a smaller batch" not in message  # 4 x 5 / 25 rows: less than one
    outcomes[ranked[1]] = Outcome(25 * GIB, 1 * GIB, 28 * GIB)  # 53 GiB: the temporaries over the 5 GiB left
    record = search_layout(ranked, budget=tensor_budget(memory_gib), evaluate=_Replay(outcomes), workers=2)
    message = str(NoLayoutFits.of(record, {}, hardware=Hardware(memory_gib), batch_shape=shape, world_size=8))
    assert "needs 53.00 GiB per GPU" in message and "a shorter sequence" not in message
    assert "more GPUs: about 16" in message  # state and temporaries sharded into 30 GiB: 8 x 53 / 30, whole nodes


def test_strategy_options_of_the_search():
    """The sizes, checkpointing and micro-batches given are fixed; what the estimate cannot model is refused, and so
    are the search's settings without it."""
    strategy = AutoModelParallelStrategy(layout="auto", tp=2, activation_checkpointing="selective", gpu_memory=80)
    space = strategy.options.search
    assert (space.tp, space.pp, space.cp, space.dp_shard, space.checkpointing, space.sp) == (
        2,
        None,
        None,
        None,
        "selective",
        True,
    )
    assert AutoModelParallelStrategy(layout="auto", sp=False).options.search.sp is False
    assert AutoModelParallelStrategy(tp=2).options.search is None
    vision = dict(layout_images_per_row=2, layout_image_tokens=64, freeze=["vision_tower"])
    step = step_options(AutoModelParallelStrategy(layout="auto", **vision).options, torch.nn.Module())
    assert (step.images_per_row, step.image_tokens, step.freeze) == (2, 64, ("vision_tower",))
    routing = AutoModelParallelStrategy(layout="auto", layout_expert_imbalance=1.5).options
    assert step_options(routing, torch.nn.Module()).expert_imbalance == 1.5
    assert step_options(AutoModelParallelStrategy(layout="auto").options, torch.nn.Module()).expert_imbalance == 1
    for options, match in [
        (dict(layout="auto", cpu_offload=True), "CPU offload keeps none"),
        (dict(layout="auto", float8=True), "float8 changes"),
        (dict(layout="fast"), 'use "auto"'),
        (dict(gpu_memory=80), 'sizes the search of layout="auto"'),
        (dict(layout="auto", gpu_memory=0), "a positive number"),
        (dict(layout="auto", layout_batch=(2,)), "two positive integers"),
        (dict(layout_images_per_row=2), 'sizes the search of layout="auto"'),
        (dict(layout="auto", layout_image_tokens=0), "layout_image_tokens=0: an integer of at least 1"),
        (dict(layout_expert_imbalance=1.5), 'sizes the search of layout="auto"'),
        (dict(layout="auto", layout_expert_imbalance=0.5), "expert_imbalance=0.5: the busiest expert's share"),
        (dict(layout="auto", pp_layers_per_stage=[2, 2]), "give pp too"),
    ]:
        with pytest.raises(ValueError, match=re.escape(match)):
            AutoModelParallelStrategy(**options)


# 200 MiB for tensors, of which the GPU's memory is 90%
CHOSEN_LAYOUT_MEMORY = partial(check_chosen_layout_memory, 200 / 0.9 / 1024)


@pytest.fixture(scope="module")
def two_ranks():
    """One launch of two gloo ranks: the refusal (first, before any real step has allocated) and layout="auto" for
    the memory test's model with its real step; each as every rank saw it."""
    checks = [partial(check_refusal_before_any_weight, 1e-5), CHOSEN_LAYOUT_MEMORY]
    return run_checks(2, checks, timeout=600)


def test_every_rank_reaches_the_same_choice_and_trains_at_parity():
    """The ranks measured different jobs (here each pp rank of two pp=2 candidates) and exchanged them: every rank
    logs the same choice, the same measurements. The chosen layout (pp=2 x tp=2 here: it accumulates 4 batches of 2
    rows, the global batch of 8 as four data-parallel ranks would read it) trains at parity with one process: losses,
    every gradient, the weights after 3 AdamW steps."""
    ranks = run_checks(4, [partial(check_auto_layout_trains_at_parity, 1.0)], timeout=600)
    ranks = ranks["check_auto_layout_trains_at_parity(1.0)"]
    assert all((rank["layout"], rank["measured"]) == (ranks[0]["layout"], ranks[0]["measured"]) for rank in ranks)
    jobs = sum(int(name.split()[0].removeprefix("pp=")) for name, _, _ in ranks[0]["measured"])
    assert jobs >= 4, "each rank measured a job of the first wave (one pp rank's stages of a pp candidate)"
    assert ranks[0]["layout"] == ("pp=2 tp=2 cp=1 dp_shard=1", "off")
    assert "each optimizer step accumulates 4 batches" in ranks[0]["choice"]


@pytest.mark.sweep
def test_a_size_given_stays_fixed():
    """pp=1 given: the choice, and every candidate measured, has pp=1; it too trains at parity (a launch of its own:
    the search and Trainer.fit again)."""
    ranks = run_checks(4, [partial(check_auto_layout_trains_at_parity, 1.0, pp=1)], timeout=600)
    ranks = ranks["check_auto_layout_trains_at_parity(1.0, pp=1)"]
    assert all((rank["layout"], rank["measured"]) == (ranks[0]["layout"], ranks[0]["measured"]) for rank in ranks)
    pipeline_rows = re.findall(r"^ +2 +\d+ +\d+ +\d+ +\d+  \w+", ranks[0]["choice"], re.MULTILINE)
    assert not pipeline_rows and not ranks[0]["layout"][0].startswith("pp=")


def test_nothing_fits_is_refused_on_every_rank_before_any_weight(two_ranks):
    refusals = two_ranks["check_refusal_before_any_weight(1e-05)"]
    assert len(set(refusals)) == 1, refusals
    assert "no layout of 2 GPUs fits 1e-05 GiB per GPU" in refusals[0]
    assert "The smallest: " in refusals[0] and "more GPUs: about" in refusals[0]


def test_the_chosen_layouts_estimate_holds_against_a_real_step(two_ranks):
    """Two gloo ranks choose for the memory test's model at 200 MiB for tensors, which its fastest layout without
    checkpointing (FSDP over both, 248 MiB) exceeds: FSDP with selective checkpointing is chosen (as fast in the
    model: its FSDP traffic outlasts the compute). On each rank the state the Trainer holds after its step
    (parameters, gradients, AdamW's moments) is the estimate's to 0.1%, and the resident memory a real step of the
    chosen layout adds at its peak is the activation estimate's within test_memory's tolerance."""
    for rank in two_ranks[check_name(CHOSEN_LAYOUT_MEMORY)]:
        assert (rank["layout"], rank["checkpointing"], rank["index"]) == ("tp=1 cp=1 dp_shard=2", "selective", 1), rank
        assert abs(rank["measured_state"] / rank["estimated_state"] - 1) < 0.001, rank
        assert abs(rank["measured_activations"] / rank["estimated_activations"] - 1) < 0.02, rank


def test_plan_prints_the_choice_of_a_layout_auto_config(capsys, no_pytest_argv):
    """`plan` on a config with layout: auto prints the choice as the strategy makes it (tp=2, which the config gives,
    kept), the same as `plan --fit`'s first row (measured by two child processes, each taking the next layout as it
    finishes one)."""
    config = ["--config", "examples/demo.yaml", "--trainer.strategy.init_args.layout=auto"]
    shape = ["--batch_size", "2", "--seq_len", "64", "--world_size", "4"]
    main(["plan", *config, *shape, "--gpu_memory", "0.05"])
    chosen = re.search(r'layout="auto" chose (.+?) with (\w+) checkpointing', capsys.readouterr().out).groups()
    main(["plan", *config, *shape, "--fit", "0.05", "--workers", "2"])  # two child processes side by side
    table = capsys.readouterr().out
    first = re.search(r"^ +(\d+) +(\d+) +(\d+) +(\d+) +(\d+)  (\w+) ", table, re.MULTILINE).groups()
    pp, tp, cp, dp_shard, _, setting = first
    expected = f"{f'pp={pp} ' if pp != '1' else ''}tp={tp} cp={cp} dp_shard={dp_shard}"
    assert chosen == (expected, setting) and tp == "2"


def test_a_layout_auto_config_needs_gpu_memory_to_plan(no_pytest_argv):
    with pytest.raises(SystemExit):
        main(["plan", "--config", "examples/demo.yaml", "--trainer.strategy.init_args.layout=auto"])


def test_where_lightning_cannot_accumulate_the_search_is_told_why():
    """Manual optimization, or a GradientAccumulationScheduler: the layouts that would shrink the global batch are
    refused (see test_sizes_given_stay_fixed_and_the_global_batch_is_kept), for the reason named here."""
    manual = mock.Mock(lightning_module=mock.Mock(automatic_optimization=False), callbacks=[])
    assert "manual optimization" in _with_accumulation(SearchSpace(), manual).no_accumulation
    scheduled = mock.Mock(
        lightning_module=mock.Mock(automatic_optimization=True), callbacks=[GradientAccumulationScheduler({0: 2})]
    )
    assert "GradientAccumulationScheduler" in _with_accumulation(SearchSpace(), scheduled).no_accumulation
    plain = mock.Mock(lightning_module=mock.Mock(automatic_optimization=True), callbacks=[])
    assert _with_accumulation(SearchSpace(), plain).no_accumulation is None


def test_layout_auto_on_cpu_needs_gpu_memory():
    """Refused at setup_environment, before the process group exists, on every rank alike."""
    strategy = AutoModelParallelStrategy(layout="auto")
    strategy._setup_distributed = mock.Mock()
    strategy._accelerator = mock.Mock()
    strategy.cluster_environment = mock.Mock(world_size=mock.Mock(return_value=2), local_rank=mock.Mock(return_value=0))
    strategy.parallel_devices = [torch.device("cpu")] * 2
    strategy._lightning_module = mock.Mock()
    with pytest.raises(ValueError, match="pass gpu_memory="):
        strategy.setup_environment()
    strategy._setup_distributed.assert_not_called()
