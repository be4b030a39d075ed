"""What packing vision records (``pack=True``) gains over one record a row, padded: rows, real tokens per row token,
and records a second through a tiny model's forward and backward, in one process.

    .venv/bin/python benchmarks/vision_packing.py [--records 96] [--seq-len 512] [--batch-size 4] [--hidden 128]

Records of varied lengths (answers of 5 to 300 bytes; the byte tokenizer: a token a byte) with 0 to 2 images each,
of varied sizes (8 to 64 pixels a side: 4 to 64 tokens an image for Qwen2-VL, 4 for LLaVA); the tiny processors
and models of testing/vision/processors.py, the models' decoder ``--hidden`` wide, ``--layers`` deep. The
rows are read (pixels made) once; the model's time is its forward and backward over all of them, padded and packed
in turn, the best of ``--repeats`` after one warming up, on ``--threads`` threads (one: on a shared machine, other
processes then slow both alike rather than one more).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from lightning_automodel.data import cache
from lightning_automodel.data.vision import VisionChatDataModule
from lightning_automodel.testing.vision.processors import llava_processor, qwen2_vl_processor, tiny_llava, tiny_qwen2_vl


def write_records(directory: Path, count: int) -> str:
    generator = np.random.default_rng(0)
    lines = []
    for index in range(count):
        images = []
        for number in range(int(generator.integers(0, 3))):
            width, height = (int(side) for side in generator.integers(8, 65, 2))
            Image.new("RGB", (width, height), tuple(int(c) for c in generator.integers(0, 256, 3))).save(
                directory / f"{index}-{number}.png"
            )
            images.append(f"{index}-{number}.png")
        content = [*({"type": "image"} for _ in images), {"type": "text", "text": f"What is in picture {index}?"}]
        answer = [{"type": "text", "text": "x" * int(generator.integers(5, 301))}]
        messages = [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
        lines.append(json.dumps({"messages": messages, "images": images}))
    path = directory / "records.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def batches(processor: object, files: str, *, pack: bool, args: argparse.Namespace) -> tuple[list[dict], int, float]:
    """The module's training batches (pixels made; M-RoPE positions found), the records' real tokens, and the
    seconds the loader took."""
    module = VisionChatDataModule(
        train_files=files,
        processor=processor,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        pack=pack,
        shuffle=False,
    )
    module.setup("fit")
    start = time.perf_counter()
    loaded = list(module.train_dataloader())
    return loaded, int(module.datasets["train"].kept.sum()), time.perf_counter() - start


def step_seconds(model: torch.nn.Module, loaded: list[dict]) -> float:
    start = time.perf_counter()
    for batch in loaded:
        model(**batch, use_cache=False).loss.backward()
    return time.perf_counter() - start


def measure(processor: object, model: torch.nn.Module, files: str, args: argparse.Namespace) -> list[dict]:
    """Padded, then packed: rows, real tokens per row token, records/s and real tokens/s through the model, and
    records/s through the loader; the model's two timed in turn
    (the machine's load falls on both), the best of the repeats."""
    loads = [batches(processor, files, pack=pack, args=args) for pack in (False, True)]
    model.train()
    best = [float("inf")] * 2
    for repeat in range(args.repeats + 1):  # the first pass warms up
        for which, (loaded, *_) in enumerate(loads):
            seconds = step_seconds(model, loaded)
            best[which] = min(best[which], seconds) if repeat else best[which]
    return [
        {
            "rows": (rows := sum(len(batch["input_ids"]) for batch in loaded)),
            "fill": real / (rows * args.seq_len),
            "records/s": args.records / seconds,
            "tokens/s": real / seconds,
            "loader records/s": args.records / loading,
        }
        for (loaded, real, loading), seconds in zip(loads, best, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=96)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as temporary:
        directory = Path(temporary)
        cache.DEFAULT_ROOT = directory / "cache"
        files = write_records(directory, args.records)
        print(
            "| model | rows | real tokens per row token | records/s | real tokens/s | packed / padded, records/s |"
            " loader, records/s |"
        )
        print("|---|---|---|---|---|---:|---|")
        for name, processor, build in (
            ("LLaVA", llava_processor(), tiny_llava),
            ("Qwen2-VL", qwen2_vl_processor(), tiny_qwen2_vl),
        ):
            model = build(processor, hidden=args.hidden, layers=args.layers)
            padded, packed = measure(processor, model, files, args)
            cells = [
                f"{padded[key]:,.{digits}f} / {packed[key]:,.{digits}f}"
                for key, digits in (("rows", 0), ("fill", 2), ("records/s", 1), ("tokens/s", 0))
            ]
            ratio = packed["records/s"] / padded["records/s"]
            loader = f"{padded['loader records/s']:,.0f} / {packed['loader records/s']:,.0f}"
            print(f"| {name} (padded / packed) | {' | '.join(cells)} | {ratio:.2f} | {loader} |")


if __name__ == "__main__":
    main()
