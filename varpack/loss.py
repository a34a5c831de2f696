"""Causal-LM loss for packed (padding-free) batches: token mean or sample mean, exact w.r.t. unpacked.

The collated batch is one flat row (``[1, T]``) holding N samples back to back. The loss shifts *within the
row* (logits at token t predict label t + 1). That shift would let the last token of sample n predict the
first token of sample n + 1, but the encoder sets every sample's first label to ``-100`` (ARCHITECTURE.md,
"Encoded sample"), so that prediction is never scored. When ``seq_idx`` is given, predictions whose target
lies in another sample are additionally masked out (defence in depth: correct even if a first label is not
``-100``).

Two reductions:

* ``"token"``: sum of per-token cross entropies over all supervised tokens divided by their count, the
  count being ``num_items_in_batch`` when given. Hugging Face ``Trainer`` passes ``num_items_in_batch`` = the
  number of supervised tokens in the whole optimizer step (all gradient-accumulation micro-batches, and all
  ranks with ``average_tokens_across_devices``), so the step's gradient is that of the global token mean, as
  if the whole step were one batch (transformers' fix of the gradient-accumulation loss bug,
  ``ForCausalLMLoss``).
* ``"sample"``: mean cross entropy per sample, then the mean over samples. A "sample" is a segment of the
  stream (one ``seq_idx`` value): a piece of a sample split across packs (``overflow="split"``) counts as its
  own sample; segments without supervised tokens (e.g. the pad segment) are not counted. The accumulation
  semantics mirror ``"token"``: ``num_items_in_batch`` is then the number of *samples with at least one
  supervised token* in the whole optimizer step, so the step's gradient is that of the global sample mean
  (:func:`count_loss_items` counts it; ``varpack.train`` passes it).

Cross entropy is computed in float32 whatever the logits' dtype. No value is read back to the host (no
``.item()``): the loss is safe inside a CUDA-graph / sync-debug region.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from varpack.schema import IGNORE_INDEX

__all__ = ["causal_lm_loss", "count_loss_items", "count_loss_items_tensor", "shifted_lm_loss"]

Reduction = Literal["token", "sample"]


def _as_rows(x: torch.Tensor, name: str, ndim_row: int) -> torch.Tensor:
    """``[T, ...]`` -> ``[1, T, ...]``; ``[B, T, ...]`` unchanged."""
    if x.dim() == ndim_row:
        return x.unsqueeze(0)
    if x.dim() == ndim_row + 1:
        return x
    raise ValueError(f"{name} must have {ndim_row} or {ndim_row + 1} dims, got shape {tuple(x.shape)}")


def _shifted_targets(
    labels: torch.Tensor, seq_idx: torch.Tensor | None, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Targets ``labels[:, 1:]``, the validity mask of each prediction, and the target's global segment id.

    Returns ``(targets [B, T-1], valid [B, T-1] bool, segment [B, T-1] int64 or None)``; segment ids are made
    unique across rows (row * T + seq_idx) so that rows never merge.
    """
    targets = labels[:, 1:]
    valid = targets != ignore_index
    segment = None
    if seq_idx is not None:
        rows, t = seq_idx.shape
        same = seq_idx[:, 1:] == seq_idx[:, :-1]
        valid = valid & same
        offset = torch.arange(rows, device=seq_idx.device, dtype=torch.int64).unsqueeze(1) * t
        segment = seq_idx[:, 1:].to(torch.int64) + offset
    return targets, valid, segment


