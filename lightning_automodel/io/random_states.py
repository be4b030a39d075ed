"""Every rank's random number generators, saved with each checkpoint: a resumed run then draws what the
uninterrupted one would have (dropout masks in attention and LoRA, anything else a training step draws).

Per rank: Python's ``random``, NumPy's global generator, torch's CPU generator and the accelerator's generator of
this rank's device (where DTensor's RNG tracker keeps its state too: torch's ``OffsetBasedRNGTracker`` stores none
of its own). Kept in plain types and tensors, so that a checkpoint loads with ``weights_only=True``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

RandomStates = dict[str, Any]


def gather_random_states() -> list[RandomStates] | None:
    """Every rank's generator states, in rank order, on rank 0 (None on the others); collective."""
    states = _this_rank()
    if not dist.is_initialized():
        return [states]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(states, gathered, dst=0)
    return gathered


def restore_random_states(saved: list[RandomStates]) -> None:
    """Set this rank's generators to what ``saved`` (from :func:`gather_random_states`) holds for its rank."""
    states = saved[dist.get_rank() if dist.is_initialized() else 0]
    random.setstate(states["python"])
    kind, keys, position, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    torch.set_rng_state(states["torch"])
    accelerator = _accelerator()
    if accelerator is not None and states.get(accelerator.type) is not None:
        torch.get_device_module(accelerator).set_rng_state(states[accelerator.type])


def _this_rank() -> RandomStates:
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    states = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    accelerator = _accelerator()
    if accelerator is not None:
        states[accelerator.type] = torch.get_device_module(accelerator).get_rng_state()
    return states


def _accelerator() -> torch.device | None:
    """This process's accelerator, if it has one in use (asking does not create a context on other devices)."""
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
