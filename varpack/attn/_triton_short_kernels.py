"""Triton kernels of the ``triton_short`` backend (imported lazily by :mod:`varpack.attn.triton_short`).

Tiles run over the packed row irrespective of document boundaries: a query tile of ``BLOCK_M`` tokens and key
tiles of ``BLOCK_N`` tokens may each hold several documents; the mask inside a tile is

    keep(i, j) = doc_q[i] == doc_k[j]  and  lim[i] - left <= j  and  j <= lim[i] + right

with ``lim[i]`` the key-stream position of query i's (bottom-right aligned) diagonal; ``right`` is 0 for
causal, and either bound is dropped when it is unbounded (``HAS_LEFT`` / ``HAS_RIGHT``). The key range of a
query tile (and the query range of a key tile, in the backward) comes from per-tile tables built once per
batch (:mod:`varpack.attn.triton_short`), so a tile visits only the key tiles its documents can see.

Masked and mask-free tiles (``MASK_FREE``): as in FlashAttention-2 (arXiv:2307.08691, causal masking: blocks
wholly below the diagonal need no mask) and Triton's fused-attention tutorial (its off-diagonal and diagonal
stages), each kernel splits its tile loop in three. A query tile's key tiles run from its ``lo`` in steps of
``BLOCK_N``; those lying wholly inside ``[max_i key_lo[i], min_i key_hi[i])`` (the keys that every query of
the tile sees: one document, inside every query's band) form the mask-free run ``[full_lo, full_hi)`` (a
table per tile, on the same grid). Loop 1 ``[lo, full_lo)`` and
loop 3 ``[full_hi, hi)`` apply the mask above and the ``< hi`` load bounds; loop 2 ``[full_lo, full_hi)``
loads no document id, compares nothing and bounds no load except a padded head dim (and needs no ``-inf``
guard: its scores are finite). A tile of several documents has no mask-free run (``full_lo = full_hi = hi``:
one masked loop, as with ``MASK_FREE`` off). The dK / dV kernel does the same over its key tile's query
tiles with ``[max_j query_lo[j], min_j query_hi[j])``. Padded rows of the last tile (past ``Tq`` / ``Tk``)
do not narrow the range; in loop 2 they load zeros (bounded by the tile's own ``m_ok`` / ``n_ok``) and their
results are not stored.

Forward: FlashAttention-2's online softmax (exp2 with the scale folded into log2 units), storing the
log-sum-exp ``lse`` (natural log, ``[H, Tq]`` fp32; ``+inf`` for a query that sees no key, whose output is 0,
flash-attn's convention). Backward: FlashAttention-2's: ``delta = rowsum(dO * O)``, then one kernel per key
tile and KV head for dK / dV (looping over the query heads of its GQA group: no atomics) and one per query
tile and head for dQ. By default the dQ kernel runs first and computes ``delta`` for its own rows on the way
(``DELTA_IN_DQ``), saving the separate preprocessing pass; the dK / dV kernel reads it.

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

from varpack._triton import fix_interpreter_index

__all__ = [
    "INTERPRETED",
    "attn_bwd_dkdv",
    "attn_bwd_dq",
    "attn_bwd_preprocess",
    "attn_fwd",
    "build_tile_tables",
    "build_token_tables",
]

#: the kernels below were built for Triton's interpreter (CPU tensors) rather than for a GPU
INTERPRETED: bool = bool(knobs.runtime.interpret)

if INTERPRETED:  # loop bounds are loaded scalars (varpack._triton.fix_interpreter_index)
    fix_interpreter_index()


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
def _load_d(ptrs, d_mask, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """A tile load in a mask-free loop: masked only on the head dim, and only when it is padded."""
    if HEAD_DIM == BLOCK_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=d_mask, other=0.0)
    return x


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q, doc_q, lim, K, V, DOC_K, start, end, hi, hk, qk_scale, left, right,
    stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """Online-softmax update of one query tile over the key tiles ``start, start + BLOCK_N, .. < end``.

    ``MASKED``: the document / band mask and the ``< hi`` bound are applied per element. Not ``MASKED``: every
    key of these tiles is visible to every query of the tile (the caller's mask-free range), so no document
    ids are loaded, no compare runs, and no score is ``-inf`` (no guard for an all-masked row)."""
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt_ptrs = K + offs_n[None, :] * stride_kt + hk * stride_kh + offs_d[:, None]
        v_ptrs = V + offs_n[:, None] * stride_vt + hk * stride_vh + offs_d[None, :]
        if MASKED:
            n_ok = offs_n < hi
            kt = tl.load(kt_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            s = _dot(q, kt, PRECISION, UPCAST) * qk_scale
            doc_k = tl.load(DOC_K + offs_n, mask=n_ok, other=-2)
            keep = _keep(doc_q, doc_k, lim, offs_n, left, right, HAS_LEFT, HAS_RIGHT)
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # a row with no key yet: no NaN from -inf - -inf
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            v = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            kt = _load_d(kt_ptrs, d_ok[:, None], HEAD_DIM, BLOCK_D)
            s = _dot(q, kt, PRECISION, UPCAST) * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new  # finite: every score of the tile is
            v = _load_d(v_ptrs, d_ok[None, :], HEAD_DIM, BLOCK_D)
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _query_rows(pid_m, pid_h, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, PACK_GQA: tl.constexpr):
    """``(token [BLOCK_M], query head ([BLOCK_M], or a scalar when not packed), KV head)`` of the rows of
    query tile ``pid_m``.

    Not ``PACK_GQA``: ``pid_h`` is a query head and the rows are ``BLOCK_M`` consecutive tokens of it. With
    ``PACK_GQA`` (FlashAttention-3's PackGQA layout): ``pid_h`` is a KV head and the rows are ``BLOCK_M //
    GROUP`` consecutive tokens times the ``GROUP`` query heads that share it, token-major; the query tile (and
    its tables) then spans ``BLOCK_M // GROUP`` tokens."""
    rows = tl.arange(0, BLOCK_M)
    if PACK_GQA:
        hk = pid_h
        offs_m = pid_m * (BLOCK_M // GROUP) + rows // GROUP
        heads = hk * GROUP + rows % GROUP
    else:
        hk = pid_h // GROUP
        offs_m = pid_m * BLOCK_M + rows
        heads = pid_h  # a scalar: the addressing of the unpacked kernels as before
    return offs_m, heads, hk


@triton.jit
def _program_tile(ORDER, n_heads, LPT: tl.constexpr):
    """``(tile, head)`` of this program. Not ``LPT``: the 2-D grid ``(tiles, heads)``, tiles in row order. With
    ``LPT`` (longest-processing-time first): a 1-D grid of ``tiles x n_heads`` programs, heads varying fastest,
    whose ``r``-th tile is ``ORDER[r]`` -- the tiles sorted by descending loop length, built once per batch
    (:meth:`varpack.attn.triton_short.TritonShortTables.tile_order`), so the GPU's block scheduler starts the
    longest tiles (the last query tiles of long documents, the first key tiles in the backward) first and the
    short ones fill the tail, instead of a long tile launched late holding the kernel's last wave."""
    if LPT:
        pid = tl.program_id(0)
        tile = tl.load(ORDER + pid // n_heads)
        head = pid % n_heads
    else:
        tile = tl.program_id(0)
        head = tl.program_id(1)
    return tile, head


@triton.jit
def attn_fwd(
    Q, K, V, OUT, LSE, DOC_Q, DOC_K, LIM, TILE_LO, TILE_HI, FULL_LO, FULL_HI, ORDER,
    qk_scale,  # softmax_scale * log2(e)
    total_q, left, right, n_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    MASK_FREE: tl.constexpr, PACK_GQA: tl.constexpr, LPT: tl.constexpr,
):  # fmt: skip
    """Output and lse of one query tile and head: key tiles ``[lo, hi)`` in steps of ``BLOCK_N``, the
    mask-free ones ``[FULL_LO, FULL_HI)`` without the mask when ``MASK_FREE`` (module docstring). With
    ``PACK_GQA`` the program owns one KV head and its tile's rows are (token, query head of the group) pairs
    (:func:`_query_rows`), so each K / V tile is loaded once for the whole group."""
    pid_m, pid_h = _program_tile(ORDER, n_heads, LPT)
    offs_m, heads, hk = _query_rows(pid_m, pid_h, GROUP, BLOCK_M, PACK_GQA)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < total_q
    q = tl.load(
        Q + (offs_m * stride_qt + heads * stride_qh)[:, None] + offs_d[None, :],
        mask=m_ok[:, None] & d_ok[None, :], other=0.0,
    )  # fmt: skip
    doc_q = tl.load(DOC_Q + offs_m, mask=m_ok, other=-1)
    lim = tl.load(LIM + offs_m, mask=m_ok, other=0)
    lo = tl.load(TILE_LO + pid_m)
    hi = tl.load(TILE_HI + pid_m)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if MASK_FREE:
        full_lo = tl.load(FULL_LO + pid_m)  # on the grid lo + k * BLOCK_N; hi when the tile has no full tile
        full_hi = tl.load(FULL_HI + pid_m)
    else:
        full_lo = hi
        full_hi = hi
    acc, l_i, m_i = _fwd_tiles(
        acc, l_i, m_i, q, doc_q, lim, K, V, DOC_K, lo, full_lo, hi, hk, qk_scale, left, right,
        stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok,
        HEAD_DIM, BLOCK_D, BLOCK_N, HAS_LEFT, HAS_RIGHT, PRECISION, UPCAST, True,
    )  # fmt: skip
    if MASK_FREE:
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, doc_q, lim, K, V, DOC_K, full_lo, full_hi, hi, hk, qk_scale, left, right,
            stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok,
            HEAD_DIM, BLOCK_D, BLOCK_N, HAS_LEFT, HAS_RIGHT, PRECISION, UPCAST, False,
        )  # fmt: skip
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, doc_q, lim, K, V, DOC_K, full_hi, hi, hi, hk, qk_scale, left, right,
            stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok,
            HEAD_DIM, BLOCK_D, BLOCK_N, HAS_LEFT, HAS_RIGHT, PRECISION, UPCAST, True,
        )  # fmt: skip
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    # natural-log lse; +inf where the query sees no key (flash-attn), so the backward's exp(s - lse) is 0
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tl.store(
        OUT + (offs_m * stride_ot + heads * stride_oh)[:, None] + offs_d[None, :],
        out.to(OUT.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :],
    )  # fmt: skip
    tl.store(LSE + heads * stride_lh + offs_m, lse, mask=m_ok)


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
def _dkdv_tiles(
    dk, dv, k, v, doc_k, offs_n, Q, DO, LSE, DELTA, DOC_Q, LIM, h, start, end, hi, qk_scale, left, right,
    stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, offs_d, d_ok,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    MASKED: tl.constexpr, GROUP: tl.constexpr = 1, PACK_GQA: tl.constexpr = False,
    DP_FIRST: tl.constexpr = True,
):  # fmt: skip
    """dK / dV of one key tile accumulated over the query tiles ``start, start + BLOCK_M, .. < end`` of head
    ``h``; not ``MASKED``: every query of these tiles sees every key of the tile (no mask, no bound). With
    ``PACK_GQA``, ``h`` is the KV head and each query tile is ``BLOCK_M // GROUP`` tokens times the group's
    query heads (rows token-major, as :func:`_query_rows`): one pass instead of one per query head.
    ``DP_FIRST``: ``dP^T = V dO^T`` is issued right after the scores, before the softmax (else after ``dV``'s
    update, the earlier order)."""
    rows = tl.arange(0, BLOCK_M)
    if PACK_GQA:
        heads = h * GROUP + rows % GROUP
        step = BLOCK_M // GROUP
        row_tok = rows // GROUP
    else:
        heads = h
        step = BLOCK_M
        row_tok = rows
    for start_m in range(start, end, step):
        offs_m = start_m + row_tok
        q_ptrs = Q + (offs_m * stride_qt + heads * stride_qh)[:, None] + offs_d[None, :]
        do_ptrs = DO + (offs_m * stride_dot + heads * stride_doh)[:, None] + offs_d[None, :]
        if MASKED:
            m_ok = offs_m < hi
            q_mask = m_ok[:, None] & d_ok[None, :]
            q = tl.load(q_ptrs, mask=q_mask, other=0.0)
            do = tl.load(do_ptrs, mask=q_mask, other=0.0)
            doc_q = tl.load(DOC_Q + offs_m, mask=m_ok, other=-1)
            lim = tl.load(LIM + offs_m, mask=m_ok, other=0)
            lse = (
                tl.load(LSE + heads * stride_lh + offs_m, mask=m_ok, other=float("inf")) * 1.4426950408889634
            )
            delta = tl.load(DELTA + heads * stride_lh + offs_m, mask=m_ok, other=0.0)
        else:
            q = _load_d(q_ptrs, d_ok[None, :], HEAD_DIM, BLOCK_D)
            do = _load_d(do_ptrs, d_ok[None, :], HEAD_DIM, BLOCK_D)
            lse = tl.load(LSE + heads * stride_lh + offs_m) * 1.4426950408889634
            delta = tl.load(DELTA + heads * stride_lh + offs_m)
        st = _dot(k, tl.trans(q), PRECISION, UPCAST)  # [BLOCK_N, BLOCK_M], unscaled
        if DP_FIRST:
            dpt = _dot(v, tl.trans(do), PRECISION, UPCAST)
        pt = tl.exp2(st * qk_scale - lse[None, :])
        if MASKED:
            keep = tl.trans(_keep(doc_q, doc_k, lim, offs_n, left, right, HAS_LEFT, HAS_RIGHT))
            pt = tl.where(keep, pt, 0.0)
        dv += _dot(pt.to(do.dtype), do, PRECISION, UPCAST)
        if not DP_FIRST:
            dpt = _dot(v, tl.trans(do), PRECISION, UPCAST)
        dst = pt * (dpt - delta[None, :])
        dk += _dot(dst.to(q.dtype), q, PRECISION, UPCAST)
    return dk, dv


@triton.jit
def attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, DOC_Q, DOC_K, LIM, TILE_LO, TILE_HI, FULL_LO, FULL_HI, ORDER,
    qk_scale, sm_scale, total_q, total_k, left, right, n_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    MASK_FREE: tl.constexpr, PACK_GQA: tl.constexpr, LPT: tl.constexpr,
    DP_FIRST: tl.constexpr = True,
):  # fmt: skip
    """dK, dV of one key tile and KV head: loop over the query tiles that can see it, for every query head
    of the GQA group (transposed scores ``s^T = k q^T``, FlashAttention-2 algorithm 2); with ``MASK_FREE``
    the query tiles ``[FULL_LO, FULL_HI)`` that see the whole key tile skip the mask; with ``PACK_GQA`` the
    group's heads are rows of each query tile (one loop, ``BLOCK_M // GROUP`` tokens per tile)."""
    pid_n, hk = _program_tile(ORDER, n_heads, LPT)
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
    if MASK_FREE:
        full_lo = tl.load(FULL_LO + pid_n)  # on the grid lo + k * BLOCK_M; hi when no full query tile
        full_hi = tl.load(FULL_HI + pid_n)
    else:
        full_lo = hi
        full_hi = hi
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(1 if PACK_GQA else GROUP):
        h = hk if PACK_GQA else hk * GROUP + g
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, doc_k, offs_n, Q, DO, LSE, DELTA, DOC_Q, LIM, h, lo, full_lo, hi, qk_scale, left,
            right, stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, offs_d, d_ok,
            HEAD_DIM, BLOCK_D, BLOCK_M, HAS_LEFT, HAS_RIGHT, PRECISION, UPCAST, True, GROUP, PACK_GQA,
            DP_FIRST,
        )  # fmt: skip
        if MASK_FREE:
            dk, dv = _dkdv_tiles(
                dk, dv, k, v, doc_k, offs_n, Q, DO, LSE, DELTA, DOC_Q, LIM, h, full_lo, full_hi, hi, qk_scale,
                left, right, stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, offs_d, d_ok,
                HEAD_DIM, BLOCK_D, BLOCK_M, HAS_LEFT, HAS_RIGHT, PRECISION, UPCAST, False, GROUP, PACK_GQA,
                DP_FIRST,
            )  # fmt: skip
            dk, dv = _dkdv_tiles(
                dk, dv, k, v, doc_k, offs_n, Q, DO, LSE, DELTA, DOC_Q, LIM, h, full_hi, hi, hi, qk_scale,
                left, right, stride_qt, stride_qh, stride_dot, stride_doh, stride_lh, offs_d, d_ok,
                HEAD_DIM, BLOCK_D, BLOCK_M, HAS_LEFT, HAS_RIGHT, PRECISION, UPCAST, True, GROUP, PACK_GQA,
                DP_FIRST,
            )  # fmt: skip
    tl.store(
        DK + offs_n[:, None] * stride_dkt + hk * stride_dkh + offs_d[None, :],
        (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_mask,
    )  # fmt: skip
    tl.store(
        DV + offs_n[:, None] * stride_dvt + hk * stride_dvh + offs_d[None, :],
        dv.to(DV.dtype.element_ty), mask=kv_mask,
    )  # fmt: skip


@triton.jit
def _dq_tiles(
    dq, q, do, lse, delta, doc_q, lim, K, V, DOC_K, hk, start, end, hi, qk_scale, left, right,
    stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    MASKED: tl.constexpr, DP_FIRST: tl.constexpr = True,
):  # fmt: skip
    """dQ of one query tile accumulated over the key tiles ``start, start + BLOCK_N, .. < end``; not
    ``MASKED``: every key of these tiles is visible to every query of the tile (no mask, no bound).
    ``DP_FIRST``: as :func:`_dkdv_tiles`'."""
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt_ptrs = K + offs_n[None, :] * stride_kt + hk * stride_kh + offs_d[:, None]
        vt_ptrs = V + offs_n[None, :] * stride_vt + hk * stride_vh + offs_d[:, None]
        if MASKED:
            n_ok = offs_n < hi
            kv_mask = n_ok[None, :] & d_ok[:, None]
            kt = tl.load(kt_ptrs, mask=kv_mask, other=0.0)
            vt = tl.load(vt_ptrs, mask=kv_mask, other=0.0)
            doc_k = tl.load(DOC_K + offs_n, mask=n_ok, other=-2)
        else:
            kt = _load_d(kt_ptrs, d_ok[:, None], HEAD_DIM, BLOCK_D)
            vt = _load_d(vt_ptrs, d_ok[:, None], HEAD_DIM, BLOCK_D)
        s = _dot(q, kt, PRECISION, UPCAST)  # unscaled
        if DP_FIRST:
            dp = _dot(do, vt, PRECISION, UPCAST)
        p = tl.exp2(s * qk_scale - lse[:, None])
        if MASKED:
            keep = _keep(doc_q, doc_k, lim, offs_n, left, right, HAS_LEFT, HAS_RIGHT)
            p = tl.where(keep, p, 0.0)
        if not DP_FIRST:
            dp = _dot(do, vt, PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(kt.dtype), tl.trans(kt), PRECISION, UPCAST)
    return dq


@triton.jit
def attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, DOC_Q, DOC_K, LIM, TILE_LO, TILE_HI, FULL_LO, FULL_HI, OUT, ORDER,
    qk_scale, sm_scale, total_q, left, right, n_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    MASK_FREE: tl.constexpr, PACK_GQA: tl.constexpr, DELTA_IN_DQ: tl.constexpr, LPT: tl.constexpr,
    DP_FIRST: tl.constexpr = True,
):  # fmt: skip
    """dQ of one query tile and head: loop over the key tiles its documents can see; with ``MASK_FREE`` the
    key tiles ``[FULL_LO, FULL_HI)`` that every query of the tile sees whole skip the mask; with ``PACK_GQA``
    the tile's rows are the GQA group's heads of ``BLOCK_M // GROUP`` tokens (:func:`_query_rows`).

    ``DELTA_IN_DQ``: the tile's ``delta = rowsum(dO * O)`` is computed here from ``OUT`` (the grid covers every
    (token, query head) row once) and stored to ``DELTA`` for the dK / dV kernel launched after this one, in
    place of :func:`attn_bwd_preprocess`'s separate pass over O and dO (dO is loaded here anyway); otherwise it
    is read from ``DELTA``."""
    pid_m, pid_h = _program_tile(ORDER, n_heads, LPT)
    offs_m, heads, hk = _query_rows(pid_m, pid_h, GROUP, BLOCK_M, PACK_GQA)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < total_q
    q_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(
        Q + (offs_m * stride_qt + heads * stride_qh)[:, None] + offs_d[None, :], mask=q_mask, other=0.0
    )
    do = tl.load(
        DO + (offs_m * stride_dot + heads * stride_doh)[:, None] + offs_d[None, :], mask=q_mask, other=0.0
    )
    doc_q = tl.load(DOC_Q + offs_m, mask=m_ok, other=-1)
    lim = tl.load(LIM + offs_m, mask=m_ok, other=0)
    # padded rows: lse +inf, so their p is 0 in the mask-free loop too (their dq is not stored anyway)
    lse = tl.load(LSE + heads * stride_lh + offs_m, mask=m_ok, other=float("inf")) * 1.4426950408889634
    if DELTA_IN_DQ:
        o = tl.load(
            OUT + (offs_m * stride_ot + heads * stride_oh)[:, None] + offs_d[None, :], mask=q_mask, other=0.0
        )
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + heads * stride_lh + offs_m, delta, mask=m_ok)
    else:
        delta = tl.load(DELTA + heads * stride_lh + offs_m, mask=m_ok, other=0.0)
    lo = tl.load(TILE_LO + pid_m)
    hi = tl.load(TILE_HI + pid_m)
    if MASK_FREE:
        full_lo = tl.load(FULL_LO + pid_m)
        full_hi = tl.load(FULL_HI + pid_m)
    else:
        full_lo = hi
        full_hi = hi
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _dq_tiles(
        dq, q, do, lse, delta, doc_q, lim, K, V, DOC_K, hk, lo, full_lo, hi, qk_scale, left, right,
        stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok,
        HEAD_DIM, BLOCK_D, BLOCK_N, HAS_LEFT, HAS_RIGHT, PRECISION, UPCAST, True, DP_FIRST,
    )  # fmt: skip
    if MASK_FREE:
        dq = _dq_tiles(
            dq, q, do, lse, delta, doc_q, lim, K, V, DOC_K, hk, full_lo, full_hi, hi, qk_scale, left, right,
            stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok,
            HEAD_DIM, BLOCK_D, BLOCK_N, HAS_LEFT, HAS_RIGHT, PRECISION, UPCAST, False, DP_FIRST,
        )  # fmt: skip
        dq = _dq_tiles(
            dq, q, do, lse, delta, doc_q, lim, K, V, DOC_K, hk, full_hi, hi, hi, qk_scale, left, right,
            stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok,
            HEAD_DIM, BLOCK_D, BLOCK_N, HAS_LEFT, HAS_RIGHT, PRECISION, UPCAST, True, DP_FIRST,
        )  # fmt: skip
    tl.store(
        DQ + (offs_m * stride_dqt + heads * stride_dqh)[:, None] + offs_d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask,
    )  # fmt: skip


