"""``fla_hybrid``: fla's gated delta rule kernels with varpack's own ``dq, dk, dw, dg`` step.

CPU: :func:`chunk_bwd_dqkwg_torch` (the step that replaces fla's ``chunk_bwd_dqkwg``, which fla 0.6.0 flags
as wrong on Hopper with Triton >= 3.4, < 3.7.1) against autograd of the chunk equations it differentiates,
written per sequence and per chunk in fp64, on packed rows: 1-token sequences, lengths that are not multiples
of the chunk, many sequences, grouped value heads; a negative control (boundaries dropped) must mismatch.
fla's own kernels do not run under Triton's interpreter (fla 0.6.0 / Triton 3.6: Python ints where the
kernels expect tensors), so the whole backend is tested on the GPU (``gpu`` marker).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from varpack.ops.gated_delta_rule.fla_hybrid import FLA_CHUNK_SIZE, chunk_bwd_dqkwg_torch, dqkwg_plan

BT = FLA_CHUNK_SIZE


def _chunks(lengths, bt=BT):
    """fla's chunk order: per sequence n, its chunks j = 0.. (sequence-major); (n, j, t0, t1) each."""
    out, start = [], 0
    for n, L in enumerate(lengths):
        for j in range(-(-L // bt)):
            out.append((n, j, start + j * bt, start + min((j + 1) * bt, L)))
        start += L
    return out


def _problem(lengths, Hk=2, H=4, K=16, V=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    ch = _chunks(lengths)
    NT = len(ch)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    q, k = F.normalize(r(1, T, Hk, K), dim=-1), F.normalize(r(1, T, Hk, K), dim=-1)
    w = r(1, T, H, K) * 0.3
    g_step = F.logsigmoid(r(1, T, H) + 2.0)
    gcum = torch.empty_like(g_step)
    for _, _, t0, t1 in ch:  # chunk-local cumsum, natural units
        gcum[:, t0:t1] = g_step[:, t0:t1].cumsum(1)
    v_new, do, dv = r(1, T, H, V), r(1, T, H, V), r(1, T, H, V)
    h, dh = r(1, NT, H, K, V) * 0.5, r(1, NT, H, K, V) * 0.5
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    ci = torch.tensor([[n, j] for n, j, _, _ in ch], dtype=torch.int64).reshape(-1, 2)
    ins = {"q": q, "k": k, "w": w, "gcum": gcum, "v_new": v_new, "do": do, "dv": dv, "h": h, "dh": dh}
    return {name: x.to(dtype) for name, x in ins.items()}, cu, ci, ch


def _reference(p, ch, scale):
    """Autograd of the chunk equations (fla/ops/common/chunk_o.py's dqkwg, derived, per chunk): the loss
    ``<O, dO> + <S', dS'> + <-W S, dV'>`` with S = h and V' = v_new held fixed."""
    q, k, w, gcum = (p[n].detach().clone().requires_grad_() for n in ("q", "k", "w", "gcum"))
    H, Hk = p["v_new"].shape[2], q.shape[2]
    qe, ke = q.repeat_interleave(H // Hk, dim=2)[0], k.repeat_interleave(H // Hk, dim=2)[0]  # [T, H, K]
    loss = 0.0
    for c, (_, _, t0, t1) in enumerate(ch):
        Q, Kc = qe[t0:t1].transpose(0, 1), ke[t0:t1].transpose(0, 1)  # [H, L, K]
        G = gcum[0, t0:t1].transpose(0, 1)  # [H, L]
        S, dS = p["h"][0, c], p["dh"][0, c]  # [H, K, V]
        Vn = p["v_new"][0, t0:t1].transpose(0, 1)
        L = t1 - t0
        mask = torch.ones(L, L, dtype=torch.bool).tril()
        A = (Q @ Kc.transpose(-1, -2)) * torch.exp(
            (G[:, :, None] - G[:, None, :]).masked_fill(~mask, -math.inf)
        )
        out = scale * (torch.exp(G)[..., None] * Q) @ S + scale * A @ Vn
        S_next = (
            torch.exp(G[:, -1])[:, None, None] * S
            + (torch.exp(G[:, -1:] - G)[..., None] * Kc).transpose(-1, -2) @ Vn
        )
        Wt = -(w[0, t0:t1].transpose(0, 1) @ S)
        loss = loss + (out * p["do"][0, t0:t1].transpose(0, 1)).sum() + (S_next * dS).sum()
        loss = loss + (Wt * p["dv"][0, t0:t1].transpose(0, 1)).sum()
    return torch.autograd.grad(loss, (q, k, w, gcum))


def _ours(p, cu, ci, scale, **kw):
    g2 = p["gcum"] / math.log(2.0)  # fla's log2 units
    return chunk_bwd_dqkwg_torch(
        p["q"], p["k"], p["v_new"], g2, p["h"], p["dh"], p["dv"], p["do"], scale, cu, **kw
    )


CASES = [
    [1],
    [1, 1, 1],
    [5, 64, 1, 130, 63, 65],
    [200],
    [1] * 40 + [70, 3],
]


@pytest.mark.parametrize("lengths", CASES)
@pytest.mark.parametrize("Hk,H", [(2, 4), (3, 3)])
def test_dqkwg_matches_autograd_fp64(lengths, Hk, H):
    p, cu, ci, ch = _problem(lengths, Hk=Hk, H=H)
    scale = 16**-0.5
    ref = _reference(p, ch, scale)
    # default plan (built from cu_seqlens) and an explicit one; and one padded batch of 64 for every chunk
    # (the plan's grouping by padded length must not change a value)
    one_group = dqkwg_plan(cu, uniform=True)
    assert len(one_group.groups) == 1 and one_group.groups[0].P == BT
    for plan in (None, dqkwg_plan(cu), one_group):
        got = _ours(p, cu, ci, scale, plan=plan)
        for name, a, b in zip(("dq", "dk", "dw", "dg"), got, ref):
            assert a.shape == b.shape, name
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=name)
    assert sum(grp.num for grp in one_group.groups) == len(ch)


def test_dqkwg_fp32_and_input_precision():
    lengths = [5, 64, 1, 130, 63]
    p64, cu, ci, ch = _problem(lengths)
    scale = 0.3
    ref = _reference(p64, ch, scale)
    p32 = {n: x.float() for n, x in p64.items()}
    for precision in ("fp32", "mixed", "input"):
        got = _ours(p32, cu, ci, scale, precision=precision, w_dtype=torch.float32)
        assert [x.dtype for x in got] == [torch.float32] * 4
        for name, a, b in zip(("dq", "dk", "dw", "dg"), got, ref):
            torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4, msg=name)
    # bf16 states: GEMMs in bf16 ("input") stay within bf16 tolerance of the fp64 truth
    pbf = {
        n: (x.bfloat16() if n in ("h", "dh", "q", "k", "v_new", "do", "dv", "w") else x.float())
        for n, x in p64.items()
    }
    errs = {}
    for precision in ("input", "mixed", "fp32"):
        got = _ours(pbf, cu, ci, scale, precision=precision)
        assert got[2].dtype == torch.bfloat16
        for name, a, b in zip(("dq", "dk", "dw", "dg"), got, ref):
            errs[precision, name] = float((a.double() - b).abs().max() / b.abs().max())
            assert errs[precision, name] < 3e-2, (precision, name)
    # with bf16 operands, fp32 outputs ("mixed") are not less exact than bf16-rounded ones ("input")
    assert sum(errs["mixed", n] for n in ("dq", "dk", "dg")) <= sum(
        errs["input", n] for n in ("dq", "dk", "dg")
    )


def test_dqkwg_negative_control_boundaries_dropped():
    """The same tensors chunked as one sequence (boundaries dropped) must not reproduce the packed truth."""
    lengths = [5, 64, 1, 130, 63]
    p, cu, ci, ch = _problem(lengths)
    scale = 0.25
    ref = _reference(p, ch, scale)
    T = sum(lengths)
    ch1 = _chunks([T])
    cu1 = torch.tensor([0, T])
    ci1 = torch.tensor([[0, j] for _, j, _, _ in ch1])
    p1 = dict(p, h=p["h"][:, : len(ch1)].contiguous(), dh=p["dh"][:, : len(ch1)].contiguous())
    got = _ours(p1, cu1, ci1, scale)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(got, ref))


def test_dqkwg_rejects_bad_arguments():
    p, cu, ci, _ = _problem([3, 4])
    with pytest.raises(ValueError, match="precision"):
        _ours(p, cu, ci, 0.5, precision="tf32")
    with pytest.raises(ValueError, match="plan of cu_seqlens"):
        _ours(p, cu, ci, 0.5, plan=dqkwg_plan([0, 3, 5]))
    with pytest.raises(ValueError, match="h/dh"):
        _ours(dict(p, h=p["h"][:, :1]), cu, ci, 0.5)


# ------------------------------------------------------------------------------------------------------
# the whole hybrid pipeline on the CPU, fla's kernels played by PyTorch stand-ins (tests/ops/_fla_standins.py)


def _gdr_inputs(lengths, Hk=2, H=4, K=16, V=8, seed=0, B=1):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths) if B == 1 else lengths[0]
    N = len(lengths) if B == 1 else B

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    ins = [r(B, T, Hk, K), r(B, T, Hk, K), r(B, T, H, V), F.logsigmoid(r(B, T, H) + 2.0)]
    ins.append(torch.rand(B, T, H, generator=gen, dtype=torch.float64))
    return ins, r(N, H, K, V) * 0.5


