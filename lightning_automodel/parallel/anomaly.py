"""The sharding rule that autograd's anomaly mode needs on DTensors, which torch lacks.

Anomaly mode (``torch.autograd.set_detect_anomaly``, Lightning's ``Trainer(detect_anomaly=True)``) checks every
gradient with ``isnan(grad)._is_any_true()``. DTensor has no rule for ``aten._is_any_true``, so under tensor
parallelism the first backward failed with NotImplementedError before any NaN appeared. The rule gathers the mask
(anomaly mode is a debugging aid, slow anyway), so every rank gets the same answer and raises on the same
gradient.
"""

import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.experimental import register_sharding


@register_sharding(torch.ops.aten._is_any_true.default)
def _is_any_true(mask):
    return [([Replicate()], [Replicate()])]
