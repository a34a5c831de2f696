"""Boundary metadata (cu_seqlens, max_seqlen, seq_idx), built once per batch on the CPU."""

from __future__ import annotations

from varpack.varlen.boundaries import (
    cu_seqlens_from_lengths,
    cu_seqlens_from_position_ids,
    cu_seqlens_from_segment_ids,
    lengths_from_cu_seqlens,
    max_seqlen_from_cu_seqlens,
    normalize_cu_seqlens,
    normalize_max_seqlen,
    seq_idx_from_cu_seqlens,
    seq_idx_on_device,
    validate_cu_seqlens,
)
from varpack.varlen.meta import LINEAR_CHUNK_SIZE, VarlenMeta, linear_chunk_count, varlen_meta_from_kwargs

__all__ = [
    "LINEAR_CHUNK_SIZE",
    "VarlenMeta",
    "cu_seqlens_from_lengths",
    "cu_seqlens_from_position_ids",
    "cu_seqlens_from_segment_ids",
    "linear_chunk_count",
    "lengths_from_cu_seqlens",
    "max_seqlen_from_cu_seqlens",
    "normalize_cu_seqlens",
    "normalize_max_seqlen",
    "seq_idx_from_cu_seqlens",
    "seq_idx_on_device",
    "validate_cu_seqlens",
    "varlen_meta_from_kwargs",
]