def _fwd_bwd(fn, ins, h0, seed=7, **kw):
    leaves = [x.clone().requires_grad_() for x in (*ins, h0)]
    o, s = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    do, dht = (
        torch.randn(o.shape, generator=gen, dtype=o.dtype),
        torch.randn(s.shape, generator=gen, dtype=s.dtype),
    )
    grads = torch.autograd.grad((o * do).sum() + (s * dht).sum(), leaves)
    return o.detach(), s.detach(), grads


@pytest.fixture
def standins(monkeypatch):
    from tests.ops._fla_standins import standins as fakes
    from varpack.ops.gated_delta_rule import fla_hybrid

    monkeypatch.setattr(fla_hybrid, "load_hybrid", lambda: (fakes(), "ok"))
    return fla_hybrid


def _hybrid_fn(mod, cu, **kw):
    def fn(q, k, v, g, beta, **call):
        return mod._hybrid(
            q, k, v, g, beta, call.pop("scale", None), call.pop("initial_state"), call.pop("output_final_state"),
            cu, call.pop("use_qk_l2norm_in_kernel", False), kw.get("cu_seqlens_cpu"), kw.get("precision", "fp32"),
        )  # fmt: skip

    return fn


@pytest.mark.parametrize("lengths", [[1], [5, 64, 1, 130, 63, 65], [1] * 30 + [70]])
@pytest.mark.parametrize("l2", [True, False])
def test_hybrid_pipeline_on_standins_equals_naive(standins, lengths, l2):
    from varpack.ops import naive_recurrent_gated_delta_rule

    ins, h0 = _gdr_inputs(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    o, s, grads = _fwd_bwd(_hybrid_fn(standins, cu), ins, h0, use_qk_l2norm_in_kernel=l2)
    o_r, s_r, grads_r = _fwd_bwd(
        naive_recurrent_gated_delta_rule, ins, h0, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2
    )
    torch.testing.assert_close(o, o_r, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(s, s_r, atol=1e-10, rtol=1e-10)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, grads_r):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9, msg=name)
    # negative control: the same rows without their boundaries
    T = sum(lengths)
    if len(lengths) > 1:
        o1, _, grads1 = _fwd_bwd(
            _hybrid_fn(standins, torch.tensor([0, T])), ins, h0[:1], use_qk_l2norm_in_kernel=l2
        )
        assert (o1 - o_r).abs().max() > 1e-3
        assert (grads1[0] - grads_r[0]).abs().max() > 1e-3


