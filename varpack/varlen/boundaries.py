"""Boundary metadata of a padding-free token stream: cu_seqlens, max_seqlen, seq_idx.

Everything here runs once per batch on the CPU (vectorized torch / numpy, no per-token Python loop) and
returns CPU tensors plus Python ints, so that no attention layer ever has to derive boundaries again or sync
with the host.

Vocabulary: **T** tokens in the flat stream, **N** samples (documents, segments) in it, **P** position planes.
``cu_seqlens`` is the FlashAttention varlen format (``flash_attn_varlen_func``): an int32 tensor ``[N+1]``
``[0, l_0, l_0+l_1, ..., T]`` whose consecutive differences are the segment lengths.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch

__all__ = [
    "cu_seqlens_from_lengths",
    "cu_seqlens_from_position_ids",
    "cu_seqlens_from_segment_ids",
    "lengths_from_cu_seqlens",
    "max_seqlen_from_cu_seqlens",
    "normalize_cu_seqlens",
    "normalize_max_seqlen",
    "seq_idx_from_cu_seqlens",
    "seq_idx_on_device",
    "validate_cu_seqlens",
]

_INT32_MAX = int(np.iinfo(np.int32).max)


def _to_numpy_int(values: Any, name: str) -> np.ndarray:
    """Any tensor / array / nested sequence of integers -> int64 numpy array (a device tensor is copied once)."""
    if isinstance(values, torch.Tensor):
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got a tensor of dtype {values.dtype}")
        return values.detach().to("cpu", torch.int64).numpy()
    arr = np.asarray(values)
    if arr.size and not (np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must hold integers, got an array of dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def normalize_max_seqlen(value: Any, name: str = "max_seqlen") -> int:
    """A longest-segment length (``max_seqlen``; transformers' ``max_length_q/k``) as a Python int.

    The one contract of every varpack entry point that takes it: the packing guard of
    :func:`varpack.integrations.transformers.enable_varpack` and its attention function,
    :func:`varpack.attn.varlen_attention`, :func:`varpack.attn.resolve_backend` and
    :func:`validate_cu_seqlens`. Varlen kernels (flash-attn's ``flash_attn_varlen_func``) take it as a host
    int; every attention layer reads it, so it must never be a value that lives on a device.

    Accepted, a host integer of any integral type, returned as ``int``:

    * a Python ``int`` (or any object with ``__index__``), not ``bool``;
    * a NumPy integer scalar (``np.int64(3)``, what ``np.max(lengths)`` gives) or a one-element integer
      ``ndarray``;
    * a one-element integer tensor on the CPU (``torch.tensor(3)``, what ``int(cu.diff().max())`` would read
      from a CPU ``cu_seqlens``): reading it is a host read, free.

    Refused:

    * a tensor on any other device (``TypeError``): reading it is a device-to-host sync, once per layer;
      compute ``max_seqlen`` once per batch on the CPU (the collator does);
    * ``bool``, floats (even ``3.0``), strings, ``None``, arrays / tensors of more than one element or of a
      non-integer dtype (``TypeError``);
    * a negative value (``ValueError``).

    Args:
        value: the value to normalise.
        name: the argument's name, used in the error messages (e.g. ``"max_length_q"``).

    Returns:
        ``value`` as a non-negative Python int.

    Raises:
        TypeError / ValueError: as above, naming ``name``, the type and the value.

    Example:
        >>> normalize_max_seqlen(np.int64(3), "max_length_q")
        3
        >>> normalize_max_seqlen(3.0, "max_length_q")
        Traceback (most recent call last):
        ...
        TypeError: max_length_q must be an integer (a Python int, a NumPy integer or a one-element CPU integer tensor), got float 3.0
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got bool {value!r}")
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise TypeError(
                f"{name} must be a Python int (a host integer), got a tensor on {value.device}: reading it "
                f"would sync the host with the device in every layer; compute it once per batch on the CPU "
                f"(e.g. the longest segment of a CPU cu_seqlens, as varpack's collator does)"
            )
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise TypeError(f"{name} must be an integer, got a tensor of dtype {value.dtype}")
        if value.numel() != 1:
            raise TypeError(f"{name} must be one integer, got a tensor of shape {tuple(value.shape)}")
        result = int(value.reshape(()).item())
    elif isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            raise TypeError(f"{name} must be an integer, got an array of dtype {value.dtype}")
        if value.size != 1:
            raise TypeError(f"{name} must be one integer, got an array of shape {value.shape}")
        result = int(value.reshape(()))
    else:
        try:
            result = operator.index(value)
        except TypeError:
            raise TypeError(
                f"{name} must be an integer (a Python int, a NumPy integer or a one-element CPU integer "
                f"tensor), got {type(value).__name__} {value!r}"
            ) from None
    if result < 0:
        raise ValueError(f"{name} must be >= 0 (the longest segment, in tokens), got {result}")
    return result


def normalize_cu_seqlens(value: Any, name: str = "cu_seqlens", *, min_entries: int = 2) -> torch.Tensor:
    """Segment offsets ``cu_seqlens`` (transformers' ``cu_seq_lens_q/k``) as an integer tensor ``[N+1]``.

    The one contract of every varpack entry point that takes them: the packing guard of
    :func:`varpack.integrations.transformers.enable_varpack`, :func:`varpack.attn.varlen_attention`,
    :func:`varpack.attn.resolve_backend`, the patched Gated DeltaNet layers, the gated delta rule ops
    (:mod:`varpack.ops.gated_delta_rule`), :func:`varpack.ops.short_conv` and the readers of this module.

    * An int32 / int64 tensor, on any device, is returned as is (the same object, so the per-batch caches
      keyed by tensor identity keep working; a device tensor's values are not read here).
    * A tensor of another integer dtype is cast to int32 on its device (no host read).
    * A list, tuple or NumPy array of integers (Python ints or NumPy integers) is converted once to a CPU
      int32 tensor (the varlen kernels' dtype).

    Only types and shape are checked here; the values (``cu[0] == 0``, non-decreasing, ``cu[-1] == T``) are
    checked by the callers, which know ``T``.

    Args:
        value: the offsets.
        name: the argument's name, used in the error messages (e.g. ``"cu_seq_lens_q"``).
        min_entries: the fewest entries accepted (2: ``[0, T]``, one segment).

    Returns:
        An int32 / int64 tensor ``[N+1]``.

    Raises:
        TypeError: ``None``, a scalar, a string, a ragged nesting, or a tensor / array / list holding
            non-integers (floats, even integral ones, bools, complex, objects).
        ValueError: not 1-D, fewer than ``min_entries`` entries, or (list / array) a value outside int32.

    Example:
        >>> normalize_cu_seqlens([0, 3, 4, 7], "cu_seq_lens_q")
        tensor([0, 3, 4, 7], dtype=torch.int32)
    """
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise TypeError(
                f"{name} must be an int32/int64 tensor [N+1] (or a list / NumPy array of integers), got a "
                f"tensor of dtype {value.dtype}"
            )
        shape = tuple(value.shape)
        if value.dtype not in (torch.int32, torch.int64):
            value = value.to(torch.int32)
        out = value
    else:
        if value is None or isinstance(value, (str, bytes, bool, np.bool_, int, float, np.generic)):
            raise TypeError(
                f"{name} must be an int32 tensor [N+1] (or a list / NumPy array of integers), got "
                f"{type(value).__name__} {value!r}"
            )
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{name} must be a 1-D sequence of integers [N+1], got {type(value).__name__}: {exc}"
            ) from exc
        shape = tuple(arr.shape)
        if arr.ndim == 1 and arr.size and arr.dtype.kind not in "iu":
            kind = "a NumPy array" if isinstance(value, np.ndarray) else f"a {type(value).__name__}"
            raise TypeError(f"{name} must hold integers, got {kind} of dtype {arr.dtype} ({_fmt_any(arr)})")
        out = None
    if len(shape) != 1 or shape[0] < min_entries:
        raise ValueError(
            f"{name} must be 1-D [N+1] with at least {min_entries} entries ([0, ..., T]), got shape {shape}"
        )
    if out is not None:
        return out
    if arr.size and (int(arr.min()) < -_INT32_MAX - 1 or int(arr.max()) > _INT32_MAX):
        raise ValueError(
            f"{name} has values outside int32 ({_fmt(arr)}); the varlen kernels index with int32"
        )
    return torch.from_numpy(arr.astype(np.int32))


def _fmt_any(values: np.ndarray, limit: int = 8) -> str:
    head = ", ".join(repr(v) for v in values.tolist()[:limit])
    return f"[{head}{', ...' if values.size > limit else ''}]"


def _check_fits_int32(total: int, name: str) -> None:
    if total > _INT32_MAX:
        raise ValueError(
            f"{name}: the stream has {total} tokens, more than int32 cu_seqlens can index ({_INT32_MAX})"
        )


def _fmt(values: np.ndarray, limit: int = 8) -> str:
    head = ", ".join(str(int(v)) for v in values[:limit])
    return f"[{head}{', ...' if len(values) > limit else ''}]"


def cu_seqlens_from_lengths(lengths: Any, *, allow_empty: bool = False) -> torch.Tensor:
    """Cumulative sequence lengths ``[0, l_0, l_0+l_1, ..., T]`` from per-sample lengths.

    Args:
        lengths: ``[N]`` non-negative integers (list, numpy array or tensor), the token count of each sample in
            stream order. ``N >= 1``.
        allow_empty: accept zero-length samples (they give repeated entries in ``cu_seqlens``). Off by default:
            FlashAttention-style kernels accept empty segments, but an empty sample is almost always a data
            bug, and the planner reports empty samples instead of packing them.

    Returns:
        ``cu_seqlens``: CPU int32 tensor ``[N+1]``, first entry 0, last entry ``T = sum(lengths)``.

    Raises:
        TypeError: ``lengths`` is not integral.
        ValueError: ``lengths`` is empty or not 1-D, a length is negative (or zero without ``allow_empty``), or
            ``T`` does not fit int32.

    Example:
        >>> cu_seqlens_from_lengths([3, 1, 3])
        tensor([0, 3, 4, 7], dtype=torch.int32)
    """
    arr = _to_numpy_int(lengths, "lengths")
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"lengths must be a non-empty 1-D sequence, got shape {tuple(arr.shape)}")
    bad = np.flatnonzero(arr < 0 if allow_empty else arr <= 0)
    if bad.size:
        kind = "negative" if allow_empty else "non-positive"
        raise ValueError(
            f"lengths has {bad.size} {kind} entries at indices {_fmt(bad)} (values {_fmt(arr[bad])})"
            + ("" if allow_empty else "; pass allow_empty=True to accept zero-length samples")
        )
    cu = np.zeros(arr.size + 1, dtype=np.int64)
    np.cumsum(arr, out=cu[1:])
    _check_fits_int32(int(cu[-1]), "cu_seqlens_from_lengths")
    return torch.from_numpy(cu.astype(np.int32))


