"""The peak memory of a call on CPU, which has no allocator statistics (the estimate's tracker, on a real step)."""

from __future__ import annotations

import torch

from lightning_automodel.planning.memory.activations import TotalsTracker


def peak_bytes(run, *held) -> int:
    """The peak memory of one call of ``run`` on this rank: the bytes of every tensor alive at its highest point,
    those ``held`` (modules, optimizers, tensors) start it with included."""
    tracker = TotalsTracker()
    tracker.track_external(*held)
    with tracker:
        run()
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def peak_above_held(run, *held) -> int:
    """The bytes one call of ``run`` allocates at its peak above what this rank held when it began: every live tensor
    then, ``held`` (modules, optimizers, tensors) included, counted once."""
    tracker = TotalsTracker()
    tracker.track_external(*held)
    with tracker:
        before = tracker.get_tracker_snapshot()[torch.device("cpu")]["Total"]
        run()
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - before
