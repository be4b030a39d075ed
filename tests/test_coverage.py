"""The coverage report's instrument (scripts/coverage.py): today's verdicts on a model type of every kind it
finds, and a sweep that survives hangs and crashes."""

import os
import time
from functools import partial

import torch
import torch.distributed as dist
from coverage_checks import (
    CRASH,
    HANG,
    PASS,
    REFUSAL,
    WRONG,
    classify,
    coverage_check,
    describe_error,
    measure,
)
from harness import check_name, run_checks

# Today's verdict on one type of every kind docs/coverage.md shows, with a fragment of its detail (for a pass: of
# where its plan came from) and, for a tensor-parallel pass, the share of block weights sharded. The fixes that
# follow issue 12 change these on purpose.
EXPECTED = {
    ("olmo2", "tp2"): (PASS, "Hugging Face plan", 0.99),  # its Hugging Face plan shards the blocks
    ("hunyuan_v1_dense", "tp2"): (PASS, "Hugging Face plan", 0.0),  # the plan is lm_head only: blocks whole
    ("gptj", "tp2"): (PASS, "default Llama-style plan", 0.0),  # the default matches lm_head only
    ("gptj", "tp2_sp"): (CRASH, "Expected input batch_size (128)", None),  # lm_head gets the full sequence
    ("stablelm", "tp2"): (CRASH, "is invalid for input of size", None),  # attention reads global head counts
    ("gpt2", "tp2"): (REFUSAL, "are tied, but the tensor-parallel plan shards them differently", None),  # Conv1D
    ("gpt2", "dp_shard2"): (PASS, "", None),
    ("apertus", "tp2"): (WRONG, "act_fn.alpha_n", None),  # xIELU's scalars see half the MLP, never summed
    ("granite", "tp2_sp"): (REFUSAL, "has no sequence-parallel layout", None),
    ("roberta", "tp2"): (CRASH, "ColwiseParallel currently only support nn.Linear", None),  # names no module
    ("zamba2", "dp_shard2"): (CRASH, "Cannot concatenate overlapping meshes", None),  # nested ModuleLists
}


def test_todays_verdict_on_a_model_type_of_every_kind():
    checks = {job: partial(coverage_check, *job) for job in EXPECTED}
    outcomes = run_checks(2, list(checks.values()))
    for job, (verdict, fragment, sharded) in EXPECTED.items():
        result = classify(outcomes[check_name(checks[job])])
        assert result["verdict"] == verdict, (job, result)
        assert fragment in result["detail"] + (result.get("plan") or ""), (job, result)
        if sharded is not None:
            assert round(result["sharded"], 2) == sharded, (job, result)


def scripted_check(model_type: str, layout: str) -> dict:
    """A stand-in for coverage_check that behaves as its model type says."""
    if model_type == "hangs":
        time.sleep(3600)
    if model_type == "rank1_raises" and dist.get_rank() == 0:
        dist.all_reduce(torch.zeros(1))  # waits for rank 1, which never comes
    if model_type == "rank1_raises":
        try:
            raise RuntimeError("boom")
        except RuntimeError as error:
            return {"status": "raised", "stage": "test", **describe_error(error)}
    if model_type == "rank0_exits" and dist.get_rank() == 0:
        os._exit(3)
    if model_type == "rank0_exits":
        dist.barrier()
    assert model_type.startswith("fine"), model_type
    errors = {"loss": 0.0, "logits": 0.0, "grad": 0.0}
    return {"status": "ran", "errors": errors, "worst_grad": "w", "uninitialised_buffers": []}


def test_a_hang_or_a_crash_ends_its_launch_and_the_sweep_goes_on():
    kinds = ("fine1", "hangs", "fine2", "rank1_raises", "fine3", "rank0_exits", "fine4")
    jobs = [(kind, "tp2") for kind in kinds]
    results = list(measure(jobs, job_timeout=5, check=scripted_check))
    assert [job for _, job, _ in results] == jobs
    verdicts = [verdict["verdict"] for _, _, verdict in results]
    assert verdicts == [PASS, HANG, PASS, CRASH, PASS, CRASH, PASS], results
    assert "rank 1 only" in results[3][2]["detail"] and "boom" in results[3][2]["detail"], results[3]
    assert "within 5 s" in results[1][2]["detail"], results[1]
    assert "exited with code 3" in results[5][2]["detail"], results[5]
    assert [launch for launch, _, _ in results] == [1, 1, 2, 2, 3, 3, 4]
