"""One rank's share of a collated packed row under context parallelism: :func:`shard_batch`.

The split is data-exact. What makes it so, in the order it is done:

1. **Labels are shifted before the split.** ``shift_labels[t]`` is the label of token ``t + 1`` when that
   token is in ``t``'s sample, else ``IGNORE_INDEX`` (the last token of a sample never meets the next
   sample's first, and the row's last token has no target). Shifted on the whole row, the targets are then
   cut with the tokens: a rank whose tokens are not contiguous (the zigzag split) still scores each
   prediction against its true next token, which a shift after the split would not (it would pair the last
   token of one chunk with the first token of the next chunk the rank holds). ``loss_scale`` is shifted with
   the labels (``shift_loss_scale``).
2. **Token-aligned fields are cut with the tokens**: ``input_ids``, ``token_type_ids``,
   ``mm_token_type_ids`` and the ``position_ids`` (``[1, T]`` or every plane of ``[P, 1, T]``, mRoPE
   included): each token keeps the position it has in the whole row.
3. **The row's boundaries and media stay whole**: ``varlen_meta`` (and its ``cu_seq_lens_q/k`` /
   ``max_length_q/k`` view) describe the whole row, which the mixing layers rebuild for the heads they own;
   the media (``pixel_values``, grids) stay whole so that the vision tower runs on every image before the
   split (:mod:`varpack.integrations.context_parallel`) and each rank keeps the feature rows of its own
   placeholder tokens.

The shard carries the split itself under ``cp_shard`` (:class:`varpack.varlen.shard.ContextParallelShard`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from varpack.schema import (
    CP_SHARD,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    LOSS_SCALE,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    MEDIA_FIELDS,
    MM_TOKEN_TYPE_IDS,
    NUM_PACKS,
    POSITION_IDS,
    SAMPLE_IDS,
    SEQ_IDX,
    SHIFT_LABELS,
    SHIFT_LOSS_SCALE,
    TOKEN_TYPE_IDS,
    VARLEN_META,
)
from varpack.varlen.meta import VarlenMeta
from varpack.varlen.shard import ContextParallelShard

__all__ = ["shard_batch", "shifted_targets"]

#: ``[1, T]`` fields cut with the tokens
_CUT = (INPUT_IDS, TOKEN_TYPE_IDS, MM_TOKEN_TYPE_IDS)
#: fields kept whole (the row's boundaries, media, bookkeeping)
_WHOLE = (CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K, VARLEN_META, SAMPLE_IDS, NUM_PACKS)
#: fields used up here (the shifted targets replace them; seq_idx is the meta's view)
_CONSUMED = (LABELS, LOSS_SCALE, SEQ_IDX)


def shifted_targets(
    labels: torch.Tensor, seq_idx: torch.Tensor, loss_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next-token targets of a packed row, shifted inside each sample: ``(shift_labels, shift_loss_scale)``.

    Args:
        labels: ``[1, T]`` int64 (``IGNORE_INDEX`` where not supervised).
        seq_idx: ``[1, T]`` sample index of every token.
        loss_scale: optional ``[1, T]`` float weight aligned with ``labels``.

    Returns:
        ``shift_labels [1, T]`` int64 (``labels[t + 1]`` when token ``t + 1`` is in ``t``'s sample, else
        ``IGNORE_INDEX``; the last token ``IGNORE_INDEX``) and ``shift_loss_scale [1, T]`` float32 (``loss_scale``
        shifted the same way, 0 where there is no target) or ``None``.

    Example:
        >>> shifted_targets(torch.tensor([[-100, 5, 6, -100, 7]]), torch.tensor([[0, 0, 0, 1, 1]]))[0].tolist()
        [[5, 6, -100, 7, -100]]
    """
    if labels.shape != seq_idx.shape or labels.dim() != 2 or labels.shape[0] != 1:
        raise ValueError(
            f"labels {tuple(labels.shape)} and seq_idx {tuple(seq_idx.shape)} must both be one row [1, T]"
        )
    same = seq_idx[:, 1:] == seq_idx[:, :-1]
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, :-1] = torch.where(same, labels[:, 1:], torch.full_like(labels[:, 1:], IGNORE_INDEX))
    scale = None
    if loss_scale is not None:
        if loss_scale.shape != labels.shape:
            raise ValueError(
                f"loss_scale {tuple(loss_scale.shape)} does not match labels {tuple(labels.shape)}"
            )
        scale = torch.zeros(labels.shape, dtype=torch.float32)
        scale[:, :-1] = torch.where(same, loss_scale[:, 1:].float(), torch.zeros_like(scale[:, 1:]))
    return out, scale


