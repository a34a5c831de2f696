"""The field names and constants of an encoded sample and of a collated batch, defined once.

Every stage reads its names from here: the encoders (``varpack.data``) write an *encoded sample*, the
planner/dataset (``varpack.data.dataset``) cuts pieces of it, the collator (``varpack.collate``) turns packs of
samples into one *collated batch*, and the model side (``varpack.integrations``, ``varpack.loss``,
``varpack.ops.linear_ce``, ``varpack.train``, ``varpack.check``) splits that batch into model inputs, boundary
kwargs and loss fields. The layouts are drawn in docs/ARCHITECTURE.md ("Encoded sample", "Collated batch").

This module imports nothing (no torch, no numpy) so the CLI parsers and ``import varpack`` stay fast.
"""

from __future__ import annotations

__all__ = [
    "ATTENTION_MASK",
    "BATCH_STATS",
    "BOOKKEEPING_BATCH_KEYS",
    "BOUNDARY_KEYS",
    "CP_SHARD",
    "CU_SEQ_LENS_K",
    "CU_SEQ_LENS_Q",
    "FLASH_ATTN_KWARGS",
    "FLAT_TOKEN_FIELDS",
    "IGNORE_INDEX",
    "IMAGE_FIELDS",
    "IMAGE_GRID_THW",
    "INPUT_IDS",
    "LABELS",
    "LENGTH",
    "LOSS_FIELDS",
    "LOSS_SCALE",
    "MAX_LENGTH_K",
    "MAX_LENGTH_Q",
    "MEDIA_FIELDS",
    "MEDIA_PAIRS",
    "MM_TOKEN_TYPE_IDS",
    "NOT_MODEL_INPUTS",
    "NUM_PACKS",
    "PIXEL_VALUES",
    "PIXEL_VALUES_VIDEOS",
    "POSITION_IDS",
    "SAMPLE_BOOKKEEPING_FIELDS",
    "SAMPLE_ID",
    "SAMPLE_IDS",
    "SECOND_PER_GRID_TS",
    "SEQ_IDX",
    "SHIFT_LABELS",
    "SHIFT_LOSS_SCALE",
    "VARLEN_META",
    "TOKEN_ALIGNED_FIELDS",
    "TOKEN_FIELDS",
    "TOKEN_TYPE_IDS",
    "VIDEO_FIELDS",
    "VIDEO_GRID_THW",
]

# ------------------------------------------------------------------------------------------- the label
#: label of a token that is not supervised (prompt tokens, padding, and every sample's first token, whose
#: predecessor lies in another sample). Written by the encoders (``labels[0]`` of every sample and piece),
#: checked by the collator, skipped by ``varpack.loss`` / ``varpack.ops.linear_ce``. Same value as
#: ``torch.nn.functional.cross_entropy``'s default ``ignore_index`` and transformers' ``-100``.
IGNORE_INDEX: int = -100

# ------------------------------------------------------------------------------ token-aligned fields
#: token ids, ``L`` ints per sample; collated to ``[1, T]`` int64. Written by the encoders.
INPUT_IDS = "input_ids"
#: next-token targets aligned with ``input_ids`` (``IGNORE_INDEX`` where not supervised, always at
#: ``labels[0]``); collated to ``[1, T]`` int64, shifted inside the sample by the loss. Not a model input.
LABELS = "labels"
#: optional per-token loss weight (float, ``L`` per sample), collated to ``[1, T]`` float32; read by the loss.
LOSS_SCALE = "loss_scale"
#: optional per-token segment ids (BERT-style), ``L`` ints; collated to ``[1, T]`` int64.
TOKEN_TYPE_IDS = "token_type_ids"
#: Qwen-VL modality of each token (0 text, 1 image, 2 video); written by ``encode.multimodal``, collated to
#: ``[1, T]`` int64 (zeros for text-only samples), read by the mRoPE index function.
MM_TOKEN_TYPE_IDS = "mm_token_type_ids"
#: optional all-ones mask on a sample (a padding-free sample has no padding); the collator checks it and
#: never emits it.
ATTENTION_MASK = "attention_mask"
#: position ids: built by the collator (``[1, T]``, restarting at 0 per sample) or given by a sample as
#: mRoPE planes ``[P, L]`` (token axis last), then collated to ``[P, 1, T]``.
POSITION_IDS = "position_ids"

