"""``python -m lightning_automodel.cli``: the ``lightning-automodel`` command."""

from lightning_automodel.cli import main

main()
