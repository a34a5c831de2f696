"""Gated delta rule (Gated DeltaNet linear attention) with sequence boundaries (``cu_seqlens``).

* :func:`naive_recurrent_gated_delta_rule` (``naive.py``): token by token, the truth.
* :func:`chunk_gated_delta_rule` (``chunk.py``): chunked (64), vectorized over all sequences of a packed
  row, autograd backward, any device.
* :func:`fla_hybrid_gated_delta_rule` (``fla_hybrid.py``): fla's kernels with varpack's own step (a Triton
  kernel, ``_dqkwg_kernels.py``; batched PyTorch elsewhere) in place of the backward kernel fla flags as wrong
  on Hopper with Triton >= 3.4, < 3.7.1 (CUDA).
* :func:`gated_delta_rule` (``dispatch.py``): picks ``fla`` / ``fla_hybrid`` / ``chunk`` / ``chunk_compiled``
  / ``naive``.
"""

from __future__ import annotations

from .chunk import ChunkLayout, chunk_gated_delta_rule, prepare_chunk_layout
from .dispatch import BACKENDS, available_backends, gated_delta_rule, resolve_backend
from .fla_hybrid import fla_hybrid_gated_delta_rule
from .naive import naive_recurrent_gated_delta_rule

__all__ = [
    "BACKENDS",
    "ChunkLayout",
    "available_backends",
    "chunk_gated_delta_rule",
    "fla_hybrid_gated_delta_rule",
    "gated_delta_rule",
    "naive_recurrent_gated_delta_rule",
    "prepare_chunk_layout",
    "resolve_backend",
]
