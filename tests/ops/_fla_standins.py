"""PyTorch stand-ins for the fla-core 0.6.0 internal kernels that ``fla_hybrid`` calls, for CPU tests.

fla's Triton kernels do not run under Triton's interpreter, so the CPU tests of the hybrid pipeline (the
wiring: which tensor goes where, log2 units, the reverse cumsum of ``dg``, the l2norm backward) run it on
these stand-ins: same names, keyword parameters, tensor layouts and meanings as fla 0.6.0 (read from its
kernels, written here per chunk in plain PyTorch; fp64 capable). ``prepare_wy_repr_bwd`` is the vjp of
``recompute_w_u_fwd`` (with ``A`` recomputed from ``k, beta, g``) by autograd. The GPU tests run fla itself.
"""

from __future__ import annotations

import math

import torch

RCP_LN2 = 1.0 / math.log(2.0)


def _acc(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _chunks(cu_seqlens, chunk_indices, chunk_size=64):
    """``(sequence, first token, end)`` of every chunk row; a row at or past its sequence's end (a padding row
    of a fixed-size table, varpack.ops._fla.fla_chunk_tables) holds no token and is dropped, as fla's kernels
    mask every token of it. Padding rows come after the real ones, so a kept row's position is its index."""
    cu = cu_seqlens.tolist()
    rows = [
        (n, cu[n] + j * chunk_size, min(cu[n] + (j + 1) * chunk_size, cu[n + 1]))
        for n, j in chunk_indices.tolist()
    ]
    kept = [r for r in rows if r[1] < r[2]]
    assert rows[: len(kept)] == kept, "padding rows must follow the real chunks"
    return kept


def _grp(x, H):  # [.., Hk, D] -> [.., H, D]
    return x.repeat_interleave(H // x.shape[-2], dim=-2)


def l2norm_fwd(x, eps=1e-6, output_dtype=None):
    xf = x.to(_acc(x))
    rstd = torch.rsqrt((xf * xf).sum(-1) + eps)
    return (xf * rstd[..., None]).to(x.dtype), rstd.float() if x.dtype != torch.float64 else rstd


def l2norm_bwd(y, rstd, dy, eps=1e-6):
    yf, dyf = y.to(_acc(y)), dy.to(_acc(y))
    r = rstd.to(yf.dtype)[..., None]
    return (dyf * r - (dyf * yf).sum(-1, keepdim=True) * yf * r).to(y.dtype)


def prepare_chunk_indices(cu_seqlens, chunk_size, cu_seqlens_cpu=None):
    src = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
    rows = [[n, j] for n in range(len(src) - 1) for j in range(-(-(src[n + 1] - src[n]) // chunk_size))]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2).to(cu_seqlens.device)


def chunk_local_cumsum(g, chunk_size, reverse=False, scale=None, cu_seqlens=None, chunk_indices=None, **kw):
    out = torch.zeros_like(g, dtype=_acc(g))
    for _, t0, t1 in _chunks(cu_seqlens, chunk_indices, chunk_size):
        x = g[:, t0:t1].to(out.dtype)
        c = x.flip(1).cumsum(1).flip(1) if reverse else x.cumsum(1)
        out[:, t0:t1] = c * scale if scale is not None else c
    return out


def _A_chunk(k, beta, g2):
    """(I + strictly lower beta_i k_i.k_j exp2(g_i - g_j))^-1 for one chunk: k [L, H, K], beta/g2 [L, H]."""
    L = k.shape[0]
    kk = torch.einsum("ihk,jhk->hij", k, k)
    strict = torch.ones(L, L, dtype=torch.bool).tril(-1)
    decay = torch.exp2((g2.T[:, :, None] - g2.T[:, None, :]).masked_fill(~strict, -math.inf))  # no inf above
    M = kk * decay * beta.T[:, :, None]
    eye = torch.eye(L, dtype=k.dtype)
    return torch.linalg.solve_triangular(
        eye + M, eye.expand_as(M), upper=False, unitriangular=True
    )  # [H,L,L]


def recompute_w_u_fwd(k, v, beta, A, g=None, cu_seqlens=None, chunk_indices=None):
    H, BT = v.shape[2], A.shape[-1]
    w = torch.zeros(*v.shape[:3], k.shape[-1], dtype=k.dtype)
    u = torch.zeros_like(v)
    for _, t0, t1 in _chunks(cu_seqlens, chunk_indices, BT):
        L = t1 - t0
        Ac = A[0, t0:t1, :, :L].permute(1, 0, 2).to(_acc(k))  # [H, L, L]
        kc = _grp(k[0, t0:t1], H).to(Ac.dtype)
        b = beta[0, t0:t1].to(Ac.dtype)
        e = torch.exp2(g[0, t0:t1].to(Ac.dtype))
        w[0, t0:t1] = torch.einsum("hij,jhk->ihk", Ac, kc * (b * e)[..., None]).to(w.dtype)
        u[0, t0:t1] = torch.einsum("hij,jhv->ihv", Ac, v[0, t0:t1].to(Ac.dtype) * b[..., None]).to(u.dtype)
    return w, u


def chunk_gated_delta_rule_fwd_h(
    k, w, u, g=None, gk=None, initial_state=None, output_final_state=False, chunk_size=64, save_new_value=True,
    state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_offsets=None,
):  # fmt: skip
    assert not state_v_first and gk is None
    H, K, V = u.shape[2], k.shape[-1], u.shape[-1]
    ch = _chunks(cu_seqlens, chunk_indices, chunk_size)
    acc = _acc(k)
    h = torch.full((1, chunk_indices.shape[0], H, K, V), math.nan, dtype=k.dtype)  # padding rows: never read
    v_new = torch.zeros_like(u)
    N = cu_seqlens.numel() - 1
    S = [
        initial_state[n].to(acc) if initial_state is not None else torch.zeros(H, K, V, dtype=acc)
        for n in range(N)
    ]
    for c, (n, t0, t1) in enumerate(ch):
        h[0, c] = S[n].to(h.dtype)
        kc = _grp(k[0, t0:t1], H).to(acc)
        vn = u[0, t0:t1].to(acc) - torch.einsum("lhk,hkv->lhv", w[0, t0:t1].to(acc), S[n])
        v_new[0, t0:t1] = vn.to(v_new.dtype)
        gc = g[0, t0:t1].to(acc)
        gl = gc[-1]
        S[n] = torch.exp2(gl)[:, None, None] * S[n] + torch.einsum(
            "lhk,lhv->hkv", kc * torch.exp2(gl - gc)[..., None], vn
        )
    final = torch.stack(S).float() if output_final_state else None
    if final is not None and acc == torch.float64:
        final = torch.stack(S)
    return h, v_new, final


def _fwd_o(q, k, v_new, h, g, scale, cu_seqlens, chunk_indices, chunk_size):
    H = v_new.shape[2]
    acc = _acc(q)
    o = torch.zeros_like(v_new)
    for c, (_, t0, t1) in enumerate(_chunks(cu_seqlens, chunk_indices, chunk_size)):
        qc, kc = _grp(q[0, t0:t1], H).to(acc), _grp(k[0, t0:t1], H).to(acc)
        gc = g[0, t0:t1].to(acc)
        L = t1 - t0
        mask = torch.ones(L, L, dtype=torch.bool).tril()
        A = torch.einsum("ihk,jhk->hij", qc, kc) * torch.exp2(
            (gc.T[:, :, None] - gc.T[:, None, :]).masked_fill(~mask, -math.inf)
        )
        oc = torch.einsum("lhk,hkv->lhv", qc * torch.exp2(gc)[..., None], h[0, c].to(acc))
        oc = oc + torch.einsum("hij,jhv->ihv", A, v_new[0, t0:t1].to(acc))
        o[0, t0:t1] = (scale * oc).to(o.dtype)
    return o


def chunk_gated_delta_rule_fwd_intra(k, v, g=None, beta=None, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """``(w, u, A)``: the inverted ``(I + beta K K^T)`` blocks of every chunk, then the WY form."""
    H = v.shape[2]
    A = torch.zeros(1, k.shape[1], H, chunk_size, dtype=k.dtype)
    for _, t0, t1 in _chunks(cu_seqlens, chunk_indices, chunk_size):
        Ac = _A_chunk(_grp(k[0, t0:t1], H).to(_acc(k)), beta[0, t0:t1].to(_acc(k)), g[0, t0:t1].to(_acc(k)))
        A[0, t0:t1, :, : t1 - t0] = Ac.permute(1, 0, 2).to(A.dtype)
    w, u = recompute_w_u_fwd(k, v, beta, A, g, cu_seqlens, chunk_indices)
    return w, u, A


def chunk_fwd_o(
    q, k, v, h, g=None, g_gamma=None, scale=None, state_v_first=False, cu_seqlens=None, chunk_size=64,
    chunk_indices=None,
):  # fmt: skip
    assert not state_v_first and g_gamma is None
    return _fwd_o(q, k, v, h, g, scale, cu_seqlens, chunk_indices, chunk_size)


def chunk_gated_delta_rule_fwd(
    q, k, v, g, beta, scale, initial_state, output_final_state, state_v_first=False, cu_seqlens=None,
    cp_context=None, chunk_indices=None, use_gate_in_kernel=False, A_log=None, dt_bias=None, chunk_size=64,
):  # fmt: skip
    g2 = chunk_local_cumsum(g, chunk_size, scale=RCP_LN2, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    w, u, A = chunk_gated_delta_rule_fwd_intra(k, v, g2, beta, cu_seqlens, chunk_size, chunk_indices)
    h, v_new, final = chunk_gated_delta_rule_fwd_h(
        k, w, u, g2, initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
    )  # fmt: skip
    o = _fwd_o(q, k, v_new, h, g2, scale, cu_seqlens, chunk_indices, chunk_size)
    return g2, o, A, final, initial_state, None


def chunk_bwd_dv_local(
    q, k, do, g=None, g_gamma=None, A=None, scale=None, cu_seqlens=None, chunk_size=64, chunk_indices=None
):
    H = do.shape[2]
    acc = _acc(q)
    dv = torch.zeros_like(do)
    for _, t0, t1 in _chunks(cu_seqlens, chunk_indices, chunk_size):
        qc, kc = _grp(q[0, t0:t1], H).to(acc), _grp(k[0, t0:t1], H).to(acc)
        gc = g[0, t0:t1].to(acc)
        L = t1 - t0
        mask = torch.ones(L, L, dtype=torch.bool).tril()
        A = torch.einsum("ihk,jhk->hij", qc, kc) * torch.exp2(
            (gc.T[:, :, None] - gc.T[:, None, :]).masked_fill(~mask, -math.inf)
        )
        dv[0, t0:t1] = (scale * torch.einsum("hij,ihv->jhv", A, do[0, t0:t1].to(acc))).to(dv.dtype)
    return dv


def chunk_gated_delta_rule_bwd_dhu(
    q, k, w, do, dv, g=None, gk=None, h0=None, dht=None, scale=None, state_v_first=False, cu_seqlens=None,
    chunk_size=64, chunk_indices=None, chunk_offsets=None, use_graph=False,
):  # fmt: skip
    H, K, V = do.shape[2], q.shape[-1], do.shape[-1]
    acc = _acc(q)
    ch = _chunks(cu_seqlens, chunk_indices, chunk_size)
    N = cu_seqlens.numel() - 1
    dh = torch.full((1, chunk_indices.shape[0], H, K, V), math.nan, dtype=q.dtype)  # padding rows: never read
    dv2 = torch.zeros_like(dv)
    dS = [dht[n].to(acc) if dht is not None else torch.zeros(H, K, V, dtype=acc) for n in range(N)]
    for c in reversed(range(len(ch))):
        n, t0, t1 = ch[c]
        dh[0, c] = dS[n].to(dh.dtype)
        qc, kc = _grp(q[0, t0:t1], H).to(acc), _grp(k[0, t0:t1], H).to(acc)
        gc = g[0, t0:t1].to(acc)
        gl = gc[-1]
        dvc = dv[0, t0:t1].to(acc) + torch.einsum("lhk,hkv->lhv", kc * torch.exp2(gl - gc)[..., None], dS[n])
        dv2[0, t0:t1] = dvc.to(dv2.dtype)
        dS[n] = (
            torch.exp2(gl)[:, None, None] * dS[n]
            + scale * torch.einsum("lhk,lhv->hkv", qc * torch.exp2(gc)[..., None], do[0, t0:t1].to(acc))
            - torch.einsum("lhk,lhv->hkv", w[0, t0:t1].to(acc), dvc)
        )
    dh0 = (
        torch.stack(dS).to(torch.float64 if acc == torch.float64 else torch.float32)
        if h0 is not None
        else None
    )
    return dh, dh0, dv2


def prepare_wy_repr_bwd(k, v, beta, A, dw, du, g=None, cu_seqlens=None, chunk_indices=None):
    """vjp of ``w = A (k beta exp(G))``, ``u = A (v beta)`` with ``A`` = :func:`_A_chunk` of ``(k, beta, G)``
    (natural-unit ``G = g * ln 2``): ``(dk [1,T,Hk,K], dv, dbeta, dG)``. ``torch.func.vjp``: it runs inside
    a backward and inside a custom op's implementation, where autograd records nothing."""
    H, BT = v.shape[2], A.shape[-1]
    acc = _acc(k)
    dk = torch.zeros(*k.shape, dtype=acc)
    dv = torch.zeros_like(v)
    db = torch.zeros_like(beta)
    dg = torch.zeros_like(g)

    def wu(kc, vc, bc, G):
        kg = _grp(kc, H)
        Ac = _A_chunk(kg, bc, G * RCP_LN2)
        wc = torch.einsum("hij,jhk->ihk", Ac, kg * (bc * torch.exp(G))[..., None])
        return wc, torch.einsum("hij,jhv->ihv", Ac, vc * bc[..., None])

    for _, t0, t1 in _chunks(cu_seqlens, chunk_indices, BT):
        prim = (
            k[0, t0:t1].to(acc),
            v[0, t0:t1].to(acc),
            beta[0, t0:t1].to(acc),
            g[0, t0:t1].to(acc) / RCP_LN2,
        )
        _, pull = torch.func.vjp(wu, *prim)
        gk, gv, gb, gG = pull((dw[0, t0:t1].to(acc), du[0, t0:t1].to(acc)))
        dk[0, t0:t1], dv[0, t0:t1] = gk, gv.to(dv.dtype)
        db[0, t0:t1], dg[0, t0:t1] = gb.to(db.dtype), gG.to(dg.dtype)
    return dk.to(k.dtype), dv, db, dg


def standins() -> dict:
    """``{name: function}`` as :func:`varpack.ops._fla.load_fla_internals` returns for fla."""
    return {
        name: globals()[name]
        for name in (
            "l2norm_fwd",
            "l2norm_bwd",
            "prepare_chunk_indices",
            "chunk_gated_delta_rule_fwd",
            "recompute_w_u_fwd",
            "prepare_wy_repr_bwd",
            "chunk_gated_delta_rule_fwd_h",
            "chunk_gated_delta_rule_bwd_dhu",
            "chunk_bwd_dv_local",
            "chunk_local_cumsum",
            "chunk_gated_delta_rule_fwd_intra",
            "chunk_fwd_o",
        )
    }
