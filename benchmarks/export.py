"""`lightning-automodel export` against save_pretrained of the model loaded whole: seconds and peak memory by size.

    .venv/bin/python benchmarks/export.py              # about 5 minutes on 2 CPU cores; 13 GiB of disk at most

Generated bf16 Llama checkpoints (~1 and ~4 GiB of weights), written as Lightning's ModelParallelStrategy writes a
LightningModule holding the model. Each way runs in its own process, one after the other, from the same checkpoint
(in the page cache for both): ours (`export_checkpoint`: a meta model, each shard read by key), and the peer
(the same meta model filled with every weight of the checkpoint, then transformers' `save_pretrained`, which is
what the export did before). Peak memory is the process's peak resident set (VmHWM), and its growth over the
resident set once imports are done. Output shards at save_pretrained's default size (50GB: one file).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_attention_heads=16,
    num_key_value_heads=16,
    tie_word_embeddings=False,
    dtype="bfloat16",
)
LAYERS = (8, 40)  # 1.0 and 4.1 GiB of bf16 weights


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(field)).split()[1]) * 1024


def generate(directory: Path, layers: int) -> None:
    """A random bf16 Llama of ``layers`` layers saved as a CausalLMModule checkpoint (config recorded)."""
    from lightning_automodel.testing.exports import write_lightning_checkpoint

    config = LlamaConfig(num_hidden_layers=layers, **CONFIG)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    for param in model.parameters():
        param.data.normal_(std=0.02, generator=generator)
    write_lightning_checkpoint(model, directory, hf_config=config.to_dict())


def run(way: str, checkpoint: Path, output: Path) -> None:
    """Export ``checkpoint`` one way; prints seconds and peak memory as JSON."""
    import transformers

    from lightning_automodel.io.checkpoint_to_hf import export_checkpoint
    from lightning_automodel.testing.exports import save_pretrained_whole

    start = _status("VmRSS:")
    began = time.perf_counter()
    if way == "export":
        export_checkpoint(checkpoint, output)
    else:
        recorded = torch.load(checkpoint / "meta.pt", weights_only=True)["hf_config"]
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(LlamaConfig(**recorded))
        save_pretrained_whole(checkpoint, model, output)
    seconds = time.perf_counter() - began
    print(json.dumps({"seconds": seconds, "peak": _status("VmHWM:"), "start": start}))


def main() -> None:
    print("| weights (bf16) | way | seconds | peak resident | growth over start |")
    print("|---|---|---|---|---|")
    for layers in LAYERS:
        with tempfile.TemporaryDirectory(dir="/tmp") as directory:
            checkpoint, output = Path(directory) / "ckpt", Path(directory) / "out"
            subprocess.run([sys.executable, __file__, "generate", str(checkpoint), str(layers)], check=True)
            size = sum(p.stat().st_size for p in checkpoint.glob("*.distcp")) / 2**30
            for way, label in (("export", "lightning-automodel export"), ("peer", "save_pretrained, loaded whole")):
                command = [sys.executable, __file__, way, str(checkpoint), str(output)]
                finished = subprocess.run(command, check=True, capture_output=True, text=True)
                result = json.loads(finished.stdout.splitlines()[-1])
                subprocess.run(["rm", "-rf", str(output)], check=True)
                peak, growth = result["peak"] / 2**30, (result["peak"] - result["start"]) / 2**30
                print(f"| {size:.2f} GiB | {label} | {result['seconds']:.1f} | {peak:.2f} GiB | {growth:.2f} GiB |")


if __name__ == "__main__":
    if len(sys.argv) == 1:
        main()
    elif sys.argv[1] == "generate":
        generate(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        run(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
