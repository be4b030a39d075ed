"""The data pipeline's cost on a synthetic corpus written to disk, at two sizes side by side: a rank's memory (flat in
the corpus size), the loader's tokens/s against what a training step consumes, the cache's build time, and the time
from launch to the first step, cache cold and warm.

    .venv/bin/python benchmarks/data.py [--sizes 10M,100M] [--seq-len 2048] [--batch-size 8] [--workers 2]
    .venv/bin/python benchmarks/data.py --sizes 10M,100M,1B     # the sweep: 1B tokens (about 1 GB on disk)

The corpus: JSONL documents of 100 to 8,000 random words, tokenized by the byte tokenizer (a token a byte, so the
sizes are tokens). Every measurement runs in a fresh process (spawned), one rank as a data-parallel rank of 8 would
read its share (the stream shuffled, through its default buffer of 1,000 documents). Memory is read from /proc:
private (anonymous) memory, which the corpus would fill if it were held, and the resident pages of the
memory-mapped cache files (the page cache's, shared by a machine's ranks and dropped under pressure). "Held in
memory" is what the data module did before the cache: every rank's int64 token tensor.
A training step's consumption is measured side by side on a small Llama (2 layers, hidden 256) training on this
machine's CPU, and computed for a 1B-parameter model at 40% MFU of an H100's 989 TFLOP/s (6 x 1e9 FLOPs a token).
The same corpus as Parquet, against pyarrow's own read: benchmarks/data_tables.py.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

H100_TOKENS_PER_S_1B = 0.4 * 989e12 / (6 * 1e9)  # a 1B model's training consumption on one H100 at 40% MFU
WORDS = [
    "".join(random.Random(i).choices("abcdefghijklmnopqrstuvwxyz", k=1 + i % 9)) for i in range(5000)
]  # a fixed vocabulary of made-up words
# What the data module reads of a Trainer, as data-parallel rank 0 of 8 on one machine.
RANK_0_OF_8 = SimpleNamespace(
    distributed_sampler_kwargs={"num_replicas": 8, "rank": 0},
    local_rank=0,
    node_rank=0,
    max_steps=1,
    val_check_interval=1,
)


def documents(tokens: int) -> Iterator[str]:
    """Documents of 100 to 8,000 made-up words, about ``tokens`` bytes in all with an EOS each, deterministic."""
    rng, written = random.Random(0), 0
    while written < tokens:
        text = " ".join(rng.choices(WORDS, k=rng.randint(100, 8000)))
        written += len(text) + 1  # the document's tokens and its EOS
        yield text


def shards(tokens: int) -> Iterator[list[str]]:
    """The documents of a corpus of ``tokens``, a file's worth (64 MB of text at most) at a time."""
    shard, size = [], 0
    for text in documents(tokens):
        shard.append(text)
        size += len(text) + 1
        if size >= 64 << 20:
            yield shard
            shard, size = [], 0
    if shard:
        yield shard


def write_corpus(directory: Path, tokens: int) -> list[str]:
    """JSONL files of about ``tokens`` bytes (64 MB each at most)."""
    files = []
    for index, shard in enumerate(shards(tokens)):
        path = directory / f"part-{index:04d}.jsonl"
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in shard))
        files.append(str(path))
    return files


def private_mib() -> float:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(status["RssAnon"].split()[0]) / 1024


def _resident_mib(directory: str) -> float:
    """The resident pages of this process's mappings of files under ``directory``."""
    resident, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header: its path last, if any
            inside = len(fields) >= 6 and fields[5].startswith(directory)
        elif inside and fields[0] == "Rss:":
            resident += int(fields[1])
    return resident / 1024


def read_as_rank(files: list[str], cache_dir: str, options: dict, batches: int) -> dict:
    """In a fresh process: set up (cold or warm) as data-parallel rank 0 of 8, then read ``batches`` batches; a
    stream's state (what a checkpoint saves) is measured over 10 more, as JSON bytes."""
    from lightning_automodel.data import TextDataModule

    before = private_mib()
    module = TextDataModule(train_files=files, cache_dir=cache_dir, **options)
    module.trainer = RANK_0_OF_8
    started = time.perf_counter()
    module.setup("fit")
    setup_s = time.perf_counter() - started
    after_setup = private_mib()
    batches_read = _batches_of(module.train_dataloader())
    next(batches_read)
    started = time.perf_counter()
    tokens = 0
    for _ in range(batches):
        tokens += next(batches_read)["input_ids"].numel()
    read_s = time.perf_counter() - started
    measured = {
        "setup_s": setup_s,
        "tokens_per_s": tokens / read_s,
        "anon_setup_mib": after_setup - before,
        "anon_read_mib": private_mib() - before,
        "file_mib": _resident_mib(cache_dir),
    }
    if options.get("streaming"):
        measured.update(_state_bytes(module.datasets["train"], batches_read))
    return measured


def _state_bytes(rows, batches_read: Iterator[dict]) -> dict:
    """A rank's entry in the stream's state (the checkpoint holds one a data-parallel rank), as JSON bytes: the most
    over 10 batches (its tokens not yet in a row vary), and its buffer's part."""
    sizes = []
    for _ in range(10):
        next(batches_read)
        sizes.append(len(json.dumps(rows.own_state())))
    return {"state_bytes": max(sizes), "buffer_state_bytes": len(json.dumps(rows.own_state()["buffer"]))}


