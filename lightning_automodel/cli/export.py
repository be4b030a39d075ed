"""``lightning-automodel export``: a checkpoint of ``fit`` as a Hugging Face model directory."""

from __future__ import annotations

import argparse

from lightning_automodel.io.checkpoint_to_hf import export_checkpoint


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
