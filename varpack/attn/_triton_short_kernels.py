"""Triton kernels of the ``triton_short`` backend (imported lazily by :mod:`varpack.attn.triton_short`).

Tiles run over the packed row irrespective of document boundaries: a query tile of ``BLOCK_M`` tokens and key
tiles of ``BLOCK_N`` tokens may each hold several documents; the mask inside a tile is

    keep(i, j) = doc_q[i] == doc_k[j]  and  lim[i] - left <= j  and  j <= lim[i] + right

with ``lim[i]`` the key-stream position of query i's (bottom-right aligned) diagonal; ``right`` is 0 for
causal, and either bound is dropped when it is unbounded (``HAS_LEFT`` / ``HAS_RIGHT``). The key range of a
query tile (and the query range of a key tile, in the backward) comes from per-tile tables built once per
batch (:mod:`varpack.attn.triton_short`), so a tile visits only the key tiles its documents can see.

Forward: FlashAttention-2's online softmax (exp2 with the scale folded into log2 units), storing the
log-sum-exp ``lse`` (natural log, ``[H, Tq]`` fp32; ``+inf`` for a query that sees no key, whose output is 0,
flash-attn's convention). Backward: FlashAttention-2's: ``delta = rowsum(dO * O)``, then one kernel per key
tile and KV head for dK / dV (looping over the query heads of its GQA group: no atomics) and one per query
tile and head for dQ.

Whether these kernels run interpreted (``TRITON_INTERPRET=1``, NumPy on the CPU) is fixed by ``triton.jit``
when this module is imported, and must agree with Triton's own import (its library functions are
``triton.jit`` too): :data:`INTERPRETED` records it.

Sources: FlashAttention-2 (Dao, 2023, arXiv:2307.08691, algorithms 1 and 2); Triton's fused-attention
tutorial (triton-lang/triton, python/tutorials/06-fused-attention.py).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

__all__ = ["INTERPRETED", "attn_bwd_dkdv", "attn_bwd_dq", "attn_bwd_preprocess", "attn_fwd"]

#: the kernels below were built for Triton's interpreter (CPU tensors) rather than for a GPU
INTERPRETED: bool = bool(knobs.runtime.interpret)


def _fix_interpreter_index() -> None:
    """Triton <= 3.6's interpreter turns a scalar tensor into a loop bound with ``int(array_of_shape_1)``,
    which NumPy >= 2.4 refuses (triton-lang/triton#9171, fixed upstream by #9172 with ``.squeeze()``). The
    kernels' loop bounds are loaded scalars, so under the interpreter the same fix is applied here, wrapping
    the interpreter's per-launch tensor patch (nothing changes for compiled GPU kernels)."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "__varpack_index_fix__", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.__varpack_index_fix__ = True
    interpreter._patch_lang_tensor = patched


if INTERPRETED:
    _fix_interpreter_index()


@triton.jit
def _keep(doc_i, doc_j, lim_i, offs_j, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """[len(i), len(j)] mask: same document, inside the (causal / window) band of each query."""
    keep = doc_i[:, None] == doc_j[None, :]
    if HAS_RIGHT:
        keep = keep & (offs_j[None, :] <= lim_i[:, None] + right)
    if HAS_LEFT:
        keep = keep & (offs_j[None, :] >= lim_i[:, None] - left)
    return keep


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32. ``UPCAST`` (interpreter, bf16 only): Triton 3.6's interpreter multiplies
    bf16 blocks as their raw 16-bit integers, so they are widened to fp32 first -- the same products (a bf16
    product is exact in fp32) and fp32 accumulation as the GPU's tensor cores."""
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def attn_fwd(
    Q, K, V, OUT, LSE, DOC_Q, DOC_K, LIM, TILE_LO, TILE_HI,
    qk_scale,  # softmax_scale * log2(e)
    total_q, left, right,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < total_q
    q = tl.load(
        Q + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_ok[:, None] & d_ok[None, :], other=0.0,
    )  # fmt: skip
    doc_q = tl.load(DOC_Q + offs_m, mask=m_ok, other=-1)
    lim = tl.load(LIM + offs_m, mask=m_ok, other=0)
    lo = tl.load(TILE_LO + pid_m)
    hi = tl.load(TILE_HI + pid_m)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        kt = tl.load(
            K + offs_n[None, :] * stride_kt + hk * stride_kh + offs_d[:, None],
            mask=n_ok[None, :] & d_ok[:, None], other=0.0,
        )  # fmt: skip
        s = _dot(q, kt, PRECISION, UPCAST) * qk_scale
        doc_k = tl.load(DOC_K + offs_n, mask=n_ok, other=-2)
        keep = _keep(doc_q, doc_k, lim, offs_n, left, right, HAS_LEFT, HAS_RIGHT)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no NaN from -inf - -inf
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + offs_n[:, None] * stride_vt + hk * stride_vh + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :], other=0.0,
        )  # fmt: skip
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    # natural-log lse; +inf where the query sees no key (flash-attn), so the backward's exp(s - lse) is 0
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tl.store(
        OUT + offs_m[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(OUT.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :],
    )  # fmt: skip
    tl.store(LSE + h * stride_lh + offs_m, lse, mask=m_ok)


@triton.jit
def attn_bwd_preprocess(
    OUT, DO, DELTA, total_q, stride_ot, stride_oh, stride_dot, stride_doh, stride_dh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """``delta[h, i] = sum_d dO[i, h, d] * O[i, h, d]`` (fp32)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < total_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(OUT + offs_m[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + offs_m[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + h * stride_dh + offs_m, delta, mask=offs_m < total_q)


@triton.jit
def attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, DOC_Q, DOC_K, LIM, TILE_LO, TILE_HI,
    qk_scale, sm_scale, total_q, total_k, left, right,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """dK, dV of one key tile and KV head: loop over the query tiles that can see it, for every query head
    of the GQA group (transposed scores ``s^T = k q^T``, FlashAttention-2 algorithm 2)."""
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n_ok = offs_n < total_k
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + offs_n[:, None] * stride_kt + hk * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + offs_n[:, None] * stride_vt + hk * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    doc_k = tl.load(DOC_K + offs_n, mask=n_ok, other=-2)
    lo = tl.load(TILE_LO + pid_n)
    hi = tl.load(TILE_HI + pid_n)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_ok = offs_m < hi
            q_mask = m_ok[:, None] & d_ok[None, :]
            q = tl.load(
                Q + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask, other=0.0
            )
            do = tl.load(
                DO + offs_m[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=q_mask, other=0.0
            )  # fmt: skip
            doc_q = tl.load(DOC_Q + offs_m, mask=m_ok, other=-1)
            lim = tl.load(LIM + offs_m, mask=m_ok, other=0)
            lse = tl.load(LSE + h * stride_lh + offs_m, mask=m_ok, other=float("inf")) * 1.4426950408889634
            delta = tl.load(DELTA + h * stride_lh + offs_m, mask=m_ok, other=0.0)
            st = _dot(k, tl.trans(q), PRECISION, UPCAST) * qk_scale  # [BLOCK_N, BLOCK_M]
            keep = tl.trans(_keep(doc_q, doc_k, lim, offs_n, left, right, HAS_LEFT, HAS_RIGHT))
            pt = tl.where(keep, tl.exp2(st - lse[None, :]), 0.0)
            dv += _dot(pt.to(do.dtype), do, PRECISION, UPCAST)
            dpt = _dot(v, tl.trans(do), PRECISION, UPCAST)
            dst = pt * (dpt - delta[None, :])
            dk += _dot(dst.to(q.dtype), q, PRECISION, UPCAST)
    tl.store(
        DK + offs_n[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :],
        (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask,
    )  # fmt: skip
    tl.store(
        DV + offs_n[:, None] * stride_dvt + hk * stride_dvh + offs_d[None, :],
        dv.to(DV.dtype.element_ty), mask=kv_mask,
    )  # fmt: skip


@triton.jit
def attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, DOC_Q, DOC_K, LIM, TILE_LO, TILE_HI,
    qk_scale, sm_scale, total_q, left, right,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """dQ of one query tile and head: loop over the key tiles its documents can see."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < total_q
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + offs_m[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=q_mask, other=0.0)
    doc_q = tl.load(DOC_Q + offs_m, mask=m_ok, other=-1)
    lim = tl.load(LIM + offs_m, mask=m_ok, other=0)
    lse = tl.load(LSE + h * stride_lh + offs_m, mask=m_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + h * stride_lh + offs_m, mask=m_ok, other=0.0)
    lo = tl.load(TILE_LO + pid_m)
    hi = tl.load(TILE_HI + pid_m)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        kv_mask = n_ok[None, :] & d_ok[:, None]
        kt = tl.load(
            K + offs_n[None, :] * stride_kt + hk * stride_kh + offs_d[:, None], mask=kv_mask, other=0.0
        )
        vt = tl.load(
            V + offs_n[None, :] * stride_vt + hk * stride_vh + offs_d[:, None], mask=kv_mask, other=0.0
        )
        doc_k = tl.load(DOC_K + offs_n, mask=n_ok, other=-2)
        s = _dot(q, kt, PRECISION, UPCAST) * qk_scale
        keep = _keep(doc_q, doc_k, lim, offs_n, left, right, HAS_LEFT, HAS_RIGHT)
        p = tl.where(keep, tl.exp2(s - lse[:, None]), 0.0)
        dp = _dot(do, vt, PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(kt.dtype), tl.trans(kt), PRECISION, UPCAST)
    tl.store(
        DQ + offs_m[:, None] * stride_dqt + h * stride_dqh + offs_d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask,
    )  # fmt: skip
