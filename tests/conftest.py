import os
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def no_pytest_argv(monkeypatch):
    """LightningCLI warns when it is given args while sys.argv holds pytest's."""
    monkeypatch.setattr(sys, "argv", ["lightning-automodel"])
