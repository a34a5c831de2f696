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

from tests._sync import without_host_sync
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


@pytest.mark.parametrize("lengths", [[1], [64], [65, 0, 128, 1, 63], [0, 0, 3], [1] * 5 + [200]])
def test_fla_chunk_indices_layout(lengths):
    """varpack's host-built chunk indices == fla's layout ((sequence, chunk within it), sequence-major; a
    zero-length sequence has no chunk), written out independently (the stand-in of fla's function)."""
    from tests.ops._fla_standins import prepare_chunk_indices
    from varpack.ops._fla import fla_chunk_indices

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    got = fla_chunk_indices(cu.to(torch.int32), "cpu")
    assert got.dtype == torch.int64 and got.shape[1] == 2
    assert torch.equal(got, prepare_chunk_indices(cu, 64))
    # negative control: another chunk size gives other indices wherever a sequence is longer than it
    if max(lengths) > 32:
        assert not torch.equal(fla_chunk_indices(cu, "cpu", 32), got)


def test_fla_chunk_indices_needs_host_offsets():
    from varpack.ops._fla import fla_chunk_indices

    with pytest.raises(ValueError, match="1-D CPU offsets"):
        fla_chunk_indices(torch.tensor([[0, 3]]), "cpu")


def test_hybrid_passes_its_own_chunk_indices(standins, monkeypatch):
    """fla's own prepare_chunk_indices (a blocking host-to-device copy per call on CUDA) is never called: the
    batch's indices come from the boundaries, and the pipeline still equals the naive recurrence."""
    from tests.ops import _fla_standins
    from varpack.ops import naive_recurrent_gated_delta_rule

    fakes = _fla_standins.standins()
    calls = []

    def counted(*a, **k):
        calls.append(1)
        return _fla_standins.prepare_chunk_indices(*a, **k)

    fakes["prepare_chunk_indices"] = counted
    monkeypatch.setattr(standins, "load_hybrid", lambda: (fakes, "ok"))
    lengths = [5, 64, 1, 130]
    ins, h0 = _gdr_inputs(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    o, s, grads = _fwd_bwd(_hybrid_fn(standins, cu), ins, h0, use_qk_l2norm_in_kernel=True)
    o_r, s_r, grads_r = _fwd_bwd(
        naive_recurrent_gated_delta_rule, ins, h0, cu_seqlens=cu, use_qk_l2norm_in_kernel=True
    )
    assert calls == []
    torch.testing.assert_close(o, o_r, atol=1e-10, rtol=1e-10)
    for a, b in zip(grads, grads_r):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)
    # negative control: without the batch's indices the forward asks fla for them
    saved = standins._forward_impl(*ins, h0, 0.3, False, cu, cu, True, None)[2]
    assert calls == [1] and torch.equal(saved[10], _fla_standins.prepare_chunk_indices(cu, 64))


def test_hybrid_refuses_cpu_and_missing_fla(monkeypatch):
    from varpack.ops.gated_delta_rule import fla_hybrid_gated_delta_rule

    ins, h0 = _gdr_inputs([3, 4])
    with pytest.raises(RuntimeError, match="fla_hybrid needs a CUDA device"):
        fla_hybrid_gated_delta_rule(*ins, cu_seqlens=[0, 3, 7])