def _batches_of(loader):
    """The loader's batches, epoch after epoch."""
    while True:
        yield from loader


def _training_consumption(seq_len: int, batch_size: int, steps: int = 4) -> float:
    """Tokens a second a small Llama's training steps consume on this CPU."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=320, hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4
    )
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 258, (batch_size, seq_len))
    times = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    return batch_size * seq_len / min(times[1:])


def in_fresh_process(function, *args):
    """``function(*args)`` in a spawned process (not a pool's daemon: the cache's build forks workers)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_put_result, args=(results, function, *args))
    process.start()
    result = results.get()
    process.join()
    if isinstance(result, BaseException):
        raise result
    return result


def _put_result(results, function, *args) -> None:
    try:
        results.put(function(*args))
    except BaseException as error:
        results.put(error)
        raise


def _launch_to_first_step(files: list[str], cache_dir: str, seq_len: int, directory: Path) -> float:
    """Wall time of ``lightning-automodel fit`` on one process for one step of a tiny Llama, run in ``directory``
    (new): launch, imports, the data's setup, the model, one step."""
    directory.mkdir()
    config = directory / "benchmark.yaml"
    config.write_text(
        json.dumps(
            {
                "trainer": {
                    "accelerator": "cpu",
                    "devices": 1,
                    "max_steps": 1,
                    "logger": False,
                    "enable_checkpointing": False,
                    "enable_progress_bar": False,
                },
                "model": {
                    "config": {
                        "model_type": "llama",
                        "hidden_size": 64,
                        "intermediate_size": 128,
                        "num_hidden_layers": 1,
                        "num_attention_heads": 2,
                        "max_position_embeddings": seq_len,
                    }
                },
                "data": {
                    "class_path": "lightning_automodel.data.TextDataModule",
                    "init_args": {"train_files": files, "cache_dir": cache_dir, "seq_len": seq_len, "batch_size": 1},
                },
            }
        )
    )
    started = time.perf_counter()
    command = [sys.executable, "-m", "lightning_automodel.cli", "fit", f"--config={config}"]
    subprocess.run(command, check=True, capture_output=True, cwd=directory)
    return time.perf_counter() - started


def parse_sizes(sizes: str) -> list[int]:
    """ "10M,100M": the sizes in tokens."""
    scale = {"K": 10**3, "M": 10**6, "B": 10**9}
    return [int(float(size[:-1]) * scale[size[-1]]) for size in sizes.split(",")]


def arguments(description: str) -> argparse.Namespace:
    """The options both data benchmarks take."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sizes", default="10M,100M", help="corpus sizes in tokens (K, M, B suffixes)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches", type=int, default=200, help="batches each rank reads")
    parser.add_argument("--workers", type=int, default=2, help="processes tokenizing the cache")
    return parser.parse_args()


def main() -> None:
    args = arguments(__doc__.split("\n\n")[0])
    sizes = parse_sizes(args.sizes)
    options = dict(seq_len=args.seq_len, batch_size=args.batch_size, tokenize_workers=args.workers)
    consumed = in_fresh_process(_training_consumption, args.seq_len, args.batch_size)
    print(
        f"a training step's consumption: small Llama on this CPU {consumed:,.0f} tokens/s; 1B model on an H100"
        f" at 40% MFU {H100_TOKENS_PER_S_1B:,.0f} tokens/s"
    )
    rows = []
    for tokens in sizes:
        with tempfile.TemporaryDirectory() as scratch:
            directory = Path(scratch)
            (directory / "corpus").mkdir()
            files = write_corpus(directory / "corpus", tokens)
            cache = str(directory / "cache")
            launch_cold = _launch_to_first_step(files, cache + "-launch", args.seq_len, directory / "cold")
            launch_warm = _launch_to_first_step(files, cache + "-launch", args.seq_len, directory / "warm")
            cold = in_fresh_process(read_as_rank, files, cache, options, args.batches)
            warm = in_fresh_process(read_as_rank, files, cache, options, args.batches)
            streamed = in_fresh_process(read_as_rank, files, cache, {**options, "streaming": True}, args.batches)
        rows.append((tokens, cold, warm, streamed, launch_cold, launch_warm))
    print()
    print(
        "| corpus tokens | held in memory (MiB a rank) | private memory after setup / after reading (MiB) |"
        " cache pages resident (MiB) | cache build (s) | tokens/s built | setup warm (s) | loader tokens/s |"
        " x CPU step | x H100 1B | streamed tokens/s | streamed private memory (MiB) | launch to first step"
        " cold / warm (s) |"
    )
    print("|" + "---:|" * 13)
    for tokens, cold, warm, streamed, launch_cold, launch_warm in rows:
        print(
            f"| {tokens:,} | {tokens * 8 / 2**20:,.0f} | {warm['anon_setup_mib']:.1f} / {warm['anon_read_mib']:.1f} |"
            f" {warm['file_mib']:.1f} | {cold['setup_s']:.1f} | {tokens / cold['setup_s']:,.0f} |"
            f" {warm['setup_s']:.2f} | {warm['tokens_per_s']:,.0f} | {warm['tokens_per_s'] / consumed:,.0f} |"
            f" {warm['tokens_per_s'] / H100_TOKENS_PER_S_1B:.1f} | {streamed['tokens_per_s']:,.0f} |"
            f" {streamed['anon_read_mib']:.1f} | {launch_cold:.1f} / {launch_warm:.1f} |"
        )


if __name__ == "__main__":
    main()
