"""Triton kernel of ``fla_hybrid``'s ``dq, dk, dw, dg`` step (imported lazily, in Triton's mode, by
:func:`varpack.ops.gated_delta_rule.fla_hybrid.chunk_bwd_dqkwg_triton`).

One program per (chunk, key block, value head): the chunk's gradients in the chunk form documented in
:mod:`varpack.ops.gated_delta_rule.fla_hybrid` (the quantities of fla 0.6.0's ``chunk_bwd_dqkwg``, written
from the chunk equations)::

    dQ  = scale * exp(G) * (dO S^T) + dS K           dS = scale * tril(dO V'^T * exp(G_i - G_j))
    dK  = exp(G_last - G) * (V' dS'^T) + dS^T Q
    dW  = -dV' S^T
    dG  = rowsum(dQ * Q) - rowsum(dK * K);  dG_last += exp(G_last) <S, dS'> + sum(dK_inter * K)

fla's own kernel is miscompiled on Hopper by Triton >= 3.4, < 3.7.1 (github.com/fla-org/flash-linear-attention/issues/640; fla pull request 826 traced it to
``tl.trans`` of a ``tl.dot`` result, ``dS^T``, fed to another ``tl.dot``). This kernel never transposes a
``tl.dot`` result: ``dS^T`` is its own product ``V' dO^T`` of operands loaded transposed from memory, and every
transposed operand (``S^T``, ``dS'^T``, ``V'^T``, ``dO^T``) is loaded through swapped strides. It is verified
against the batched PyTorch step (:func:`chunk_bwd_dqkwg_torch`) on the GPU and, interpreted, on the CPU.

Layouts (one packed row): q, k ``[T, Hk, K]``; v_new, do, dv ``[T, H, V]``; g ``[T, H]`` fp32 log2 units;
h, dh ``[NT, H, K, V]``; the chunk table ``start``, ``length`` ``[NT]`` int32 (fla's chunk order). Outputs:
dq, dk ``[T, H, K]`` fp32 per *value* head (summed over each q/k head's group by the caller); dw ``[T, H, K]``;
dg ``[NK, T, H]`` fp32 (one slice per key block, summed by the caller).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

__all__ = ["INTERPRETED", "chunk_bwd_dqkwg_kernel"]

#: the kernel below was built for Triton's interpreter (CPU tensors) rather than for a GPU
INTERPRETED: bool = bool(knobs.runtime.interpret)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32: IEEE fp32 for fp32 operands (no TF32); ``UPCAST`` (interpreter, bf16):
    Triton 3.6's interpreter multiplies bf16 blocks as raw integers, so they are widened first (a bf16 product
    is exact in fp32: the same values as the tensor cores' fp32 accumulation)."""
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def chunk_bwd_dqkwg_kernel(
    Q, K, VN, DO, DV, G, Hs, DHs, CH_START, CH_LEN,
    DQ, DK, DW, DG,
    scale, T,
    s_qt, s_qh, s_vt, s_vh, s_gt, s_hn, s_hh, s_hk, s_hv, s_ot, s_oh, s_dwt, s_dwh, s_gk,
    GROUP: tl.constexpr, KDIM: tl.constexpr, VDIM: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    MM: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    i_t = tl.program_id(0)  # chunks on axis 0: CUDA allows 2^31 - 1 there, 65,535 on axes 1 and 2
    i_k = tl.program_id(1)
    i_h = tl.program_id(2)
    i_hk = i_h // GROUP
    start = tl.load(CH_START + i_t).to(tl.int64)
    n = tl.load(CH_LEN + i_t)
    if n == 0:  # a padding row of a fixed-size table: no token, nothing to write
        return
    offs_t = tl.arange(0, BT)
    t_ok = offs_t < n
    rows = start + offs_t
    offs_k = i_k * BK + tl.arange(0, BK)
    k_ok = offs_k < KDIM
    h_base = i_t.to(tl.int64) * s_hn + i_h * s_hh

    b_dq = tl.zeros([BT, BK], dtype=tl.float32)  # dO S^T
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)  # V' dS'^T
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)  # dV' S^T
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)  # dO V'^T
    b_dst = tl.zeros([BT, BT], dtype=tl.float32)  # V' dO^T (the transpose, as its own product)
    b_hdh = tl.zeros([BK], dtype=tl.float32)  # <S, dS'> over this key block, per key row
    for i_v in range(0, VDIM, BV):
        offs_v = i_v + tl.arange(0, BV)
        v_ok = offs_v < VDIM
        tv = t_ok[:, None] & v_ok[None, :]
        vt = v_ok[:, None] & t_ok[None, :]
        kv = v_ok[:, None] & k_ok[None, :]
        tok_v = rows[:, None] * s_vt + i_h * s_vh + offs_v[None, :]  # [BT, BV]
        tok_vt = rows[None, :] * s_vt + i_h * s_vh + offs_v[:, None]  # [BV, BT]
        b_v = tl.load(VN + tok_v, mask=tv, other=0.0)
        b_do = tl.load(DO + tok_v, mask=tv, other=0.0)
        b_dv = tl.load(DV + tok_v, mask=tv, other=0.0)
        b_vt = tl.load(VN + tok_vt, mask=vt, other=0.0)
        b_dot = tl.load(DO + tok_vt, mask=vt, other=0.0)
        st = h_base + offs_v[:, None] * s_hv + offs_k[None, :] * s_hk  # [BV, BK]: S^T
        b_ht = tl.load(Hs + st, mask=kv, other=0.0)
        b_dht = tl.load(DHs + st, mask=kv, other=0.0)
        # every operand in MM: the states' dtype (fla's kernel: bf16 tl.dot operands, fp32 accumulation) or fp32
        b_ht = b_ht.to(MM)
        b_dht = b_dht.to(MM)
        b_v = b_v.to(MM)
        b_do = b_do.to(MM)
        b_dv = b_dv.to(MM)
        b_vt = b_vt.to(MM)
        b_dot = b_dot.to(MM)
        b_dq += _dot(b_do, b_ht, IEEE, UPCAST)
        b_dk += _dot(b_v, b_dht, IEEE, UPCAST)
        b_dw += _dot(b_dv, b_ht, IEEE, UPCAST)
        b_ds += _dot(b_do, b_vt, IEEE, UPCAST)
        b_dst += _dot(b_v, b_dot, IEEE, UPCAST)
        b_hdh += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), 0)

    b_g = tl.load(G + rows * s_gt + i_h, mask=t_ok, other=0.0)
    g_last = tl.load(G + (start + n - 1) * s_gt + i_h)
    tk = t_ok[:, None] & k_ok[None, :]
    tok_k = rows[:, None] * s_qt + i_hk * s_qh + offs_k[None, :]
    b_q = tl.load(Q + tok_k, mask=tk, other=0.0)
    b_k = tl.load(K + tok_k, mask=tk, other=0.0)

    b_dq = b_dq * (tl.exp2(b_g) * scale)[:, None]
    b_dk = b_dk * tl.where(t_ok, tl.exp2(g_last - b_g), 0.0)[:, None]
    qf = b_q.to(tl.float32)
    kf = b_k.to(tl.float32)
    dg_last = tl.sum(b_hdh, 0) * tl.exp2(g_last) + tl.sum(tl.sum(b_dk * kf, 1), 0)

    # intra-chunk: dS[i, j] (i >= j) and its transpose dS^T[j, i], each from its own product
    ii = offs_t[:, None]
    jj = offs_t[None, :]
    both = t_ok[:, None] & t_ok[None, :]
    lower = (ii >= jj) & both
    upper = (ii <= jj) & both
    e_low = tl.where(lower, b_g[:, None] - b_g[None, :], float("-inf"))  # g_i - g_j, row i, column j
    e_up = tl.where(upper, b_g[None, :] - b_g[:, None], float("-inf"))  # g_col - g_row for dS^T
    b_ds = b_ds * tl.exp2(e_low) * scale
    b_dst = b_dst * tl.exp2(e_up) * scale
    b_dq += _dot(b_ds.to(MM), b_k.to(MM), IEEE, UPCAST)
    b_dk += _dot(b_dst.to(MM), b_q.to(MM), IEEE, UPCAST)

    b_dg = tl.sum(b_dq * qf, 1) - tl.sum(b_dk * kf, 1)
    b_dg = tl.where(offs_t == n - 1, b_dg + dg_last, b_dg)

    out = rows[:, None] * s_ot + i_h * s_oh + offs_k[None, :]
    tl.store(DQ + out, b_dq.to(DQ.dtype.element_ty), mask=tk)
    tl.store(DK + out, b_dk, mask=tk)
    dw_out = rows[:, None] * s_dwt + i_h * s_dwh + offs_k[None, :]
    tl.store(DW + dw_out, (-b_dw).to(DW.dtype.element_ty), mask=tk)
    tl.store(DG + i_k * s_gk + rows * s_gt + i_h, b_dg, mask=t_ok)
