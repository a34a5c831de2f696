"""Padding-free collation: a batch of packs (or plain samples) -> ONE flat token row plus boundary metadata.

The output follows docs/ARCHITECTURE.md ("Collated batch"); the boundary key names are transformers'
``FlashAttentionKwargs`` (``cu_seq_lens_q/k``, ``max_length_q/k``), so HF models hand them unchanged to every
attention layer. Anchors read for the behaviour: transformers' ``DataCollatorWithFlattening`` (same keys, but
it builds Python lists token by token and pads nothing), TRL's padding-free ``DataCollatorForLanguageModeling``
and axolotl#2739 (padding as one segment rather than many 1-token segments).
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from varpack.collate.static import StaticShape
from varpack.schema import (
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    LOSS_SCALE,
    MEDIA_FIELDS,
    MEDIA_PAIRS,
    MM_TOKEN_TYPE_IDS,
    SAMPLE_BOOKKEEPING_FIELDS,
    SEQ_IDX,
    VARLEN_META,
)
from varpack.schema import TOKEN_FIELDS as _TOKEN_FIELD_NAMES
from varpack.varlen.meta import VarlenMeta

__all__ = [
    "IGNORED_FIELDS",
    "MEDIA_FIELDS",
    "TOKEN_FIELDS",
    "PaddingFreeCollator",
]

#: token-aligned fields known to varpack (:data:`varpack.schema.TOKEN_FIELDS`) and their output dtype (numpy);
#: every one has the sample's length
TOKEN_FIELDS: dict[str, type] = {f: np.float32 if f == LOSS_SCALE else np.int64 for f in _TOKEN_FIELD_NAMES}
#: per-sample bookkeeping fields that never reach the model (:data:`varpack.schema.SAMPLE_BOOKKEEPING_FIELDS`)
IGNORED_FIELDS: frozenset[str] = SAMPLE_BOOKKEEPING_FIELDS

_STRUCT_CODES: dict[type, str] = {np.int64: "q", np.float32: "f"}


def _is_sample(x: Any) -> bool:
    return type(x) is dict or isinstance(x, Mapping)


def _flatten(features: Sequence[Any]) -> list[Mapping[str, Any]]:
    if isinstance(features, Mapping):
        raise TypeError(
            "PaddingFreeCollator takes a list of packs (lists of sample dicts) or a list of sample dicts, "
            f"got one {type(features).__name__}; wrap it in a list"
        )
    if len(features) == 0:
        raise ValueError("PaddingFreeCollator received an empty batch (no packs, no samples)")
    samples: list[Mapping[str, Any]] = []
    for i, item in enumerate(features):
        if _is_sample(item):
            samples.append(item)
        elif isinstance(item, (list, tuple)):
            for j, sample in enumerate(item):
                if not _is_sample(sample):
                    raise TypeError(f"pack {i} item {j} is a {type(sample).__name__}, expected a sample dict")
                samples.append(sample)
        else:
            raise TypeError(
                f"batch item {i} is a {type(item).__name__}; expected a sample dict or a pack (list of dicts)"
            )
    if not samples:
        raise ValueError(f"PaddingFreeCollator received {len(features)} packs with no samples in them")
    return samples


def _name(sample_ids: list[Any], i: int) -> str:
    """How an error names sample ``i`` of the flattened batch: its ``sample_id`` and its index."""
    sid = sample_ids[i]
    return (
        f"sample {sid} (#{i} of the batch)" if sid is not None else f"sample #{i} of the batch (no sample_id)"
    )


def _batch_name(sample_ids: list[Any], limit: int = 6) -> str:
    """How an error names a whole batch: its sample ids (the first few) and count."""
    shown = ", ".join(str(s) for s in sample_ids[:limit]) + (", ..." if len(sample_ids) > limit else "")
    return f"the batch of {len(sample_ids)} samples (sample_id {shown})"


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _seq_len(value: Any) -> int:
    """Length along the token axis of a 1-D token field (tensor, array, list or tuple); ``-1`` for anything
    else (a scalar, ``None``, a string, an array or tensor that is not 1-D)."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return int(value.shape[0]) if value.ndim == 1 else -1
    if isinstance(value, (list, tuple)):
        return len(value)
    return -1


