"""Sequence-boundary-aware ops for linear-attention layers: the gated delta rule and the short conv."""

from __future__ import annotations

from .fla_probe import FlaStatus, fla_status
from .gated_delta_rule import (
    ChunkLayout,
    available_backends,
    chunk_gated_delta_rule,
    gated_delta_rule,
    naive_recurrent_gated_delta_rule,
    prepare_chunk_layout,
    resolve_backend,
)
from .short_conv import resolve_conv_backend, seq_idx_for_conv, short_conv, short_conv_reference

__all__ = [
    "ChunkLayout",
    "FlaStatus",
    "available_backends",
    "chunk_gated_delta_rule",
    "fla_status",
    "gated_delta_rule",
    "naive_recurrent_gated_delta_rule",
    "prepare_chunk_layout",
    "resolve_backend",
    "resolve_conv_backend",
    "seq_idx_for_conv",
    "short_conv",
    "short_conv_reference",
]