@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("final", [True, False])
def test_hybrid_backward_function_equals_autograd_on_standins(standins, final, l2):
    """fla_hybrid_forward + fla_hybrid_backward (the custom op's pair: the forward's residuals, no forward
    recomputed) == autograd through the whole pipeline, values and every gradient; the residuals have the
    shapes and dtypes the op's fake implementation gives."""
    lengths = [5, 64, 1, 70]
    ins, h0 = _gdr_inputs(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    leaves = [x.clone().requires_grad_() for x in (*ins, h0)]
    o, s = standins._hybrid(*leaves[:5], 0.3, leaves[5], final, cu, l2, None, "fp32")
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dht = torch.randn(h0.shape, generator=gen, dtype=o.dtype) if final else None
    want = torch.autograd.grad((o * do).sum() + ((s * dht).sum() if final else 0), leaves)
    q, k, v, g, beta = ins
    o2, s2, residuals = standins._hybrid_forward(q, k, v, g, beta, 0.3, h0, final, cu, l2, None, "fp32")
    torch.testing.assert_close(o2, o.detach(), atol=0, rtol=0)
    if final:
        torch.testing.assert_close(s2, s.detach(), atol=0, rtol=0)
    shapes = standins.fla_hybrid_residual_shapes(tuple(q.shape), tuple(v.shape), q.dtype, l2)
    assert [(tuple(x.shape), x.dtype) for x in residuals] == shapes
    assert not any(x.data_ptr() in (q.data_ptr(), k.data_ptr()) for x in residuals)  # never an input's storage
    got = standins._hybrid_backward(do, dht, v, beta, residuals, 0.3, h0, cu, l2, g.dtype, None, "fp32")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    if not l2:  # qk_residuals=False: q and k left out (no copies), the caller puts them back packed
        *_, short = standins._hybrid_forward(q, k, v, g, beta, 0.3, h0, final, cu, l2, None, "fp32", None, None, False)
        assert [(tuple(x.shape), x.dtype) for x in short] == shapes[2:]
        packed = [x.reshape(1, -1, *x.shape[2:]) for x in (q, k)]
        kept = standins._hybrid_backward(do, dht, v, beta, packed + short, 0.3, h0, cu, l2, g.dtype, None, "fp32")
        for a, b in zip(kept, want):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    # negative control: residuals of other keys give other gradients
    wrong = list(residuals)
    wrong[1] = residuals[1].roll(1, dims=1)
    bad = standins._hybrid_backward(do, dht, v, beta, wrong, 0.3, h0, cu, l2, g.dtype, None, "fp32")
    assert not torch.allclose(bad[1], want[1], atol=1e-6)
    with pytest.raises(ValueError, match="residuals"):
        standins._hybrid_backward(do, dht, v, beta, residuals[:3], 0.3, h0, cu, l2, g.dtype, None, "fp32")


@pytest.mark.parametrize("tables", ["host", "device"])
def test_hybrid_residual_chunk_states_equal_recomputed(standins, tables):
    """With ``chunk_rows`` the forward keeps fla's chunk states (w, h, v_new) among its residuals, with the
    shapes the op's fake implementation gives (h padded to chunk_rows rows for host tables of fewer chunks), and
    the backward reads them instead of recomputing: output and every gradient equal the residual pair without
    states. Negative control: the states of the chunk before (h rolled by one chunk row) change dq."""
    lengths = [5, 64, 1, 70]
    ins, h0 = _gdr_inputs(lengths)
    cu = _cu64(lengths)
    exact = sum(-(-n // BT) for n in lengths)
    if tables == "device":
        _interpreted_or_skip()
        ins, h0 = [x.float() for x in ins], h0.float()
        rows, bnd, cu_cpu = exact, standins.device_fla_hybrid_boundaries(cu.to(torch.int32), sum(lengths), rows=exact), None
    else:
        rows, bnd, cu_cpu = exact + 3, None, cu
    q, k, v, g, beta = ins
    call = (q, k, v, g, beta, 0.3, h0, True, bnd.cu_seqlens if bnd else cu, True, cu_cpu, "fp32", bnd)
    o0, s0, res0 = standins._hybrid_forward(*call)
    o1, s1, res1 = standins._hybrid_forward(*call, rows)
    torch.testing.assert_close(o1, o0, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s1, s0, atol=1e-6, rtol=1e-6)
    shapes = standins.fla_hybrid_residual_shapes(tuple(q.shape), tuple(v.shape), q.dtype, True, rows)
    assert [(tuple(x.shape), x.dtype) for x in res1] == shapes and len(res1) == len(res0) + 3
    assert shapes[-2][0] == (1, rows, v.shape[2], q.shape[3], v.shape[3])
    gen = torch.Generator().manual_seed(4)
    do, dht = torch.randn(o0.shape, generator=gen, dtype=o0.dtype), torch.randn(s0.shape, generator=gen, dtype=s0.dtype)
    back = (do, dht, v, beta)
    tail = (0.3, h0, bnd.cu_seqlens if bnd else cu, True, g.dtype, cu_cpu, "fp32", bnd)
    want = standins._hybrid_backward(*back, res0, *tail)
    got = standins._hybrid_backward(*back, res1, *tail, rows)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    wrong = list(res1)
    wrong[-2] = res1[-2].roll(1, dims=1)
    bad = standins._hybrid_backward(*back, wrong, *tail, rows)
    assert not torch.allclose(bad[0], want[0], atol=1e-4)
    with pytest.raises(ValueError, match="residuals"):  # states expected, none given
        standins._hybrid_backward(*back, res0, *tail, rows)


def _custom_op_on_standins(monkeypatch, custom_op, standins):
    """Route varpack::gated_delta_rule's fla_hybrid forward and backward to the stand-in kernels (fp32 step)."""
    monkeypatch.setattr(
        custom_op,
        "fla_hybrid_forward",
        lambda *a, cu_seqlens_cpu=None, boundaries=None, chunk_rows=None, qk_residuals=True: (
            standins._hybrid_forward(*a, cu_seqlens_cpu, "fp32", boundaries, chunk_rows, qk_residuals)
        ),
    )
    monkeypatch.setattr(
        custom_op,
        "fla_hybrid_backward",
        lambda *a, g_dtype, cu_seqlens_cpu=None, boundaries=None, chunk_rows=None: standins._hybrid_backward(
            *a, g_dtype, cu_seqlens_cpu, "fp32", boundaries, chunk_rows
        ),
    )


@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("final", [True, False])
def test_custom_op_fla_hybrid_native_backward_on_standins(standins, monkeypatch, final, l2):
    """varpack::gated_delta_rule with backend fla_hybrid: forward and its native backward op (fla_hybrid's
    recompute + backward pipeline) == the naive recurrence, values and every gradient (stand-in kernels); with
    and without the rule's l2norm (without it the op's residuals leave q and k out, autograd keeps them)."""
    from varpack.ops import naive_recurrent_gated_delta_rule
    from varpack.ops.gated_delta_rule import custom_op

    _custom_op_on_standins(monkeypatch, custom_op, standins)
    lengths = [5, 64, 1, 70]
    ins, h0 = _gdr_inputs(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    def via_op(q, k, v, g, beta, initial_state, output_final_state, **kw):
        o, s, residuals = torch.ops.varpack.gated_delta_rule(
            q, k, v, g, beta, cu, cu, initial_state, 0.3, output_final_state, l2, "fla_hybrid", 0
        )
        assert len(residuals) == (6 if l2 else 2)
        return o, s

    def naive(q, k, v, g, beta, initial_state, output_final_state, **kw):
        return naive_recurrent_gated_delta_rule(
            q, k, v, g, beta, 0.3, initial_state, output_final_state, cu, l2
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


@pytest.mark.parametrize("l2", [True, False])
@pytest.mark.parametrize("final", [False, True])
def test_custom_op_fla_hybrid_opcheck_on_standins(standins, monkeypatch, final, l2):
    from varpack.ops.gated_delta_rule import custom_op

    _custom_op_on_standins(monkeypatch, custom_op, standins)
    ins, h0 = _gdr_inputs([5, 1, 30, 3])
    ins = [x.float().requires_grad_() for x in ins]
    cu = torch.tensor([0, 5, 6, 36, 39])
    args = (*ins, cu, cu, h0.float().requires_grad_(), 0.35, final, l2, "fla_hybrid", 0)
    torch.library.opcheck(custom_op._gated_delta_rule, args)


# ------------------------------------------------------------------------------------------------------
# GPU (run by the lead on the device machine, fla-core 0.6.0 importable): fla's real kernels


def _gpu_hybrid(precision="fp32"):
    pytest.importorskip("fla")
    from varpack.ops import gated_delta_rule

    def fn(*a, cu_seqlens=None, **kw):
        if cu_seqlens is None:
            return gated_delta_rule(*a, backend="fla_hybrid", **kw)
        from varpack.ops.gated_delta_rule import fla_hybrid_gated_delta_rule

        return fla_hybrid_gated_delta_rule(
            *a, cu_seqlens=cu_seqlens.cuda(), cu_seqlens_cpu=cu_seqlens, precision=precision, **kw
        )

    return fn


def _check_vs_chunk_fp32(lengths, precision, dims=None, initial=True):
    from tests.ops.test_gated_delta_rule import GPU_DIMS, _bf16_tol, _cu, _inputs, _run
    from varpack.ops import chunk_gated_delta_rule

    Hk, H, K, V = dims or GPU_DIMS
    ins, h0 = _inputs(lengths, Hk=Hk, H=H, K=K, V=V, device="cuda", dtype=torch.bfloat16, initial=initial)
    cu = _cu(lengths, torch.int64)
    o, s, g, do, dht = _run(_gpu_hybrid(precision), ins, h0, cu)
    ref_ins = [x.float().cpu() for x in ins]
    o_ref, s_ref, g_ref, _, _ = _run(
        chunk_gated_delta_rule, ref_ins, h0.cpu() if h0 is not None else None, cu, do=do.float().cpu(),
        dht=dht.float().cpu(),
    )  # fmt: skip
    errs = {"o": (o.float().cpu() - o_ref).abs().max() / _bf16_tol(o_ref)}
    errs["final_state"] = (s.float().cpu() - s_ref).abs().max() / _bf16_tol(s_ref)
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], g, g_ref):
        errs[name] = (a.float().cpu() - b).abs().max() / (2 * _bf16_tol(b))
    print({n: round(float(e), 3) for n, e in errs.items()}, "(error / tolerance)")
    return errs


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "mixed", "input"])
def test_gpu_fla_hybrid_matches_chunk_fp32(precision):
    """fla_hybrid (bf16, 1-token and non-multiple-of-64 sequences, GVA, initial state) vs the fp32 chunk path:
    output, final state and every gradient within the bf16 tolerance of tests/ops/test_gated_delta_rule.py."""
    from tests.ops.test_gated_delta_rule import GPU_LENGTHS

    errs = _check_vs_chunk_fp32(GPU_LENGTHS, precision)
    bound = 1 if precision != "input" else 3  # "input": bf16-rounded GEMM outputs, an experimental mode
    bad = {n: float(e) for n, e in errs.items() if not e < bound}
    assert not bad, bad


@pytest.mark.gpu
def test_gpu_fla_hybrid_no_initial_state_equal_heads():
    errs = _check_vs_chunk_fp32([3, 64, 65, 1, 200], "fp32", (4, 4, 64, 64), initial=False)
    assert all(e < 1 for e in errs.values()), errs


@pytest.mark.gpu
def test_gpu_fla_hybrid_negative_control_boundaries_dropped():
    """The same packed row with cu_seqlens dropped (one sequence) must not match the packed reference."""
    from tests.ops.test_gated_delta_rule import GPU_DIMS, GPU_LENGTHS, _bf16_tol, _cu, _inputs
    from varpack.ops import chunk_gated_delta_rule

    Hk, H, K, V = GPU_DIMS
    ins, _ = _inputs(GPU_LENGTHS, Hk=Hk, H=H, K=K, V=V, device="cuda", dtype=torch.bfloat16)
    cu = _cu(GPU_LENGTHS, torch.int64)
    o_ref, _ = chunk_gated_delta_rule(
        *[x.float().cpu() for x in ins], cu_seqlens=cu, use_qk_l2norm_in_kernel=True
    )
    T = sum(GPU_LENGTHS)
    o, _ = _gpu_hybrid()(*ins, cu_seqlens=torch.tensor([0, T]), use_qk_l2norm_in_kernel=True)
    assert (o.float().cpu() - o_ref).abs().max() > 5 * _bf16_tol(o_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [None, (16, 16, 128, 128)], ids=["tests_dims", "qwen3.5_heads"])
def test_gpu_fla_hybrid_packed_row_equals_per_sample_calls_bitwise(dims):
    """The same bf16 inputs as one packed row and as one call per sample: every output and gradient of each
    sample is the same bits (the kernels work per sample and per chunk: nothing of a sample depends on its
    neighbours in the row). Negative control: the row without its boundaries differs."""
    from tests.ops.test_gated_delta_rule import GPU_DIMS, GPU_LENGTHS, _cu, _inputs, _run

    Hk, H, K, V = dims or GPU_DIMS
    lengths = GPU_LENGTHS if dims is None else [308, 63, 177, 46]
    ins, h0 = _inputs(lengths, Hk=Hk, H=H, K=K, V=V, device="cuda", dtype=torch.bfloat16, initial=True)
    cu = _cu(lengths, torch.int64)
    fn = _gpu_hybrid()
    o, s, grads, do, dht = _run(fn, ins, h0, cu)
    parts = []
    for i in range(len(lengths)):
        a, b = int(cu[i]), int(cu[i + 1])
        parts.append(_run(fn, [x[:, a:b] for x in ins], h0[i : i + 1], torch.tensor([0, b - a]),
                          do=do[:, a:b], dht=dht[i : i + 1]))  # fmt: skip
    assert torch.equal(o, torch.cat([p[0] for p in parts], dim=1))
    assert torch.equal(s, torch.cat([p[1] for p in parts]))
    for j, name in enumerate(["dq", "dk", "dv", "dg", "dbeta"]):
        assert torch.equal(grads[j], torch.cat([p[2][j] for p in parts], dim=1)), name
    assert torch.equal(grads[5], torch.cat([p[2][5] for p in parts])), "dh0"
    T = sum(lengths)
    joined, _, _, _, _ = _run(fn, ins, h0[:1], torch.tensor([0, T]), do=do, dht=dht[:1])
    assert not torch.equal(joined, o)
    assert (joined.float() - o.float()).abs().max() > 0.1 * o.float().abs().max()


@pytest.mark.gpu
def test_gpu_fla_hybrid_70000_one_token_sequences():
    """70,000 sequences (69,990 of one token, 10 of 70) x 4 value heads: forward, final state and every
    gradient vs the fp32 chunk path on the GPU (no grid or memory blow-up in the replaced step)."""
    from tests.ops.test_gated_delta_rule import _bf16_tol, _cu
    from varpack.ops import chunk_gated_delta_rule

    N = 70_000
    lengths = [1] * (N - 10) + [70] * 10
    T, Hk, H, K, V = sum(lengths), 2, 4, 64, 64
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, T, Hk, K, generator=gen).cuda().bfloat16() for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen).cuda().bfloat16()
    g = F.logsigmoid(torch.randn(1, T, H, generator=gen) + 2).cuda()
    beta = torch.rand(1, T, H, generator=gen).cuda().bfloat16()
    cu = _cu(lengths, torch.int64)
    do = torch.randn(1, T, H, V, generator=gen).cuda().bfloat16()
    dht = torch.randn(N, H, K, V, generator=torch.Generator("cuda").manual_seed(1), device="cuda")
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o, s = _gpu_hybrid()(*leaves, cu_seqlens=cu, output_final_state=True, use_qk_l2norm_in_kernel=True)
    g1 = torch.autograd.grad((o.float() * do.float()).sum() + (s * dht).sum(), leaves)
    # reference: the fp32 chunk path on the two independent parts (the one-token sequences, the 70-token
    # ones), each packed alone: sequences do not interact, and each part gets its own small chunk layout
    parts = []
    for tok, seq, lens in (
        (slice(0, N - 10), slice(0, N - 10), [1] * (N - 10)),
        (slice(N - 10, T), slice(N - 10, N), [70] * 10),
    ):
        ref_leaves = [x[:, tok].float().requires_grad_() for x in (q, k, v, g, beta)]
        o_p, s_p = chunk_gated_delta_rule(
            *ref_leaves,
            cu_seqlens=_cu(lens, torch.int64),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        g_p = torch.autograd.grad((o_p * do[:, tok].float()).sum() + (s_p * dht[seq]).sum(), ref_leaves)
        parts.append((o_p.detach(), s_p.detach(), g_p))
    o_ref = torch.cat([p[0] for p in parts], dim=1)
    s_ref = torch.cat([p[1] for p in parts], dim=0)
    g_ref = [torch.cat([p[2][i] for p in parts], dim=1) for i in range(5)]
    assert (o.float() - o_ref).abs().max() < _bf16_tol(o_ref)
    assert (s - s_ref).abs().max() < _bf16_tol(s_ref)
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], g1, g_ref):
        assert (a.float() - b).abs().max() < 2 * _bf16_tol(b), name