def _describe(value: Any) -> str:
    """What a token field holds instead of a 1-D sequence (for error messages)."""
    if value is None:
        return "is None"
    if isinstance(value, (torch.Tensor, np.ndarray)):
        shape = tuple(value.shape)
        if len(shape) == 1:
            return f"has length {shape[0]}"
        return f"is a scalar {type(value).__name__} (shape ())" if not shape else f"has shape {shape}"
    if isinstance(value, (list, tuple)):
        return f"has length {len(value)}"
    text, kind = repr(value), type(value).__name__
    article = "an" if kind[:1] in "aeiou" else "a"
    return f"is {article} {kind} ({text[:40]}{'...' if len(text) > 40 else ''})"


def _lengths_of(values: list[Any]) -> np.ndarray:
    """Token count of each value (``-1`` for an array or tensor that is not 1-D), as int64 ``[len(values)]``."""
    if all(type(v) is list for v in values):
        return np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    if all(type(v) is np.ndarray and v.ndim == 1 for v in values):
        return np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    return np.fromiter(map(_seq_len, values), dtype=np.int64, count=len(values))


def _concat_token_field(values: list[Any], total: int, dtype: type | None) -> np.ndarray:
    """One concatenation for the whole batch: one ``struct.pack`` over lists of Python numbers (it unboxes
    them faster than ``np.fromiter``), or ``np.concatenate`` over arrays / tensors.

    Raises:
        TypeError: an integer field holds non-integers (floats are never truncated silently).
        struct.error / OverflowError / ValueError: values that do not fit ``dtype``.
    """
    if dtype is not None and all(type(v) is list for v in values):
        flat: list[Any] = []
        for v in values:
            flat += v
        try:
            return np.frombuffer(struct.pack(f"={total}{_STRUCT_CODES[dtype]}", *flat), dtype=dtype).copy()
        except struct.error:
            pass  # a float in an int field, an int beyond int64, ...: the checked path below says which
    if all(type(v) is np.ndarray for v in values):  # 1-D already checked by the caller
        out = np.concatenate(values)
    else:
        out = np.concatenate([_as_array(v).reshape(-1) for v in values])
    if out.size != total:  # nested lists ([[1, 2, 3]]): one entry per token is required
        raise ValueError(f"expected one value per token ({total}), got {out.size} values (nested sequences?)")
    if out.dtype.kind not in "biuf":
        raise TypeError(f"expected numbers, got values of dtype {out.dtype}")
    if dtype is not None:
        if np.dtype(dtype).kind in "iu" and out.dtype.kind not in "iub":
            raise TypeError(f"expected integers, got values of dtype {out.dtype}")
        return out.astype(dtype, copy=False)
    if out.dtype.kind == "f":
        return out.astype(np.float32, copy=False)
    if out.dtype.kind in "iu":
        return out.astype(np.int64, copy=False)
    return out


def _bad_values(
    field: str, dtype: type | None, have: list[int], values: list[Any], names: list[Any], exc: Exception
) -> ValueError:
    """Locate the sample whose ``field`` cannot be converted (error path only: one sample at a time)."""
    for i, value in zip(have, values):
        try:
            _concat_token_field([value], _seq_len(value), dtype)
        except (TypeError, ValueError, OverflowError) as err:
            return ValueError(
                f"{_name(names, i)}: field {field!r} cannot be converted to {np.dtype(dtype)}: {err}"
            )
    return ValueError(f"field {field!r} cannot be converted: {type(exc).__name__}: {exc}")


def _length_value(value: Any, names: list[Any], i: int) -> int:
    """A sample's ``length`` bookkeeping field as an int (an integer of any integral type)."""
    if not isinstance(value, (bool, np.bool_)):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise ValueError(
        f"{_name(names, i)}: field 'length' must be an integer token count, but it {_describe(value)}"
    )


def _concat_media(values: list[Any], field: str = "") -> torch.Tensor:
    if field == "second_per_grid_ts":  # as the processor's BatchFeature makes it: float list -> float32
        return torch.cat([torch.as_tensor(v).reshape(-1) for v in values], dim=0)
    tensors = [v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v)) for v in values]
    return torch.cat(tensors, dim=0)


