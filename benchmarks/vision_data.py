"""What vision records cost where they are paid: the cache's build (every image decoded and rendered by the
processor, once) and a row's read (its images decoded and made pixels, every time), at the models' own resolutions.

    .venv/bin/python benchmarks/vision_data.py [--records 200] [--workers 2]

Records of one or two JPEG images (random noise at quality 90: 640 x 480 and 800 x 600, 269 and 422 KiB, more than
photos of those sizes) as a JSONL file naming them; the processors are LLaVA-1.5's image processor (336 x 336,
patches of 14: 576 tokens an image) and Qwen2-VL's (patches of 14 merged 2 x 2, images up to 1,003 x 1,003 pixels),
built in code on the byte tokenizer (lightning_automodel.testing.vision.processors). The build runs with ``--workers``
tokenizing processes; rows are read in this process, in order, after the build (the image files in the page cache).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from lightning_automodel.data import cache
from lightning_automodel.data.vision import VisionChatDataModule
from lightning_automodel.testing.vision.processors import llava_processor, qwen2_vl_processor

SIZES = ((640, 480), (800, 600))


def write_records(directory: Path, count: int) -> str:
    generator = np.random.default_rng(0)
    for index, size in enumerate(SIZES):
        pixels = generator.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(directory / f"{index}.jpg", quality=90)
    lines = []
    for index in range(count):
        images = [f"{number}.jpg" for number in range(1 + index % 2)]
        content = [*({"type": "image"} for _ in images), {"type": "text", "text": f"What is in picture {index}?"}]
        answer = [{"type": "text", "text": "Noise, " * 20}]
        messages = [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
        lines.append(json.dumps({"messages": messages, "images": images}))
    path = directory / "records.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def measure(name: str, processor: object, files: str, *, records: int, workers: int, directory: Path) -> None:
    cache.DEFAULT_ROOT = directory / f"cache-{name}"
    module = VisionChatDataModule(
        train_files=files, processor=processor, seq_len=4096, shuffle=False, tokenize_workers=workers
    )
    start = time.perf_counter()
    module.setup("fit")
    built = time.perf_counter() - start
    rows = module.datasets["train"]
    start = time.perf_counter()
    read = [rows[index] for index in range(len(rows))]
    reading = time.perf_counter() - start
    images = sum(1 + index % 2 for index in range(records))
    tokens = int(sum(int(row["attention_mask"].sum()) for row in read))
    pixels = sum(row["pixel_values"].numel() * 4 for row in read) / images / 2**20
    print(
        f"| {name} | {records} | {images} | {tokens / records:,.0f} | {records / built:,.1f} | {records / reading:,.1f}"
        f" | {images / reading:,.1f} | {pixels:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        directory = Path(temporary)
        files = write_records(directory, args.records)
        print(
            "| processor | records | images | tokens a record | build, records/s | rows read/s | images made/s |"
            " pixel inputs an image (MiB, float32) |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        options = dict(records=args.records, workers=args.workers, directory=directory)
        measure("LLaVA-1.5 (336 px)", llava_processor(side=336, patch=14), files, **options)
        measure("Qwen2-VL (14 px patches)", qwen2_vl_processor(patch=14, max_side=1003), files, **options)


if __name__ == "__main__":
    main()
