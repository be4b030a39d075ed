"""diffusers' transformer denoisers (Wan, HunyuanVideo, Flux, SD3 and the rest of ``diffusers.models.transformers``):
what the strategy needs to know of them beside what it knows of transformers' models.

They are ``diffusers.ModelMixin`` subclasses, found by the package their class comes from; diffusers' autoencoders
and controlnets are not denoisers of this kind and are left to the user. diffusers is an optional dependency: a model
of it exists only in a process that imported it, so nothing here imports it.
"""

from __future__ import annotations

import sys

from torch import nn

_TRANSFORMERS_PACKAGE = "diffusers.models.transformers."


def is_denoiser(module: nn.Module) -> bool:
    """Whether ``module`` is one of diffusers' transformer denoisers."""
    diffusers = sys.modules.get("diffusers")
    if diffusers is None:
        return False
    return isinstance(module, diffusers.ModelMixin) and type(module).__module__.startswith(_TRANSFORMERS_PACKAGE)
