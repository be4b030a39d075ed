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
def _no_process_group_left():
    """A test that runs the strategy in this process (a world of 1) leaves its process group: the tests after it in
    this worker would find one initialized (and the planning's fake process group refuses to run beside it)."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
