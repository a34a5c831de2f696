"""Labels and per-token weights of linear cross entropy: the causal shift and ``w_t`` of every reduction.

Unlike :func:`varpack.loss.causal_lm_loss`, which shifts inside, linear cross entropy takes labels that are
**already shifted** (``labels[t]`` is the target of ``hidden[t]``); :func:`shift_labels` makes them from the
collator's unshifted labels. Every reduction is one float32 weight per token, ``loss = sum_t w_t * CE_t``
(:func:`token_loss_weights`); see :mod:`varpack.ops.linear_ce` for the contract and the reductions.
"""

from __future__ import annotations

from typing import Literal

import torch

from varpack.loss import loss_denominator
from varpack.schema import IGNORE_INDEX

__all__ = ["Reduction", "shift_labels", "token_loss_weights"]

Reduction = Literal["token", "sample"]


def _shift_tokens(x: torch.Tensor, fill: float | int) -> torch.Tensor:
    """``[B, T]`` -> ``[B, T]`` with ``out[:, t] = x[:, t + 1]`` and ``out[:, -1] = fill``."""
    out = torch.full_like(x, fill)
    out[:, :-1] = x[:, 1:]
    return out


def shift_labels(
    labels: torch.Tensor, *, seq_idx: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Causal shift of padding-free labels: ``[1, T]`` (or ``[B, T]``, or ``[T]``) -> ``[B * T]``.

    ``out[t] = labels[t + 1]`` within each row; the last position of each row gets ``ignore_index``. The
    result is aligned with ``hidden.reshape(-1, D)`` for :func:`linear_cross_entropy`.

    >>> shift_labels(torch.tensor([[-100, 5, 6, -100, 7]])).tolist()
    [5, 6, -100, 7, -100]

    Args:
        labels: int64 ``[B, T]`` or ``[T]``; every sample's first label is ``ignore_index`` (collator
            contract), so no prediction crosses a sample boundary.
        seq_idx: optional ``[B, T]`` / ``[T]`` sample index of every token; predictions whose target lies in
            another sample are set to ``ignore_index`` too (defence in depth).
        ignore_index: the label value that is not scored.

    Returns:
        int64 ``[B * T]``.

    Raises:
        ValueError: labels not 1-D / 2-D, or ``seq_idx`` of another shape.
    """
    rows = _rows(labels, "labels")
    out = _shift_tokens(rows, ignore_index)
    if seq_idx is not None:
        seg = _rows(seq_idx, "seq_idx")
        if seg.shape != rows.shape:
            raise ValueError(
                f"seq_idx shape {tuple(seq_idx.shape)} does not match labels shape {tuple(labels.shape)}"
            )
        seg = seg.to(rows.device)
        crosses = torch.zeros_like(rows, dtype=torch.bool)
        crosses[:, :-1] = seg[:, 1:] != seg[:, :-1]
        out = out.masked_fill(crosses, ignore_index)
    return out.reshape(-1)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() == 1:
        return x.unsqueeze(0)
    if x.dim() == 2:
        return x
    raise ValueError(f"{name} must be [T] or [B, T], got shape {tuple(x.shape)}")


def token_loss_weights(
    labels: torch.Tensor,
    *,
    reduction: Reduction = "token",
    seq_idx: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | float | None = None,
    ignore_index: int = IGNORE_INDEX,
    loss_scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The float32 weight ``w_t`` of every (already shifted) label: ``loss = sum_t w_t * CE_t``.

    Args:
        labels: int64 ``[T]``, already shifted (see the module docstring).
        reduction, seq_idx, num_items_in_batch, ignore_index, loss_scale: as in :func:`linear_cross_entropy`;
            ``seq_idx`` and ``loss_scale`` are ``[T]``.
        dtype: float32 (default) or float64 (used for fp64 hidden states).

    Returns:
        ``dtype`` ``[T]``, 0 where the label is ignored. Computed on the labels' device without a host sync.

    Raises:
        ValueError: an unknown reduction, ``"sample"`` without ``seq_idx``, shapes that differ from labels',
            a non-positive ``num_items_in_batch``.
        TypeError: a ``num_items_in_batch`` that is not a number or tensor.
    """
    if reduction not in ("token", "sample"):
        raise ValueError(f"reduction must be 'token' or 'sample', got {reduction!r}")
    if labels.dim() != 1:
        raise ValueError(
            f"labels must be [T] (already shifted, see shift_labels), got shape {tuple(labels.shape)}"
        )
    device = labels.device
    valid = labels != ignore_index
    weight = valid.to(dtype)
    if loss_scale is not None:
        if loss_scale.shape != labels.shape:
            raise ValueError(
                f"loss_scale shape {tuple(loss_scale.shape)} does not match labels shape {tuple(labels.shape)}"
            )
        weight = weight * loss_scale.to(device=device, dtype=dtype)
    if reduction == "token":
        if num_items_in_batch is None:
            denom = valid.sum().to(dtype).clamp(min=1.0)
        else:
            denom = loss_denominator(num_items_in_batch, device, dtype)
        return weight / denom
    if seq_idx is None:
        raise ValueError(
            "reduction='sample' needs seq_idx (the sample index of every token, from the collator)"
        )
    if seq_idx.shape != labels.shape:
        raise ValueError(
            f"seq_idx shape {tuple(seq_idx.shape)} does not match labels shape {tuple(labels.shape)}"
        )
    seg = seq_idx.to(device=device, dtype=torch.int64)
    num_slots = labels.shape[0]  # seq_idx values are sample indices in [0, N) with N <= T
    if seg.device.type == "cpu" and seg.numel() and (int(seg.min()) < 0 or int(seg.max()) >= num_slots):
        raise ValueError(
            f"seq_idx values must lie in [0, T={num_slots}), got min {int(seg.min())} max {int(seg.max())}"
        )
    counts = torch.zeros(num_slots, device=device, dtype=dtype).index_add_(0, seg, valid.to(dtype))
    per_token_count = counts[seg].clamp(min=1.0)
    if num_items_in_batch is None:
        n_samples = (counts > 0).sum().to(dtype).clamp(min=1.0)
    else:
        n_samples = loss_denominator(num_items_in_batch, device, dtype)
    return weight / (per_token_count * n_samples)
