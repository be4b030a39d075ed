"""``lightning-automodel export``: a checkpoint of ``fit`` as a Hugging Face model directory."""

from __future__ import annotations

import argparse

from lightning_automodel.io.checkpoint_to_hf import export_checkpoint
from lightning_automodel.io.export.shards import DEFAULT_MAX_SHARD_SIZE


def export_command(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-automodel export",
        description="Write a checkpoint of `fit` (or any sharded Lightning checkpoint) as a Hugging Face model"
        " directory for from_pretrained, shard by shard (the model is never held whole). One process, no GPU.",
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
    parser.add_argument(
        "--max_shard_size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help=f"largest safetensors file, as save_pretrained takes it (default {DEFAULT_MAX_SHARD_SIZE}: transformers')",
    )
    parser.add_argument(
        "--lora",
        choices=("merge", "adapter"),
        default="merge",
        help="LoRA checkpoints: merge the adapters into the weights (default), or write a PEFT adapter directory",
    )
    args = parser.parse_args(argv)
    max_shard_size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
    export_checkpoint(
        args.checkpoint,
        args.output,
        config=args.config,
        model_class=args.model_class,
        max_shard_size=max_shard_size,
        lora=args.lora,
    )
    print(f"wrote {args.output}")