def _position_row(position_ids: Any, text_plane: int | None) -> np.ndarray:
    """Select the single ``[T]`` row of positions that carries the sample restarts."""
    pos = _to_numpy_int(position_ids, "position_ids")
    shape = tuple(pos.shape)
    if pos.ndim == 1:
        if text_plane not in (None, 0):
            raise ValueError(
                f"text_plane={text_plane} given for 1-D position_ids of shape {shape} (one plane)"
            )
        return pos
    if pos.ndim == 2:
        if text_plane is None:
            if shape[0] != 1:
                raise ValueError(
                    f"position_ids of shape {shape}: padding-free batches have one row (B = 1). For "
                    f"multi-plane positions [P, T] name the plane that restarts per sample with text_plane=..."
                )
            return pos[0]
        planes = pos
    elif pos.ndim == 3:
        if text_plane is None:
            raise ValueError(
                f"position_ids of shape {shape} has {shape[0]} planes [P, B, T]; name the plane that restarts "
                f"per sample with text_plane=... (0 for Qwen3-VL's [text, t, h, w] layout)"
            )
        if shape[1] != 1:
            raise ValueError(
                f"position_ids of shape {shape}: padding-free batches have one row (B = 1), got B={shape[1]}"
            )
        planes = pos[:, 0, :]
    else:
        raise ValueError(f"position_ids must be [T], [1, T], [P, T] or [P, 1, T], got shape {shape}")
    num_planes = planes.shape[0]
    if not -num_planes <= text_plane < num_planes:
        raise ValueError(
            f"text_plane={text_plane} out of range for {num_planes} position planes (shape {shape})"
        )
    return planes[text_plane]


