"""Checks that misbehave on purpose, to show the harness turns them into failures."""

import time

import torch.distributed as dist


def check_rank_one_hangs() -> None:
    """Rank 0 waits for rank 1 in a collective: the process group's timeout must end the wait."""
    if dist.get_rank() == 1:
        time.sleep(600)
    dist.barrier()


def check_every_rank_hangs() -> None:
    """No collective watches this hang: only the launch timeout can end it."""
    time.sleep(600)


def check_rank_one_raises() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("deliberate failure")
    dist.barrier()