#: 1-D token fields that the collator concatenates into ``[1, T]`` rows (in this order), all of a sample's
#: length ``L``; ``input_ids`` and ``labels`` are required, the others optional.
TOKEN_FIELDS: tuple[str, ...] = (INPUT_IDS, LABELS, LOSS_SCALE, TOKEN_TYPE_IDS, MM_TOKEN_TYPE_IDS)
#: every 1-D field with one entry per token (:data:`TOKEN_FIELDS` and ``attention_mask``): sliced as
#: ``value[start:stop]`` when an overlong sample is cut into pieces.
FLAT_TOKEN_FIELDS: tuple[str, ...] = TOKEN_FIELDS + (ATTENTION_MASK,)
#: every field with a token axis (:data:`FLAT_TOKEN_FIELDS` and ``position_ids``, whose token axis is the
#: last one): cut together when a piece is taken from a sample (``varpack.data.dataset``).
TOKEN_ALIGNED_FIELDS: tuple[str, ...] = FLAT_TOKEN_FIELDS + (POSITION_IDS,)

# -------------------------------------------------------------------------------------- media fields
#: image patches ``[patches, features]`` (Qwen-VL processor layout), concatenated along dim 0 in pack order.
PIXEL_VALUES = "pixel_values"
#: one ``(t, h, w)`` int row per image ``[images, 3]``; ``t * h * w`` rows of ``pixel_values`` each.
IMAGE_GRID_THW = "image_grid_thw"
#: video patches ``[patches, features]``, concatenated along dim 0 in pack order.
PIXEL_VALUES_VIDEOS = "pixel_values_videos"
#: one ``(t, h, w)`` int row per video ``[videos, 3]``; ``t * h * w`` rows of ``pixel_values_videos`` each.
VIDEO_GRID_THW = "video_grid_thw"
#: Qwen2.5-VL: seconds per temporal grid, one float per video (collated to a float32 ``[videos]`` tensor).
SECOND_PER_GRID_TS = "second_per_grid_ts"

#: media fields of a sample, concatenated by the collator along dim 0 in pack order (written by
#: ``encode.multimodal``, consumed by the vision tower and the mRoPE index function).
MEDIA_FIELDS: tuple[str, ...] = (
    PIXEL_VALUES,
    IMAGE_GRID_THW,
    PIXEL_VALUES_VIDEOS,
    VIDEO_GRID_THW,
    SECOND_PER_GRID_TS,
)
#: ``(pixels, grid)`` of images: the grid's rows give the number of patch rows of the pixels.
IMAGE_FIELDS: tuple[str, str] = (PIXEL_VALUES, IMAGE_GRID_THW)
#: ``(pixels, grid)`` of videos.
VIDEO_FIELDS: tuple[str, str] = (PIXEL_VALUES_VIDEOS, VIDEO_GRID_THW)
#: every ``(pixels, grid)`` pair (images, then videos); checked together by the collator, the piece cutter and
#: the vision isolation.
MEDIA_PAIRS: tuple[tuple[str, str], ...] = (IMAGE_FIELDS, VIDEO_FIELDS)

# ------------------------------------------------------------------------------------ boundary keys
#: ``[N + 1]`` int32 sample starts in the flat row (``cu_seqlens``), built by the collator on the CPU;
#: transformers' ``FlashAttentionKwargs`` name, handed to every attention layer.
CU_SEQ_LENS_Q = "cu_seq_lens_q"
#: same tensor as ``cu_seq_lens_q`` (self-attention).
CU_SEQ_LENS_K = "cu_seq_lens_k"
#: the longest segment (``max_seqlen``), a Python int.
MAX_LENGTH_Q = "max_length_q"
#: same as ``max_length_q``.
MAX_LENGTH_K = "max_length_k"
#: ``[1, T]`` int32 segment index of every token (0..N-1); read by gated delta, short conv and the loss.
SEQ_IDX = "seq_idx"
#: the batch's :class:`varpack.varlen.VarlenMeta` (built once by the collator): the boundaries every
#: consumer reads; the four ``FlashAttentionKwargs`` above are a view of it.
VARLEN_META = "varlen_meta"

