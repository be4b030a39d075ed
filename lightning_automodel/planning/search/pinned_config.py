"""A chosen layout as the config lines and ``fit`` overrides that pin it: the strategy's arguments that select it and
the Trainer's accumulation that keeps the global batch."""

from __future__ import annotations

from lightning_automodel.planning.search.layouts import Candidate


def strategy_arguments(candidate: Candidate) -> dict[str, int | bool | str]:
    """The strategy's arguments that select ``candidate``: its sizes, sequence parallel, its checkpointing, and under
    pp the micro-batches it was estimated with."""
    dims = candidate.dims
    arguments: dict[str, int | bool | str] = {
        "pp": dims.pp,
        "tp": dims.tp,
        "sp": candidate.sp,
        "cp": dims.cp,
        "dp_shard": dims.dp_shard,
        "dp_replicate": dims.dp_replicate,
        "activation_checkpointing": candidate.checkpointing,
    }
    if dims.ep > 1:
        arguments["ep"] = dims.ep
    if candidate.pipeline is not None:
        arguments["pp_microbatches"] = candidate.pipeline.microbatches
    return arguments


def pinned_config(candidate: Candidate, *, heading: str) -> list[str]:
    """``candidate`` as a config's lines and as ``fit``'s overrides, to paste: the strategy's arguments and the
    Trainer's accumulation that keeps the global batch (times the config's own, if it sets one)."""
    arguments = strategy_arguments(candidate)
    lines = [heading, "trainer:"]
    overrides = []
    if candidate.accumulation > 1:
        lines.append(f"  accumulate_grad_batches: {candidate.accumulation}")
        overrides.append(f"--trainer.accumulate_grad_batches={candidate.accumulation}")
    lines += ["  strategy:", "    class_path: lightning_automodel.AutoModelParallelStrategy", "    init_args:"]
    lines += [f"      {name}: {_yaml(value)}" for name, value in arguments.items()]
    overrides += [f"--trainer.strategy.init_args.{name}={_yaml(value)}" for name, value in arguments.items()]
    return [*lines, "or as fit's overrides:", " ".join(overrides)]


def _yaml(value: int | bool | str) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
