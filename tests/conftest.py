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