def shard_batch(
    batch: Mapping[str, Any], rank: int, size: int, *, split: str = "zigzag", keep_input_ids: bool = False
) -> dict[str, Any]:
    """The share of context-parallel rank ``rank`` of a collated packed row (module docstring).

    Args:
        batch: a :class:`varpack.collate.PaddingFreeCollator` batch of one row (CPU tensors): ``input_ids``,
            ``labels``, ``position_ids``, ``varlen_meta`` (CPU offsets), optional ``loss_scale``,
            ``token_type_ids``, ``mm_token_type_ids``, media, ``sample_ids`` / ``num_packs``.
        rank: this rank's index in the context-parallel group.
        size: ranks in the group (``1``: the batch is returned as a shard of one rank, every token its own).
        split: ``"zigzag"`` (load-balanced, the default) or ``"contiguous"``
            (:data:`varpack.varlen.shard.CONTEXT_PARALLEL_SPLITS`).
        keep_input_ids: keep the whole row's ``input_ids`` on the shard (``full_input_ids``): needed by a
            vision-language model (which rank holds which image feature); set automatically when the batch
            has media.

    Returns:
        A new dict: ``input_ids`` / ``position_ids`` / ``token_type_ids`` / ``mm_token_type_ids`` of this
        rank (``[1, T_r]``, ``[P, 1, T_r]``), ``shift_labels`` ``[1, T_r]``, ``shift_loss_scale`` (when
        ``loss_scale`` was given), ``cp_shard``, and the whole row's boundaries, media and bookkeeping.
        ``labels``, ``loss_scale`` and ``seq_idx`` are not in it (a loss that shifted them again would be
        wrong: the split is not contiguous).

    Raises:
        ValueError: a batch of more than one row, without ``varlen_meta`` / ``labels``, a row of fewer tokens
            than ranks, or a key this function does not know how to split (named; nothing is passed on uncut).
    """
    unknown = sorted(k for k in batch if k not in _CUT + _WHOLE + _CONSUMED + MEDIA_FIELDS + (POSITION_IDS,))
    if unknown:
        raise ValueError(
            f"shard_batch does not know how to split the batch keys {unknown} over context-parallel ranks "
            "(token-aligned fields would stay whole); drop them or split them yourself"
        )
    meta = batch.get(VARLEN_META)
    if not isinstance(meta, VarlenMeta):
        raise ValueError("shard_batch needs the collator's varlen_meta (the whole row's boundaries)")
    if LABELS not in batch:
        raise ValueError(
            "shard_batch needs labels: the targets are shifted on the whole row before the split"
        )
    ids = batch[INPUT_IDS]
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] != meta.total_q:
        raise ValueError(
            f"shard_batch takes one packed row: input_ids {tuple(ids.shape)} with varlen_meta over {meta.total_q} tokens"
        )
    has_media = any(batch.get(k) is not None for k in MEDIA_FIELDS)
    full_ids = ids[0].clone() if (keep_input_ids or has_media) else None
    shard = ContextParallelShard.from_offsets(
        meta.host_offsets()[0], size, rank, split=split, full_input_ids=full_ids
    )
    seq_idx = batch[SEQ_IDX] if batch.get(SEQ_IDX) is not None else meta.seq_idx()
    targets, scale = shifted_targets(batch[LABELS], seq_idx.to(batch[LABELS].device), batch.get(LOSS_SCALE))
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in _CUT:
            out[key] = shard.take(value, dim=-1)
        elif key == POSITION_IDS:
            out[key] = shard.take(value, dim=-1)  # [1, T] or [P, 1, T]: every plane cut with the tokens
        elif key in _WHOLE or key in MEDIA_FIELDS:
            out[key] = value
    out[SHIFT_LABELS] = shard.take(targets, dim=-1)
    if scale is not None:
        out[SHIFT_LOSS_SCALE] = shard.take(scale, dim=-1)
    out[CP_SHARD] = shard
    return out