def cu_seqlens_from_position_ids(
    position_ids: Any, *, text_plane: int | None = None, strict: bool = True
) -> torch.Tensor:
    """Sample boundaries of a padding-free row, read from its position ids.

    A sample starts at index 0 and at every token whose position equals the row minimum. Anchoring on the
    row minimum rather than on 0 makes these cases work:

    - 1-token samples (consecutive minima): ``[[0, 1, 2, 0, 0, 1, 2]] -> [0, 3, 4, 7]``;
    - models whose positions start at an offset (RoBERTa-like models start at ``padding_idx + 1 = 2``);
    - a row that contains no 0 at all (e.g. ``[[2, 3, 2, 3, 4]]``).

    transformers located starts with ``position_ids == 0`` until huggingface/transformers#47525 (2026), which
    breaks on rows without a 0 (#39814, 4.54); its ``prepare_fa_kwargs_from_position_ids`` (5.24) now uses
    ``== position_ids.min()`` as here, but it does not add index 0 when the row begins inside a sample, and its
    sdpa/eager mask path (``masking_utils.find_packed_sequence_indices``) uses a different rule (a new sample
    wherever the position does not grow by exactly 1). With ``strict=True`` (default) varpack refuses rows on
    which the two rules disagree, so whatever this function accepts means the same thing to every path.

    Args:
        position_ids: integer positions, ``[T]``, ``[1, T]``, or multi-plane ``[P, T]`` / ``[P, 1, T]`` (mRoPE;
            then ``text_plane`` must be given). Any device; it is read on the CPU once.
        text_plane: index of the plane that restarts per sample (0 for Qwen3-VL's ``[text, t, h, w]``). Needed
            for multi-plane input; a 2-D input with more than one row and no ``text_plane`` is a batch with
            B > 1, which padding-free input never has (flatten it to one row first).
        strict: refuse a row where, inside a sample, a position does not follow its predecessor by exactly +1
            (e.g. ``[0, 1, 2, 3, 1, 2]``: the drop to 1 is not to the row minimum, so the minimum rule sees one
            sample of 6 tokens while the +1 rule sees two). With ``strict=False`` only the minimum rule applies.

    Returns:
        ``cu_seqlens``: CPU int32 tensor ``[N+1]``, strictly increasing, ``[0, ..., T]``. Zero-length samples
        cannot be expressed in position ids, so none are produced.

    Raises:
        TypeError: non-integer positions.
        ValueError: bad shape, B > 1, multi-plane input without ``text_plane``, ``text_plane`` out of range,
            an empty row, or (``strict``) a non-+1 step inside a sample, reported with its index and values.

    Example:
        >>> cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 0, 1, 2]]))
        tensor([0, 3, 4, 7], dtype=torch.int32)
        >>> cu_seqlens_from_position_ids(torch.tensor([[2, 3, 2, 3, 4]]))
        tensor([0, 2, 5], dtype=torch.int32)
    """
    row = _position_row(position_ids, text_plane)
    total = int(row.shape[0])
    if total == 0:
        raise ValueError("position_ids has no tokens (T = 0)")
    _check_fits_int32(total, "cu_seqlens_from_position_ids")
    is_start = row == row.min()
    is_start[0] = True
    if strict and total > 1:
        bad = np.flatnonzero((np.diff(row) != 1) & ~is_start[1:]) + 1
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"position_ids step from {int(row[i - 1])} to {int(row[i])} at index {i} is neither +1 nor a "
                f"restart at the row minimum {int(row.min())} ({bad.size} such steps, at indices {_fmt(bad)}); "
                f"the sample boundaries are ambiguous. Restart every sample at the same first position, or pass "
                f"strict=False to split only at the row minimum."
            )
    starts = np.flatnonzero(is_start)
    cu = np.empty(starts.size + 1, dtype=np.int32)
    cu[:-1] = starts
    cu[-1] = total
    return torch.from_numpy(cu)