@pytest.mark.gpu
def test_gpu_fla_hybrid_probe_and_auto():
    """The probe passes on this device and auto picks fla (its own backward runs) or else fla_hybrid (when
    AUTO_FLA_HYBRID is on; chunk otherwise)."""
    pytest.importorskip("fla")
    from tests.ops.test_gated_delta_rule import GPU_DIMS
    from varpack.ops import resolve_backend
    from varpack.ops.gated_delta_rule.dispatch import (
        AUTO_FLA_HYBRID,
        fla_gated_delta_status,
        fla_hybrid_status,
    )

    forward, backward = fla_gated_delta_status("cuda", GPU_DIMS)  # at the GPU tests' head shape (one autotune)
    hybrid = fla_hybrid_status("cuda", GPU_DIMS)
    print(f"fla forward {forward}, backward {backward}, fla_hybrid {hybrid}")
    assert hybrid == (True, "ok"), hybrid
    want = "fla" if forward[0] and backward[0] else ("fla_hybrid" if AUTO_FLA_HYBRID else "chunk")
    assert resolve_backend("auto", "cuda", dims=GPU_DIMS) == want


@pytest.mark.gpu
@pytest.mark.parametrize("l2", [True, False])
def test_gpu_fla_hybrid_custom_op_equals_direct(l2):
    """varpack::gated_delta_rule on fla_hybrid (native backward op) == fla_hybrid_gated_delta_rule, with and
    without the rule's l2norm (without it the op keeps q and k rather than copies)."""
    pytest.importorskip("fla")
    from tests.ops.test_gated_delta_rule import GPU_DIMS, _cu, _inputs
    from varpack.ops.gated_delta_rule import fla_hybrid_gated_delta_rule
    from varpack.ops.gated_delta_rule._common import l2norm
    from varpack.ops.gated_delta_rule.custom_op import gated_delta_rule_op

    lengths = [5, 300, 64, 1]
    Hk, H, K, V = GPU_DIMS
    ins, h0 = _inputs(lengths, Hk=Hk, H=H, K=K, V=V, device="cuda", dtype=torch.bfloat16, initial=True)
    if not l2:  # without the rule's l2norm, unit-norm q and k as the convolution hands them over
        ins = [l2norm(x) if i < 2 else x for i, x in enumerate(ins)]
    cu = _cu(lengths, torch.int64)
    outs = []
    for fn in (
        fla_hybrid_gated_delta_rule,
        lambda *a, **kw: gated_delta_rule_op(*a, backend="fla_hybrid", **kw),
    ):
        leaves = [x.clone().requires_grad_() for x in (*ins, h0)]
        o, s = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu.cuda(),
                  cu_seqlens_cpu=cu, use_qk_l2norm_in_kernel=l2)  # fmt: skip
        gen = torch.Generator().manual_seed(1)
        do = torch.randn(o.shape, generator=gen).cuda().to(o.dtype)
        dht = torch.randn(s.shape, generator=gen).cuda()
        outs.append([o, s, *torch.autograd.grad((o.float() * do.float()).sum() + (s * dht).sum(), leaves)])
    for a, b in zip(*outs):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
