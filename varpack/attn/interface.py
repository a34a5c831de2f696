"""The public entry point :func:`varlen_attention`: cheap validation, backend resolution, dispatch."""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from varpack.varlen.boundaries import normalize_cu_seqlens, normalize_max_seqlen

from ._base import CallSpec
from ._cache import TensorCache
from .registry import BACKENDS, normalize_mask_args, resolve_spec

__all__ = ["varlen_attention"]


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over a packed (padding-free) stream of N independent segments; no token attends across
    a segment boundary.

    Semantics are exactly flash-attn's ``flash_attn_varlen_func``. Segment ``n`` holds queries
    ``q[cu_seqlens_q[n]:cu_seqlens_q[n+1]]`` and keys/values ``k/v[cu_seqlens_k[n]:cu_seqlens_k[n+1]]``.

    ====================  ===========================  =====================================================
    argument              shape                        dtype / meaning
    ====================  ===========================  =====================================================
    q                     ``(Tq, H, D)``               fp16 / bf16 / fp32 (fp64: ``reference`` only)
    k, v                  ``(Tk, Hkv, D)``             same dtype and device as q; ``H % Hkv == 0`` (GQA/MQA)
    cu_seqlens_q, _k      ``(N + 1,)``                 int32 (int64 accepted), ``[0, ..., Tq]`` / ``[.., Tk]``
    max_seqlen_q, _k      host ``int``                 longest segment (an upper bound is fine)
    return                ``(Tq, H, D)``               q's dtype
    ====================  ===========================  =====================================================

    T counts tokens in the flat stream, N segments (samples), H / Hkv query / key-value heads, D head dim.
    Zero-length segments (repeated offsets) are allowed by the backends that declare it
    (see :func:`varpack.attn.available_backends`).

    The mask of a packed stream is block-diagonal. Segments of 3 and 2 tokens, ``cu_seqlens = [0, 3, 5]``,
    causal (1 = query row may attend key column)::

        1 0 0 0 0
        1 1 0 0 0
        1 1 1 0 0
        0 0 0 1 0
        0 0 0 1 1

    If ``causal=True`` and a segment has different query and key lengths, the causal mask is aligned to the
    bottom-right corner of that segment's attention matrix. With seqlen_q = 2 and seqlen_k = 5::

        1 1 1 1 0
        1 1 1 1 1

    With seqlen_q = 5 and seqlen_k = 2 (a query row with no visible key outputs 0)::

        0 0
        0 0
        0 0
        1 0
        1 1

    ``window_size=(left, right)`` keeps key j for query i iff
    ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right`` (``-1``: unbounded;
    ``causal=True`` sets right = 0). ``softcap > 0`` caps scores as ``softcap * tanh(q.k * scale / softcap)``
    before masking (Gemma-2 style).

    Args:
        q, k, v: see the table.
        cu_seqlens_q, cu_seqlens_k: segment offsets, same length. On the CPU they are validated (start at 0,
            non-decreasing, end at Tq / Tk, max_seqlen large enough). On the GPU their values are never read
            here (no device-to-host sync per layer): validate them once per batch where they are built.
            A list / tuple / NumPy array of integers is converted to a CPU int32 tensor (on every call:
            pass a tensor to reuse the per-batch device copy across layers)
            (:func:`varpack.varlen.normalize_cu_seqlens`).
        max_seqlen_q, max_seqlen_k: host integers of any integral type -- Python int, NumPy integer,
            one-element CPU integer tensor -- read as Python ints; never a device tensor, whose reading
            would sync with the host in every layer (:func:`varpack.varlen.normalize_max_seqlen`).
        causal: causal mask per segment (bottom-right aligned).
        window_size: sliding window ``(left, right)``; ``(-1, -1)`` = no window.
        softmax_scale: scale of ``q.k``; default ``1 / sqrt(D)``.
        softcap: score capping (0 = off).
        backend: ``"auto"`` (fastest backend that supports this call: see
            :data:`varpack.attn.registry.AUTO_PRIORITY`) or a name: ``reference``, ``sdpa``, ``torch_varlen``,
            ``flex``, ``flash_attn`` (FA2), ``flash_attn_3``, ``flash_attn_4``.

    Returns:
        Tensor ``(Tq, H, D)``: the attention output of every query token, in q's dtype.

    Raises:
        TypeError: a non-tensor q/k/v, mismatched q/k/v dtypes, non-integer cu_seqlens, a max_seqlen that
            is not a host integer (a device tensor, a float, a bool), non-bool causal.
        ValueError: wrong ranks or shapes (``H % Hkv != 0``, k/v shape mismatch, head dims differ),
            mismatched devices, cu_seqlens of different lengths, invalid CPU cu_seqlens values,
            ``window_size`` entries below -1, negative softcap, non-positive softmax_scale, unknown backend.
        BackendUnavailableError (a ValueError and RuntimeError): the forced backend cannot run this call
            (the message says why), or under ``auto`` no backend can. varpack never falls back to dense
            attention over the whole stream.

    Sources:
        flash-attn ``flash_attn_varlen_func`` (Dao-AILab/flash-attention, flash_attn/flash_attn_interface.py:
        semantics, bottom-right causal alignment, window and softcap conventions); FlashAttention-2
        (Dao, 2023, arXiv:2307.08691); varlen packing as in "Efficient Sequence Packing without
        Cross-contamination" (Krell et al., 2021, arXiv:2107.02027).

    Example:
        Two segments of two tokens; with q = k = 0 every visible key gets the same weight, so each output
        is the mean of the values its query may see. Token 2 starts a new segment and sees only itself
        (over the whole stream it would see tokens 0..2 and give ``[2., 3.]``):

        >>> import torch
        >>> from varpack.attn import varlen_attention
        >>> q = k = torch.zeros(4, 1, 2)
        >>> v = torch.arange(8.0).reshape(4, 1, 2)
        >>> cu = torch.tensor([0, 2, 4], dtype=torch.int32)
        >>> varlen_attention(q, k, v, cu, cu, 2, 2)[:, 0]
        tensor([[0., 1.],
                [1., 2.],
                [4., 5.],
                [5., 6.]])
    """
    _check_tensors(q, k, v)
    cu_seqlens_q = _check_cu("cu_seqlens_q", cu_seqlens_q, q)
    cu_seqlens_k = _check_cu("cu_seqlens_k", cu_seqlens_k, q)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries but cu_seqlens_k has {cu_seqlens_k.shape[0]}"
        )
    max_seqlen_q = normalize_max_seqlen(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = normalize_max_seqlen(max_seqlen_k, "max_seqlen_k")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    window_size = _check_window(window_size)
    softcap = float(softcap)
    if not softcap >= 0.0:
        raise ValueError(f"softcap must be >= 0 (0 = off), got {softcap}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    else:
        softmax_scale = float(softmax_scale)
        if not softmax_scale > 0.0 or not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale}")
    causal, window_size = normalize_mask_args(causal, window_size)

    info = _boundary_info(
        cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k, q.device
    )
    spec = CallSpec.from_tensors(
        q,
        k,
        v,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        has_empty_segments=info.has_empty,
        max_seqlen=max(max_seqlen_q, max_seqlen_k),
    )
    name = resolve_spec(backend, spec)
    return BACKENDS[name].forward(
        q,
        k,
        v,
        info.cu_q,
        info.cu_k,
        max_seqlen_q,
        max_seqlen_k,
        causal=causal,
        window_size=window_size,
        softmax_scale=softmax_scale,
        softcap=softcap,
    )


# -- validation (shapes, dtypes, devices: no tensor values on the GPU) ----------------------------------


def _check_tensors(q: Any, k: Any, v: Any) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must have shape (T, heads, D) for the packed stream, got {tuple(t.shape)}"
                " (flatten a [1, T, ...] batch first)"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape (Tk, Hkv, D), got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: q D={q.shape[-1]}, k D={k.shape[-1]}")
    h, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"query heads H={h} must be a multiple of key/value heads Hkv={hkv} (GQA/MQA)")
    if q.shape[-1] == 0:
        raise ValueError("head dim D must be > 0")


def _check_cu(name: str, cu: Any, q: torch.Tensor) -> torch.Tensor:
    cu = normalize_cu_seqlens(cu, name, min_entries=1)
    if cu.device != q.device and cu.device.type != "cpu":
        raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
    return cu


def _check_window(window_size: Any) -> tuple[int, int]:
    try:
        left, right = (operator.index(w) for w in window_size)
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {(left, right)}")
    return left, right


# -- boundary info: validated once per cu_seqlens tensor, reused by every layer ---------------------------


class _BoundaryInfo:
    __slots__ = ("cu_q", "cu_k", "has_empty")

    def __init__(self, cu_q: torch.Tensor, cu_k: torch.Tensor, has_empty: bool | None) -> None:
        self.cu_q = cu_q
        self.cu_k = cu_k
        self.has_empty = has_empty


_BOUNDARY_CACHE = TensorCache()


def _boundary_info(
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    total_q: int,
    total_k: int,
    max_q: int,
    max_k: int,
    device: torch.device,
) -> _BoundaryInfo:
    extra = (total_q, total_k, max_q, max_k, str(device))
    info = _BOUNDARY_CACHE.get((cu_q, cu_k), extra)
    if info is not None:
        return info
    has_empty: bool | None = None
    if cu_q.device.type == "cpu" and cu_k.device.type == "cpu":
        has_empty = False
        for name, cu, total, max_len in (
            ("cu_seqlens_q", cu_q, total_q, max_q),
            ("cu_seqlens_k", cu_k, total_k, max_k),
        ):
            values = cu.tolist()
            lengths = [b - a for a, b in zip(values, values[1:])]
            if values[0] != 0 or values[-1] != total or any(n < 0 for n in lengths):
                raise ValueError(
                    f"{name}={_short(values)} must start at 0, never decrease and end at the token count {total}"
                )
            longest = max(lengths, default=0)
            if longest > max_len:
                raise ValueError(
                    f"max_seqlen_{name[-1]}={max_len} is smaller than the longest segment ({longest} tokens) "
                    f"in {name}"
                )
            has_empty = has_empty or any(n == 0 for n in lengths)
    cu_q_dev = cu_q.to(device=device, dtype=torch.int32, non_blocking=True)
    cu_k_dev = cu_q_dev if cu_k is cu_q else cu_k.to(device=device, dtype=torch.int32, non_blocking=True)
    info = _BoundaryInfo(cu_q_dev, cu_k_dev, has_empty)
    _BOUNDARY_CACHE.put((cu_q, cu_k), extra, info)
    return info


def _short(values: list[int], limit: int = 12) -> str:
    if len(values) <= limit:
        return str(values)
    return (
        "[" + ", ".join(map(str, values[: limit // 2])) + ", ..., " + ", ".join(map(str, values[-3:])) + "]"
    )


def _clear_caches() -> None:
    """Drop cached boundary info (tests)."""
    _BOUNDARY_CACHE.clear()
