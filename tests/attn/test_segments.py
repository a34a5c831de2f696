"""Many-segment inputs through the per-segment loops (``sdpa`` / ``reference`` attention, the naive gated delta
rule, the short-conv reference): the packed gradients equal a loop that runs every segment alone, and the
backward graph hands each input ONE gradient (one split / unbind), not one full-size zero-filled gradient per
segment or token (an O(N * T) backward otherwise; timings in benchmarks/attention_cpu.py).
The offsets the loops read are still validated before anything is cut."""

from __future__ import annotations

import pytest
import torch

from varpack.attn import BACKENDS, BackendUnavailableError, reference_varlen_attention, varlen_attention
from varpack.ops import naive_recurrent_gated_delta_rule, short_conv_reference

LOOP_BACKENDS = ("reference", "sdpa")


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _lengths(n: int, low: int, high: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (n,), generator=g).tolist()


def _inputs(lens_q, lens_k, h, hkv, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, generator=g)
    k = torch.randn(sum(lens_k), hkv, d, generator=g)
    v = torch.randn(sum(lens_k), hkv, d, generator=g)
    dout = torch.randn(sum(lens_q), h, d, generator=g)
    return q, k, v, dout


def _packed_grads(backend, q, k, v, dout, lens_q, lens_k, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out = varlen_attention(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), backend=backend, **kw)
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    return out.detach(), [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]


def _per_segment_loop(backend, q, k, v, dout, lens_q, lens_k, **kw):
    """Each segment alone (fresh leaves, its own one-segment call); outputs and gradients concatenated."""
    outs, dq, dk, dv = [], [], [], []
    bq = bk = 0
    for lq, lk in zip(lens_q, lens_k):
        qs, ks, vs = (t.clone().requires_grad_() for t in (q[bq : bq + lq], k[bk : bk + lk], v[bk : bk + lk]))
        if lq == 0:  # no query: nothing to compute, no gradient
            outs.append(qs.detach())
            dq.append(torch.zeros_like(qs))
            dk.append(torch.zeros_like(ks))
            dv.append(torch.zeros_like(vs))
        else:
            out = varlen_attention(qs, ks, vs, _cu([lq]), _cu([lk]), lq, lk, backend=backend, **kw)
            grads = torch.autograd.grad(out, (qs, ks, vs), dout[bq : bq + lq], allow_unused=True)
            outs.append(out.detach())
            for acc, t, g in zip((dq, dk, dv), (qs, ks, vs), grads):
                acc.append(torch.zeros_like(t) if g is None else g)
        bq += lq
        bk += lk
    return torch.cat(outs), [torch.cat(x) for x in (dq, dk, dv)]


MANY = [
    # (lens_q, lens_k, kwargs, h, hkv, backends)
    pytest.param(
        _lengths(96, 0, 12, seed=1),
        None,
        dict(causal=True),
        4,
        2,
        LOOP_BACKENDS,
        id="causal-gqa-zero-lengths",
    ),
    pytest.param(
        _lengths(64, 1, 9, seed=2),
        None,
        dict(causal=False, window_size=(2, 1)),
        2,
        2,
        LOOP_BACKENDS,
        id="noncausal-window",
    ),
    pytest.param(
        _lengths(64, 1, 9, seed=3),
        None,
        dict(causal=True, window_size=(3, -1)),
        4,
        1,
        LOOP_BACKENDS,
        id="causal-window-mqa",
    ),
    pytest.param(
        _lengths(48, 0, 7, seed=4),
        _lengths(48, 0, 7, seed=5),
        dict(causal=True),
        4,
        2,
        LOOP_BACKENDS,
        id="q!=k-empty-k",
    ),
    pytest.param(
        _lengths(64, 1, 9, seed=6), None, dict(causal=True, softcap=2.5), 4, 2, ("reference",), id="softcap"
    ),
]


@pytest.mark.parametrize("lens_q,lens_k,kw,h,hkv,backends", MANY)
def test_many_segments_grads_equal_per_segment_loop(lens_q, lens_k, kw, h, hkv, backends):
    lens_k = lens_q if lens_k is None else lens_k
    q, k, v, dout = _inputs(lens_q, lens_k, h, hkv)
    for backend in backends:
        out, grads = _packed_grads(backend, q, k, v, dout, lens_q, lens_k, **kw)
        want_out, want_grads = _per_segment_loop(backend, q, k, v, dout, lens_q, lens_k, **kw)
        torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6, msg=f"{backend} output")
        for name, got, want in zip("qkv", grads, want_grads):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{backend} d{name}")
            assert got.abs().sum() > 0, f"{backend} d{name} is all zero: the comparison would be vacuous"
        # negative control: the same packed call with one boundary moved by a token gives other gradients
        moved = list(lens_q)
        i = next(n for n in range(len(moved) - 1) if moved[n] > 1 and moved[n + 1] > 0)
        moved[i], moved[i + 1] = moved[i] - 1, moved[i + 1] + 1
        if lens_k == lens_q:
            _, wrong = _packed_grads(backend, q, k, v, dout, moved, moved, **kw)
            assert (wrong[0] - want_grads[0]).abs().max() > 1e-3, backend


def _grad_edges(out: torch.Tensor, leaves: dict[str, torch.Tensor]) -> dict[str, int]:
    """How many autograd edges lead into each leaf's gradient accumulator (= gradients summed into it)."""
    ids = {id(t): name for name, t in leaves.items()}
    counts = dict.fromkeys(leaves, 0)
    stack, seen = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if type(nxt).__name__ == "AccumulateGrad":
                name = ids.get(id(nxt.variable))
                if name is not None:
                    counts[name] += 1
            else:
                stack.append(nxt)
    return counts