class PaddingFreeCollator:
    """Flatten packs (or plain samples) into one padding-free row with its sample boundaries.

    The input is a list of packs, each a list of sample dicts (what ``PackedDataset`` yields, batched by a
    ``DataLoader``), or a flat list of sample dicts. All samples of all packs become ONE row, in order. A
    sample is an encoded sample (docs/ARCHITECTURE.md): ``input_ids`` and ``labels`` (lists, numpy arrays or
    1-D tensors of length ``L``, ``labels[0] == -100``), optionally ``loss_scale``, ``token_type_ids``,
    ``mm_token_type_ids``, ``attention_mask`` (must be all 1; dropped), ``position_ids`` ``[P, L]`` (or
    ``[L]``), media (``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``,
    ``second_per_grid_ts``),
    bookkeeping that is not passed on (``length`` -- checked against ``len(input_ids)``, ``sample_id``,
    ``source``, ``messages``, ``piece_id``, ``piece_range``), and the fields named in ``extra_fields`` /
    ``media_fields``. Any other field is an error, never silently dropped.

    Output (T tokens, N samples, plus one pad segment when padding is added; B = 1):

    ========================== ============================ ===============================================
    key                        shape / type                 meaning
    ========================== ============================ ===============================================
    ``input_ids``              ``[1, T]`` int64             samples concatenated in order
    ``labels``                 ``[1, T]`` int64             same order; every sample starts with -100
    ``position_ids``           ``[1, T]`` int64 or          restart at 0 for every sample (text plane);
                               ``[P, 1, T]``                ``[P, 1, T]`` when samples carry ``[P, L]``
    ``cu_seq_lens_q`` / ``_k`` ``[N+1]`` int32              ``[0, ..., T]``, strictly increasing (same tensor)
    ``max_length_q`` / ``_k``  Python int                   longest segment
    ``seq_idx``                ``[1, T]`` int32             segment index of every token, ``0..N-1``
    ``varlen_meta``            ``VarlenMeta``               the boundaries above as one validated object,
                                                            read by every consumer (varpack.varlen.meta)
    optional token fields      ``[1, T]``                   ``loss_scale`` float32, ``token_type_ids``,
                                                            ``mm_token_type_ids`` int64, ``extra_fields``
    media                      concatenated on dim 0        ``pixel_values``, ``image_grid_thw``, ...,
                                                            ``second_per_grid_ts`` (one float per video)
    ``sample_ids``             list (length N)              each sample's ``sample_id`` (None if absent)
    ========================== ============================ ===============================================

    Boundaries come from the sample lengths (never re-derived from positions). Samples without
    ``position_ids`` get ``arange(L)`` on every plane; samples without ``mm_token_type_ids`` (text-only beside
    image samples) get zeros. With multi-plane positions the ``text_plane`` of each sample must be exactly
    ``0..L-1``, so that transformers' own boundary rules (``== min`` for FlashAttention kwargs, ``diff != 1``
    for masks) read the same samples as ``cu_seq_lens_q``.

    ``pad_to_multiple_of=m`` appends ONE pad segment of ``n = (-T) % m`` tokens (``input_ids = pad_token_id``,
    positions ``0..n-1`` on every plane, ``labels = -100``, ``loss_scale = 0``, other token fields 0): it is its
    own entry in ``cu_seq_lens_q`` and its own ``seq_idx``, so it attends only to itself; it is never n
    one-token segments (axolotl#2739: many tiny segments inflate the varlen batch size).
    ``sample_ids`` has no entry for it. The output is built with one concatenation per field and
    arange/repeat arithmetic: no per-token Python loop.

    ``static_shape=StaticShape(tokens, segments, max_seqlen)`` (:mod:`varpack.collate.static`) gives every
    row the same shapes instead, as CUDA graphs need: ``T = tokens`` and ``N = segments`` always, the real
    samples followed by ``segments - n`` pad segments (pad tokens as above, split evenly, each at least one
    token unless the shape has ``empty_pads``: then zero-length pad segments, repeated values at the end of
    ``cu_seqlens``), and ``max_length_q/k = max_seqlen`` (a fixed upper bound). A row that
    does not fit raises, naming its samples; nothing is dropped or cut.

    Args:
        pad_to_multiple_of: pad the row length to a multiple of this (``None``: no padding).
        pad_token_id: ``input_ids`` value of the pad segment(s).
        static_shape: a :class:`~varpack.collate.StaticShape`: every row padded to its fixed ``tokens``,
            ``segments`` and ``max_seqlen`` (exclusive with ``pad_to_multiple_of``; ``None``: shapes follow the
            batch).
        position_planes: expected number of position planes ``P``; ``None`` infers it from the samples
            (``[1, T]`` output when no sample carries 2-D ``position_ids``). Setting it forces ``[P, 1, T]``
            output even for text-only batches (e.g. Qwen3-VL's 4 planes).
        text_plane: the plane that restarts per sample (0 for Qwen3-VL's ``[text, t, h, w]`` layout).
        extra_fields: names of additional token-aligned fields to concatenate (int -> int64, float -> float32).
        media_fields: names of additional media fields to concatenate along dim 0.
        ignore_fields: additional per-sample bookkeeping fields to drop (e.g. a dataset's ``id`` column).

    Raises (from ``__init__``): TypeError / ValueError for bad options (``static_shape`` with
    ``pad_to_multiple_of``).

    Raises (from ``__call__``):
        TypeError: the batch is not a list of sample dicts / packs.
        ValueError: a row that does not fit ``static_shape`` (more samples than ``segments``, more tokens
            than ``tokens``, a sample longer than ``max_seqlen``, too few pad tokens for the pad segments:
            :meth:`StaticShape.pad_lengths`), naming the batch's samples; an empty batch; a sample without ``input_ids``/``labels``, with 0 tokens, with a token
            field (``input_ids``, ``labels``, ``loss_scale``, ``token_type_ids``, ``mm_token_type_ids``,
            ``attention_mask``, ``extra_fields``) that is not a 1-D sequence of numbers -- a scalar (``labels=1``
            as in classification rows), ``None``, a string, a nested list, a 2-D array -- or whose length
            differs from ``len(input_ids)``, with ``labels[0] != -100``, with a ``length`` that is not an
            integer or disagrees, with an ``attention_mask`` containing 0, with ``position_ids`` that are not
            integers ``[L]`` / ``[P, L]``, with a text plane that is not ``0..L-1``, with ``position_ids`` of a
            different ``P``; an unknown field; a field present in only some samples (except ``position_ids``,
            ``mm_token_type_ids`` and media); a media field that is not an array with the media along dim 0;
            Qwen-VL media whose patch count disagrees with its grid; ``second_per_grid_ts`` whose length is not
            the sample's video count, or missing from a video sample while others carry it. Each message names
            the sample (its ``sample_id`` and its index in the flattened batch: ``sample 7 (#2 of the batch)``,
            or ``sample #2 of the batch (no sample_id)``) and the field.

    Example (a toy batch of two packs; compare TRL's ``pack_dataset`` docstring):

        >>> collate = PaddingFreeCollator(pad_to_multiple_of=4, pad_token_id=0)
        >>> packs = [
        ...     [{"input_ids": [11, 12, 13], "labels": [-100, 12, 13], "sample_id": 7},
        ...      {"input_ids": [21], "labels": [-100], "sample_id": 2}],
        ...     [{"input_ids": [31, 32], "labels": [-100, 32], "sample_id": 5}],
        ... ]
        >>> batch = collate(packs)
        >>> batch["input_ids"]
        tensor([[11, 12, 13, 21, 31, 32,  0,  0]])
        >>> batch["labels"]
        tensor([[-100,   12,   13, -100, -100,   32, -100, -100]])
        >>> batch["position_ids"]
        tensor([[0, 1, 2, 0, 0, 1, 0, 1]])
        >>> batch["cu_seq_lens_q"], batch["max_length_q"]
        (tensor([0, 3, 4, 6, 8], dtype=torch.int32), 3)
        >>> batch["seq_idx"]
        tensor([[0, 0, 0, 1, 2, 2, 3, 3]], dtype=torch.int32)
        >>> batch["sample_ids"]
        [7, 2, 5]
    """

    def __init__(
        self,
        *,
        pad_to_multiple_of: int | None = None,
        pad_token_id: int = 0,
        static_shape: StaticShape | None = None,
        position_planes: int | None = None,
        text_plane: int = 0,
        extra_fields: Iterable[str] = (),
        media_fields: Iterable[str] = (),
        ignore_fields: Iterable[str] = (),
    ) -> None:
        if pad_to_multiple_of is not None and (
            isinstance(pad_to_multiple_of, bool)
            or not isinstance(pad_to_multiple_of, int)
            or pad_to_multiple_of < 1
        ):
            raise ValueError(f"pad_to_multiple_of must be a positive int or None, got {pad_to_multiple_of!r}")
        if static_shape is not None and not isinstance(static_shape, StaticShape):
            raise TypeError(
                f"static_shape must be a varpack.collate.StaticShape or None, got {type(static_shape).__name__}"
            )
        if static_shape is not None and pad_to_multiple_of is not None:
            raise ValueError(
                "pad_to_multiple_of and static_shape are exclusive: static_shape fixes the row length itself "
                f"(tokens={static_shape.tokens}; StaticShape.for_packing(..., multiple_of=...) rounds it)"
            )
        if position_planes is not None and (not isinstance(position_planes, int) or position_planes < 1):
            raise ValueError(f"position_planes must be a positive int or None, got {position_planes!r}")
        if position_planes is not None and not -position_planes <= text_plane < position_planes:
            raise ValueError(f"text_plane={text_plane} out of range for position_planes={position_planes}")
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_token_id = int(pad_token_id)
        self.static_shape = static_shape
        self.position_planes = position_planes
        self.text_plane = int(text_plane)
        self.extra_fields = tuple(extra_fields)
        self.media_fields = MEDIA_FIELDS + tuple(f for f in media_fields if f not in MEDIA_FIELDS)
        self.ignore_fields = IGNORED_FIELDS | frozenset(ignore_fields)
        clash = set(self.extra_fields) & (set(TOKEN_FIELDS) | set(self.media_fields) | self.ignore_fields)
        if clash:
            raise ValueError(f"extra_fields {sorted(clash)} are already known fields")
        self._token_fields: dict[str, type | None] = {**TOKEN_FIELDS, **{f: None for f in self.extra_fields}}
        self._known = (
            set(self._token_fields)
            | set(self.media_fields)
            | self.ignore_fields
            | {"position_ids", "attention_mask"}
        )

    def __repr__(self) -> str:
        return (
            f"PaddingFreeCollator(pad_to_multiple_of={self.pad_to_multiple_of}, pad_token_id={self.pad_token_id}, "
            + (f"static_shape={self.static_shape}, " if self.static_shape is not None else "")
            + f"position_planes={self.position_planes}, text_plane={self.text_plane}, "
            f"extra_fields={self.extra_fields})"
        )

    # ------------------------------------------------------------------ checks
    def _fields(self, samples: list[Mapping[str, Any]], names: list[Any]) -> dict[str, list[int]]:
        """field -> indices of the samples that carry it; unknown fields raise."""
        first = samples[0].keys()
        if all(s.keys() == first for s in samples):  # the usual case: one shared index list
            everyone = list(range(len(samples)))
            present: dict[str, list[int]] = dict.fromkeys(first, everyone)
        else:
            present = {}
            for i, sample in enumerate(samples):
                for key in sample:
                    present.setdefault(key, []).append(i)
        unknown = sorted(set(present) - self._known)
        if unknown:
            field = unknown[0]
            raise ValueError(
                f"{_name(names, present[field][0])} has unknown field {field!r} (all unknown: {unknown}); "
                f"declare token-aligned fields with extra_fields=..., media with media_fields=..., or drop "
                f"bookkeeping with ignore_fields=... -- varpack never drops a field silently"
            )
        n = len(samples)
        for field in (INPUT_IDS, LABELS):
            have = present.get(field, [])
            if len(have) != n:
                missing = sorted(set(range(n)) - set(have))
                raise ValueError(
                    f"{_name(names, missing[0])} has no {field!r} ({n - len(have)} of {n} samples lack it)"
                )
        optional_everywhere = [
            f for f in self._token_fields if f not in (INPUT_IDS, LABELS, MM_TOKEN_TYPE_IDS)
        ]
        for field in optional_everywhere:
            have = present.get(field)
            if have is not None and len(have) != n:
                missing = sorted(set(range(n)) - set(have))
                raise ValueError(
                    f"{_name(names, missing[0])} has no {field!r} while {len(have)} other samples of the batch "
                    f"have it; give every sample the field"
                )
        return present

    # ------------------------------------------------------------------ call
    def __call__(self, features: Sequence[Any]) -> dict[str, Any]:
        samples = _flatten(features)
        n = len(samples)
        names = [s.get("sample_id") for s in samples]
        present = self._fields(samples, names)

        columns = {f: [samples[i][f] for i in have] for f, have in present.items() if f in self._token_fields}
        lengths = _lengths_of(columns["input_ids"])
        if (lengths <= 0).any():
            i = int(np.flatnonzero(lengths <= 0)[0])
            if lengths[i] < 0:
                raise ValueError(
                    f"{_name(names, i)}: field 'input_ids' must be 1-D (a list, array or tensor of token ids), "
                    f"but it {_describe(samples[i]['input_ids'])}"
                )
            raise ValueError(f"{_name(names, i)} has 0 tokens; empty samples cannot be collated")

        for field, have in present.items():
            if field in self._token_fields or field == "attention_mask":
                values = columns[field] if field in columns else [samples[i][field] for i in have]
                got = _lengths_of(values)
                expected = lengths if len(have) == n else lengths[have]
                if not np.array_equal(got, expected):
                    bad = np.flatnonzero(got != expected)
                    i, value = have[bad[0]], values[bad[0]]
                    if got[bad[0]] >= 0:
                        raise ValueError(
                            f"{_name(names, i)}: token-aligned field {field!r} {_describe(value)}, but "
                            f"input_ids has {int(lengths[i])} tokens"
                        )
                    raise ValueError(
                        f"{_name(names, i)}: token-aligned field {field!r} must be a 1-D sequence with one value "
                        f"per token (input_ids has {int(lengths[i])} tokens), but it {_describe(value)}"
                    )
            elif field == "length":
                got = np.fromiter(
                    (_length_value(samples[i]["length"], names, i) for i in have),
                    dtype=np.int64,
                    count=len(have),
                )
                bad = np.flatnonzero(got != lengths[have])
                if bad.size:
                    i = have[bad[0]]
                    raise ValueError(
                        f"{_name(names, i)}: field 'length' is {int(got[bad[0]])} but input_ids has "
                        f"{int(lengths[i])} tokens (stale length column or plan?)"
                    )

        total = int(lengths.sum())
        max_seqlen = None
        linear: dict[str, Any] = {}
        if self.static_shape is not None:  # fixed T, N and max_seqlen (pad segments: >= 1 token unless empty_pads)
            try:
                pads = self.static_shape.pad_lengths(lengths)
                self.static_shape.check_linear_chunks(lengths)
            except ValueError as exc:
                raise ValueError(f"{_batch_name(names)}: {exc}") from None
            pad, seg_lengths = int(pads.sum()), np.concatenate([lengths, pads])
            max_seqlen = self.static_shape.max_seqlen
            # the linear-attention layers run the pad tokens as one sequence (VarlenMeta.cu_seqlens_linear); a
            # full row (no pad token) gets its own offsets, so every row of the shape carries the same fields (its
            # zero-length pad segments, if any, stay zero-length: merged after its last sample)
            linear_from = n if pad else (n - 1 if not pads.size else max(n - 1, 1))
            linear = {"linear_from": linear_from, "linear_chunk_rows": self.static_shape.linear_chunks}
        else:
            pad = 0 if self.pad_to_multiple_of is None else (-total) % self.pad_to_multiple_of
            seg_lengths = np.append(lengths, pad) if pad else lengths
        full = total + pad
        # the boundaries, once: validated, int32 (raises past int32)
        meta = VarlenMeta.from_lengths(seg_lengths, max_seqlen=max_seqlen, **linear)
        cu = meta.cu_seqlens.numpy().astype(np.int64)
        starts = cu[:-1]
        positions = np.arange(full, dtype=np.int64) - np.repeat(starts, seg_lengths)

        batch: dict[str, Any] = {}
        for field, dtype in self._token_fields.items():
            have = present.get(field)
            if have is None:
                continue
            try:
                if len(have) == n:
                    values = _concat_token_field(columns[field], total, dtype)
                else:  # mm_token_type_ids absent from text-only samples: zeros
                    values = np.zeros(total, dtype=np.int64)
                    mask = np.zeros(n, dtype=bool)
                    mask[have] = True
                    values[np.repeat(mask, lengths)] = _concat_token_field(
                        columns[field], int(lengths[have].sum()), dtype
                    )
            except (TypeError, ValueError, OverflowError, struct.error) as exc:
                raise _bad_values(field, dtype, have, columns[field], names, exc) from exc
            if field == "labels" and (values[starts[:n]] != IGNORE_INDEX).any():
                bad = np.flatnonzero(values[starts[:n]] != IGNORE_INDEX)
                if bad.size:
                    i = int(bad[0])
                    raise ValueError(
                        f"{_name(names, i)}: labels[0] is {int(values[starts[i]])}, must be {IGNORE_INDEX} "
                        f"(the first token of a sample has no predecessor inside the sample; {bad.size} "
                        f"samples of the batch break this)"
                    )
            if pad:
                fill = {INPUT_IDS: self.pad_token_id, LABELS: IGNORE_INDEX}.get(field, 0)
                values = np.concatenate([values, np.full(pad, fill, dtype=values.dtype)])
            batch[field] = torch.from_numpy(values).unsqueeze(0)

        if "attention_mask" in present:
            mask = _concat_token_field(
                [samples[i]["attention_mask"] for i in present["attention_mask"]],
                int(lengths[present["attention_mask"]].sum()),
                np.int64,
            )
            if (mask != 1).any():
                owner = np.repeat(np.asarray(present["attention_mask"]), lengths[present["attention_mask"]])
                i = int(owner[np.flatnonzero(mask != 1)[0]])
                raise ValueError(
                    f"{_name(names, i)}: attention_mask contains 0; padding-free samples carry no padding tokens "
                    f"(strip them before collating)"
                )

        batch["position_ids"] = self._positions(samples, names, present, lengths, positions, total)

        batch.update(meta.flash_attn_kwargs())  # cu_seq_lens_q/k (one tensor), max_length_q/k: views of meta
        batch[SEQ_IDX] = meta.seq_idx()
        batch[VARLEN_META] = meta

        self._check_media(samples, names, present)
        for field in self.media_fields:
            have = present.get(field)
            if have:
                batch[field] = _concat_media([samples[i][field] for i in have], field)
        batch["sample_ids"] = names
        return batch

    def _positions(
        self,
        samples: list[Mapping[str, Any]],
        names: list[Any],
        present: dict[str, list[int]],
        lengths: np.ndarray,
        positions: np.ndarray,
        total: int,
    ) -> torch.Tensor:
        """``[1, T]`` restarting positions, or ``[P, 1, T]`` with the samples' own planes where they give them."""
        have = present.get("position_ids", [])
        if not have and self.position_planes is None:
            return torch.from_numpy(positions).unsqueeze(0)
        given = {i: _as_array(samples[i]["position_ids"]) for i in have}
        for i in have:
            if given[i].dtype.kind not in "iu" or given[i].ndim == 0:
                raise ValueError(
                    f"{_name(names, i)}: field 'position_ids' must be integer positions [L] or [P, L] "
                    f"(P planes x the sample's tokens), but it {_describe(samples[i]['position_ids'])}"
                    + (f" of dtype {given[i].dtype}" if given[i].ndim else "")
                )
        planes = self.position_planes
        if planes is None:
            multi = [i for i in have if given[i].ndim == 2]
            planes = int(given[multi[0]].shape[0]) if multi else None
        for i in have:
            arr = given[i]
            if arr.ndim == 1:
                arr = given[i] = arr[None, :]
            expected_planes = 1 if planes is None else planes
            if arr.ndim != 2 or arr.shape != (expected_planes, lengths[i]):
                raise ValueError(
                    f"{_name(names, i)}: field 'position_ids' has shape {tuple(arr.shape)}, expected "
                    f"[{expected_planes}, {int(lengths[i])}] (P planes x the sample's tokens)"
                )
        text_plane = 0 if planes is None else self.text_plane
        if planes is not None and not -planes <= text_plane < planes:
            raise ValueError(f"text_plane={text_plane} out of range for {planes} position planes")
        if have:
            stacked = np.concatenate([given[i] for i in have], axis=1).astype(np.int64, copy=False)
            self._check_text_plane(stacked[text_plane], positions, lengths, have, names, total)
        if planes is None or (planes == 1 and self.position_planes is None):
            # text-only, or one plane that (checked above) equals the restarting positions: [1, T]
            return torch.from_numpy(positions).unsqueeze(0)
        out = np.broadcast_to(positions, (planes, positions.size)).copy()
        if have:
            mask = np.zeros(lengths.size, dtype=bool)
            mask[have] = True
            token_mask = np.zeros(positions.size, dtype=bool)
            token_mask[:total] = np.repeat(mask, lengths)
            out[:, token_mask] = stacked
        return torch.from_numpy(out).unsqueeze(1)

    @staticmethod
    def _check_text_plane(
        given: np.ndarray,
        positions: np.ndarray,
        lengths: np.ndarray,
        have: list[int],
        names: list[Any],
        total: int,
    ) -> None:
        mask = np.zeros(lengths.size, dtype=bool)
        mask[have] = True
        expected = positions[:total][np.repeat(mask, lengths)]
        bad = np.flatnonzero(given != expected)
        if bad.size:
            owner = np.repeat(np.asarray(have), lengths[have])
            i = int(owner[bad[0]])
            offset = int(expected[bad[0]])
            raise ValueError(
                f"{_name(names, i)}: the text plane of position_ids is {int(given[bad[0]])} at token {offset}, "
                f"expected {offset}; the text plane must restart at 0 and count up by 1 inside every sample"
            )

    def _check_media(
        self, samples: list[Mapping[str, Any]], names: list[Any], present: dict[str, list[int]]
    ) -> None:
        for field in self.media_fields:
            for i in present.get(field, ()):
                value = samples[i][field]
                arr = value if isinstance(value, torch.Tensor) else None
                if arr is None:
                    try:
                        arr = np.asarray(value)
                    except (TypeError, ValueError) as exc:
                        raise ValueError(
                            f"{_name(names, i)}: media field {field!r} is not an array: {exc}"
                        ) from exc
                if arr.ndim == 0 or (not isinstance(arr, torch.Tensor) and arr.dtype.kind not in "biuf"):
                    raise ValueError(
                        f"{_name(names, i)}: media field {field!r} must be an array or tensor with the media "
                        f"along dim 0 (e.g. pixel_values [patches, features], image_grid_thw [images, 3]), "
                        f"but it {_describe(value)}"
                    )
        for pixels, grid in MEDIA_PAIRS:
            with_pixels = set(present.get(pixels, ()))
            with_grid = set(present.get(grid, ()))
            if with_pixels != with_grid:
                i = min(with_pixels ^ with_grid)
                has, lacks = (pixels, grid) if i in with_pixels else (grid, pixels)
                raise ValueError(f"{_name(names, i)} has {has!r} but no {lacks!r}")
            for i in sorted(with_pixels):
                rows = int(np.shape(_as_array(samples[i][pixels]))[0])
                thw = _as_array(samples[i][grid])
                if thw.dtype.kind not in "iu" or thw.shape[-1] != 3 or thw.ndim > 2:
                    raise ValueError(
                        f"{_name(names, i)}: {grid!r} must be integer (t, h, w) rows [N, 3], got shape "
                        f"{tuple(thw.shape)} of dtype {thw.dtype}"
                    )
                thw = thw.reshape(-1, 3)
                expected = int(np.prod(thw, axis=1).sum())
                if rows != expected:
                    raise ValueError(
                        f"{_name(names, i)}: {pixels!r} has {rows} patch rows but {grid!r} = {thw.tolist()} "
                        f"gives {expected}"
                    )
        # Qwen2.5-VL: one second_per_grid_ts entry per video; the model reads the concatenated list in video
        # order, so either every sample with videos carries it or none does
        with_seconds = present.get("second_per_grid_ts", [])
        with_videos = set(present.get("video_grid_thw", ()))
        for i in with_seconds:
            count = int(np.size(_as_array(samples[i]["second_per_grid_ts"])))
            videos = 0
            if i in with_videos:
                videos = int(_as_array(samples[i]["video_grid_thw"]).reshape(-1, 3).shape[0])
            if count != videos:
                raise ValueError(
                    f"{_name(names, i)}: 'second_per_grid_ts' has {count} entries but 'video_grid_thw' has "
                    f"{videos} videos (one entry, seconds per temporal grid, per video)"
                )
        lacking = sorted(with_videos - set(with_seconds))
        if with_seconds and lacking:
            raise ValueError(
                f"{_name(names, lacking[0])} has 'video_grid_thw' but no 'second_per_grid_ts' while "
                f"{len(with_seconds)} other samples of the batch carry it; the model would give this sample's "
                "videos another sample's timing"
            )