def _check_shapes(
    logits: torch.Tensor,
    labels: torch.Tensor,
    seq_idx: torch.Tensor | None,
    loss_scale: torch.Tensor | None,
) -> None:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match labels shape {tuple(labels.shape)} "
            "(expected logits [B, T, V] and labels [B, T])"
        )
    for name, t in (("seq_idx", seq_idx), ("loss_scale", loss_scale)):
        if t is not None and t.shape != labels.shape:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} does not match labels shape {tuple(labels.shape)}"
            )


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    reduction: Reduction = "token",
    seq_idx: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | float | None = None,
    ignore_index: int = IGNORE_INDEX,
    loss_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token cross entropy of a packed (or ordinary) causal-LM batch.

    Args:
        logits: ``[B, T, V]`` or ``[T, V]``, any float dtype (upcast to float32 here). B = 1 for a packed batch.
        labels: ``[B, T]`` or ``[T]`` int64; ``ignore_index`` marks unsupervised tokens. Each sample's first
            label must be ``ignore_index`` (the encoder guarantees it) unless ``seq_idx`` is given.
        reduction: ``"token"`` (mean over supervised tokens) or ``"sample"`` (mean per sample, then over
            samples; needs ``seq_idx``). See the module docstring for the gradient-accumulation semantics.
        seq_idx: ``[B, T]`` or ``[T]`` integer sample index of every token (collator output). Required for
            ``"sample"``; for ``"token"`` it masks predictions that would cross a sample boundary.
        num_items_in_batch: the denominator for the whole optimizer step: supervised tokens (``"token"``) or
            samples with a supervised token (``"sample"``). ``None``: this batch's own count. 0 (a step
            with nothing supervised) divides by 1, a Python number or a tensor alike (:func:`loss_denominator`).
        ignore_index: label value that is not scored.
        loss_scale: optional ``[B, T]`` float per-token weight aligned with ``labels`` (weight of predicting
            label t); weighted tokens still count 1 in the denominator.

    Returns:
        A float32 scalar tensor. 0 (with a graph to ``logits``) when nothing is supervised and no
        ``num_items_in_batch`` is given.

    Raises:
        ValueError: mismatched shapes, an unknown ``reduction``, or ``"sample"`` without ``seq_idx``.

    Source: the shift-and-flatten causal LM loss of transformers' ``ForCausalLMLoss`` (token mean,
    ``num_items_in_batch``); the per-sample mean follows the "sample"-level loss averaging discussed in
    LLaMA-Factory / ms-swift packing docs.
    """
    if reduction not in ("token", "sample"):
        raise ValueError(f"reduction must be 'token' or 'sample', got {reduction!r}")
    logits = _as_rows(logits, "logits", 2)
    labels = _as_rows(labels, "labels", 1)
    if seq_idx is not None:
        seq_idx = _as_rows(seq_idx, "seq_idx", 1)
    if loss_scale is not None:
        loss_scale = _as_rows(loss_scale, "loss_scale", 1)
    _check_shapes(logits, labels, seq_idx, loss_scale)
    if reduction == "sample" and seq_idx is None:
        raise ValueError(
            "reduction='sample' needs seq_idx (the sample index of every token, from the collator)"
        )

    labels = labels.to(logits.device)
    if seq_idx is not None:
        seq_idx = seq_idx.to(logits.device)
    targets, valid, segment = _shifted_targets(labels, seq_idx, ignore_index)
    vocab = logits.shape[-1]
    pred = logits[:, :-1, :].reshape(-1, vocab).float()
    scored = torch.where(valid, targets, torch.full_like(targets, ignore_index)).reshape(-1)
    per_token = F.cross_entropy(pred, scored, reduction="none", ignore_index=ignore_index)  # 0 where ignored
    weight = valid.reshape(-1).to(per_token.dtype)
    if loss_scale is not None:
        weight = weight * loss_scale[:, 1:].to(logits.device, torch.float32).reshape(-1)
    per_token = per_token * weight

    if reduction == "token":
        total = per_token.sum()
        if num_items_in_batch is None:
            count = valid.sum().to(torch.float32)
            return total / count.clamp(min=1.0)
        return total / loss_denominator(num_items_in_batch, total.device)

    # "sample": per-segment mean, then mean over segments that have a supervised token.
    assert segment is not None
    flat_seg = segment.reshape(-1)
    num_slots = labels.shape[0] * labels.shape[1]  # an upper bound on segment ids, known without a sync
    sums = per_token.new_zeros(num_slots).index_add(0, flat_seg, per_token)
    counts = per_token.new_zeros(num_slots).index_add(0, flat_seg, valid.reshape(-1).to(per_token.dtype))
    per_sample = sums / counts.clamp(min=1.0)
    total = per_sample.sum()
    if num_items_in_batch is None:
        num_samples = (counts > 0).sum().to(torch.float32)
        return total / num_samples.clamp(min=1.0)
    return total / loss_denominator(num_items_in_batch, total.device)


def shifted_lm_loss(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    num_items_in_batch: torch.Tensor | int | float | None = None,
    loss_scale: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Token-mean cross entropy against targets that are already shifted: ``logits[t]`` predicts
    ``shift_labels[t]``, nothing is shifted here.

    The loss of a context-parallel shard (:func:`varpack.collate.shard_batch`): the labels were shifted inside
    each sample on the whole row before the split, so a rank holding non-contiguous tokens scores each one
    against its true next token. Summed over the ranks of the step and divided by the step's global count of
    supervised tokens (``num_items_in_batch``), it is the one-process token mean.

    Args:
        logits: ``[B, T, V]`` or ``[T, V]``, any float dtype (upcast to float32).
        shift_labels: ``[B, T]`` or ``[T]`` int64 targets (``ignore_index`` where none).
        num_items_in_batch: the denominator (supervised tokens of the whole step, over every rank); ``None``:
            this call's own count.
        loss_scale: optional ``[B, T]`` float weight aligned with ``shift_labels``.
        ignore_index: the label value that is not scored.

    Returns:
        A float32 scalar tensor.

    Raises:
        ValueError: mismatched shapes.
    """
    logits = _as_rows(logits, "logits", 2)
    shift_labels = _as_rows(shift_labels, "shift_labels", 1)
    if loss_scale is not None:
        loss_scale = _as_rows(loss_scale, "loss_scale", 1)
    _check_shapes(logits, shift_labels, None, loss_scale)
    targets = shift_labels.to(logits.device).reshape(-1)
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets, reduction="none", ignore_index=ignore_index
    )
    if loss_scale is not None:
        per_token = per_token * loss_scale.to(logits.device, torch.float32).reshape(-1)
    total = per_token.sum()
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum().to(torch.float32).clamp(min=1.0)
    return total / loss_denominator(num_items_in_batch, total.device)


