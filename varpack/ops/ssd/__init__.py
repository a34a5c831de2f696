"""The SSD (Mamba-2 selective state space) scan with sample boundaries (``cu_seqlens`` / ``seq_idx``).

* :func:`naive_recurrent_ssd_scan` (``naive.py``): token by token, the truth.
* :func:`chunk_ssd_scan` (``chunk.py``): chunked, vectorized over every sample of a packed row (chunks may
  straddle samples: ``seq_idx`` masks), autograd backward, any device; :func:`prepare_ssd_layout` builds a
  batch's masks once.
* :func:`ssd_scan` (``dispatch.py``): picks ``mamba_ssm`` (CUDA, when importable and its probe passes) /
  ``chunk`` / ``naive``.
"""

from __future__ import annotations

from .chunk import SSDLayout, chunk_ssd_scan, prepare_ssd_layout
from .dispatch import BACKENDS, mamba_ssm_status, resolve_ssd_backend, ssd_scan
from .naive import naive_recurrent_ssd_scan

__all__ = [
    "BACKENDS",
    "SSDLayout",
    "chunk_ssd_scan",
    "mamba_ssm_status",
    "naive_recurrent_ssd_scan",
    "prepare_ssd_layout",
    "resolve_ssd_backend",
    "ssd_scan",
]
