"""Liger-Kernel's fused linear cross entropy as backend ``"liger"`` (pure Triton, CUDA only).

It is used only where it computes exactly varpack's loss: with ``reduction="sum"`` its gradient is
``softmax - onehot`` summed over tokens and its backward multiplies by the scalar ``grad_output``, so
``liger(sum) / num_items`` is the token mean with any divisor (the same construction as transformers' Liger
integration with ``num_items_in_batch``). Per-token weights need Liger's ``reduction="none"`` with a
per-token backward (:func:`_liger_probe` reports whether the installed version has it). Liger reads the
supervised-token count with ``.item()`` (one host sync per call).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from varpack._probe import probe_once

__all__: list[str] = []


@probe_once
def _liger_probe() -> tuple[bool, str, bool]:
    """(importable, reason, has per-token backward for reduction='none')."""
    try:
        from liger_kernel.ops import fused_linear_cross_entropy as ops_flce
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # noqa: F401
    except Exception as exc:  # ImportError, or Triton failing to initialise
        return False, f"liger-kernel is not importable ({type(exc).__name__}: {exc})", False
    try:
        params = inspect.signature(ops_flce.fused_linear_cross_entropy_forward).parameters
        per_token = "token_grad_output" in params
    except (AttributeError, TypeError, ValueError):
        per_token = False
    return True, "liger-kernel importable", per_token


def _liger_chunk_kwargs(
    fn: Any, hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int
) -> dict[str, Any]:
    """Liger sizes its token chunks as ``next_pow2(T / ceil(V / (chunk_mem_const * D)))``; with the default
    ``chunk_mem_const=1`` and Qwen3's V / D = 148 that is 64 tokens, so each chunk re-reads the whole
    ``[V, D]`` head three times. Pick ``chunk_mem_const`` so its chunks are about ``chunk_size`` tokens (when
    the installed Liger has the argument)."""
    try:
        if "chunk_mem_const" not in inspect.signature(fn).parameters:
            return {}
    except (TypeError, ValueError):
        return {}
    num_tokens, dim = hidden.shape
    num_chunks = max(1, -(-num_tokens // chunk_size))
    return {"chunk_mem_const": max(1, -(-weight.shape[0] // (dim * num_chunks)))}


def _liger_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    token_weight: torch.Tensor,
    denom: torch.Tensor | None,
    ignore_index: int,
    chunk_size: int,
) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    kw = dict(ignore_index=ignore_index, accum_dtype=torch.float32)
    kw.update(_liger_chunk_kwargs(liger_fused_linear_cross_entropy, hidden, weight, chunk_size))
    if denom is not None:  # uniform weights: sum / num_items (exact: grad_output scales the stored grads)
        total = liger_fused_linear_cross_entropy(hidden, weight, labels, bias, reduction="sum", **kw)
        return total.float() / denom
    per_token = liger_fused_linear_cross_entropy(hidden, weight, labels, bias, reduction="none", **kw)
    return (per_token.float() * token_weight).sum()