def test_gpu_fla_hybrid_is_sync_free():
    """After a warm-up (Triton compiles), forward and backward on a new batch's boundaries make no host sync
    (the CPU offsets are given; the chunk indices come with the boundaries)."""
    from tests.ops.test_gated_delta_rule import GPU_DIMS, _cu, _inputs

    lengths = [3, 500, 64, 1, 1000]
    Hk, H, K, V = GPU_DIMS
    ins, _ = _inputs(lengths, Hk=Hk, H=H, K=K, V=V, device="cuda", dtype=torch.bfloat16)
    cu = _cu(lengths, torch.int64)
    from varpack.ops.gated_delta_rule.fla_hybrid import (
        fla_hybrid_gated_delta_rule,
        prepare_fla_hybrid_boundaries,
    )

    def step():
        # a new batch's boundaries every step (the model layers keep them on the VarlenMeta): fla's own
        # per-tensor cache of chunk indices would miss here and make a blocking copy
        bnd = prepare_fla_hybrid_boundaries(cu, "cuda")
        leaves = [x.clone().requires_grad_() for x in ins]
        o, _ = fla_hybrid_gated_delta_rule(
            *leaves,
            cu_seqlens=bnd.cu_seqlens,
            cu_seqlens_cpu=cu,
            boundaries=bnd,
            use_qk_l2norm_in_kernel=True,
        )
        o.float().sum().backward()

    pytest.importorskip("fla")
    step()
    without_host_sync(step)


