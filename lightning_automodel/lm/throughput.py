"""Lightning's ThroughputMonitor, counting a model replica as one device.

Lightning multiplies one rank's samples, tokens and FLOPs by the world size to get the global figures. Under
tensor (or context, or pipeline) parallelism the ranks of one replica share a batch, so that would count it once
per rank. Here each replica is a "device": its batch counted once, its FLOPs measured against the peak of all
its GPUs, and the global figures the replicas' sum.
"""

from __future__ import annotations

import lightning as L
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import ThroughputMonitor

from lightning_automodel.data.loaders import data_parallel_place


class ReplicaThroughputMonitor(ThroughputMonitor):
    """``ThroughputMonitor`` whose "device" metrics are one model replica's and whose MFU is over its GPUs."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._counted_replicas = False

    # The data-parallel size is known once the strategy is set up (layout="auto" chooses it there): replicas are
    # counted at the first hook after it, before the first batch is timed.
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._count_replicas(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._count_replicas(trainer)
        super().on_validation_start(trainer, pl_module)

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._count_replicas(trainer)
        super().on_test_start(trainer, pl_module)

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._count_replicas(trainer)
        super().on_predict_start(trainer, pl_module)

    def _count_replicas(self, trainer: L.Trainer) -> None:
        if self._counted_replicas:
            return
        self._counted_replicas = True
        replicas = data_parallel_place(trainer).get("num_replicas", 1)
        ranks_per_replica = trainer.world_size // replicas
        if ranks_per_replica == 1:
            return
        if not isinstance(getattr(self, "_throughputs", None), dict):  # Lightning's, private: fail loudly if it moves
            raise RuntimeError("ReplicaThroughputMonitor does not know this Lightning version's ThroughputMonitor.")
        if self.available_flops is not None:
            self.available_flops *= ranks_per_replica
        for running_stage in self._throughputs:
            self._throughputs[running_stage] = Throughput(
                available_flops=self.available_flops, world_size=replicas, **self.kwargs
            )
