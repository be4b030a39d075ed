"""Which style splits a token mixer other than attention: the recurrent mixers transformers writes (Mamba, Mamba-2,
LFM2's short convolution, the gated delta rule), found by structure."""

from __future__ import annotations

from torch import nn

from lightning_automodel.parallel.tensor.styles.delta_rule import DeltaRuleMixerParallel, is_delta_rule_mixer
from lightning_automodel.parallel.tensor.styles.state_space import (
    Mamba2MixerParallel,
    MambaMixerParallel,
    ShortConvParallel,
    StateSpaceMixerParallel,
    is_mamba2_mixer,
    is_mamba_mixer,
    is_short_conv_mixer,
)

_STYLES = (
    (is_mamba_mixer, MambaMixerParallel),
    (is_mamba2_mixer, Mamba2MixerParallel),
    (is_short_conv_mixer, ShortConvParallel),
    (is_delta_rule_mixer, DeltaRuleMixerParallel),
)


def is_recurrent_mixer(module: nn.Module) -> bool:
    return any(detects(module) for detects, _ in _STYLES)


def mixer_style(module: nn.Module, *, sequence_parallel: bool) -> StateSpaceMixerParallel | None:
    """The style that splits ``module``'s channels or heads over tp, if it is a mixer this package knows."""
    return next((style(sequence_parallel=sequence_parallel) for detects, style in _STYLES if detects(module)), None)