def test_model_layers_reach_fla_hybrid_on_standins(standins, monkeypatch):
    """tiny-qwen3.5 with its Gated DeltaNet layers forced onto fla_hybrid (fla's kernels played by the
    stand-ins): packed == unpacked for logits, loss and every gradient (varpack check); the per-batch
    boundaries are built once and kept on the batch's VarlenMeta; sabotaged boundaries fail."""
    import importlib.util

    if importlib.util.find_spec("fla") is not None:
        pytest.skip(
            "fla is importable: transformers' own Qwen3.5 forward (the unpacked reference) would call it on CPU"
        )
    import varpack.collate
    from tests.test_check import VOCAB, _Sabotaged, samples
    from varpack.check import check_exactness
    from varpack.integrations.gated_delta import patch_linear_attention
    from varpack.models import load_model
    from varpack.ops.gated_delta_rule import dispatch

    built = []
    real_prepare = standins.prepare_fla_hybrid_boundaries

    def counting_prepare(*a, **kw):
        built.append(1)
        return real_prepare(*a, **kw)

    monkeypatch.setattr(
        "varpack.integrations.gated_delta.prepare_fla_hybrid_boundaries", counting_prepare, raising=True
    )
    probed = []  # the dims the layers ask the probe about: their own, so fla autotunes once per shape
    monkeypatch.setattr(
        dispatch, "_fla_hybrid_capability", lambda device, dims=None: (probed.append(dims), (True, "ok"))[1]
    )
    monkeypatch.setattr(
        dispatch,
        "fla_hybrid_gated_delta_rule",
        lambda *a, cu_seqlens_cpu=None, boundaries=None: standins._hybrid(
            *a, cu_seqlens_cpu, "fp32", boundaries
        ),
    )
    import varpack.integrations.gated_delta as gd

    # check_exactness re-enables varpack (linear backend auto, = chunk on the CPU): force fla_hybrid there
    monkeypatch.setattr(
        gd,
        "patch_linear_attention",
        lambda m, backend="auto": patch_linear_attention(m, backend="fla_hybrid"),
    )
    model = load_model("tiny-qwen3.5", vocab_size=VOCAB, attn_backend="reference")
    rows = samples(lengths=(6, 1, 9, 70))
    res = check_exactness(model, rows, backend="reference")
    assert res["passed"], res["failures"]
    assert res["gated_delta_backend"] == "fla_hybrid"
    assert len(built) == 1  # one packed batch: built once, shared by every linear-attention layer
    gdn = next(m for m in model.modules() if hasattr(m, "head_k_dim") and hasattr(m, "A_log"))
    want = (gdn.key_dim // gdn.head_k_dim, gdn.value_dim // gdn.head_v_dim, gdn.head_k_dim, gdn.head_v_dim)
    assert probed and set(probed) == {want}, (probed, want)
    monkeypatch.setattr(varpack.collate, "PaddingFreeCollator", _Sabotaged)
    assert not check_exactness(model, rows, backend="reference")["passed"]


def test_hybrid_probe_logic_on_standins(standins, monkeypatch):
    """The fla_hybrid probe (bf16 problem with initial/final state vs the fp32 chunk path) passes on the
    stand-ins, and fails with the quantity named when the backward is wrong (dg scaled)."""
    from varpack.ops.gated_delta_rule import dispatch

    monkeypatch.setattr(dispatch, "load_hybrid", standins.load_hybrid)

    def rule(q, k, v, g, beta, *, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, **kw):
        l2 = kw["use_qk_l2norm_in_kernel"]
        return standins._hybrid(
            q, k, v, g, beta, None, initial_state, output_final_state, cu_seqlens, l2, cu_seqlens_cpu, "fp32"
        )

    assert dispatch._run_fla_hybrid_probe(torch.device("cpu"), rule) == (True, "ok")
    shapes = []

    def shape_rule(q, k, v, *a, **kw):
        shapes.append((q.shape[2], v.shape[2], q.shape[3], v.shape[3]))
        return rule(q, k, v, *a, **kw)

    # at the caller's head dims (grouped heads, K != V): the probe's problem has them
    assert dispatch._run_fla_hybrid_probe(torch.device("cpu"), shape_rule, (2, 4, 32, 16)) == (True, "ok")
    assert shapes == [(2, 4, 32, 16)]
    real = standins._backward_impl

    def wrong(*a, **kw):
        dq, dk, dv, dg, db, dh0 = real(*a, **kw)
        return dq, dk, dv, 1.5 * dg, db, dh0

    monkeypatch.setattr(standins, "_backward_impl", wrong)
    ok, reason = dispatch._run_fla_hybrid_probe(torch.device("cpu"), rule)
    assert not ok and "dg" in reason, reason


def test_probe_dims_key_and_validation():
    """fla's probes are cached per device *and* head dims (a model's layers probe at their own, sharing fla's
    autotuning with the real calls); malformed dims are refused; head_dims reads (Hk, H, K, V) off q / v
    and gives None for shapes the backends refuse themselves."""
    from varpack.ops.gated_delta_rule import dispatch

    dev = torch.device("cuda", 0)
    assert dispatch._probe_dims_key(dev) == ("cuda:0", dispatch.PROBE_DIMS)
    assert dispatch._probe_dims_key(dev, (2, 4, 128, 128)) != dispatch._probe_dims_key(dev)
    for bad in [(2, 3, 64, 64), (0, 2, 64, 64), (1, 2, 64)]:
        with pytest.raises(ValueError, match="probe dims"):
            dispatch.fla_hybrid_status("cpu", bad)
    assert dispatch.fla_hybrid_status("cpu", (2, 4, 32, 16))[0] is False  # CPU: refused, with a reason
    q, v = torch.zeros(1, 5, 2, 32), torch.zeros(1, 5, 4, 16)
    assert dispatch.head_dims(q, v) == (2, 4, 32, 16)
    assert dispatch.head_dims(q[0], v) is None
    assert dispatch.head_dims(torch.zeros(1, 5, 3, 32), v) is None


def test_short_conv_probes_at_its_own_channels(monkeypatch):
    """short_conv asks fla's conv probe about its own (D, W) (fla autotunes its conv per (D, W))."""
    import importlib

    sc = importlib.import_module(
        "varpack.ops.short_conv"
    )  # the module (varpack.ops.short_conv is the function)
    seen = []

    def status(device, dims=None):
        seen.append(dims)
        return (False, "stand-in"), (False, "stand-in")

    monkeypatch.setattr(sc, "fla_conv_status", status)
    x, w = torch.randn(1, 7, 12), torch.randn(12, 3)
    with pytest.raises(RuntimeError, match="stand-in"):
        sc.short_conv(x, w, None, "silu", cu_seqlens=[0, 3, 7], backend="fla")
    assert seen == [(12, 3)]


# ------------------------------------------------------------------------------------------------------
# fixed-size chunk tables built on the device (what a CUDA graph replays): varpack.ops._fla.fla_chunk_tables
TABLE_LAYOUTS = [[1], [5, 64, 1, 130, 63, 65], [1] * 30 + [70], [0, 3, 0], [64, 64], [3, 0, 0], [200]]


def _cu64(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


@pytest.mark.parametrize("extra", [None, 0, 3], ids=["max-chunks", "rows-exact", "rows-plus-3"])
@pytest.mark.parametrize("lengths", TABLE_LAYOUTS)
def test_device_chunk_tables_real_rows_then_padding(lengths, extra):
    """The first NT rows are fla's chunk indices and the dq/dk plan's chunk table; every row after them names
    the last non-empty sequence at or past its end, holds no token and starts inside the row; the row count
    is max_chunks(T, N), whatever the segmentation, or the ``rows`` given (a static shape's bound)."""
    from varpack.ops._fla import fla_chunk_indices, fla_chunk_tables, max_chunks

    cu = _cu64(lengths)
    T, N = sum(lengths), len(lengths)
    ref = fla_chunk_indices(cu, "cpu")
    NT = ref.shape[0]
    rows = None if extra is None else max(NT + extra, 1)
    idx, start, length = fla_chunk_tables(cu.to(torch.int32), T, rows=rows)
    plan = dqkwg_plan(cu)
    assert idx.shape == (max_chunks(T, N) if rows is None else rows, 2) and idx.dtype == torch.int64
    assert start.dtype == length.dtype == torch.int32 and start.shape == length.shape == (idx.shape[0],)
    assert torch.equal(idx[:NT], ref)
    assert torch.equal(start[:NT], plan.chunk_start) and torch.equal(length[:NT], plan.chunk_len)
    last = max(i for i, n in enumerate(lengths) if n > 0)
    pad = idx[NT:]
    assert (pad[:, 0] == last).all() and (pad[:, 1] * BT >= lengths[last]).all()
    assert (length[NT:] == 0).all() and ((start[NT:] >= 1) & (start[NT:] <= T)).all()


def test_max_chunks_bounds_every_segmentation_and_is_reached():
    import random

    from varpack.ops._fla import max_chunks

    rng = random.Random(0)
    for _ in range(500):
        T = rng.randint(1, 700)
        N = rng.randint(1, min(T, 40))
        cuts = sorted(rng.sample(range(1, T), N - 1)) if N > 1 else []
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, T])]
        assert sum(-(-n // BT) for n in lengths) <= max_chunks(T, N)
        worst = [1] * (N - 1) + [T - N + 1]  # all but one sequence of one token
        assert sum(-(-n // BT) for n in worst) == max_chunks(T, N)
    assert max_chunks(10, 30) == 10 and max_chunks(0, 3) == 0  # empty sequences hold no chunk
    with pytest.raises(ValueError, match="max_chunks"):
        max_chunks(-1, 2)


def test_device_chunk_tables_refuse_bad_offsets():
    from varpack.ops._fla import fla_chunk_tables

    with pytest.raises(TypeError, match="integer tensor"):
        fla_chunk_tables(torch.tensor([0.0, 3.0]), 3)
    with pytest.raises(ValueError, match="1-D"):
        fla_chunk_tables(torch.zeros(2, 2, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="rows must be >= 1"):
        fla_chunk_tables(torch.tensor([0, 3]), 3, rows=0)


def _interpreted_or_skip():
    pytest.importorskip("triton")
    from varpack._triton import triton_interpreted

    if not triton_interpreted():
        pytest.skip("Triton was imported compiled in this process (TRITON_INTERPRET=1 not set before it)")


@pytest.mark.parametrize("rows", ["max-chunks", "exact"])
@pytest.mark.parametrize("lengths", [[5, 64, 1, 130, 63, 65], [1] * 30 + [70], [200], [5, 64, 100, 0, 0, 0]])
def test_hybrid_on_device_tables_equals_host_plan(standins, lengths, rows):
    """The whole fla_hybrid pipeline (stand-in fla kernels, varpack's Triton dq/dk step interpreted) on the
    device-built tables (padding rows; the stand-ins' states of padding rows are NaN, so a padding row that
    reached a token would show), of the default row count or of exactly the chunks there are, with empty
    trailing sequences (a static row's merged pad layout) == on the host-built plan, output, final state and
    every gradient (fp32).
    Negative control: the tables of another segmentation with the same (T, N) -- tables of the same shape, as
    a replayed graph would hold them -- do not match."""
    _interpreted_or_skip()
    ins, h0 = _gdr_inputs(lengths)
    ins, h0 = [x.float() for x in ins], h0.float()
    cu = _cu64(lengths)
    T = sum(lengths)
    host = _fwd_bwd(_hybrid_fn(standins, cu), ins, h0, use_qk_l2norm_in_kernel=True)

    exact = sum(-(-n // BT) for n in lengths)  # the chunks of these lengths (a static shape's bound)

    def on_tables(tables_cu):
        bnd = standins.device_fla_hybrid_boundaries(
            tables_cu.to(torch.int32), T, rows=exact if rows == "exact" else None
        )
        assert bnd.cu_seqlens_cpu is None and not bnd.plan.groups

        def fn(q, k, v, g, beta, **call):
            return standins._hybrid(
                q, k, v, g, beta, None, call.pop("initial_state"), call.pop("output_final_state"), bnd.cu_seqlens,
                call.pop("use_qk_l2norm_in_kernel"), None, "fp32", bnd,
            )  # fmt: skip

        return _fwd_bwd(fn, ins, h0, use_qk_l2norm_in_kernel=True), bnd

    (o, s, grads), bnd = on_tables(cu)
    names = ("o", "final state", "dq", "dk", "dv", "dg", "dbeta", "dh0")
    for name, a, b in zip(names, (o, s, *grads), (host[0], host[1], *host[2])):
        scale = float(b.abs().max()) + 1e-6
        assert float((a - b).abs().max()) <= 1e-5 * scale, name
    if len(lengths) > 1:
        other = list(reversed(lengths))
        (o2, _, grads2), bnd2 = on_tables(_cu64(other))
        assert bnd2.chunk_indices.shape == bnd.chunk_indices.shape
        assert float((o2 - host[0]).abs().max()) > 1e-2 * float(host[0].abs().max())
        assert float((grads2[0] - host[2][0]).abs().max()) > 1e-2 * float(host[2][0].abs().max())


def test_torch_dqkwg_refuses_a_device_plan():
    """The batched PyTorch step reads host groups a device plan does not have: refused, never zeros."""
    p64, cu, _, _ = _problem([5, 70])
    from varpack.ops.gated_delta_rule.fla_hybrid import device_fla_hybrid_boundaries

    bnd = device_fla_hybrid_boundaries(cu, 75)
    NT = bnd.plan.num_chunks
    h = torch.zeros(1, NT, *p64["h"].shape[2:], dtype=torch.float64)
    with pytest.raises(ValueError, match="device plan"):
        chunk_bwd_dqkwg_torch(
            p64["q"], p64["k"], p64["v_new"], p64["gcum"], h, h, p64["dv"], p64["do"], 0.25, cu, plan=bnd.plan
        )


@pytest.mark.gpu
@pytest.mark.parametrize("states", [False, True], ids=["recomputed", "kept-states"])
def test_gpu_fla_hybrid_device_tables_replay_as_cuda_graph(states):
    """fla_hybrid's forward and backward (the custom op's pair: the forward's residuals, with fla's chunk states
    kept when ``chunk_rows`` is given) on device offsets without a CPU copy, captured once as a CUDA graph on one
    segmentation, then replayed after another segmentation (same T, N) is copied into the offsets buffer: equal
    to autograd through fla_hybrid_gated_delta_rule on the new segmentation (host-built plan, fla's forward
    recomputed in the backward). The eager call on device offsets makes no host sync. Negative control:
    replaying without copying the new offsets in computes the captured pack's segmentation, which does not
    match."""
    pytest.importorskip("fla")
    from tests.ops.test_gated_delta_rule import GPU_DIMS, _bf16_tol, _cu, _inputs
    from varpack.ops._fla import max_chunks
    from varpack.ops.gated_delta_rule.fla_hybrid import (
        fla_hybrid_backward,
        fla_hybrid_forward,
        fla_hybrid_gated_delta_rule,
    )

    first = [3, 500, 64, 1, 1000, 480]
    second = [700, 1, 1, 129, 1200, 17]
    assert sum(first) == sum(second) and len(first) == len(second)
    Hk, H, K, V = GPU_DIMS
    ins, _ = _inputs(first, Hk=Hk, H=H, K=K, V=V, device="cuda", dtype=torch.bfloat16)
    ins = [x.detach() for x in ins]
    ins[3] = ins[3].float()  # the decay g in fp32, as the models compute it: dg comes back in fp32 on both paths
    gen = torch.Generator("cuda").manual_seed(3)
    do = torch.randn(ins[2].shape, generator=gen, device="cuda").bfloat16()
    cu_static = _cu(first, torch.int64).cuda()
    rows = max_chunks(sum(first), len(first)) if states else None

    def step():
        o, _, res = fla_hybrid_forward(*ins, None, None, False, cu_static, True, chunk_rows=rows)
        assert len(res) == (9 if states else 6)
        grads = fla_hybrid_backward(
            do, None, ins[2], ins[4], res, None, None, cu_static, True, g_dtype=ins[3].dtype, chunk_rows=rows
        )
        return [o, *grads[:5]]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: Triton compiles and autotunes outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    without_host_sync(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()

    def truth(lengths):
        cu = _cu(lengths, torch.int64)
        leaves = [x.clone().requires_grad_() for x in ins]
        o, _ = fla_hybrid_gated_delta_rule(
            *leaves, cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu, use_qk_l2norm_in_kernel=True
        )
        return [o.detach(), *torch.autograd.grad(o, leaves, do)]

    names = ("o", "dq", "dk", "dv", "dg", "dbeta")
    for lengths in (second, first, second):
        cu_static.copy_(_cu(lengths, torch.int64).cuda())
        graph.replay()
        for name, a, b in zip(names, outs, truth(lengths)):
            b = b.float()
            assert float((a.float() - b).abs().max()) <= 0.05 * _bf16_tol(b), (lengths, name)
    graph.replay()  # negative control: the offsets buffer still holds `second`
    wrong = truth(first)
    assert float((outs[0].float() - wrong[0].float()).abs().max()) > 5 * _bf16_tol(wrong[0].float())


def test_op_reads_no_host_plan_for_device_offsets_alone(monkeypatch):
    """varpack::gated_delta_rule on fla_hybrid with offsets on a device and no CPU copy builds no host plan
    (no device read, nothing kept across calls: fla_hybrid builds its tables on the device); with a CPU copy
    (the control) the host plan is built from it."""
    from varpack.ops.gated_delta_rule import custom_op

    built = []
    monkeypatch.setattr(custom_op, "prepare_fla_hybrid_boundaries", lambda cu, dev: built.append(cu) or "plan")
    q = torch.zeros(1, 8, 2, 16)
    on_device = torch.tensor([0, 3, 8], device="meta")  # not the CPU: what the rule must never read
    assert custom_op._host_boundaries("fla_hybrid", q, on_device, None) is None and not built
    cpu = torch.tensor([0, 3, 8])
    assert custom_op._host_boundaries("fla_hybrid", q, on_device, cpu) == "plan" and built[0] is cpu


def test_fla_tensor_cache_is_off_around_device_tables(standins, monkeypatch):
    """fla's identity-keyed tensor cache is switched off while fla_hybrid runs on device-built tables (a kept
    result would be a live tensor in a CUDA-graph pool) and left as it was with host-built ones (the control),
    restored after both."""
    import sys
    import types

    from tests.ops import _fla_standins

    fake = types.ModuleType("fla.utils")
    fake.FLA_DISABLE_TENSOR_CACHE = False
    monkeypatch.setitem(sys.modules, "fla.utils", fake)
    seen = []
    fakes = _fla_standins.standins()
    real = fakes["chunk_gated_delta_rule_fwd"]

    def recording(*a, **kw):
        seen.append(fake.FLA_DISABLE_TENSOR_CACHE)
        return real(*a, **kw)

    fakes["chunk_gated_delta_rule_fwd"] = recording
    monkeypatch.setattr(standins, "load_hybrid", lambda: (fakes, "ok"))
    ins, h0 = _gdr_inputs([5, 70])
    ins = [x.float() for x in ins]
    cu = _cu64([5, 70])
    standins._forward_impl(*ins, None, 0.3, False, cu, cu, True, None)
    bnd = standins.device_fla_hybrid_boundaries(cu, 75)
    standins._forward_impl(*ins, None, 0.3, False, bnd.cu_seqlens, None, True, bnd.chunk_indices)
    assert seen == [False, True] and fake.FLA_DISABLE_TENSOR_CACHE is False
