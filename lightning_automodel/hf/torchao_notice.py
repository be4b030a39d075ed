"""transformers imports torchao wherever it is installed (its quantizers register torchao's), float8 on or off, and
torchao logs on import that it skips its C++ extensions when torch is newer than the one it was built for: a warning
per process, on every run, that no user can act on (float8 training calls torch's own float8 matmuls, not those
extensions). A filter on torchao's logger drops that one message, matched by its text; every other message of torchao
passes."""

from __future__ import annotations

import logging

_NOTICE = "Skipping import of cpp extensions due to incompatible torch version"


def _not_the_extensions_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_NOTICE)


def drop_torchao_extensions_notice() -> None:
    """Before transformers is imported (its first import loads torchao). Adding the filter again is a no-op."""
    logging.getLogger("torchao").addFilter(_not_the_extensions_notice)