def loss_denominator(
    num_items: torch.Tensor | int | float, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``num_items_in_batch`` as a 0-d ``dtype`` tensor on ``device``: the divisor of a whole optimizer step
    (HF Trainer semantics), shared by :func:`causal_lm_loss`, :func:`varpack.ops.linear_ce.linear_cross_entropy`
    and the DPO objective.

    One rule for a Python number and a tensor: a count of 0 divides by 1. A step with no supervised item at
    all (e.g. only prompt pieces of split samples, or masked filler packs) has a zero numerator too, so its
    loss is 0 with zero gradients rather than 0/0 = NaN poisoning every weight. A tensor is clamped to >= 1
    (reading it would be a host sync); a negative Python number, which no count can be, is refused.

    No host sync: a Python number (or a one-element CPU tensor, read on the host) becomes a fill on ``device``
    (``torch.full``), never a copy from pageable host memory, which CUDA performs only after the stream has
    drained; a tensor already on ``device`` stays there.

    Raises:
        TypeError: not an int, float or tensor.
        ValueError: a negative or non-finite Python number or host tensor going to another device.
    """
    if isinstance(num_items, torch.Tensor):
        if num_items.device.type != "cpu" or torch.device(device).type == "cpu" or num_items.numel() != 1:
            return num_items.to(device=device, dtype=dtype).reshape(()).clamp_min(1.0)
        num_items = num_items.item()  # a host value: filled on the device below instead of copied
    if isinstance(num_items, bool) or not isinstance(num_items, (int, float)):
        raise TypeError(f"num_items_in_batch must be an int, float or tensor, got {type(num_items).__name__}")
    if not (num_items >= 0 and math.isfinite(num_items)):
        raise ValueError(f"num_items_in_batch must be a count >= 0, got {num_items}")
    return torch.full((), max(float(num_items), 1.0), device=device, dtype=dtype)


def count_loss_items(
    labels: torch.Tensor,
    *,
    reduction: Reduction = "token",
    seq_idx: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> int:
    """The denominator :func:`causal_lm_loss` uses for one batch: supervised predictions (``"token"``) or
    segments with at least one supervised prediction (``"sample"``). Sum it over the micro-batches (and
    ranks) of an optimizer step and pass the sum as ``num_items_in_batch``.

    Reads tensor values: call it on CPU batches (the collator's output) to avoid a device sync.

    Raises:
        ValueError: ``"sample"`` without ``seq_idx``; an unknown ``reduction``.
    """
    return int(count_loss_items_tensor(labels, reduction=reduction, seq_idx=seq_idx, ignore_index=ignore_index))


def count_loss_items_tensor(
    labels: torch.Tensor,
    *,
    reduction: Reduction = "token",
    seq_idx: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """:func:`count_loss_items` as a 0-d int64 tensor on ``labels``' device, computed without reading any
    value back to the host (safe on GPU batches inside a training step).

    Raises:
        ValueError: ``"sample"`` without ``seq_idx``; an unknown ``reduction``.
    """
    if reduction not in ("token", "sample"):
        raise ValueError(f"reduction must be 'token' or 'sample', got {reduction!r}")
    labels = _as_rows(labels, "labels", 1)
    if seq_idx is not None:
        seq_idx = _as_rows(seq_idx, "seq_idx", 1).to(labels.device)
    if reduction == "sample" and seq_idx is None:
        raise ValueError("reduction='sample' needs seq_idx")
    _, valid, segment = _shifted_targets(labels, seq_idx, ignore_index)
    if reduction == "token":
        return valid.sum()
    assert segment is not None
    slots = torch.zeros(labels.numel(), dtype=torch.int64, device=labels.device)
    slots.index_add_(0, segment.reshape(-1), valid.reshape(-1).to(torch.int64))
    return (slots > 0).sum()
