"""Linear cross entropy: the LM head and the causal-LM loss in one pass, without the ``[T, V]`` logits.

The code now lives in :mod:`varpack.ops.linear_ce` (one op folder: weights, chunked, liger, dispatch, naive,
causal_lm); this module re-exports its public names so ``from varpack.linear_ce import ...`` keeps working.
"""

from __future__ import annotations

from varpack.ops.linear_ce import (
    AUTO_PREFERS_LIGER,
    causal_lm_forward_with_linear_ce,
    linear_ce_backends,
    linear_cross_entropy,
    naive_linear_cross_entropy,
    resolve_linear_ce_backend,
    shift_labels,
    token_loss_weights,
)

__all__ = [
    "AUTO_PREFERS_LIGER",
    "causal_lm_forward_with_linear_ce",
    "linear_cross_entropy",
    "linear_ce_backends",
    "naive_linear_cross_entropy",
    "resolve_linear_ce_backend",
    "shift_labels",
    "token_loss_weights",
]
