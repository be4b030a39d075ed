"""The step stall of a checkpoint save, synchronous against asynchronous (``async_save=True``), measured side by side.

    .venv/bin/python benchmarks/async_checkpoint.py [--frozen-mib 1024] [--steps 32] [--every 10]

A small Llama (2 layers, hidden 256) with AdamW, trained by 2 CPU processes over gloo at dp_shard=2 through a real
Trainer, beside ``--frozen-mib`` MiB of frozen weights (a fine-tune's frozen base): steps stay short and the
checkpoint large, as on a GPU, where a save's write spans many steps. A ModelCheckpoint saves every ``--every``
steps into a temporary directory on the local disk (home). Per step: the wall time from one step's end to the next;
Lightning runs ModelCheckpoint after every other callback, so a save falls in the interval after its step. The
stall of a save is that interval less the median of the intervals without a save; the asynchronous run's write
goes on behind later steps, which that median includes, and the end of fit waits for the last write.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path


def measure(directory: str, frozen_mib: int, steps: int, every: int, asynchronous: bool) -> dict:
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_automodel import AutoModelParallelStrategy
    from lightning_automodel.testing.trainer_parity import CausalLM, data

    class StepTimes(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._last = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._last = self._last or time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            now = time.perf_counter()
            self.times.append(now - self._last)
            self._last = now

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    module = CausalLM(AutoModelForCausalLM.from_config(config))
    module.frozen = torch.nn.Parameter(torch.zeros(frozen_mib * 2**18), requires_grad=False)
    parameters = sum(p.numel() for p in module.parameters())
    timing = StepTimes()
    saving = ModelCheckpoint(Path(directory) / f"async-{asynchronous}", every_n_train_steps=every, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=AutoModelParallelStrategy(async_save=asynchronous),
        max_steps=steps,
        logger=False,
        callbacks=[timing, saving],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(module, data(dist.get_world_size()))
    total = time.perf_counter() - start
    saves = [index + 1 for index in range(steps - 1) if (index + 1) % every == 0]  # the intervals after saving steps
    plain = [t for index, t in enumerate(timing.times) if index not in saves and index > 0]  # step 1: warm-up
    median = statistics.median(plain)
    return {
        "parameters": parameters,
        "checkpoint_bytes": sum(f.stat().st_size for f in Path(saving.dirpath).rglob("*") if f.is_file()) // len(saves),
        "median_step": median,
        "stalls": [timing.times[index] - median for index in saves],
        "fit": total,
    }


def main() -> None:
    from lightning_automodel.testing.harness import run_checks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frozen-mib", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lam-async-", dir=Path.home()) as directory:
        checks = [
            partial(measure, directory, args.frozen_mib, args.steps, args.every, asynchronous)
            for asynchronous in (False, True)
        ]
        results = [ranks[0] for ranks in run_checks(2, checks, timeout=1800, pg_timeout=600).values()]
    sync, overlapped = results
    print(f"{sync['parameters'] / 1e6:.0f}M parameters, {sync['checkpoint_bytes'] / 2**20:.0f} MiB per checkpoint")
    for name, result in (("synchronous", sync), ("asynchronous", overlapped)):
        stalls = ", ".join(f"{stall:.2f}" for stall in result["stalls"])
        step, fit = result["median_step"], result["fit"]
        print(f"{name:12} median step {step:.2f} s | stall per save: {stalls} s | fit {fit:.1f} s")
    first = overlapped["stalls"][0] / sync["stalls"][0]
    later = statistics.mean(overlapped["stalls"][1:]) / statistics.mean(sync["stalls"][1:])
    print(f"asynchronous / synchronous stall: first save {first:.2f} (it sets up), then {later:.2f}")


if __name__ == "__main__":
    main()
