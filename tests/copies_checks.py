"""Machines holding different copies of the files, simulated in gloo workers: each rank is a node of its own (its
local rank 0), in a directory of its own holding its copy under the same relative names, building its own cache
there, under a real ``Trainer(num_nodes=world, devices=1)``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
from data_checks import RecordRows

from lightning_automodel import AutoModelParallelStrategy
from lightning_automodel.data import TextDataModule
from lightning_automodel.data.demo import demo_documents
from lightning_automodel.testing.trainer_parity import trainer

FILES = {name: "\n\n".join(demo_documents(6, seed=seed)) + "\n" for seed, name in enumerate(("a", "b", "c"))}


@contextmanager
def own_node(directory: Path) -> Iterator[None]:
    """This rank as the local rank 0 of node ``rank``, working in ``directory``."""
    saved, cwd = {name: os.environ[name] for name in ("LOCAL_RANK", "NODE_RANK")}, os.getcwd()
    os.environ.update(LOCAL_RANK="0", NODE_RANK=str(dist.get_rank()))
    directory.mkdir(parents=True)
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(cwd)
        os.environ.update(saved)


def write_copy(case: str, *, other: bool) -> None:
    """This node's copy of data/{a,b,c}.txt: node 0's is the original, the other's differs as ``case`` says."""
    Path("data").mkdir()
    for name, text in FILES.items():
        if other and case == "missing" and name == "c":
            continue
        if other and name == "b":
            text = _edited(text, case)
        Path(f"data/{name}.txt").write_text(text)
    if case == "fails on one" and not other:
        Path("data/extra.txt").write_text("Only on node 0.\n")
    if other:  # a copy made without keeping the times (cp without -p): never a difference
        for path in Path("data").iterdir():
            os.utime(path, ns=(1_000_000_000, 1_000_000_000))


def _edited(text: str, case: str) -> str:
    if case == "edited":
        return text + "\nOne more paragraph.\n"
    if case in ("same size", "streamed"):  # one letter changed: in the middle for the cache, at the start streamed
        at = next(i for i in range(len(text) // 2 if case == "same size" else 0, len(text)) if text[i].isalpha())
        return text[:at] + ("x" if text[at] != "x" else "y") + text[at + 1 :]
    return text


def check_copies(directory: str, case: str) -> dict:
    """Fit one step from this node's copy; returns the refusal's message (None: it trained) and whether this node
    built its own cache."""
    with own_node(Path(directory) / case / f"node{dist.get_rank()}"):
        write_copy(case, other=dist.get_rank() > 0)
        streamed = case == "streamed"
        files = ["data/*.txt", "data/extra.txt"] if case == "fails on one" else "data/*.txt"
        data = TextDataModule(files, streaming=streamed, seq_len=16, batch_size=2, cache_dir="cache")
        run = trainer(AutoModelParallelStrategy(), devices=1, num_nodes=dist.get_world_size(), max_steps=1)
        try:
            run.fit(RecordRows(), data)
            error = None
        except ValueError as refused:
            error = str(refused)
        place = (run.local_rank, run.node_rank, run.global_rank)
        return {"error": error, "place": place, "cached": Path("cache/train/meta.json").is_file()}
