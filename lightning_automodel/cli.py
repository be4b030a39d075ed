"""``lightning-automodel``: train, evaluate, inspect and export Hugging Face causal LMs from a YAML config.

    lightning-automodel fit --config config.yaml        # validate, test and predict alike (LightningCLI)
    lightning-automodel fit --config config.yaml --print_config
    lightning-automodel plan --config config.yaml [--world_size 64] [--verify] [--activations] [fit's overrides]
    lightning-automodel plan --config config.yaml --fit 80 [--workers 4]    # the layouts that fit 80 GiB GPUs
    lightning-automodel export CHECKPOINT --output DIR

``fit``/``validate``/``test``/``predict`` are Lightning's own LightningCLI over :class:`CausalLMModule` and any
LightningDataModule (``TextDataModule``, ``ChatDataModule`` and ``DemoDataModule`` also by their short names). The
Trainer's defaults differ from Lightning's in three ways: the strategy is ``AutoModelParallelStrategy``
(``"automodel"``), the logger a CSVLogger, which the end-of-training summary draws its loss curve from, and the
progress bar counts a ``max_steps`` run in steps (:class:`StepProgressBar`).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_automodel import data  # noqa: F401 - its data modules' short names, for LightningCLI
from lightning_automodel.io.checkpoint_to_hf import export_checkpoint
from lightning_automodel.lm import CausalLMModule
from lightning_automodel.lm.progress import StepProgressBar
from lightning_automodel.parallel.fsdp.dtypes import keep_pinned_fp32
from lightning_automodel.parallel.fsdp.precision import mixed_precision_policy
from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.parallel.parallelizer import fp32_pinned_names
from lightning_automodel.planning.fitting import Fitting, LayoutChoice, NoLayoutFits, choose_layout, fitting_layouts
from lightning_automodel.planning.layouts import SearchSpace
from lightning_automodel.planning.report import PlanReport, plan_report
from lightning_automodel.planning.throughput import Hardware
from lightning_automodel.planning.verify import verify_plan
from lightning_automodel.strategy import AutoModelParallelStrategy

TRAINER_DEFAULTS = {
    "strategy": "automodel",
    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "."}},
}


DESCRIPTION = "Train, evaluate, inspect and export Hugging Face causal LMs from a YAML config."

# Every command, as `lightning-automodel --help` lists them: LightningCLI's parser knows its four only.
COMMANDS = {
    "fit": "train the config's model (LightningCLI's fit: the Trainer, the module, the data)",
    "validate": "one pass over the validation data",
    "test": "one pass over the test data",
    "predict": "predictions over the predict data",
    "plan": "what the config's strategy does to its model, without GPUs: the plan, memory per rank, layouts that fit",
    "export": "a checkpoint of fit as a Hugging Face model directory, LoRA merged",
}


def main(argv: list[str] | None = None) -> None:
    """``argv`` defaults to the command line (which LightningCLI then reads itself, as it prefers)."""
    given = [expand_home(argument) for argument in (sys.argv[1:] if argv is None else argv)]
    if argv is None:
        sys.argv[1:] = given  # what LightningCLI, and the processes Lightning's launcher starts, read
    commands = {"plan": plan_command, "export": export_command}
    _ignore_lightning_deprecations()
    if not given or given[0] in ("-h", "--help"):
        _front_door(given)
    elif given[0] in commands:
        commands[given[0]](given[1:])
    else:
        cli(None if argv is None else given)


def expand_home(argument: str) -> str:
    """``--output=~/models/x`` with the home directory for ``~``: a shell expands a ``~`` that starts a word, not one
    after ``=``, and the option would name a folder called ``~``."""
    option, equals, value = argument.partition("=") if argument.startswith("--") else ("", "", argument)
    return option + equals + os.path.expanduser(value) if value.startswith("~") else argument


def _front_door(given: list[str]) -> None:
    """The command's own help: every command with what it does, each command's options behind its own --help."""
    parser = argparse.ArgumentParser(
        prog="lightning-automodel",
        description=DESCRIPTION,
        epilog="`lightning-automodel COMMAND --help` lists a command's options; fit, validate, test and predict"
        " take the same --config.",
    )
    subcommands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, summary in COMMANDS.items():
        subcommands.add_parser(name, help=summary)
    if given:
        parser.parse_args(given)  # --help: prints the commands and exits
    parser.error("a command is needed")


def _ignore_lightning_deprecations() -> None:
    """Lightning 2.6's data loop builds torch's deprecated ``LeafSpec``: a FutureWarning per process that only
    Lightning can act on. The command owns its processes (those Lightning's launcher starts run this function too),
    so it ignores that warning, matched by message, category and module, and no other."""
    warnings.filterwarnings(
        "ignore",
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        FutureWarning,
        r"lightning\.pytorch\.utilities\._pytree",
    )


class AutomodelCLI(LightningCLI):
    """LightningCLI whose Trainer gets a :class:`StepProgressBar` unless the config brings a progress bar of its own
    or turns the bar off."""

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        section = self.config_init.get(str(self.subcommand), self.config_init)
        trainer = {**section.get("trainer", {}), **kwargs}
        callbacks = trainer.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        if trainer.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            kwargs["callbacks"] = [*callbacks, StepProgressBar()]
        return super().instantiate_trainer(**kwargs)


def cli(
    argv: list[str] | None = None, *, run: bool = True, cli_class: type[LightningCLI] = AutomodelCLI
) -> LightningCLI:
    """Lightning's CLI over CausalLMModule and any data module, with this package's Trainer defaults."""
    return cli_class(
        CausalLMModule,
        L.LightningDataModule,
        subclass_mode_data=True,
        trainer_defaults=TRAINER_DEFAULTS,
        args=argv,
        run=run,
        parser_kwargs={"description": DESCRIPTION},
    )


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
    args, overrides = parser.parse_known_args(argv)
    if args.fit is not None and args.verify:
        parser.error("--fit lists other layouts than the config's: verify the one you pick, without --fit")
    config = configured(args.config, *overrides, world_size=args.world_size)
    search = config.strategy.options.search
    if search is not None and args.verify:
        parser.error("the config's layout is auto: verify the layout it chooses, pinned (plan prints it)")
    estimate = args.activations or args.fit is not None or args.batch_size is not None or args.seq_len is not None
    batch_shape = config.batch_shape(batch_size=args.batch_size, seq_len=args.seq_len) if estimate or search else None
    if args.fit is not None:
        print(_fitting_of(config, memory_gib=args.fit, batch_shape=batch_shape, workers=args.workers))
        return
    if search is not None:
        memory_gib = args.gpu_memory if args.gpu_memory is not None else config.strategy.options.gpu_memory
        if memory_gib is None:
            parser.error("the config's layout is auto: pass --gpu_memory GIB (or give the strategy gpu_memory)")
        try:
            print(_choice_of(config, memory_gib=memory_gib, batch_shape=batch_shape, workers=args.workers))
        except NoLayoutFits as refusal:
            print(refusal)
            sys.exit(1)
        return
    print(_plan_of(config, batch_shape=batch_shape))
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


class _ConfigOnly(AutomodelCLI):
    """Parses and instantiates a `fit` config as `fit` would, but builds no Trainer (whose accelerator this machine
    may not have): the strategy, model and data are what the plan needs."""

    def parse_arguments(self, parser: LightningArgumentParser, args: list[str]) -> None:
        # The arguments are the ones `plan` builds, while sys.argv holds the `plan` command line: Lightning's warning
        # against giving both guards a CLI that could have meant to read sys.argv, which this one never does.
        self.config = parser.parse_args(args)

    def instantiate_trainer(self, **kwargs: Any) -> None:
        return None


def plan_for_config(
    path: str, *overrides: str, world_size: int | None = None, batch_shape: tuple[int, int] | None = None
) -> PlanReport:
    """The plan report of a ``lightning-automodel fit`` config (with `fit`'s command-line overrides): its model on
    its strategy's mesh; with ``batch_shape`` (rows, tokens a row), its activation memory too."""
    return _plan_of(configured(path, *overrides, world_size=world_size), batch_shape=batch_shape)


@dataclass
class Configured:
    """What a ``lightning-automodel fit`` config trains, and how: its model on the meta device (in the Trainer's
    precision where it casts weights), its strategy, the world size, and the data module, Trainer and LightningModule
    settings that size a step."""

    model: nn.Module
    strategy: AutoModelParallelStrategy
    world_size: int
    datamodule: Any
    precision: str
    devices: Any = None  # the Trainer's devices (a number of GPUs a node, where the config gives one)
    loss_chunks: int = 1  # CausalLMModule's (a module of one's own computes the logits whole, as far as we know)

    @property
    def dims(self) -> ParallelDims:
        """The strategy's sizes resolved for the world (`plan --fit` needs the world size only)."""
        return self.strategy.options.dims.resolve(self.world_size)

    @property
    def mp_policy(self) -> MixedPrecisionPolicy | None:
        """FSDP2's policy, as the strategy would take it from the Trainer's precision."""
        policy = self.strategy.options.parallel.fsdp.mp_policy
        return policy if policy is not None else mixed_precision_policy(self.precision)

    def hardware(self, memory_gib: float) -> Hardware:
        """GPUs of ``memory_gib`` GiB, as many a node as the config's devices (the throughput model's H100 else)."""
        devices = self.devices if isinstance(self.devices, int) else Hardware.gpus_per_node
        return Hardware(memory_gib, gpus_per_node=devices)

    def step_options(self) -> dict[str, Any]:
        """The options that shape a training step's memory, as the strategy and the module set them."""
        parallel = self.strategy.options.parallel
        return dict(
            mp_policy=self.mp_policy,
            tp_plan=parallel.tp_plan,
            allow_unsharded_linears=parallel.allow_unsharded_linears,
            cp_attention=parallel.cp_attention,
            loss_chunks=self.loss_chunks,
        )

    def batch_shape(self, *, batch_size: int | None = None, seq_len: int | None = None) -> tuple[int, int]:
        """Rows per data-parallel rank and step and tokens a row: those given, else the strategy's ``layout_batch``,
        else the data module's."""
        given = self.strategy.options.layout_batch or (None, None)
        rows = next(
            (size for size in (batch_size, given[0], getattr(self.datamodule, "batch_size", None)) if size), None
        )
        tokens = next((size for size in (seq_len, given[1], getattr(self.datamodule, "seq_len", None)) if size), None)
        if rows is None or tokens is None:
            raise ValueError(
                f"The config's data module ({type(self.datamodule).__name__}) gives no batch_size or seq_len: pass"
                " --batch_size and --seq_len, the rows per data-parallel rank and the tokens a row."
            )
        return rows, tokens


def configured(path: str, *overrides: str, world_size: int | None = None) -> Configured:
    """What a ``lightning-automodel fit`` config (with `fit`'s command-line overrides) trains, and how."""
    # run=False: no subcommand. No seeding: seed_everything would seed this process and export PL_GLOBAL_SEED,
    # which every later Trainer (and the processes it starts) would then re-seed from.
    arguments = [f"--config={path}", *overrides, "--seed_everything=false"]
    parsed = cli(arguments, run=False, cli_class=_ConfigOnly)
    trainer = parsed.config_init["trainer"]
    strategy = AutoModelParallelStrategy() if trainer["strategy"] == "automodel" else trainer["strategy"]
    if not isinstance(strategy, AutoModelParallelStrategy):
        raise ValueError(f"`plan` describes AutoModelParallelStrategy layouts; the config's strategy is {strategy!r}.")
    if world_size is None:
        if not isinstance(trainer["devices"], int):
            raise ValueError(
                f"trainer.devices is {trainer['devices']!r}: pass --world_size, the number of ranks to plan for."
            )
        world_size = trainer["devices"] * trainer["num_nodes"]
    module = parsed.model
    needs_tokenizer = module.hparams.model is None and "vocab_size" not in (module.hparams.config or {})
    tokenizer = getattr(parsed.datamodule, "tokenizer", None) if needs_tokenizer else None
    model = module.build_model(tokenizer, meta=True, seq_len=getattr(parsed.datamodule, "seq_len", None))
    precision = str(trainer["precision"] or "32-true")
    if precision in _CAST_WEIGHTS:  # as the strategy casts them, what the model pins to fp32 kept so
        with keep_pinned_fp32(model, fp32_pinned_names(model)):
            model.to(_CAST_WEIGHTS[precision])
    loss_chunks = module.hparams.get("loss_chunks", 1)
    return Configured(
        model, strategy, world_size, parsed.datamodule, precision, devices=trainer["devices"], loss_chunks=loss_chunks
    )


_CAST_WEIGHTS = {"bf16-true": torch.bfloat16, "16-true": torch.float16}  # the "-true" flags the strategy takes


def _plan_of(config: Configured, *, batch_shape: tuple[int, int] | None = None) -> PlanReport:
    parallel = config.strategy.options.parallel
    return plan_report(
        config.model,
        config.dims,
        sp=parallel.sp,
        tp_plan=parallel.tp_plan,
        allow_unsharded_linears=parallel.allow_unsharded_linears,
        pipeline=parallel.pipeline,
        float8=parallel.float8,
        batch_shape=batch_shape,
        step_options=dict(
            mp_policy=config.mp_policy, cp_attention=parallel.cp_attention, loss_chunks=config.loss_chunks
        ),
    )


def _fitting_of(config: Configured, *, memory_gib: float, batch_shape: tuple[int, int], workers: int) -> Fitting:
    return fitting_layouts(
        config.model,
        config.world_size,
        hardware=config.hardware(memory_gib),
        batch_shape=batch_shape,
        space=config.strategy.options.search or SearchSpace(),
        workers=workers,
        **config.step_options(),
    )


def _choice_of(config: Configured, *, memory_gib: float, batch_shape: tuple[int, int], workers: int) -> LayoutChoice:
    """What layout="auto" chooses for the config, as the strategy would choose it at setup."""
    return choose_layout(
        config.model,
        config.world_size,
        hardware=config.hardware(memory_gib),
        batch_shape=batch_shape,
        space=config.strategy.options.search,
        workers=workers,
        **config.step_options(),
    )


def export_command(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-automodel export",
        description="Write a checkpoint of `fit` (or any sharded Lightning checkpoint) as a Hugging Face model"
        " directory for from_pretrained. One process, no GPU; LoRA adapters are merged.",
    )
    parser.add_argument(
        "checkpoint", help="a checkpoint directory written by ModelCheckpoint / trainer.save_checkpoint"
    )
    parser.add_argument("--output", required=True, help="directory to write (replaced only once complete)")
    parser.add_argument(
        "--config",
        help="Hugging Face model directory with the model's config.json (only for checkpoints not"
        " written by CausalLMModule, which record their config)",
    )
    parser.add_argument("--model_class", default="", help="transformers class (default: the config's architecture)")
    args = parser.parse_args(argv)
    export_checkpoint(args.checkpoint, args.output, config=args.config, model_class=args.model_class)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
