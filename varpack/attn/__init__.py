"""Varlen (packed, padding-free) attention: one public :func:`varlen_attention`, a backend registry, and one
module per backend: ``reference`` (per-segment explicit math, the truth), ``sdpa`` (per-segment SDPA loop, the
CPU default), ``torch_varlen``, ``flex``, ``flash_attn`` (FA2), ``flash_attn_3``, ``flash_attn_4``,
``triton_short`` (Triton tiles spanning several documents).

Public names:
    varlen_attention: attention over a packed stream of segments (flash-attn ``flash_attn_varlen_func``
        semantics), dispatched to a backend.
    available_backends: ``{name: (ok, reason)}`` for a device / dtype.
    resolve_backend: which backend ``auto`` (or a forced name) runs a call, with ``.reason``.
    BackendUnavailableError: raised when a forced backend (or every ``auto`` candidate) cannot run a call.
    AUTO_PRIORITY: the ``auto`` order per device type (one table, updated by benchmarks);
        AUTO_PRIORITY_SHORT: the order for short documents (``max_seqlen <= AUTO_SHORT_MAX_SEQLEN``).
    reference_varlen_attention: the per-segment reference (the truth in tests).
"""

from __future__ import annotations

from ._base import Backend, BackendUnavailableError, CallSpec, Capabilities
from .interface import varlen_attention
from .reference import reference_varlen_attention, segment_mask
from .registry import (
    AUTO_PRIORITY,
    AUTO_PRIORITY_SHORT,
    AUTO_SHORT_MAX_SEQLEN,
    BACKENDS,
    ResolvedBackend,
    available_backends,
    get_backend,
    resolve_backend,
)

__all__ = [
    "AUTO_PRIORITY",
    "AUTO_PRIORITY_SHORT",
    "AUTO_SHORT_MAX_SEQLEN",
    "BACKENDS",
    "Backend",
    "BackendUnavailableError",
    "CallSpec",
    "Capabilities",
    "ResolvedBackend",
    "available_backends",
    "get_backend",
    "reference_varlen_attention",
    "resolve_backend",
    "segment_mask",
    "varlen_attention",
]
