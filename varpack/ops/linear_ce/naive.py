"""The naive twin of :func:`varpack.ops.linear_ce.linear_cross_entropy`: the full ``[T, V]`` logits, then
PyTorch's cross entropy, weighted per token.

It materializes what the fused backends avoid (``T x V`` logits and, through autograd, their gradient), so it
is for tests, benchmarks' baselines and small problems: the same loss as the ``chunked`` and ``liger``
backends up to float rounding order, with autograd's gradients. Its numerics follow an unfused causal LM:
the logits in hidden's dtype (``hidden @ weight.T + bias``, as the model's LM head computes them), upcast to
float32 (float64 for fp64 input) for the cross entropy, as :func:`varpack.loss.causal_lm_loss` does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from varpack.schema import IGNORE_INDEX

from .weights import Reduction, token_loss_weights

__all__ = ["naive_linear_cross_entropy"]


def naive_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    reduction: Reduction = "token",
    seq_idx: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | float | None = None,
    ignore_index: int = IGNORE_INDEX,
    loss_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_t w_t * F.cross_entropy(hidden @ weight.T + bias, labels, reduction="none")[t]``.

    Args:
        hidden: ``(T, D)`` float; weight ``(V, D)`` (cast to hidden's dtype); bias ``(V,)`` or None.
        labels: int64 ``(T,)``, **already shifted** (:func:`varpack.ops.linear_ce.shift_labels`).
        reduction, seq_idx, num_items_in_batch, ignore_index, loss_scale: as in
            :func:`varpack.ops.linear_ce.linear_cross_entropy`; the weights ``w_t`` are
            :func:`varpack.ops.linear_ce.token_loss_weights`.

    Returns:
        The scalar loss, float32 (float64 for fp64 input). 0 when nothing is supervised.

    Raises:
        ValueError: hidden not ``(T, D)``, labels not ``(T,)``, or the errors of :func:`token_loss_weights`.
    """
    if hidden.dim() != 2 or labels.shape != (hidden.shape[0],):
        raise ValueError(
            f"hidden must be [T, D] and labels [T], got {tuple(hidden.shape)} and {tuple(labels.shape)}"
        )
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = hidden @ weight.to(hidden.dtype).T
    if bias is not None:
        logits = logits + bias.to(hidden.dtype)
    labels = labels.to(hidden.device, torch.int64)
    per_token = F.cross_entropy(logits.to(acc), labels, ignore_index=ignore_index, reduction="none")
    token_weight = token_loss_weights(
        labels,
        reduction=reduction,
        seq_idx=None if seq_idx is None else seq_idx.to(hidden.device),
        num_items_in_batch=num_items_in_batch,
        ignore_index=ignore_index,
        loss_scale=None if loss_scale is None else loss_scale.to(hidden.device),
        dtype=acc,
    )
    return (per_token * token_weight).sum()
