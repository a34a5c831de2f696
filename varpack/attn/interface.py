"""The public entry point :func:`varlen_attention`: cheap validation, backend resolution, dispatch."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from varpack.varlen.boundaries import normalize_cu_seqlens, normalize_max_seqlen
from varpack.varlen.meta import VarlenMeta

from ._base import CallSpec
from .registry import BACKENDS, normalize_mask_args, resolve_spec

__all__ = ["varlen_attention"]


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    backend: str = "auto",
    meta: VarlenMeta | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over a packed (padding-free) stream of N independent segments; no token attends across
    a segment boundary.

    Semantics are exactly flash-attn's ``flash_attn_varlen_func``. Segment ``n`` holds queries
    ``q[cu_seqlens_q[n]:cu_seqlens_q[n+1]]`` and keys/values ``k/v[cu_seqlens_k[n]:cu_seqlens_k[n+1]]``.

    ====================  ===========================  =====================================================
    argument              shape                        dtype / meaning
    ====================  ===========================  =====================================================
    q                     ``(Tq, H, D)``               fp16 / bf16 / fp32 (fp64: ``reference`` only)
    k                     ``(Tk, Hkv, D)``             same dtype and device as q; ``H % Hkv == 0`` (GQA/MQA)
    v                     ``(Tk, Hkv, Dv)``            as k; ``Dv != D`` (MLA) where the backend declares it
    sinks (optional)      ``(H,)``                     float, q's device: attention-sink logits (GPT-OSS)
    cu_seqlens_q, _k      ``(N + 1,)``                 int32 (int64 accepted), ``[0, ..., Tq]`` / ``[.., Tk]``
    max_seqlen_q, _k      host ``int``                 longest segment (an upper bound is fine)
    return                ``(Tq, H, Dv)``              q's dtype
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
    before masking (Gemma-2 style). ``sinks[h]`` is a logit that joins every row's softmax of head ``h``
    without a value: ``out_i = sum_j exp(s_ij) v_j / (exp(sinks[h]) + sum_j exp(s_ij))`` (GPT-OSS's learned
    sinks; a row with no visible key stays 0).

    Args:
        q, k, v: see the table.
        cu_seqlens_q, cu_seqlens_k: segment offsets, same length (ignored when ``meta`` is given). On the CPU
            they are validated (start at 0, non-decreasing, end at Tq / Tk, max_seqlen large enough) and
            copied to q's device -- on every call: a model passes ``meta`` instead, so that this happens
            once per batch. On the GPU their values are never read (no device-to-host sync). A list /
            tuple / NumPy array of integers is converted to a CPU int32 tensor
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
            ``flex``, ``flash_attn`` (FA2), ``flash_attn_3``, ``flash_attn_4``, ``triton_short`` (tiles that span
            several short documents; not in ``auto`` yet).
        meta: the batch's :class:`varpack.varlen.VarlenMeta` (validated once, when it was built): its offsets
            and max_seqlen are used, its device copy is made once per batch and kept, as are the per-batch
            objects a backend derives (FlexAttention's block mask, the host offsets of the per-segment
            backends). Every layer of a model passes the same meta: nothing is re-validated or re-derived.
        sinks: ``(H,)`` attention-sink logits or None; differentiable. Backends that declare it
            (:attr:`varpack.attn.Capabilities.sinks`: ``reference``, ``sdpa``, ``flex``, ``flash_attn_4``);
            the others refuse such a call.

    Returns:
        Tensor ``(Tq, H, Dv)``: the attention output of every query token, in q's dtype.

    Raises:
        TypeError: a non-tensor q/k/v, mismatched q/k/v dtypes, non-integer cu_seqlens, a max_seqlen that
            is not a host integer (a device tensor, a float, a bool), non-bool causal.
        ValueError: wrong ranks or shapes (``H % Hkv != 0``, k/v token or head counts differ, q/k head dims
            differ, ``sinks`` not of shape ``(H,)``),
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
    call = prepare_call(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, meta,
        causal=causal, window_size=window_size, softmax_scale=softmax_scale, softcap=softcap, backend=backend,
        sinks=sinks,
    )  # fmt: skip
    extra = {} if sinks is None else {"sinks": sinks}
    return BACKENDS[call.backend].forward(
        q,
        k,
        v,
        call.cu_q,
        call.cu_k,
        call.meta.max_seqlen_q,
        call.meta.max_seqlen_k,
        causal=call.causal,
        window_size=call.window_size,
        softmax_scale=call.softmax_scale,
        softcap=call.softcap,
        meta=call.meta,
        **extra,
    )


class PreparedCall(NamedTuple):
    """A checked varlen attention call: its boundaries (and their copy on q's device), normalized mask
    arguments and scalars, the backend spec and the resolved backend name."""

    meta: VarlenMeta
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    causal: bool
    window_size: tuple[int, int]
    softmax_scale: float
    softcap: float
    spec: CallSpec
    backend: str


def prepare_call(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    meta: VarlenMeta | None,
    *,
    causal: Any,
    window_size: Any,
    softmax_scale: Any,
    softcap: Any,
    backend: str,
    exclude: Mapping[str, str] | None = None,
    sinks: Any = None,
) -> PreparedCall:
    """Every check and the backend resolution of :func:`varlen_attention` (also used by the custom op
    :func:`varpack.attn.custom_op.varlen_attention_op`, which passes ``exclude``: backends ``auto`` skips,
    :func:`varpack.attn.registry.resolve_spec`): errors as documented there."""
    _check_tensors(q, k, v)
    _check_sinks(sinks, q)
    meta = _call_meta(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, meta)
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
    cu_q, cu_k = meta.cu_seqlens_on(q.device)  # one host-to-device copy per batch, kept on the meta
    spec = CallSpec.from_tensors(
        q,
        k,
        v,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        has_empty_segments=meta.has_empty,
        max_seqlen=max(meta.max_seqlen_q, meta.max_seqlen_k),
        mean_seqlen=q.shape[0] / meta.num_seqs if meta.num_seqs else None,
        sinks=sinks,
    )
    name = str(resolve_spec(backend, spec, exclude=exclude))
    return PreparedCall(meta, cu_q, cu_k, causal, window_size, softmax_scale, softcap, spec, name)


def _call_meta(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    meta: VarlenMeta | None,
) -> VarlenMeta:
    """The call's boundaries: the given batch meta (its token counts checked against q / k), or a meta built
    and validated from the offsets for this call (:class:`varpack.varlen.VarlenMeta`)."""
    if meta is None:
        same = cu_seqlens_k is cu_seqlens_q
        cu_seqlens_q = normalize_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", min_entries=1)
        cu_seqlens_k = (
            cu_seqlens_q if same else normalize_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", min_entries=1)
        )
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            _check_cu_device(name, cu, q)
        meta = VarlenMeta(
            cu_seqlens_q,
            cu_seqlens_k,
            normalize_max_seqlen(max_seqlen_q, "max_seqlen_q"),
            normalize_max_seqlen(max_seqlen_k, "max_seqlen_k"),
            total_q=q.shape[0],
            total_k=k.shape[0],
        )
    elif not isinstance(meta, VarlenMeta):
        raise TypeError(f"meta must be a varpack.varlen.VarlenMeta, got {type(meta).__name__}")
    elif meta.total_q != q.shape[0] or meta.total_k != k.shape[0]:
        raise ValueError(
            f"meta covers Tq={meta.total_q}, Tk={meta.total_k} tokens but q has {q.shape[0]} and k {k.shape[0]}"
        )
    return meta


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
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"k and v must have the same tokens and heads (Tk, Hkv, .), got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if v.shape[-1] == 0:
        raise ValueError("value head dim Dv must be > 0")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: q D={q.shape[-1]}, k D={k.shape[-1]}")
    h, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"query heads H={h} must be a multiple of key/value heads Hkv={hkv} (GQA/MQA)")
    if q.shape[-1] == 0:
        raise ValueError("head dim D must be > 0")


def _check_sinks(sinks: Any, q: torch.Tensor) -> None:
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating torch.Tensor of shape (H,), got {type(sinks).__name__}")
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks must have shape (H,) = ({q.shape[1]},), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device} but q is on {q.device}")


def _check_cu_device(name: str, cu: Any, q: torch.Tensor) -> None:
    if isinstance(cu, torch.Tensor) and cu.device != q.device and cu.device.type != "cpu":
        raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")


def _check_window(window_size: Any) -> tuple[int, int]:
    try:
        left, right = (operator.index(w) for w in window_size)
    except (TypeError, ValueError):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1 = unbounded), got {(left, right)}")
    return left, right
