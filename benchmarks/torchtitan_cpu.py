"""torchtitan 0.3.0 on a CPU-only torch (benchmarks/torchtitan_peer.py): its imports and trainer set for a CPU, each
workaround a function here that cites the line it works around.

- device type: tools/utils.py:55 falls back to "cuda"; resolved as "cpu" (torch.cpu, gloo) while torchtitan imports.
- triton: distributed/minimal_async_ep/kernels.py:10 imports it (MoE kernels, unused here); that module is stubbed.
- memory monitor: components/metrics.py:42-50 asks torch.cpu for CUDA's memory statistics; a monitor of zeros.
- gradient division: distributed/fsdp.py:41 makes FSDP2 reduce with PREMUL_SUM, which gloo rejects; plain SUM.
- attention: models/common/config_utils.py:97 refuses "sdpa"; SDPA is put into the built config, as its tests do
  (benchmarks/torchtitan_trainer.py's ``llama_spec``).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from contextlib import contextmanager

KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def import_torchtitan() -> None:
    """torchtitan's trainer and Llama-3, imported on a CPU-only torch."""
    with cpu_device_type():
        stub_triton_kernels()
        import torchtitan.models.llama3  # noqa: F401
        import torchtitan.trainer  # noqa: F401
    zero_memory_monitor()


@contextmanager
def cpu_device_type():
    """tools/utils.py:55 takes ``_get_available_device_type() or "cuda"`` at import: on a CPU-only torch the Trainer
    would set a CUDA device and pick NCCL. While torchtitan imports, the available device is "cpu" (torch.cpu, gloo)."""
    import torch._utils

    available = torch._utils._get_available_device_type
    torch._utils._get_available_device_type = lambda: "cpu"
    try:
        yield
    finally:
        torch._utils._get_available_device_type = available


def stub_triton_kernels() -> None:
    """distributed/minimal_async_ep/kernels.py:10 imports triton, which a CPU torch lacks; every model reaches it
    (models/common/token_dispatcher.py:17 -> minimal_async_ep/api.py:30) but only MoE expert parallelism runs its
    kernels. That module alone is stubbed: a fake triton would mislead torch's own imports of it."""
    if importlib.util.find_spec("triton") is not None:
        return

    def kernel(name: str):
        if name.startswith("__"):  # a module's own attributes (``__file__``...), which inspect looks up
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{name} needs triton")

        return unavailable

    module = types.ModuleType(KERNELS)
    module.__getattr__ = kernel
    sys.modules[KERNELS] = module


def zero_memory_monitor() -> None:
    """components/metrics.py:42-50: the device memory monitor asks torch.cpu for a device name, its properties and
    memory statistics, which it has not. A monitor of zeros instead (CPU has no allocator statistics)."""
    import torchtitan.components.metrics as metrics

    class CpuMemoryMonitor:
        device_name, device_capacity_gib = "cpu", 0.0

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self) -> None:
            pass

    metrics.build_device_memory_monitor = CpuMemoryMonitor


def sum_reductions(trainer) -> None:
    """distributed/fsdp.py:41 sets every FSDP module's gradient divide factor to 1.0 (the loss is already divided by
    the global token count), which torch's FSDP2 reduces with ReduceOp.PREMUL_SUM(1 / 1.0)
    (fsdp/_fully_shard/_fsdp_collectives.py:850), which gloo rejects. Plain SUM reductions compute the same."""
    from torch.distributed.fsdp import FSDPModule

    for part in trainer.model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
