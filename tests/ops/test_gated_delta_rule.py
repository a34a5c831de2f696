"""Gated delta rule with cu_seqlens: chunked (varpack) == recurrent (varpack naive) == transformers' oracle.

Pattern of fla's tests/ops/test_gdn.py::test_chunk_varlen: the packed kernel runs once, the reference runs
per sequence (here: the naive recurrence with cu_seqlens, itself checked against transformers'
``torch_recurrent_gated_delta_rule`` run on each slice alone).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from varpack.ops import (
    available_backends,
    chunk_gated_delta_rule,
    gated_delta_rule,
    naive_recurrent_gated_delta_rule,
    prepare_chunk_layout,
    resolve_backend,
)

ATOL = 2e-5  # fp32 chunked vs fp32 recurrent: rounding of two summation orders (values are O(1))


def _cu(lengths, dtype=torch.int32):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def _inputs(lengths, Hk=2, H=4, K=16, V=8, dtype=torch.float32, seed=0, B=1, initial=False, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths) if B == 1 else lengths[0]
    N = len(lengths) if B == 1 else B

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    q, k, v = r(B, T, Hk, K), r(B, T, Hk, K), r(B, T, H, V)
    g = F.logsigmoid(r(B, T, H) + 2.0)  # decays in (0, 1), mostly mild
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    h0 = r(N, H, K, V) * 0.5 if initial else None
    out = [x.to(device=device, dtype=dtype) for x in (q, k, v, g, beta)]
    return out, (h0.to(device=device, dtype=torch.float32) if h0 is not None else None)


def _run(fn, ins, h0, cu, l2=True, do=None, dht=None, **kw):
    leaves = [x.detach().clone().requires_grad_() for x in ins]
    h = h0.detach().clone().requires_grad_() if h0 is not None else None
    o, s = fn(
        *leaves, initial_state=h, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2, **kw
    )
    gen = torch.Generator().manual_seed(123)
    if do is None:
        do = torch.randn(o.shape, generator=gen).to(o)
        dht = torch.randn(s.shape, generator=gen).to(s)
    ((o * do).sum() + (s * dht).sum()).backward()
    grads = [x.grad for x in leaves] + ([h.grad] if h is not None else [])
    return o.detach(), s.detach(), grads, do, dht


LENGTH_CASES = {
    "mixed": [1, 70, 64, 129, 3, 1, 65],
    "one_token_each": [1] * 9,
    "single_long": [193],
    "with_empty": [5, 0, 64, 0, 1],
    "exact_chunks": [64, 128],
}


@pytest.mark.parametrize("case", list(LENGTH_CASES))
@pytest.mark.parametrize("initial", [False, True])
def test_chunk_equals_recurrent_forward_and_all_gradients(case, initial):
    lengths = LENGTH_CASES[case]
    ins, h0 = _inputs(lengths, initial=initial, seed=len(lengths))
    cu = _cu(lengths)
    o_ref, s_ref, g_ref, do, dht = _run(naive_recurrent_gated_delta_rule, ins, h0, cu)
    o, s, g, _, _ = _run(chunk_gated_delta_rule, ins, h0, cu, do=do, dht=dht)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(s, s_ref, atol=ATOL, rtol=1e-4)
    names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for name, a, b in zip(names, g, g_ref):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("solve", ["blocked", "solve"])
def test_triangular_solve_methods_match_recurrence_fp64(solve):
    """Both per-chunk solvers equal the recurrence to fp64 rounding (no l2norm: unnormalised keys)."""
    lengths = [100, 3, 64]
    ins, h0 = _inputs(lengths, dtype=torch.float64, initial=True)
    ins[1] = ins[1] / 4  # keep the delta rule contractive without l2norm
    cu = _cu(lengths)
    o_ref, s_ref, g_ref, do, dht = _run(naive_recurrent_gated_delta_rule, ins, h0.double(), cu, l2=False)
    o, s, g, _, _ = _run(chunk_gated_delta_rule, ins, h0.double(), cu, l2=False, do=do, dht=dht, solve=solve)
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=1e-9)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-8)


def test_blocked_inverse_is_stable_for_correlated_keys():
    """beta ~ 1 and nearly identical keys: powers of the WY matrix explode, the block inverse must not."""
    T, K = 128, 32
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(1, 1, 1, K, generator=gen)
    k = 0.99 * base + 0.01 * torch.randn(1, T, 1, K, generator=gen)
    q, v = torch.randn(1, T, 1, K, generator=gen), torch.randn(1, T, 1, 8, generator=gen)
    g = -0.01 * torch.rand(1, T, 1, generator=gen)
    beta = 0.9 + 0.1 * torch.rand(1, T, 1, generator=gen)
    cu = _cu([T])
    args = [x.double() for x in (q, k, v, g, beta)]
    o_ref, _ = naive_recurrent_gated_delta_rule(*args, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    assert (o.double() - o_ref).abs().max() < 1e-5


def test_naive_matches_transformers_recurrent_per_sequence():
    """The truth itself against an independent oracle: transformers' recurrence on each slice alone."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    lengths = [7, 1, 30]
    ins, h0 = _inputs(lengths, initial=True)
    cu = _cu(lengths)
    o, s = naive_recurrent_gated_delta_rule(
        *ins, initial_state=h0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True
    )
    outs, states = [], []
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        q, k, v, g, beta = (x[:, a:b] for x in ins)
        o_n, s_n = torch_recurrent_gated_delta_rule(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=h0[n : n + 1],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        outs.append(o_n)
        states.append(s_n)
    torch.testing.assert_close(o, torch.cat(outs, 1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(s, torch.cat(states, 0), atol=1e-6, rtol=1e-5)


def test_chunk_matches_transformers_chunk_per_sequence_bf16_inputs():
    """bf16 inputs (fp32 state accumulation inside): equal to transformers' chunked reference per slice."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    lengths = [90, 1, 64]
    ins, _ = _inputs(lengths, dtype=torch.bfloat16)
    cu = _cu(lengths)
    o, _ = chunk_gated_delta_rule(*ins, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.bfloat16
    ref = torch.cat(
        [
            torch_chunk_gated_delta_rule(
                *(x[:, a:b] for x in ins[:3]),
                g=ins[3][:, a:b],
                beta=ins[4][:, a:b],
                use_qk_l2norm_in_kernel=True,
            )[0]
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
        ],
        1,
    )
    torch.testing.assert_close(o.float(), ref.float(), atol=1e-2, rtol=1e-2)


def test_batch_rows_without_cu_seqlens_are_independent_sequences():
    ins, h0 = _inputs([50, 50, 50], B=3, initial=True)
    o, s = chunk_gated_delta_rule(
        *ins, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    o_ref, s_ref = naive_recurrent_gated_delta_rule(
        *ins, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(s, s_ref, atol=ATOL, rtol=1e-4)


def test_boundaries_matter_negative_control():
    """Dropping the boundaries (one sequence) changes the output: the equality above is not vacuous."""
    lengths = [40, 40]
    ins, _ = _inputs(lengths)
    o_packed, _ = chunk_gated_delta_rule(*ins, cu_seqlens=_cu(lengths), use_qk_l2norm_in_kernel=True)
    o_joined, _ = chunk_gated_delta_rule(*ins, cu_seqlens=_cu([80]), use_qk_l2norm_in_kernel=True)
    assert (o_packed[:, :40] - o_joined[:, :40]).abs().max() < 1e-6  # the first sample is unaffected
    assert (o_packed[:, 40:] - o_joined[:, 40:]).abs().max() > 1e-2  # the second one sees the first's state


def test_layout_reuse_and_cpu_layout():
    lengths = [3, 130, 64, 1]
    cu = _cu(lengths)
    layout = prepare_chunk_layout(cu)
    assert layout.chunk_size == 64 and layout.num_chunks == 1 + 3 + 1 + 1
    assert layout.active == (4, 1, 1) and layout.offsets == (0, 4, 5)
    ins, h0 = _inputs(lengths, initial=True)
    a, sa = chunk_gated_delta_rule(
        *ins, cu_seqlens=cu, layout=layout, initial_state=h0, output_final_state=True
    )
    b, sb = chunk_gated_delta_rule(*ins, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    assert torch.equal(a, b) and torch.equal(sa, sb)
    with pytest.raises(ValueError, match=r"initial_state must be \[N=4"):
        chunk_gated_delta_rule(*ins, layout=layout, initial_state=h0[:3])
    with pytest.raises(ValueError, match="layout describes 198 tokens"):
        chunk_gated_delta_rule(*(x[:, :100] for x in ins), layout=layout)


def test_short_rows_use_a_smaller_chunk():
    assert prepare_chunk_layout(_cu([1, 3, 2])).chunk_size == 4
    assert prepare_chunk_layout(_cu([1])).chunk_size == 1
    assert prepare_chunk_layout(_cu([65])).chunk_size == 64


def test_many_one_token_sequences_beyond_grid_limits():
    """70,000 sequences (> 65535 / H): works, vectorized, and every 1-token output is beta (q.k) v."""
    N, H, K, V = 70_000, 2, 4, 4
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, N, H, K, generator=gen), torch.randn(1, N, H, K, generator=gen)
    v = torch.randn(1, N, H, V, generator=gen)
    g, beta = -torch.rand(1, N, H, generator=gen), torch.rand(1, N, H, generator=gen)
    cu = torch.arange(N + 1, dtype=torch.int32)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
    scale = K**-0.5
    expected = (beta * (q * k).sum(-1) * scale).unsqueeze(-1) * v  # zero state: S = beta k v^T, o = q^T S
    torch.testing.assert_close(o, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        s, (beta[0, :, :, None, None] * k[0, :, :, :, None] * v[0, :, :, None, :]), atol=1e-6, rtol=1e-5
    )
    # a few longer sequences among them still match the recurrence
    lengths = [1] * 1000 + [70, 1, 129]
    ins, _ = _inputs(lengths, Hk=1, H=1, K=4, V=4)
    cu = _cu(lengths)
    o, _ = chunk_gated_delta_rule(*ins, cu_seqlens=cu)
    tail = slice(1000, None)
    o_ref, _ = naive_recurrent_gated_delta_rule(*(x[:, 1000:] for x in ins), cu_seqlens=_cu(lengths[tail]))
    torch.testing.assert_close(o[:, 1000:], o_ref, atol=ATOL, rtol=1e-4)


# ------------------------------------------------------------------------------------------------------
# errors and backend selection


def test_batch_dimension_with_cu_seqlens_is_refused():
    ins, _ = _inputs([20, 20], B=2)
    for fn in (chunk_gated_delta_rule, naive_recurrent_gated_delta_rule, gated_delta_rule):
        with pytest.raises(ValueError, match="batch dimension must be 1.*B=2"):
            fn(*ins, cu_seqlens=_cu([10, 10]))


@pytest.mark.parametrize(
    "cu, msg",
    [
        ([0, 5, 30], r"cu_seqlens\[-1\]=30 but the stream has 20 tokens"),
        ([1, 20], r"cu_seqlens\[0\]=1"),
        ([0, 15, 10, 20], r"\[0, 15, 10, 20\] must start at 0, never decrease"),
    ],
)
def test_bad_cu_seqlens(cu, msg):
    ins, _ = _inputs([20])
    with pytest.raises(ValueError, match=msg):
        chunk_gated_delta_rule(*ins, cu_seqlens=torch.tensor(cu))


def test_shape_errors_name_the_field():
    ins, _ = _inputs([20])
    q, k, v, g, beta = ins
    with pytest.raises(ValueError, match="num_v_heads H=3 must be a multiple of num_k_heads Hk=2"):
        chunk_gated_delta_rule(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match=r"beta must be \[B=1, T=20, H=4\]"):
        chunk_gated_delta_rule(q, k, v, g, beta[:, :10])
    with pytest.raises(ValueError, match=r"initial_state must be \[N=2, H=4, K=16, V=8\]"):
        chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=_cu([10, 10]), initial_state=torch.zeros(3, 4, 16, 8)
        )
    with pytest.raises(TypeError, match="cu_seqlens must be an int32/int64"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0.0, 20.0]))


def test_backend_selection_on_cpu():
    assert resolve_backend("auto", "cpu") == "chunk"
    assert resolve_backend("naive", "cpu") == "naive"
    ok, reason = available_backends("cpu")["fla"]
    assert not ok and "CUDA" in reason
    with pytest.raises(RuntimeError, match="backend 'fla' cannot run on cpu: fla needs a CUDA device"):
        resolve_backend("fla", "cpu")
    with pytest.raises(ValueError, match="unknown gated delta rule backend 'triton'"):
        resolve_backend("triton", "cpu")
    lengths = [9, 70]
    ins, _ = _inputs(lengths)
    a, _ = gated_delta_rule(*ins, cu_seqlens=_cu(lengths), use_qk_l2norm_in_kernel=True)
    b, _ = gated_delta_rule(*ins, cu_seqlens=_cu(lengths), use_qk_l2norm_in_kernel=True, backend="naive")
    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)


# ------------------------------------------------------------------------------------------------------
# GPU (run by the lead on the device machine)

GPU_LENGTHS = [1, 700, 64, 3, 1000, 1, 129, 2100]
#: (Hk, H, K, V) of the GPU tests that run fla's kernels (here and in test_fla_hybrid.py): Qwen3.5's head size
#: with grouped value heads. fla autotunes each kernel once per head shape and dtype (about 90 s of a cold
#: machine's time per shape, benchmarks/RESULTS.md), so these tests share one shape.
GPU_DIMS = (2, 4, 128, 128)


def _bf16_tol(ref32: torch.Tensor) -> float:
    return 2e-2 * float(ref32.abs().max()) + 1e-3


@pytest.mark.gpu
def test_gpu_chunk_matches_reference():
    lengths = GPU_LENGTHS
    ins, h0 = _inputs(lengths, Hk=2, H=4, K=64, V=64, device="cuda", dtype=torch.bfloat16, initial=True)
    cu = _cu(lengths)
    o, s, g, do, dht = _run(chunk_gated_delta_rule, ins, h0, cu)
    ref_ins = [x.float() for x in ins]
    o_ref, s_ref, g_ref, _, _ = _run(
        chunk_gated_delta_rule, [x.cpu() for x in ref_ins], h0.cpu(), cu, do=do.float().cpu(), dht=dht.cpu()
    )
    # the CPU fp32 chunk result is itself == naive (tests above); compare the GPU bf16 run against it
    assert (o.float().cpu() - o_ref).abs().max() < _bf16_tol(o_ref)
    assert (s.cpu() - s_ref).abs().max() < _bf16_tol(s_ref)
    for a, b in zip(g, g_ref):
        assert (a.float().cpu() - b).abs().max() < _bf16_tol(b) * 2


@pytest.mark.gpu
def test_gpu_chunk_fp32_equals_naive():
    lengths = [1, 90, 64, 3]
    ins, h0 = _inputs(lengths, device="cuda", initial=True)
    cu = _cu(lengths)
    o_ref, s_ref, g_ref, do, dht = _run(naive_recurrent_gated_delta_rule, ins, h0, cu)
    o, s, g, _, _ = _run(chunk_gated_delta_rule, ins, h0, cu, do=do, dht=dht)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=1e-4)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_chunk_compiled_matches_eager():
    lengths = [5, 300, 64]
    ins, _ = _inputs(lengths, device="cuda", K=64, V=64)
    cu = _cu(lengths)
    o1, _, g1, do, dht = _run(chunk_gated_delta_rule, ins, None, cu)
    o2, _, g2, _, _ = _run(chunk_gated_delta_rule, ins, None, cu, do=do, dht=dht, compile=True)
    torch.testing.assert_close(o2, o1, atol=1e-4, rtol=1e-3)
    for a, b in zip(g2, g1):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


@pytest.mark.gpu
def test_gpu_many_sequences_no_launch_limit():
    """70,000 sequences x 4 heads on the GPU: no grid-size limit in the chunk path."""
    N, H, D = 70_000, 4, 16
    lengths = [1] * (N - 10) + [70] * 10
    T = sum(lengths)
    q, k, v = (torch.randn(1, T, H, D, device="cuda") for _ in range(3))
    g, beta = -torch.rand(1, T, H, device="cuda"), torch.rand(1, T, H, device="cuda")
    cu = _cu(lengths, torch.int64)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o).all()
    last = (x[:, -70:] for x in (q, k, v, g, beta))
    o_ref, _ = naive_recurrent_gated_delta_rule(*last, cu_seqlens=_cu([70]), use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o[:, -70:], o_ref, atol=ATOL, rtol=1e-4)
    one = slice(0, 5)
    qn, kn = F.normalize(q[:, one], dim=-1), F.normalize(k[:, one], dim=-1)
    expected = (beta[:, one] * (qn * kn).sum(-1) * D**-0.5).unsqueeze(-1) * v[:, one]
    torch.testing.assert_close(o[:, one], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_chunk_is_sync_free():
    lengths = [3, 500, 64, 1, 1000]
    ins, _ = _inputs(lengths, device="cuda", dtype=torch.bfloat16, K=64, V=64)
    cu = _cu(lengths)
    layout = prepare_chunk_layout(cu, device="cuda")
    leaves = [x.clone().requires_grad_() for x in ins]
    chunk_gated_delta_rule(*leaves, cu_seqlens=cu, layout=layout)  # warm-up (allocator, kernels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o, _ = chunk_gated_delta_rule(*leaves, cu_seqlens=cu, layout=layout, use_qk_l2norm_in_kernel=True)
        o.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _fla_or_skip(needs_backward: bool):
    pytest.importorskip("fla")
    from varpack.ops.gated_delta_rule.dispatch import fla_gated_delta_status

    forward, backward = fla_gated_delta_status("cuda", GPU_DIMS)  # probed at the tests' own head shape
    if not forward[0]:
        pytest.skip(f"fla forward unusable here: {forward[1]}")
    if needs_backward and not backward[0]:
        pytest.skip(f"fla backward unusable here: {backward[1]}")


@pytest.mark.gpu
@pytest.mark.parametrize("needs_backward", [False, True])
def test_gpu_fla_matches_reference(needs_backward):
    _fla_or_skip(needs_backward)
    lengths = GPU_LENGTHS
    Hk, H, K, V = GPU_DIMS
    ins, h0 = _inputs(lengths, Hk=Hk, H=H, K=K, V=V, device="cuda", dtype=torch.bfloat16, initial=True)
    cu = _cu(lengths, torch.int64)
    ref_ins = [x.float().cpu() for x in ins]
    if not needs_backward:
        with torch.no_grad():
            o, s = gated_delta_rule(
                *ins,
                initial_state=h0,
                output_final_state=True,
                cu_seqlens=cu.cuda(),
                cu_seqlens_cpu=cu,
                use_qk_l2norm_in_kernel=True,
                backend="fla",
            )
        o_ref, s_ref = chunk_gated_delta_rule(
            *ref_ins,
            initial_state=h0.cpu(),
            output_final_state=True,
            cu_seqlens=cu,
            use_qk_l2norm_in_kernel=True,
        )
        assert (o.float().cpu() - o_ref).abs().max() < _bf16_tol(o_ref)
        assert (s.float().cpu() - s_ref).abs().max() < _bf16_tol(s_ref)
        return

    def fla_fn(*a, **kw):
        kw["cu_seqlens"] = kw["cu_seqlens"].cuda()
        return gated_delta_rule(*a, cu_seqlens_cpu=cu, backend="fla", **kw)

    o, s, g, do, dht = _run(fla_fn, ins, h0, cu)
    o_ref, s_ref, g_ref, _, _ = _run(
        chunk_gated_delta_rule, ref_ins, h0.cpu(), cu, do=do.float().cpu(), dht=dht.float().cpu()
    )
    assert (o.float().cpu() - o_ref).abs().max() < _bf16_tol(o_ref)
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], g, g_ref):
        assert (a.float().cpu() - b).abs().max() < 2 * _bf16_tol(b), name


@pytest.mark.parametrize("backend", ["chunk", "naive"])
@pytest.mark.parametrize("cu", [None, [0, 0]], ids=["rows", "varlen"])
def test_empty_input_output_belongs_to_the_graph(backend, cu):
    """No token at all (a sample of length 0 on its own): the empty output still carries a gradient function,
    so a caller's backward runs (and gives empty gradients) instead of failing on a detached tensor."""
    from varpack.ops import gated_delta_rule

    ins, _ = _inputs([0])
    leaves = [x.detach().clone().requires_grad_() for x in ins]
    o, _ = gated_delta_rule(
        *leaves, backend=backend, cu_seqlens=None if cu is None else torch.tensor(cu), use_qk_l2norm_in_kernel=True
    )
    assert o.shape[1] == 0 and o.grad_fn is not None
    o.sum().backward()
    assert leaves[2].grad is not None and leaves[2].grad.shape == leaves[2].shape
