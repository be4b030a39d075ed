"""What a ``lightning-automodel fit`` config trains, and how, read without a Trainer (whose accelerator this machine
may not have): the model on the meta device, the strategy, the world size and what sizes a step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.cli import LightningArgumentParser
from torch import nn

from lightning_automodel.cli.lightning_cli import AutomodelCLI, cli
from lightning_automodel.parallel.fsdp.dtypes import keep_pinned_fp32
from lightning_automodel.parallel.mesh import ParallelDims
from lightning_automodel.parallel.parallelizer import fp32_pinned_names
from lightning_automodel.planning.memory.optimizer_step import AdamWImplementation
from lightning_automodel.planning.memory.step_options import StepOptions
from lightning_automodel.planning.search.throughput import Hardware
from lightning_automodel.strategy import AutoModelParallelStrategy
from lightning_automodel.strategy.module_hints import adamw_of, loss_chunks_of


class _ConfigOnly(AutomodelCLI):
    """Parses and instantiates a `fit` config as `fit` would, but builds no Trainer (whose accelerator this machine
    may not have): the strategy, model and data are what the plan needs."""

    def parse_arguments(self, parser: LightningArgumentParser, args: list[str]) -> None:
        # The arguments are the ones `plan` builds, while sys.argv holds the `plan` command line: Lightning's warning
        # against giving both guards a CLI that could have meant to read sys.argv, which this one never does.
        self.config = parser.parse_args(args)

    def instantiate_trainer(self, **kwargs: Any) -> None:
        return None


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
    loss_chunks: int = 1  # the LightningModule's (see strategy/module_hints.py)
    adamw: AdamWImplementation = "foreach"  # the LightningModule's AdamW implementation (likewise)

    @property
    def dims(self) -> ParallelDims:
        """The strategy's sizes resolved for the world (`plan --fit` needs the world size only)."""
        return self.strategy.options.dims.resolve(self.world_size)

    def hardware(self, memory_gib: float) -> Hardware:
        """GPUs of ``memory_gib`` GiB, as many a node as the config's devices (the throughput model's H100 else)."""
        devices = self.devices if isinstance(self.devices, int) else Hardware.gpus_per_node
        return Hardware(memory_gib, gpus_per_node=devices)

    def step_options(
        self,
        *,
        images_per_row: int | None = None,
        image_tokens: int | None = None,
        expert_imbalance: float | None = None,
    ) -> StepOptions:
        """The options that shape a training step's memory, as the strategy and the module set them; a
        vision-language model's images and a mixture-of-experts model's routing those given, else the strategy's
        ``layout_images_per_row``, ``layout_image_tokens`` and ``layout_expert_imbalance``."""
        options = self.strategy.options
        images = (
            images_per_row if images_per_row is not None else options.layout_images_per_row,
            image_tokens if image_tokens is not None else options.layout_image_tokens,
        )
        return StepOptions.of(
            options.parallel,
            mp_policy=options.mp_policy_for(self.precision),
            loss_chunks=self.loss_chunks,
            adamw=self.adamw,
            images=images,
            expert_imbalance=expert_imbalance if expert_imbalance is not None else options.layout_expert_imbalance,
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
    data = parsed.datamodule if needs_tokenizer else None  # a vision-language model's processor as well
    tokenizer, processor = getattr(data, "tokenizer", None), getattr(data, "processor", None)
    seq_len = getattr(parsed.datamodule, "seq_len", None)
    model = module.build_model(tokenizer, meta=True, seq_len=seq_len, processor=processor)
    precision = str(trainer["precision"] or "32-true")
    if precision in _CAST_WEIGHTS:  # as the strategy casts them, what the model pins to fp32 kept so
        with keep_pinned_fp32(model, fp32_pinned_names(model)):
            model.to(_CAST_WEIGHTS[precision])
    return Configured(
        model,
        strategy,
        world_size,
        parsed.datamodule,
        precision,
        devices=trainer["devices"],
        loss_chunks=loss_chunks_of(module),
        adamw=adamw_of(module),
    )


_CAST_WEIGHTS = {"bf16-true": torch.bfloat16, "16-true": torch.float16}  # the "-true" flags the strategy takes
