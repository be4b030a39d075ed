"""The M-RoPE sections a text model takes where its config gives none: the default its modeling code reads
(``rope_parameters.get("mrope_section", [...])``: Ernie 4.5-VL's height, width, time 22 : 22 : 20, PaddleOCR-VL's 16,
24, 24), so that a tiny config scales the proportions that model's code expects (Ernie's needs height and width
equal)."""

from __future__ import annotations

import importlib
import inspect
import re

# Qwen2-VL's 16, 24, 24 (time, height, width): a model that takes sections but whose code names no default.
QWEN_SECTIONS = [16, 24, 24]
_CODE_DEFAULT = re.compile(r"""get\(\s*["']mrope_section["']\s*,\s*\[([\d,\s]+)\]\s*\)""")


def default_sections(config_class: type) -> list[int] | None:
    """The sections the text model of ``config_class`` reads where its config gives none: its code's default, Qwen2-VL's
    for a config that lets them through rope validation, else None (it takes no M-RoPE sections)."""
    found = _CODE_DEFAULT.search(_modeling_source(config_class))
    if found:
        return [int(part) for part in found.group(1).split(",") if part.strip()]
    return QWEN_SECTIONS if "mrope_section" in getattr(config_class, "ignore_keys_at_rope_validation", ()) else None


def _modeling_source(config_class: type) -> str:
    """The source of the modeling module beside ``config_class``'s configuration module ("" where there is none)."""
    name = config_class.__module__.replace(".configuration_", ".modeling_")
    try:
        return inspect.getsource(importlib.import_module(name))
    except (ImportError, OSError, TypeError):
        return ""