#: transformers' ``FlashAttentionKwargs`` boundary keys, as the collator emits them; any of them present in
#: a model call means "this batch is packed" to the packing guard.
FLASH_ATTN_KWARGS: tuple[str, ...] = (CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K)
#: every boundary key of a collated batch (:data:`FLASH_ATTN_KWARGS`, ``seq_idx``, ``varlen_meta``): dropped for an
#: unpacked forward, and kept away from a vision tower (they describe the text stream).
BOUNDARY_KEYS: tuple[str, ...] = FLASH_ATTN_KWARGS + (SEQ_IDX, VARLEN_META)

# ------------------------------------------------------------------------- context-parallel shard keys
#: the :class:`varpack.varlen.shard.ContextParallelShard` of a context-parallel shard of a collated batch
#: (``varpack.collate.shard_batch``): which tokens of the packed row this rank holds. Beside it the shard
#: keeps the WHOLE row's boundaries (``varlen_meta``, ``cu_seq_lens_q/k``, ``max_length_q/k``), media and
#: ``sample_ids``; token-aligned fields hold this rank's tokens only.
CP_SHARD = "cp_shard"
#: a context-parallel shard's next-token targets ``[1, T_r]`` int64: the row's labels shifted inside each
#: sample BEFORE the split (``shift_labels[t] = labels[t + 1]`` when token t + 1 is in t's sample, else
#: ``IGNORE_INDEX``), then cut with the tokens; the loss does not shift them again (transformers' name).
SHIFT_LABELS = "shift_labels"
#: a context-parallel shard's per-token loss weight ``[1, T_r]`` float32, aligned with ``shift_labels``
#: (``loss_scale`` shifted with the labels before the split).
SHIFT_LOSS_SCALE = "shift_loss_scale"

# ----------------------------------------------------------------------------------- non-model keys
#: per-sample id (an int, the row of the source data); carried by samples and pieces, named in errors.
SAMPLE_ID = "sample_id"
#: a sample's token count (an int); written by the encoders, read by the planner.
LENGTH = "length"
#: per-sample bookkeeping fields that the collator drops (never reach the model): ``length``,
#: ``sample_id``, the raw ``source`` / ``messages``, and a piece's ``piece_id`` / ``piece_range``.
SAMPLE_BOOKKEEPING_FIELDS: frozenset[str] = frozenset(
    {LENGTH, SAMPLE_ID, "source", "messages", "piece_id", "piece_range"}
)
#: the collated batch's list of its samples' ``sample_id`` (pack order), for reports and errors.
SAMPLE_IDS = "sample_ids"
#: packs in the batch (an int), added by ``train.TrainCollator`` for the pack-fill log.
NUM_PACKS = "num_packs"
#: the batch's counts as Python ints, added by ``train.TrainCollator`` on the CPU for the per-step logs:
#: ``{"packs", "samples", "tokens", "supervised_tokens"}`` (``tokens``: real tokens, padding excluded;
#: ``supervised_tokens``: labels != IGNORE_INDEX).
BATCH_STATS = "batch_stats"
#: batch keys kept for bookkeeping only (neither model input nor loss input).
BOOKKEEPING_BATCH_KEYS: tuple[str, ...] = (SAMPLE_IDS, NUM_PACKS, BATCH_STATS)
#: batch fields read by the loss, not by the model's forward.
LOSS_FIELDS: tuple[str, ...] = (LABELS, LOSS_SCALE, SHIFT_LABELS, SHIFT_LOSS_SCALE)
#: batch keys removed before ``model(**batch)`` (loss fields and bookkeeping).
NOT_MODEL_INPUTS: tuple[str, ...] = LOSS_FIELDS + BOOKKEEPING_BATCH_KEYS
