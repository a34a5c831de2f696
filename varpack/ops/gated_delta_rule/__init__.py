"""Gated delta rule (Gated DeltaNet linear attention) with sequence boundaries (``cu_seqlens``).

* :func:`naive_recurrent_gated_delta_rule` (``naive.py``): token by token, the truth.
* :func:`chunk_gated_delta_rule` (``chunk.py``): chunked (64), vectorized over all sequences of a packed
  row, autograd backward, any device.
"""

from __future__ import annotations

from .chunk import ChunkLayout, chunk_gated_delta_rule, prepare_chunk_layout
from .naive import naive_recurrent_gated_delta_rule

__all__ = [
    "ChunkLayout",
    "chunk_gated_delta_rule",
    "naive_recurrent_gated_delta_rule",
    "prepare_chunk_layout",
]
