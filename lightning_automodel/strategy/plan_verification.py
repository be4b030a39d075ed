"""``verify_plans``: the plan of each class no family registered, verified once before parallelizing, with one
verdict on every rank."""

from __future__ import annotations

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_automodel.hf.peft import unwrap_peft
from lightning_automodel.parallel.options import ParallelOptions
from lightning_automodel.planning.verify import plan_unregistered, verify_plan


class VerifiedPlans:
    """The model classes whose plans passed, each verified once."""

    def __init__(self) -> None:
        self.classes: set[type] = set()

    def verify_once(self, model: nn.Module, *, tp: int, options: ParallelOptions) -> None:
        """Verify the plan of a class met for the first time whose plan no family registered.

        Every rank verifies on its own, in a child process (verify_plan's simulation needs a process group of its
        own): the step is seeded and deterministic, so every rank should reach the same verdict. A child can still
        fail on one rank only (out of memory, killed), so the ranks then exchange their outcomes, all of them
        reaching that one collective, and every rank raises the first failure, before parallelize's first collective.
        """
        hf_model = unwrap_peft(model)
        if tp == 1 or type(hf_model) in self.classes or not plan_unregistered(hf_model, options.tp_plan):
            return
        verification, failure = None, None
        try:
            verification = verify_plan(
                hf_model,
                tp=tp,
                sp=options.sp,
                tp_plan=options.tp_plan,
                allow_unsharded_linears=options.allow_unsharded_linears,
            )
        except Exception as error:  # noqa: BLE001 - raised below on every rank, once all know
            failure = error
        _raise_on_every_rank(failure, model_name=type(hf_model).__name__)
        self.classes.add(type(hf_model))
        rank_zero_info(f"The plan of {type(hf_model).__name__} is verified:\n{verification}")


def _raise_on_every_rank(failure: Exception | None, *, model_name: str) -> None:
    """This rank's own failure, else the first rank's that failed, raised on every rank."""
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, None if failure is None else f"{type(failure).__name__}: {failure}")
    failed = [(rank, message) for rank, message in enumerate(outcomes) if message is not None]
    if failure is not None:
        raise failure
    if failed:
        rank, message = failed[0]
        raise ValueError(f"verify_plans: verifying the plan of {model_name} failed on rank {rank}: {message}")
