import os
import sys

import pytest
import torch.distributed as dist

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def no_pytest_argv(monkeypatch):
    """LightningCLI warns when it is given args while sys.argv holds pytest's."""
    monkeypatch.setattr(sys, "argv", ["lightning-automodel"])


@pytest.fixture(autouse=True)
def _no_distributed_state_left():
    """A test that runs the strategy in this process (a world of 1) leaves its process group and the variables
    Lightning sets (MASTER_PORT, WORLD_SIZE, ...): the tests after it in this worker would find a process group
    initialized (the planning's fake one refuses to run beside it), and launches would inherit a port in use."""
    environment = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)


# The test files that take longest, longest first (summed durations of a whole run with --durations=0; docs/testing.md):
# pytest-xdist hands each worker one file at a time, and a long file handed out last keeps one core busy after the
# other has finished. The other files follow in collection order.
LONGEST_FIRST = (
    "test_faults.py",
    "test_cli.py",
    "test_vision.py",
    "test_auto_layout.py",
    "test_pipeline.py",
    "test_context_parallel.py",
    "test_fitting.py",
    "test_expert_parallel.py",
    "test_coverage.py",
    "test_vision_memory.py",
    "test_families.py",
    "test_lora.py",
    "test_loading.py",
    "test_compile.py",
    "test_vision_checkpoints.py",
    "test_memory.py",
    "test_parallel_parity.py",
    "test_strategy.py",
    "test_multinode.py",
    "test_checkpoints.py",
    "test_layouts.py",
    "test_vision_pipeline.py",
    "test_gpu_benchmark.py",
    "test_lm.py",
    "test_float8.py",
    "test_data_resume.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (xdist keeps this order: ``--no-loadscope-reorder`` in pyproject.toml)."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