# -- per-batch tables in two launches (instead of ~40 + ~25 per tile size of small PyTorch ops) -------------


@triton.jit
def _segment_of(CU, n, pos, STEPS: tl.constexpr):
    """Segment of each position: the count of ``CU[1..n]`` that are ``<= pos`` (``searchsorted(cu[1:], pos,
    right=True)``, as :meth:`varpack.varlen.VarlenMeta.seq_idx` builds it), by a vectorised upper-bound binary
    search of ``STEPS = bit_length(n)`` steps; ``pos`` int64."""
    first = tl.zeros(pos.shape, dtype=tl.int64)
    count = tl.zeros(pos.shape, dtype=tl.int64) + n
    for _ in range(STEPS):
        half = count // 2
        probe = first + half
        active = count > 0
        le = active & (tl.load(CU + probe + 1, mask=active, other=0).to(tl.int64) <= pos)
        first = tl.where(le, probe + 1, first)
        count = tl.where(active, tl.where(le, count - half - 1, half), 0)
    return first


@triton.jit
def build_token_tables(
    CU_Q, CU_K, SEQ_Q, DOC_Q, LIM, KEY_LO, KEY_HI, DOC_K, QUERY_LO, QUERY_HI,
    n, total_q, total_k, left, right,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, GIVEN_DOC: tl.constexpr, SELF: tl.constexpr,
    STEPS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """:meth:`varpack.attn.triton_short.TritonShortTables.build` in one launch: per query token its document
    (given in ``SEQ_Q`` when ``GIVEN_DOC``, else searched in ``CU_Q``), diagonal ``lim`` and visible key range
    ``[KEY_LO, KEY_HI)``; per key token its document and the range of queries that see it (empty ranges as the
    ``[BIG, 0)`` sentinel). ``SELF``: the keys are the queries' stream (``CU_K`` is ``CU_Q``, equal totals)."""
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    big = 2147483647
    m_q = offs < total_q
    if GIVEN_DOC:
        doc = tl.load(SEQ_Q + offs, mask=m_q, other=0).to(tl.int64)
    else:
        doc = _segment_of(CU_Q, n, offs, STEPS)
    doc = tl.where(m_q, doc, 0)
    q_end = tl.load(CU_Q + doc + 1, mask=m_q, other=0).to(tl.int64)
    k_start = tl.load(CU_K + doc, mask=m_q, other=0).to(tl.int64)
    k_end = tl.load(CU_K + doc + 1, mask=m_q, other=0).to(tl.int64)
    lim = offs + (k_end - q_end)
    lo = k_start
    hi = k_end
    if HAS_LEFT:
        lo = tl.maximum(lo, lim - left)
    if HAS_RIGHT:
        hi = tl.minimum(hi, lim + right + 1)
    empty = hi <= lo
    tl.store(DOC_Q + offs, doc.to(tl.int32), mask=m_q)
    tl.store(LIM + offs, lim.to(tl.int32), mask=m_q)
    tl.store(KEY_LO + offs, tl.where(empty, big, lo), mask=m_q)
    tl.store(KEY_HI + offs, tl.where(empty, 0, hi), mask=m_q)

    m_k = offs < total_k
    if SELF:
        doc_k = doc
    else:
        doc_k = tl.where(m_k, _segment_of(CU_K, n, offs, STEPS), 0)
    q_start = tl.load(CU_Q + doc_k, mask=m_k, other=0).to(tl.int64)
    q_stop = tl.load(CU_Q + doc_k + 1, mask=m_k, other=0).to(tl.int64)
    shift = tl.load(CU_K + doc_k + 1, mask=m_k, other=0).to(tl.int64) - q_stop
    qlo = q_start
    qhi = q_stop
    if HAS_RIGHT:
        qlo = tl.maximum(qlo, offs - right - shift)
    if HAS_LEFT:
        qhi = tl.minimum(qhi, offs + left - shift + 1)
    empty_k = qhi <= qlo
    tl.store(DOC_K + offs, doc_k.to(tl.int32), mask=m_k)
    tl.store(QUERY_LO + offs, tl.where(empty_k, big, qlo), mask=m_k)
    tl.store(QUERY_HI + offs, tl.where(empty_k, 0, qhi), mask=m_k)


@triton.jit
def _floor_div(a, b):
    """``floor(a / b)`` for int64 ``a`` and ``b > 0`` (Triton's ``//`` truncates toward zero)."""
    return tl.where(a >= 0, a // b, -((-a + b - 1) // b))


@triton.jit
def build_tile_tables(
    LO, HI, TILE_LO, TILE_HI, FULL_LO, FULL_HI, total, step,
    TILE: tl.constexpr,
):  # fmt: skip
    """The tile tables of one tile size in one launch (one program per tile of ``TILE`` rows), as
    :meth:`~varpack.attn.triton_short.TritonShortTables.query_tiles` / ``_full`` compute them: the union range
    ``[min LO, max HI)`` the tile's loop visits, and its mask-free run ``[FULL_LO, FULL_HI)`` on the loop's
    grid ``TILE_LO + k * step`` inside the range every row sees (``[max LO, min HI)``; padded rows past
    ``total`` left out; none: ``FULL_LO = FULL_HI = TILE_HI``)."""
    t = tl.program_id(0)
    rows = t * TILE + tl.arange(0, TILE)
    ok = rows < total
    big = 2147483647
    lo_r = tl.load(LO + rows, mask=ok, other=big).to(tl.int64)
    hi_r = tl.load(HI + rows, mask=ok, other=0).to(tl.int64)
    lo = tl.min(lo_r, 0)
    hi = tl.max(hi_r, 0)
    s_lo = tl.max(tl.where(ok, lo_r, 0), 0)
    s_hi = tl.min(tl.where(ok, hi_r, big), 0)
    shared = s_hi > s_lo
    s_lo = tl.where(shared, s_lo, big)
    s_hi = tl.where(shared, s_hi, 0)
    start = lo + _floor_div(s_lo - lo + step - 1, step) * step
    end = start + _floor_div(s_hi - start, step) * step
    some = (s_hi > s_lo) & (end > start)
    tl.store(TILE_LO + t, lo.to(tl.int32))
    tl.store(TILE_HI + t, hi.to(tl.int32))
    tl.store(FULL_LO + t, tl.where(some, start, hi).to(tl.int32))
    tl.store(FULL_HI + t, tl.where(some, end, hi).to(tl.int32))