def test_hybrid_pipeline_on_standins_batch_rows(standins):
    """Without cu_seqlens the B rows are B sequences (packed internally): equal to the naive rows."""
    from varpack.ops import naive_recurrent_gated_delta_rule

    ins, h0 = _gdr_inputs([70], B=3, Hk=1, H=3)
    o, s, grads = _fwd_bwd(_hybrid_fn(standins, None), ins, h0, use_qk_l2norm_in_kernel=True, scale=0.3)
    o_r, s_r, grads_r = _fwd_bwd(
        naive_recurrent_gated_delta_rule, ins, h0, use_qk_l2norm_in_kernel=True, scale=0.3
    )
    torch.testing.assert_close(o, o_r, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(s, s_r, atol=1e-10, rtol=1e-10)
    for a, b in zip(grads, grads_r):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


def test_hybrid_never_calls_flas_dqkwg():
    from varpack.ops._fla import FLA_INTERNALS

    assert "chunk_bwd_dqkwg" not in FLA_INTERNALS
    import inspect

    from varpack.ops.gated_delta_rule import fla_hybrid

    assert 'fns["chunk_bwd_dqkwg"]' not in inspect.getsource(fla_hybrid)


def test_hybrid_refuses_cpu_and_missing_fla(monkeypatch):
    from varpack.ops.gated_delta_rule import fla_hybrid_gated_delta_rule

    ins, h0 = _gdr_inputs([3, 4])
    with pytest.raises(RuntimeError, match="fla_hybrid needs a CUDA device"):
        fla_hybrid_gated_delta_rule(*ins, cu_seqlens=[0, 3, 7])


@pytest.mark.parametrize("final", [True, False])
def test_hybrid_backward_function_equals_autograd_on_standins(standins, final):
    """fla_hybrid_backward (the custom op's backward: recompute + fla's backward pipeline) == autograd."""
    lengths = [5, 64, 1, 70]
    ins, h0 = _gdr_inputs(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    leaves = [x.clone().requires_grad_() for x in (*ins, h0)]
    o, s = standins._hybrid(*leaves[:5], 0.3, leaves[5], final, cu, True, None, "fp32")
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dht = torch.randn(h0.shape, generator=gen, dtype=o.dtype) if final else None
    want = torch.autograd.grad((o * do).sum() + ((s * dht).sum() if final else 0), leaves)
    got = standins._hybrid_backward(do, dht, *ins, 0.3, h0, cu, True, None, "fp32")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("final", [True, False])
def test_custom_op_fla_hybrid_native_backward_on_standins(standins, monkeypatch, final):
    """varpack::gated_delta_rule with backend fla_hybrid: forward and its native backward op (fla_hybrid's
    recompute + backward pipeline) == the naive recurrence, values and every gradient (stand-in kernels)."""
    from varpack.ops import naive_recurrent_gated_delta_rule
    from varpack.ops.gated_delta_rule import custom_op

    monkeypatch.setattr(
        custom_op,
        "fla_hybrid_gated_delta_rule",
        lambda *a, cu_seqlens_cpu=None: standins._hybrid(*a, cu_seqlens_cpu, "fp32"),
    )
    monkeypatch.setattr(
        custom_op,
        "fla_hybrid_backward",
        lambda *a, cu_seqlens_cpu=None: standins._hybrid_backward(*a, cu_seqlens_cpu, "fp32"),
    )
    lengths = [5, 64, 1, 70]
    ins, h0 = _gdr_inputs(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    def via_op(q, k, v, g, beta, initial_state, output_final_state, **kw):
        o, s = torch.ops.varpack.gated_delta_rule(
            q, k, v, g, beta, cu, cu, initial_state, 0.3, output_final_state, True, "fla_hybrid"
        )
        return o, s

    def naive(q, k, v, g, beta, initial_state, output_final_state, **kw):
        return naive_recurrent_gated_delta_rule(
            q, k, v, g, beta, 0.3, initial_state, output_final_state, cu, True
        )

    results = []
    for fn in (via_op, naive):
        leaves = [x.clone().requires_grad_() for x in (*ins, h0)]
        o, s = fn(*leaves[:5], initial_state=leaves[5], output_final_state=final)
        gen = torch.Generator().manual_seed(5)
        do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
        loss = (o * do).sum() + (
            (s * torch.randn(s.shape, generator=gen, dtype=s.dtype)).sum() if final else 0
        )
        results.append((o.detach(), torch.autograd.grad(loss, leaves)))
    (o1, g1), (o2, g2) = results
    torch.testing.assert_close(o1, o2, atol=1e-10, rtol=1e-10)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("final", [False, True])
def test_custom_op_fla_hybrid_opcheck_on_standins(standins, monkeypatch, final):
    from varpack.ops.gated_delta_rule import custom_op

    monkeypatch.setattr(
        custom_op,
        "fla_hybrid_gated_delta_rule",
        lambda *a, cu_seqlens_cpu=None: standins._hybrid(*a, cu_seqlens_cpu, "fp32"),
    )
    monkeypatch.setattr(
        custom_op,
        "fla_hybrid_backward",
        lambda *a, cu_seqlens_cpu=None: standins._hybrid_backward(*a, cu_seqlens_cpu, "fp32"),
    )
    ins, h0 = _gdr_inputs([5, 1, 30, 3])
    ins = [x.float().requires_grad_() for x in ins]
    cu = torch.tensor([0, 5, 6, 36, 39])
    args = (*ins, cu, cu, h0.float().requires_grad_(), 0.35, final, True, "fla_hybrid")
    torch.library.opcheck(custom_op._gated_delta_rule, args)
