"""``lightning-automodel plan``: what a config's strategy does to its model, without GPUs or weights; the layouts that
fit a GPU (``--fit``); the choice of a ``layout: auto`` config."""

from __future__ import annotations

import argparse
import sys

from lightning_automodel.cli.config import Configured, configured
from lightning_automodel.planning.memory.activations import UntraceableStep
from lightning_automodel.planning.memory.step_options import StepOptions
from lightning_automodel.planning.report import PlanReport, plan_report
from lightning_automodel.planning.search.fitting import (
    Fitting,
    LayoutChoice,
    NoLayoutFits,
    choose_layout,
    fitting_layouts,
)
from lightning_automodel.planning.search.layouts import SearchSpace
from lightning_automodel.planning.verify import verify_plan


def plan_command(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-automodel plan",
        description="Print what the config's strategy does to its model (plan, parameters and memory per rank)"
        " without GPUs or weights: the model is built on the meta device and parallelized in a fake process group."
        " Options after --config are those of `fit` (--trainer.strategy.init_args.tp=8, ...).",
    )
    parser.add_argument("--config", required=True, help="the YAML config given to `lightning-automodel fit`")
    parser.add_argument("--world_size", type=int, help="ranks in all (default: the config's devices x num_nodes)")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="also verify the tensor-parallel plan: one step of a shrunk replica of the model, the tp ranks simulated"
        " on CPU, against one process (loss, logits, every gradient); exit with 1 if they differ",
    )
    parser.add_argument(
        "--activations",
        action="store_true",
        help="also estimate the activation memory per rank of a training step, under each activation-checkpointing"
        " mode, at the data module's batch_size and seq_len (one fake-tensor step of the model per mode)",
    )
    parser.add_argument(
        "--fit",
        type=float,
        metavar="GPU_MEMORY",
        help="instead of the config's layout, list the pp x tp x cp x dp_shard (x dp_replicate) layouts of the world"
        " whose step fits GPUs of this many GiB, each with the checkpointing mode that recomputes least, best"
        " estimated throughput first (under layout: auto, those with the sizes the config fixes)",
    )
    parser.add_argument(
        "--gpu_memory",
        type=float,
        metavar="GIB",
        help="for a config with layout: auto, the GiB per GPU to choose for (default: its strategy's gpu_memory)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="with --fit or layout: auto, child processes measuring layouts side by side (default 1: this process)",
    )
    parser.add_argument("--batch_size", type=int, help="rows per data-parallel rank and step (implies --activations)")
    parser.add_argument("--seq_len", type=int, help="tokens a row (implies --activations)")
    parser.add_argument(
        "--images_per_row",
        type=int,
        help="a vision-language model's images in each row of the estimated step, whose pixels it runs through the"
        " vision tower (default: the strategy's layout_images_per_row, else 1; 0: text alone)",
    )
    parser.add_argument(
        "--image_tokens",
        type=int,
        help="the tokens an image, for a tower taking images of any size (Qwen2-VL's; default: the strategy's"
        " layout_image_tokens, else 256); other towers' are their config's",
    )
    parser.add_argument(
        "--expert_imbalance",
        type=float,
        metavar="F",
        help="a mixture-of-experts model's routing to plan for: the busiest expert's share of a rank's (token, expert)"
        " choices relative to a balanced one, on the estimated rank in every layer (default: the strategy's"
        " layout_expert_imbalance, else 1: balanced)",
    )
    args, overrides = parser.parse_known_args(argv)
    if args.fit is not None and args.verify:
        parser.error("--fit lists other layouts than the config's: verify the one you pick, without --fit")
    config = configured(args.config, *overrides, world_size=args.world_size)
    search = config.strategy.options.search
    if search is not None and args.verify:
        parser.error("the config's layout is auto: verify the layout it chooses, pinned (plan prints it)")
    estimate = args.activations or args.fit is not None or args.batch_size is not None or args.seq_len is not None
    batch_shape = config.batch_shape(batch_size=args.batch_size, seq_len=args.seq_len) if estimate or search else None
    step = config.step_options(
        images_per_row=args.images_per_row, image_tokens=args.image_tokens, expert_imbalance=args.expert_imbalance
    )
    if args.fit is not None:
        print(_fitting_of(config, memory_gib=args.fit, batch_shape=batch_shape, workers=args.workers, step=step))
        return
    if search is not None:
        memory_gib = args.gpu_memory if args.gpu_memory is not None else config.strategy.options.gpu_memory
        if memory_gib is None:
            parser.error("the config's layout is auto: pass --gpu_memory GIB (or give the strategy gpu_memory)")
        try:
            print(_choice_of(config, memory_gib=memory_gib, batch_shape=batch_shape, workers=args.workers, step=step))
        except NoLayoutFits as refusal:
            print(refusal)
            sys.exit(1)
        return
    try:
        print(_report_of(config, batch_shape=batch_shape, step=step))
    except UntraceableStep as refusal:  # a model the estimate cannot step: the reason, not a traceback
        print(refusal)
        sys.exit(1)
    model, strategy, dims = config.model, config.strategy, config.dims
    if args.verify and dims.tp == 1:
        print("--verify: tp=1, no tensor-parallel plan to verify (FSDP2 alone needs none)")
    elif args.verify:
        verification = verify_plan(
            model,
            tp=dims.tp,
            sp=strategy.options.parallel.sp,
            tp_plan=strategy.options.parallel.tp_plan,
            allow_unsharded_linears=strategy.options.parallel.allow_unsharded_linears,
            raise_on_failure=False,
        )
        print(verification)
        if not verification.passed:
            sys.exit(1)


def plan_for_config(
    path: str, *overrides: str, world_size: int | None = None, batch_shape: tuple[int, int] | None = None
) -> PlanReport:
    """The plan report of a ``lightning-automodel fit`` config (with `fit`'s command-line overrides): its model on
    its strategy's mesh; with ``batch_shape`` (rows, tokens a row), its activation memory too."""
    return _report_of(configured(path, *overrides, world_size=world_size), batch_shape=batch_shape)


def _report_of(
    config: Configured, *, batch_shape: tuple[int, int] | None = None, step: StepOptions | None = None
) -> PlanReport:
    """The plan report of the config's layout: its model on its strategy's mesh, parallelized with its options
    (``step``: the config's step options unless given)."""
    parallel = config.strategy.options.parallel
    return plan_report(
        config.model,
        config.dims,
        sp=parallel.sp,
        pipeline=parallel.pipeline,
        float8=parallel.float8,
        batch_shape=batch_shape,
        step=step if step is not None else config.step_options(),
    )


def _fitting_of(config: Configured, *, memory_gib: float, **search) -> Fitting:
    """Every layout of the config's world and whether it fits (those with the sizes a ``layout: auto`` config fixes)."""
    space = config.strategy.options.search or SearchSpace()
    hardware = config.hardware(memory_gib)
    return fitting_layouts(config.model, config.world_size, space=space, hardware=hardware, **search)


def _choice_of(config: Configured, *, memory_gib: float, **search) -> LayoutChoice:
    """What layout="auto" chooses for the config, as the strategy would choose it at setup (``search``: the batch,
    the workers and the step options)."""
    space = config.strategy.options.search
    hardware = config.hardware(memory_gib)
    return choose_layout(config.model, config.world_size, space=space, hardware=hardware, **search)
