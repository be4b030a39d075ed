"""Peak memory per rank while loading a pretrained checkpoint, as a fraction of the checkpoint's size.

    .venv/bin/python benchmarks/load_memory.py        # about 2 minutes on 2 CPU cores

For N = 1, 2 and 4 ranks (tp x dp_shard = N), side by side in one run: lightning-automodel's load (meta build,
parallelize, read each rank's slices) against transformers' from_pretrained on every rank (the usual way, then
sharded). The figure is the growth of each rank's peak anonymous resident memory during the load (sampled every
millisecond; the pages of the memory-mapped checkpoint files are the page cache's, not the rank's), over the
size of the checkpoint's weights, maximum over ranks.
"""

import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from lightning_automodel.testing.harness import run_checks

CONFIG = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)


def _anonymous_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


class _PeakSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = _anonymous_bytes(), True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, _anonymous_bytes())
            time.sleep(0.001)


def load(directory: str, way: str) -> int:
    """Growth of this rank's peak resident memory while loading ``directory`` the given way."""
    import torch.distributed as dist

    from lightning_automodel import ParallelDims, from_pretrained, parallelize
    from lightning_automodel.hf.loading import materialize_pretrained

    world = dist.get_world_size()
    mesh = ParallelDims(tp=min(2, world)).resolve(world).build_mesh("cpu")
    before = _anonymous_bytes()
    sampler = _PeakSampler()
    sampler.start()
    if way == "lightning-automodel":
        model = from_pretrained(directory, dtype=torch.float32)
        parallelize(model, mesh)
        materialize_pretrained(model, torch.device("cpu"))
    else:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        parallelize(model, mesh)
    sampler.running = False
    sampler.join()
    dist.barrier()
    return sampler.peak - before


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).save_pretrained(directory)
        size = sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))
        print(f"checkpoint: {size / 2**20:.0f} MiB of fp32 weights")
        print(f"{'ranks':>5}  {'lightning-automodel':>20}  {'from_pretrained on every rank':>30}  ratio")
        for world in (1, 2, 4):
            peaks = {}
            for way in ("lightning-automodel", "from_pretrained"):
                result = run_checks(world, [partial(load, directory, way)], timeout=900)
                peaks[way] = max(next(iter(result.values()))) / size
            ours, theirs = peaks["lightning-automodel"], peaks["from_pretrained"]
            print(f"{world:>5}  {ours:>19.2f}x  {theirs:>29.2f}x  {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
