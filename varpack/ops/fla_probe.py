"""What fla can do on a device: the gated delta rule's and the short conv's probes gathered in one record.

Each op probes its own fla kernel next to its dispatch (once per device, :class:`varpack._probe.ProbeOnce`):
:func:`varpack.ops.gated_delta_rule.dispatch.fla_gated_delta_status` and
:func:`varpack.ops.short_conv.fla_conv_status`. This module sits above both (it imports them; neither imports
it), for callers that want the whole picture (``varpack check``-style reports, tests, the gated-delta
integration).
"""

from __future__ import annotations

import torch

from ._fla import FlaStatus
from .gated_delta_rule.dispatch import fla_gated_delta_status, fla_hybrid_status
from .short_conv import fla_conv_status

__all__ = ["FlaStatus", "fla_status"]


def fla_status(device: torch.device | str | None = None) -> FlaStatus:
    """Probe fla once per device (cached): forward/backward of the gated delta rule and the causal conv, and
    the ``fla_hybrid`` gated delta rule (fla's kernels, varpack's ``dq/dk/dw/dg`` step) forward + backward.

    The first call on a CUDA device runs tiny problems there (a few milliseconds plus Triton compiles).
    """
    forward, backward = fla_gated_delta_status(device)
    conv_forward, conv_backward = fla_conv_status(device)
    return FlaStatus(forward, backward, conv_forward, conv_backward, fla_hybrid_status(device))