@pytest.mark.parametrize("backend", LOOP_BACKENDS)
def test_attention_loop_gives_each_input_one_gradient(backend):
    """One split per tensor: q, k, v each get ONE gradient, not one full-size zero-padded slice gradient per
    segment (what made the backward O(N * T))."""
    lens = _lengths(40, 0, 6, seed=7)
    q, k, v, _ = (t.requires_grad_() for t in _inputs(lens, lens, 4, 2))
    out = varlen_attention(q, k, v, _cu(lens), _cu(lens), max(lens), max(lens), backend=backend)
    assert _grad_edges(out, {"q": q, "k": k, "v": v}) == {"q": 1, "k": 1, "v": 1}


def test_gated_delta_naive_gives_each_input_one_gradient():
    """Token views from one unbind per tensor (indexing x[b, t] per token made its backward O(T^2))."""
    g = torch.Generator().manual_seed(0)
    T, H, K, V = 24, 2, 4, 4
    lens = [7, 0, 9, 8]
    q, k = (torch.randn(1, T, H, K, generator=g) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=g)
    gate = -torch.rand(1, T, H, generator=g)
    beta = torch.rand(1, T, H, generator=g)
    h0 = torch.randn(len(lens), H, K, V, generator=g)
    leaves = {"q": q, "k": k, "v": v, "g": gate, "beta": beta, "h0": h0}
    for t in leaves.values():
        t.requires_grad_()
    o, s = naive_recurrent_gated_delta_rule(
        q, k, v, gate, beta, initial_state=h0, output_final_state=True, cu_seqlens=_cu(lens)
    )
    assert _grad_edges(o.sum() + s.sum(), leaves) == dict.fromkeys(leaves, 1)


def test_short_conv_reference_gives_each_input_one_gradient():
    g = torch.Generator().manual_seed(0)
    lens = [5, 0, 3, 9, 1]
    x = torch.randn(1, sum(lens), 6, generator=g, requires_grad=True)
    w = torch.randn(6, 4, generator=g, requires_grad=True)
    b = torch.randn(6, generator=g, requires_grad=True)
    y = short_conv_reference(x, w, b, cu_seqlens=_cu(lens))
    # x (token-sized) gets one gradient; w and b get one small [D, W] / [D] gradient per sample, as in any loop
    assert _grad_edges(y, {"x": x})["x"] == 1
    with pytest.raises(ValueError, match="offsets from 0 to T=18"):
        short_conv_reference(x, w, b, cu_seqlens=_cu([5, 3, 9]))


def test_sdpa_still_refuses_softcap_and_loops_still_validate_offsets():
    lens = [3, 2]
    q, k, v, _ = _inputs(lens, lens, 4, 2)
    cu = _cu(lens)
    with pytest.raises(BackendUnavailableError, match="softcap=2.0 not supported"):
        varlen_attention(q, k, v, cu, cu, 3, 3, softcap=2.0, backend="sdpa")
    # the backends themselves (what runs when cu_seqlens lives on a GPU, where varlen_attention reads nothing)
    # check the offsets before cutting the tensors
    dec = torch.tensor([0, 4, 3, 5], dtype=torch.int32)
    short = torch.tensor([0, 3, 4], dtype=torch.int32)
    bad = [
        (dec, cu, "cu_seqlens_q has 4 entries but cu_seqlens_k has 3"),
        (dec, dec, r"cu_seqlens_q=\[0, 4, 3, 5\] must start at 0, never decrease"),
        (cu, short, r"cu_seqlens_k=\[0, 3, 4\] .* end at the token count 5"),
    ]
    kw = dict(causal=True, window_size=(-1, -1), softmax_scale=0.5, softcap=0.0)
    for name in LOOP_BACKENDS:
        for cu_q, cu_k, match in bad:
            with pytest.raises(ValueError, match=match):
                BACKENDS[name].forward(q, k, v, cu_q, cu_k, 5, 5, **kw)
    with pytest.raises(ValueError, match="never decrease"):
        reference_varlen_attention(q, k, v, dec, dec)


def test_host_offsets_refused_inside_a_cuda_graph_capture(monkeypatch):
    """A per-segment backend (sdpa, reference) reads cu_seqlens on the host: inside a CUDA-graph capture that
    read would bake one batch's boundaries into the graph (or fail with torch's CPU-copy error), so it is refused
    naming the backends that run captured, whether the offsets are on the GPU or on the CPU; outside a capture
    the same call reads the offsets."""
    import types

    from varpack.attn.reference import read_offsets
    from varpack.varlen import VarlenMeta

    meta = VarlenMeta([0, 3, 5], [0, 3, 5], total_q=5, total_k=5)
    on_cuda = types.SimpleNamespace(device=torch.device("cuda"))  # stands for a CUDA tensor on this machine
    cpu = torch.tensor([0, 3, 5], dtype=torch.int32)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for offsets in (on_cuda, cpu):
        with pytest.raises(RuntimeError, match="captured CUDA graph cannot; run the captured layers on triton_short"):
            read_offsets(offsets, offsets, 5, 5, meta)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert read_offsets(on_cuda, on_cuda, 5, 5, meta) == ([0, 3, 5], [0, 3, 5])
    assert read_offsets(cpu, cpu, 5, 5, None) == ([0, 3, 5], [0, 3, 5])