def cu_seqlens_from_segment_ids(segment_ids: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Boundaries from per-token segment ids, with 0 marking padding (excluded).

    A segment is a maximal run of equal non-zero ids once the padding tokens are removed; padding between
    two runs of the same id therefore joins them (one document with a hole of padding). An id that reappears
    after a different id is an error: the two runs would be two documents with one name. With a ``[B, T]``
    input every row is split separately (a row end always ends a segment), so a 0/1 ``attention_mask`` of a
    right- or left-padded batch unpads exactly like flash-attn's ``unpad_input``.

    Args:
        segment_ids: non-negative integers, ``[T]`` or ``[B, T]`` (B >= 1).

    Returns:
        ``(cu_seqlens, indices)``: ``cu_seqlens`` int32 ``[N+1]`` indexes the stream of kept tokens;
        ``indices`` int64 ``[T_kept]`` are the positions of the kept (non-zero) tokens in the flattened
        ``[B*T]`` input, so that ``x.reshape(B*T, ...)[indices]`` is the padding-free stream that
        ``cu_seqlens`` describes. Both on the CPU.

    Raises:
        TypeError: non-integer ids.
        ValueError: not 1-D/2-D, a negative id, no non-zero id at all, or an id used by two separate runs of
            one row.

    Example:
        >>> cu, idx = cu_seqlens_from_segment_ids(torch.tensor([[1, 1, 2, 2, 2, 0, 0]]))
        >>> cu, idx
        (tensor([0, 2, 5], dtype=torch.int32), tensor([0, 1, 2, 3, 4]))
    """
    seg = _to_numpy_int(segment_ids, "segment_ids")
    if seg.ndim == 1:
        seg = seg[None, :]
    if seg.ndim != 2:
        raise ValueError(f"segment_ids must be [T] or [B, T], got shape {tuple(seg.shape)}")
    if seg.size and seg.min() < 0:
        bad = np.flatnonzero(seg.reshape(-1) < 0)
        raise ValueError(f"segment_ids must be >= 0 (0 = padding); negative at flat indices {_fmt(bad)}")
    flat = seg.reshape(-1)
    indices = np.flatnonzero(flat != 0)
    if indices.size == 0:
        raise ValueError(f"segment_ids of shape {tuple(seg.shape)} marks every token as padding (all 0)")
    _check_fits_int32(int(indices.size), "cu_seqlens_from_segment_ids")
    kept = flat[indices]
    rows = indices // seg.shape[1]
    is_start = np.ones(kept.size, dtype=bool)
    is_start[1:] = (kept[1:] != kept[:-1]) | (rows[1:] != rows[:-1])
    starts = np.flatnonzero(is_start)
    # an id may name one run per row only
    run_keys = np.stack([rows[starts], kept[starts]], axis=1)
    uniq, counts = np.unique(run_keys, axis=0, return_counts=True)
    if (counts > 1).any():
        row, sid = (int(v) for v in uniq[np.argmax(counts > 1)])
        where = indices[starts][(run_keys[:, 0] == row) & (run_keys[:, 1] == sid)] % seg.shape[1]
        raise ValueError(
            f"segment id {sid} forms {where.size} separate runs in row {row} (starting at {_fmt(where)}); "
            f"give every document its own id"
        )
    cu = np.empty(starts.size + 1, dtype=np.int32)
    cu[:-1] = starts
    cu[-1] = kept.size
    return torch.from_numpy(cu), torch.from_numpy(indices.astype(np.int64))


def _cu_numpy(cu_seqlens: Any, min_entries: int = 2) -> np.ndarray:
    """CPU int64 values of ``cu_seqlens`` (types and shape checked by :func:`normalize_cu_seqlens`)."""
    cu = normalize_cu_seqlens(cu_seqlens, "cu_seqlens", min_entries=min_entries)
    return _host_int64(cu)


def _host_int64(cu: torch.Tensor) -> np.ndarray:
    """A tensor's values on the host as int64 NumPy (through ``tolist``: works on functionalized tensors, e.g.
    inside ``torch.func`` transforms and custom-op tests, where ``.numpy()`` has no storage to read)."""
    return np.asarray(cu.detach().tolist(), dtype=np.int64)


def max_seqlen_from_cu_seqlens(cu_seqlens: Any) -> int:
    """Length of the longest segment, as a Python int (FlashAttention's ``max_seqlen``).

    Args:
        cu_seqlens: ``[N+1]`` integers with ``N >= 1``.

    Returns:
        ``max(cu[i+1] - cu[i])`` as ``int`` (never a tensor: no host sync in the layers that consume it).

    Raises:
        ValueError: fewer than 2 entries or not 1-D.

    Example:
        >>> max_seqlen_from_cu_seqlens(torch.tensor([0, 3, 4, 7], dtype=torch.int32))
        3
    """
    cu = _cu_numpy(cu_seqlens)
    if cu.ndim != 1 or cu.size < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu.shape)}")
    return int(np.diff(cu).max())


def seq_idx_from_cu_seqlens(cu_seqlens: Any, total_tokens: int) -> torch.Tensor:
    """Sample index of every token, ``[1, T]`` int32 (the ``seq_idx`` of Mamba-2 / causal-conv1d kernels).

    Args:
        cu_seqlens: ``[N+1]`` integers, valid for ``total_tokens`` (zero-length segments allowed: their
            index simply never appears).
        total_tokens: ``T``.

    Returns:
        CPU int32 tensor ``[1, T]`` with values ``0..N-1``, non-decreasing.

    Raises:
        TypeError / ValueError: as :func:`validate_cu_seqlens` (with ``allow_empty=True``, any integer dtype).

    Example:
        >>> seq_idx_from_cu_seqlens(torch.tensor([0, 3, 4, 7], dtype=torch.int32), 7)
        tensor([[0, 0, 0, 1, 2, 2, 2]], dtype=torch.int32)
    """
    cu = _cu_numpy(cu_seqlens)
    _validate_values(cu, total_tokens, allow_empty=True, max_seqlen=None)
    lengths = np.diff(cu)
    seq_idx = np.repeat(np.arange(lengths.size, dtype=np.int32), lengths)
    return torch.from_numpy(seq_idx).unsqueeze(0)


def seq_idx_on_device(cu_seqlens: torch.Tensor, total_tokens: int | torch.SymInt) -> torch.Tensor:
    """Sample index of every token, ``[1, T]`` int32, computed where ``cu_seqlens`` lives without reading it:
    ``searchsorted(cu_seqlens, arange(T), right=True) - 1``. No host sync, no data-dependent shape, so it
    traces into a ``torch.compile`` graph (``T`` may be symbolic) and replays under a CUDA graph.

    Args:
        cu_seqlens: ``[N+1]`` int32 offsets on any device, trusted as valid (validated where they were built,
            e.g. :class:`varpack.varlen.VarlenMeta`); zero-length segments allowed.
        total_tokens: ``T``.

    Returns:
        ``[1, T]`` int32 on ``cu_seqlens``' device, equal to :func:`seq_idx_from_cu_seqlens` for valid offsets.

    Raises:
        TypeError: ``cu_seqlens`` not an integer tensor.
    """
    if (
        not isinstance(cu_seqlens, torch.Tensor)
        or cu_seqlens.is_floating_point()
        or cu_seqlens.dtype == torch.bool
    ):
        raise TypeError(f"cu_seqlens must be an integer tensor, got {type(cu_seqlens).__name__}")
    cu = cu_seqlens.to(torch.int32)
    positions = torch.arange(total_tokens, device=cu.device, dtype=torch.int32)
    # over the whole offsets, not cu[1:]: a slice's contiguity check guards on N >= 2 and a one-sample pack
    # would recompile a compiled layer
    return (torch.searchsorted(cu, positions, right=True) - 1).to(torch.int32)[None]


def _validate_values(
    cu: np.ndarray,
    total_tokens: int,
    *,
    allow_empty: bool,
    max_seqlen: int | None,
    at_least: bool = False,
    name: str = "cu_seqlens",
) -> None:
    if cu.ndim != 1:
        raise ValueError(f"{name} must be 1-D [N+1], got shape {tuple(cu.shape)}")
    if cu.size < 2:
        raise ValueError(f"{name} must have at least 2 entries ([0, T]), got {cu.size}: {_fmt(cu)}")
    rule = (
        f"{name}={_fmt(cu)} must start at 0, "
        + ("never decrease" if allow_empty else "increase strictly")
        + f" and end at the token count {total_tokens} (T={total_tokens})"
    )
    if int(cu[0]) != 0:
        raise ValueError(f"{rule}: {name}[0]={int(cu[0])}, must be 0")
    if int(cu[-1]) != total_tokens:
        raise ValueError(f"{rule}: {name}[-1]={int(cu[-1])} but the stream has {total_tokens} tokens")
    steps = np.diff(cu)
    bad = np.flatnonzero(steps < 0 if allow_empty else steps <= 0)
    if bad.size:
        i = int(bad[0])
        what = "decreasing" if allow_empty else "not strictly increasing"
        raise ValueError(
            f"{rule}: {name} is {what}: {name}[{i}]={int(cu[i])}, {name}[{i + 1}]={int(cu[i + 1])} "
            f"({bad.size} such steps)"
            + ("" if allow_empty else "; zero-length segments need allow_empty=True")
        )
    if max_seqlen is not None:
        longest = int(steps.max())
        if (max_seqlen < longest) if at_least else (max_seqlen != longest):
            max_name = (
                "max_seqlen" + name[len("cu_seqlens") :]
                if name.startswith("cu_seqlens")
                else "max_length" + name[len("cu_seq_lens") :]
                if name.startswith("cu_seq_lens")
                else "max_seqlen"
            )
            raise ValueError(
                f"{max_name}={max_seqlen} but the longest segment of {name} has {longest} tokens "
                f"(segment {int(np.argmax(steps))})"
                + ("; max_seqlen is smaller than the longest segment" if at_least else "")
            )


def validate_cu_seqlens(
    cu_seqlens: torch.Tensor,
    total_tokens: int,
    *,
    allow_empty: bool = False,
    max_seqlen: int | None = None,
    at_least: bool = False,
    name: str = "cu_seqlens",
) -> None:
    """Check that ``cu_seqlens`` is valid varlen metadata for a stream of ``total_tokens`` tokens.

    Checks, in order (the first violation raises, naming it with the offending values): a torch tensor of
    dtype int32 (what FlashAttention, torch ``varlen_attn`` and fla kernels take), 1-D, at least 2 entries,
    ``cu[0] == 0``, ``cu[-1] == T``, strictly increasing (non-decreasing with ``allow_empty``, i.e.
    zero-length segments allowed), and ``max_seqlen`` (if given) equal to the longest segment: varpack always
    derives it from ``cu_seqlens``, so any other value means the two come from different batches.
    A device tensor is copied to the CPU once: meant for collate time and tests, not inside layers.

    This is varpack's one validator of ``cu_seqlens`` values: :class:`varpack.varlen.VarlenMeta` calls it
    once per batch (with ``at_least=True``), and every consumer reads the validated meta.

    Args:
        cu_seqlens: ``[N+1]`` int32 tensor.
        total_tokens: ``T``, the number of tokens in the stream (a Python int).
        allow_empty: accept zero-length segments.
        max_seqlen: the ``max_seqlen`` that travels with ``cu_seqlens``, or ``None``: a host integer of any
            integral type (:func:`normalize_max_seqlen`).
        at_least: accept a ``max_seqlen`` above the longest segment (an upper bound, as the varlen kernels
            take it) instead of requiring equality.
        name: the argument's name in the messages (e.g. ``"cu_seq_lens_q"``).

    Raises:
        TypeError: ``cu_seqlens`` is not a tensor (this checks the collated form; :func:`normalize_cu_seqlens`
            converts a list), ``total_tokens`` is not an int, or ``max_seqlen`` is refused by
            :func:`normalize_max_seqlen` (a device tensor, a float, a bool, ...).
        ValueError: dtype not int32, not 1-D, fewer than 2 entries, first != 0, last != T, not (strictly)
            increasing, max_seqlen inconsistent.

    Example:
        >>> validate_cu_seqlens(torch.tensor([0, 3, 4, 7], dtype=torch.int32), 7, max_seqlen=3)
        >>> validate_cu_seqlens(torch.tensor([0, 3, 3, 7], dtype=torch.int32), 7)
        Traceback (most recent call last):
        ...
        ValueError: cu_seqlens=[0, 3, 3, 7] must start at 0, increase strictly and end at the token count 7 (T=7): cu_seqlens is not strictly increasing: cu_seqlens[1]=3, cu_seqlens[2]=3 (1 such steps); zero-length segments need allow_empty=True
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if isinstance(total_tokens, bool) or not isinstance(total_tokens, (int, np.integer)):
        raise TypeError(f"total_tokens must be an int, got {type(total_tokens).__name__}")
    if max_seqlen is not None:
        max_seqlen = normalize_max_seqlen(max_seqlen, "max_seqlen")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{name} dtype is {cu_seqlens.dtype}, must be torch.int32")
    cu = _host_int64(cu_seqlens)
    _validate_values(
        cu,
        int(total_tokens),
        allow_empty=allow_empty,
        max_seqlen=max_seqlen,
        at_least=at_least,
        name=name,
    )


def checked_host_cu_seqlens(
    cu_seqlens: Any, total_tokens: int | None = None, name: str = "cu_seqlens"
) -> np.ndarray:
    """``cu_seqlens`` of any integer form (:func:`normalize_cu_seqlens`) read to the host as int64 NumPy and
    checked by :func:`validate_cu_seqlens`' rules (zero-length segments allowed; ``total_tokens=None``: the
    last offset is T). For the ops' direct callers (one host read per call); a model's layers read the
    batch's :class:`varpack.varlen.VarlenMeta` instead.

    Raises:
        TypeError / ValueError: as :func:`normalize_cu_seqlens` and :func:`validate_cu_seqlens`.
    """
    cu = _host_int64(normalize_cu_seqlens(cu_seqlens, name))
    _validate_values(
        cu,
        int(cu[-1]) if total_tokens is None else int(total_tokens),
        allow_empty=True,
        max_seqlen=None,
        name=name,
    )
    return cu


def lengths_from_cu_seqlens(cu_seqlens: Any) -> np.ndarray:
    """Segment lengths ``cu[1:] - cu[:-1]`` as an int64 numpy array ``[N]`` (a convenience for reports)."""
    cu = _cu_numpy(cu_seqlens, min_entries=1)
    if cu.ndim != 1 or cu.size < 1:
        raise ValueError(f"cu_seqlens must be 1-D and non-empty, got shape {tuple(cu.shape)}")
    return np.diff(cu)
