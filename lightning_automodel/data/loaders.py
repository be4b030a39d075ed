"""The loaders the data modules hand Lightning, and each rank's place among the data-parallel replicas."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
from torchdata.stateful_dataloader import StatefulDataLoader


class QuietStatefulDataLoader(StatefulDataLoader):
    """torchdata's ``StatefulDataLoader`` without the warning its constructor causes: it calls ``torch.set_vital``,
    which torch deprecated, a warning per process that only torchdata can act on. A class rather than a filter
    around our call: Lightning rebuilds loaders to insert its distributed sampler, and it rebuilds this class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "'set_vital' is deprecated", UserWarning, r"torchdata\.")
            super().__init__(*args, **kwargs)


def data_parallel_place(trainer: L.Trainer | None) -> dict[str, int]:
    """This rank's data-parallel ``rank`` and the data-parallel size ``num_replicas``, from the strategy
    (``{}`` outside a distributed run). Tensor-parallel peers share a place: they read the same rows, and count as
    one replica (the strategy's world size and global rank would deal them different rows)."""
    kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
    return {"num_replicas": kwargs["num_replicas"], "rank": kwargs["rank"]} if kwargs else {}
