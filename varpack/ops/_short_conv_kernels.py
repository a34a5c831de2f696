"""Triton kernels of the short causal depthwise convolution with sample boundaries (imported lazily, in
Triton's mode, by :func:`varpack.ops.short_conv.short_conv_triton`).

Layouts: x, dy ``[B, T, D]`` (channels last, any strides); weight ``[D, W]`` (``weight[:, W-1]`` multiplies the
current token); bias ``[D]``; seq_idx ``[B, T]`` integer sample index (batch stride 0 for one ``[1, T]`` row
shared by every batch row); y, dx ``[B, T, D]`` contiguous. Tap ``e`` reads ``x[t-e]`` with weight
``w_e = weight[:, W-1-e]`` when ``t-e >= 0`` and ``seq_idx[t-e] == seq_idx[t]``::

    pre[t] = bias + sum_e w_e * x[t-e] * same(t, t-e)          y[t] = act(pre[t])   (act: identity or SiLU)
    g[t]   = dy[t] * act'(pre[t])
    dx[s]  = sum_e w_e * g[s+e] * same(s+e, s)
    dw_e   = sum_t g[t] * x[t-e] * same(t, t-e)                 dbias = sum_t g[t]

Every product and sum in fp32; x, dy, weight and bias are read in their own dtype (fp32, bf16 or fp16).

With ``NORM`` a program covers one head of ``HD`` channels (``BD`` the next power of two, the lanes past ``HD``
masked) and the output is L2-normalised over the head, in fp32 before rounding (fla's and transformers'
``l2norm``, ``eps = 1e-6``; a Gated DeltaNet layer's q and k)::

    r[t] = 1 / sqrt(sum_head act(pre[t])^2 + eps)      y[t] = act(pre[t]) * r[t]
    g[t] = (dy[t] - y[t] * sum_head(dy[t] * y[t])) * r[t] * act'(pre[t])

The backward recomputes ``r`` and ``y`` from the pre-activation it recomputes anyway: nothing more is read or
saved than without the norm.

Forward (:func:`short_conv_fwd_kernel`): one program per ``(BT tokens, BD channels, batch row)``; each of the W
taps loads its shifted ``[BT, BD]`` block of x (the rows above the block come from the cache: x is read from
memory about once) and y is written once.

Backward (:func:`short_conv_bwd_kernel`): walks tokens in order. A program holds ``NR`` streams of ``RS``
consecutive tokens each (the rows of its ``[NR, BD]`` blocks; stream ``j`` starts at token ``c0 + j * RS``) over
``BD`` channels of one batch row. At each step every stream loads one token row of x and dy, ``P`` steps ahead
of its use, and keeps in registers the rows it still needs (windows carried through the loop): x at
``t-(W-1) .. t+P``, dy at ``t .. t+P``, the last W values of ``g``. It recomputes ``pre[t]`` (no saved
activation) and writes ``dx[t-(W-1)]`` at step ``t``; a stream starts ``W - 1`` rows early (x only) and runs
``W - 1`` steps past its end for the ``g`` of its last rows. Each x and dy element is read from memory once, plus
those ``W - 1`` rows at each end of a stream. The weight and bias gradients of the program's tokens are summed in
registers and written as one fp32 slice of ``DWP [NB, W, D]`` (column ``W-1-e`` holds ``dw_e``) and
``DBP [NB, D]``, ``NB = B * (programs along T)``; the caller sums the slices (a fixed order: deterministic).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

__all__ = ["INTERPRETED", "short_conv_bwd_kernel", "short_conv_fwd_kernel"]

#: the kernels below were built for Triton's interpreter (CPU tensors) rather than for a GPU
INTERPRETED: bool = bool(knobs.runtime.interpret)


@triton.jit
def _load_row(base, rows, s_t, T, d_ok):
    """Rows ``rows`` ``[NR]`` of a ``[.., T, D]`` tensor at ``base`` (channel offsets folded in) as fp32
    ``[NR, BD]``; zero outside ``[0, T)``."""
    ok = (rows >= 0) & (rows < T)
    v = tl.load(base + rows.to(tl.int64)[:, None] * s_t, mask=ok[:, None] & d_ok[None, :], other=0.0)
    return v.to(tl.float32)


@triton.jit
def _load_seq(base, rows, s_t, T, HAS_SEQ: tl.constexpr):
    """Sample index of ``rows`` ``[NR]`` (0 outside ``[0, T)``: those rows' x and dy are zero anyway)."""
    if HAS_SEQ:
        s = tl.load(base + rows * s_t, mask=(rows >= 0) & (rows < T), other=0)
    else:
        s = rows * 0
    return s


@triton.jit
def _taps(Wt, offs_d, d_ok, s_wd, s_ww, W: tl.constexpr):
    """``(w_0, .., w_{W-1})``, ``w_e = weight[:, W-1-e]`` as fp32 ``[BD]``."""
    taps = ()
    for e in tl.static_range(W):
        taps = taps + (tl.load(Wt + offs_d * s_wd + (W - 1 - e) * s_ww, mask=d_ok, other=0.0).to(tl.float32),)
    return taps


@triton.jit
def _pre(xw, sw, taps, b_bias, W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr):
    """``pre`` at the window's row ``W-1`` (``xw[W-1-e]`` = x at ``t-e``) and the masked taps' inputs
    ``x[t-e] * same(t, t-e)``."""
    xs = (xw[W - 1],)
    acc = xw[W - 1] * taps[0][None, :]
    for e in tl.static_range(1, W):
        x_e = xw[W - 1 - e]
        if HAS_SEQ:
            x_e = tl.where((sw[W - 1 - e] == sw[W - 1])[:, None], x_e, 0.0)
        xs = xs + (x_e,)
        acc += x_e * taps[e][None, :]
    if HAS_BIAS:
        acc += b_bias[None, :]
    return acc, xs


@triton.jit
def _l2norm_grad(dy, y, EPS: tl.constexpr):
    """The gradient at ``y`` ``[NR, BD]`` (one head per row; masked lanes 0) of ``y / sqrt(sum(y^2) + EPS)``
    for its output gradient ``dy``."""
    r = 1.0 / tl.sqrt(tl.sum(y * y, 1) + EPS)
    yn = y * r[:, None]
    return (dy - yn * tl.sum(dy * yn, 1)[:, None]) * r[:, None]


@triton.jit
def short_conv_fwd_kernel(
    X, Wt, Bias, SEQ, Y,
    T, D,
    s_xb, s_xt, s_xd, s_wd, s_ww, s_sb, s_st, s_yb, s_yt,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, HD: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr,
):  # fmt: skip
    i_t = tl.program_id(0)  # token blocks on axis 0: CUDA allows 2^31 - 1 there, 65,535 on axes 1 and 2
    i_d = tl.program_id(1)
    i_b = tl.program_id(2).to(tl.int64)
    rows = i_t * BT + tl.arange(0, BT)
    t_ok = rows < T
    lanes = tl.arange(0, BD)
    offs_d = i_d * HD + lanes
    d_ok = (lanes < HD) & (offs_d < D)
    x_base = X + i_b * s_xb + offs_d[None, :] * s_xd
    if HAS_SEQ:
        seq_base = SEQ + i_b * s_sb
        seq_t = tl.load(seq_base + rows * s_st, mask=t_ok, other=0)

    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for e in tl.static_range(W):
        src = rows - e
        ok = t_ok & (src >= 0)
        if HAS_SEQ:
            if e > 0:
                ok = ok & (tl.load(seq_base + src * s_st, mask=ok, other=0) == seq_t)
        w_e = tl.load(Wt + offs_d * s_wd + (W - 1 - e) * s_ww, mask=d_ok, other=0.0).to(tl.float32)
        x_e = tl.load(x_base + src.to(tl.int64)[:, None] * s_xt, mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc += x_e.to(tl.float32) * w_e[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    if NORM:  # masked lanes hold 0
        acc = acc * (1.0 / tl.sqrt(tl.sum(acc * acc, 1) + EPS))[:, None]
    out = Y + i_b * s_yb + rows.to(tl.int64)[:, None] * s_yt + offs_d[None, :]
    tl.store(out, acc.to(Y.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :])


@triton.jit
def short_conv_bwd_kernel(
    X, Wt, Bias, SEQ, DY, DX, DWP, DBP,
    T, D,
    s_xb, s_xt, s_xd, s_wd, s_ww, s_sb, s_st, s_gb, s_gt, s_gd, s_ob, s_ot,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr,
    NR: tl.constexpr, RS: tl.constexpr, BD: tl.constexpr, P: tl.constexpr,
    HD: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr,
):  # fmt: skip
    i_c = tl.program_id(0)
    i_d = tl.program_id(1)
    i_b = tl.program_id(2)
    lanes = tl.arange(0, BD)
    offs_d = i_d * HD + lanes
    d_ok = (lanes < HD) & (offs_d < D)
    start = i_c * (NR * RS) + tl.arange(0, NR) * RS
    x_base = X + i_b.to(tl.int64) * s_xb + offs_d[None, :] * s_xd
    g_base = DY + i_b.to(tl.int64) * s_gb + offs_d[None, :] * s_gd
    o_base = DX + i_b.to(tl.int64) * s_ob + offs_d[None, :]
    s_base = SEQ + i_b.to(tl.int64) * s_sb
    taps = _taps(Wt, offs_d, d_ok, s_wd, s_ww, W)
    if HAS_BIAS:
        b_bias = tl.load(Bias + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    else:
        b_bias = None

    # windows: x and sample index at rows t-(W-1) .. t+P-1, dy at t .. t+P-1, g at t-(W-1) .. t-1
    xw = ()
    sw = ()
    for k in tl.static_range(W - 1 + P):
        rows = start + (k - (W - 1))
        xw = xw + (_load_row(x_base, rows, s_xt, T, d_ok),)
        sw = sw + (_load_seq(s_base, rows, s_st, T, HAS_SEQ),)
    dyw = ()
    for k in tl.static_range(P):
        dyw = dyw + (_load_row(g_base, start + k, s_gt, T, d_ok),)
    gw = ()
    dws = ()
    for _ in tl.static_range(W - 1):
        gw = gw + (tl.zeros([NR, BD], dtype=tl.float32),)  # g before the stream: never read (dx rows < start)
    for _ in tl.static_range(W):
        dws = dws + (tl.zeros([NR, BD], dtype=tl.float32),)
    db = tl.zeros([NR, BD], dtype=tl.float32)

    for i in range(RS + W - 1):  # the last W-1 steps: g of the next rows, for this stream's last dx rows
        ahead = start + (i + P)
        xw = xw + (_load_row(x_base, ahead, s_xt, T, d_ok),)
        sw = sw + (_load_seq(s_base, ahead, s_st, T, HAS_SEQ),)
        dyw = dyw + (_load_row(g_base, ahead, s_gt, T, d_ok),)
        g = dyw[0]
        pre, xs = _pre(xw, sw, taps, b_bias, W, HAS_BIAS, HAS_SEQ)
        if SILU:
            sig = tl.sigmoid(pre)
            if NORM:
                g = _l2norm_grad(g, pre * sig, EPS)
            g = g * (sig * (1.0 + pre * (1.0 - sig)))
        elif NORM:
            g = _l2norm_grad(g, pre, EPS)
        g_own = tl.where(i < RS, g, 0.0)  # this stream's tokens: the weight and bias gradients
        db += g_own
        nd = ()
        for e in tl.static_range(W):
            nd = nd + (dws[e] + g_own * xs[e],)
        dws = nd
        gw = gw + (g,)  # g at rows s .. s+W-1, s = t-(W-1)
        dx = gw[0] * taps[0][None, :]
        for e in tl.static_range(1, W):
            g_e = gw[e]
            if HAS_SEQ:
                g_e = tl.where((sw[e] == sw[0])[:, None], g_e, 0.0)
            dx += g_e * taps[e][None, :]
        rows = start + (i - (W - 1))
        ok = (i >= W - 1) & (rows < T)
        out = o_base + rows.to(tl.int64)[:, None] * s_ot
        tl.store(out, dx.to(DX.dtype.element_ty), mask=ok[:, None] & d_ok[None, :])
        nx = ()
        ns = ()
        for k in tl.static_range(1, W + P):
            nx = nx + (xw[k],)
            ns = ns + (sw[k],)
        xw = nx
        sw = ns
        ny = ()
        for k in tl.static_range(1, P + 1):
            ny = ny + (dyw[k],)
        dyw = ny
        ng = ()
        for k in tl.static_range(1, W):
            ng = ng + (gw[k],)
        gw = ng

    blk = i_b.to(tl.int64) * tl.num_programs(0) + i_c
    for e in tl.static_range(W):
        tl.store(DWP + (blk * W + (W - 1 - e)) * D + offs_d, tl.sum(dws[e], 0), mask=d_ok)
    tl.store(DBP + blk * D + offs_d, tl.sum(db, 0), mask=d_ok)
