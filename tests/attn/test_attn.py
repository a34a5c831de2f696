"""varlen attention on the CPU: the reference against an independent dense fp64 computation, every
CPU-available backend against the reference (forward and backward), validation errors, and dispatch."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

import varpack.attn.interface as attn_interface
from varpack.attn import (
    AUTO_PRIORITY,
    BACKENDS,
    BackendUnavailableError,
    available_backends,
    get_backend,
    reference_varlen_attention,
    resolve_backend,
    varlen_attention,
)
from varpack.attn._base import Backend, CallSpec, Capabilities
from varpack.attn.reference import ReferenceBackend

# --------------------------------------------------------------------------------------------------------
# An independent oracle: the full [Tq, Tk] mask built element by element, dense attention in fp64.
# --------------------------------------------------------------------------------------------------------


def dense_mask(lens_q, lens_k, *, causal, window_size):
    """[Tq, Tk] bool mask, built by hand from the segment lengths (flash-attn's rules, written out)."""
    tq, tk = sum(lens_q), sum(lens_k)
    mask = torch.zeros(tq, tk, dtype=torch.bool)
    left, right = window_size
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k):
        for i in range(lq):
            for j in range(lk):
                diag = i + lk - lq  # bottom-right aligned diagonal
                ok = True
                if causal and j > diag:
                    ok = False
                if not causal and right >= 0 and j > diag + right:
                    ok = False
                if left >= 0 and j < diag - left:
                    ok = False
                mask[q0 + i, k0 + j] = ok
        q0 += lq
        k0 += lk
    return mask


def dense_attention(q, k, v, mask, *, scale=None, softcap=0.0):
    """Dense masked attention over the whole stream in fp64; rows without a visible key give 0."""
    q, k, v = q.double(), k.double(), v.double()
    h, hkv = q.shape[1], k.shape[1]
    kv_head = torch.arange(h) // (h // hkv)
    k, v = k[:, kv_head], v[:, kv_head]  # [Tk, H, D]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # fully masked rows
    return torch.einsum("hqk,khd->qhd", p, v)


def make_inputs(lens_q, lens_k=None, *, h=4, hkv=2, d=16, dtype=torch.float32, device="cpu", seed=0):
    lens_k = lens_q if lens_k is None else lens_k
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), hkv, d, generator=g, dtype=torch.float64)
    q, k, v = (t.to(dtype=dtype, device=device).requires_grad_() for t in (q, k, v))
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out)
    return torch.autograd.grad(out, inputs, dout, allow_unused=True)


CASES = [
    # (lens_q, lens_k, causal, window, softcap, h, hkv)
    pytest.param([5, 1, 7], None, True, (-1, -1), 0.0, 4, 2, id="causal-gqa-odd"),
    pytest.param([5, 1, 7], None, False, (-1, -1), 0.0, 4, 4, id="noncausal-mha"),
    pytest.param([9, 3, 6], None, True, (2, -1), 0.0, 4, 1, id="causal-window-mqa"),
    pytest.param([9, 3, 6], None, False, (2, 1), 0.0, 2, 2, id="noncausal-window"),
    pytest.param([6, 4], None, True, (-1, -1), 3.0, 4, 2, id="softcap"),
    pytest.param([1], None, True, (-1, -1), 0.0, 4, 2, id="T=1"),
    pytest.param([4, 0, 3], None, True, (-1, -1), 0.0, 4, 2, id="zero-length"),
    pytest.param([2, 5, 3], [5, 2, 3], True, (-1, -1), 0.0, 4, 2, id="q!=k-bottom-right"),
    pytest.param([2, 5, 3], [5, 2, 0], False, (1, 0), 0.0, 2, 1, id="q!=k-window-emptyk"),
    pytest.param([13], None, True, (-1, -1), 0.0, 4, 2, id="one-segment"),
]


@pytest.mark.parametrize("lens_q,lens_k,causal,window,softcap,h,hkv", CASES)
def test_reference_matches_dense_fp64(lens_q, lens_k, causal, window, softcap, h, hkv):
    q, k, v, cu_q, cu_k = make_inputs(lens_q, lens_k, h=h, hkv=hkv, dtype=torch.float64)
    lens_k = lens_q if lens_k is None else lens_k
    out = reference_varlen_attention(q, k, v, cu_q, cu_k, causal=causal, window_size=window, softcap=softcap)
    mask = dense_mask(lens_q, lens_k, causal=causal, window_size=window)
    want = dense_attention(q, k, v, mask, softcap=softcap)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    for got_g, want_g in zip(grads(out, (q, k, v)), grads(want, (q, k, v))):
        torch.testing.assert_close(got_g, want_g, rtol=1e-10, atol=1e-10)


def test_reference_fp32_and_bf16_close_to_fp64_truth():
    lens = [7, 1, 12]
    q, k, v, cu, _ = make_inputs(lens, dtype=torch.float64)
    truth = dense_attention(q, k, v, dense_mask(lens, lens, causal=True, window_size=(-1, -1)))
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 3e-2)):
        out = reference_varlen_attention(q.to(dtype), k.to(dtype), v.to(dtype), cu, cu)
        assert out.dtype == dtype
        assert (out.double() - truth).abs().max().item() < tol


def test_negative_control_dense_causal_over_stream_differs():
    """Attention that ignores the boundaries (dense causal over the whole stream) is detectably different:
    the comparisons above can fail."""
    lens = [5, 1, 7]
    q, k, v, cu, _ = make_inputs(lens, dtype=torch.float64)
    out = varlen_attention(q, k, v, cu, cu, 7, 7, backend="reference")
    leaky = dense_attention(q, k, v, dense_mask([13], [13], causal=True, window_size=(-1, -1)))
    assert (out - leaky).abs().max().item() > 1e-3
    # ...and the first segment, which sees no other sample under either mask, agrees.
    torch.testing.assert_close(out[:5], leaky[:5])


# --------------------------------------------------------------------------------------------------------
# Every backend that can run on the CPU against the reference (the GPU ones: tests/attn/test_attn_gpu.py).
# --------------------------------------------------------------------------------------------------------

CPU_BACKENDS = [name for name, (ok, _) in available_backends("cpu", torch.float32).items() if ok]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("lens_q,lens_k,causal,window,softcap,h,hkv", CASES)
def test_cpu_backends_match_reference(backend, lens_q, lens_k, causal, window, softcap, h, hkv):
    q, k, v, cu_q, cu_k = make_inputs(lens_q, lens_k, h=h, hkv=hkv, dtype=torch.float32)
    lens_k = lens_q if lens_k is None else lens_k
    max_q, max_k = max(lens_q), max(lens_k)
    kwargs = dict(causal=causal, window_size=window, softcap=softcap)
    impl = get_backend(backend)
    spec = CallSpec.from_tensors(q, k, v, **kwargs, has_empty_segments=0 in lens_q + lens_k)
    ok, reason = impl.supports(spec)
    if not ok:  # a declared limitation must raise clearly, never run
        with pytest.raises(BackendUnavailableError, match=reason.split(" (")[0]):
            varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, backend=backend, **kwargs)
    backward = ok
    if not ok:
        with torch.no_grad():
            ok, reason = impl.supports(
                CallSpec.from_tensors(q, k, v, **kwargs, has_empty_segments=spec.has_empty_segments)
            )
        if not ok:
            pytest.skip(f"{backend} declares it cannot run this call: {reason}")
    ref = reference_varlen_attention(q, k, v, cu_q, cu_k, **kwargs)
    with torch.set_grad_enabled(backward):
        out = varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, backend=backend, **kwargs)
    assert out.shape == ref.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if backward:
        for got_g, want_g in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
            torch.testing.assert_close(got_g, want_g, rtol=1e-5, atol=1e-5)


def test_softmax_scale_is_used():
    lens = [6, 3]
    q, k, v, cu, _ = make_inputs(lens, dtype=torch.float64)
    out = varlen_attention(q, k, v, cu, cu, 6, 6, softmax_scale=0.3)
    want = dense_attention(q, k, v, dense_mask(lens, lens, causal=True, window_size=(-1, -1)), scale=0.3)
    torch.testing.assert_close(out, want)
    default = varlen_attention(q, k, v, cu, cu, 6, 6)
    assert (out - default).abs().max().item() > 1e-3


def test_causal_equals_window_minus1_0():
    """flash-attn: causal=True is window_size=(-1, 0)."""
    lens = [5, 4]
    q, k, v, cu, _ = make_inputs(lens, dtype=torch.float64)
    a = varlen_attention(q, k, v, cu, cu, 5, 5, causal=True)
    b = varlen_attention(q, k, v, cu, cu, 5, 5, causal=False, window_size=(-1, 0))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------------
# Validation: bad input raises with the actual values.
# --------------------------------------------------------------------------------------------------------


def _ok_inputs():
    q, k, v, cu, _ = make_inputs([3, 2], dtype=torch.float32)
    return q.detach(), k.detach(), v.detach(), cu


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (
            lambda a: a.update(k=a["k"][:, :1].expand(-1, 3, -1), v=a["v"][:, :1].expand(-1, 3, -1)),
            ValueError,
            "H=4 must be a multiple of",
        ),
        (lambda a: a.update(v=a["v"].double()), TypeError, "one dtype"),
        (lambda a: a.update(q=a["q"][None]), ValueError, r"shape \(T, heads, D\)"),
        (lambda a: a.update(max_seqlen_q=torch.tensor(3, device="meta")), TypeError, "Python int.*on meta"),
        (lambda a: a.update(max_seqlen_q=3.0), TypeError, "max_seqlen_q must be an integer"),
        (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].float()), TypeError, "int32"),
        (
            lambda a: a.update(cu_seqlens_q=torch.tensor([0, 1, 5], dtype=torch.int32)),
            ValueError,
            "max_seqlen_q=3",
        ),
        (
            lambda a: a.update(cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32)),
            ValueError,
            "token count 5",
        ),
        (
            lambda a: a.update(cu_seqlens_q=torch.tensor([0, 3, 2, 5], dtype=torch.int32)),
            ValueError,
            "entries",
        ),
        (lambda a: a.update(window_size=(-2, 0)), ValueError, r"\(-2, 0\)"),
        (lambda a: a.update(softcap=-1.0), ValueError, "softcap"),
        (lambda a: a.update(softmax_scale=0.0), ValueError, "softmax_scale"),
        (lambda a: a.update(causal=1), TypeError, "causal"),
        (lambda a: a.update(backend="nope"), ValueError, "unknown attention backend 'nope'"),
    ],
)
def test_validation_errors(mutate, exc, match):
    q, k, v, cu = _ok_inputs()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=3, max_seqlen_k=3)
    mutate(args)
    with pytest.raises(exc, match=match):
        varlen_attention(**args)


def test_cu_seqlens_decreasing_raises_with_values():
    q, k, v, _ = _ok_inputs()
    bad = torch.tensor([0, 4, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"\[0, 4, 3, 5\].*never decrease"):
        varlen_attention(q, k, v, bad, bad, 4, 4)


def test_in_place_change_of_cu_seqlens_is_seen():
    """Without a meta, a call validates its own boundaries (nothing is served from a cache keyed by tensor
    identity): an in-place edit of the same tensor is seen."""
    q, k, v, cu = _ok_inputs()
    varlen_attention(q, k, v, cu, cu, 3, 3)
    cu[1] = 7  # now invalid
    with pytest.raises(ValueError, match="never decrease"):
        varlen_attention(q, k, v, cu, cu, 7, 7)


# --------------------------------------------------------------------------------------------------------
# Dispatch: forced backends raise with a reason; auto never picks a backend that cannot run the call.
# --------------------------------------------------------------------------------------------------------


def test_available_backends_reports_reasons():
    report = available_backends("cpu", torch.float32)
    assert set(report) == set(BACKENDS)
    assert report["reference"] == (True, "built in")
    for name, (ok, reason) in report.items():
        assert isinstance(ok, bool) and isinstance(reason, str) and reason, name
    assert list(report)[: len(AUTO_PRIORITY["cpu"])] == list(AUTO_PRIORITY["cpu"])
    assert available_backends("cpu", torch.float64)["reference"][0]


def test_auto_on_cpu_is_sdpa_then_reference_with_reason():
    q, k, v, cu = _ok_inputs()
    chosen = resolve_backend("auto", q, k, v)
    assert chosen == "sdpa" and "auto on cpu" in chosen.reason
    chosen = resolve_backend("auto", q, k, v, softcap=3.0)
    assert chosen == "reference" and "sdpa: softcap=3.0 not supported" in chosen.reason


def test_forced_cuda_only_backend_on_cpu_raises_with_reason():
    cuda_only = [
        n
        for n, b in BACKENDS.items()
        if "*" not in b.capabilities.devices and "cpu" not in b.capabilities.devices
    ]
    if not cuda_only:
        pytest.skip("every registered backend runs on the CPU")
    q, k, v, cu = _ok_inputs()
    for name in cuda_only:
        with pytest.raises(BackendUnavailableError, match=f"'{name}' cannot run this call: ") as info:
            varlen_attention(q, k, v, cu, cu, 3, 3, backend=name)
        assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)


class _NoSoftcapBackend(ReferenceBackend):
    """A fake fast backend that declares no softcap and no zero-length segments (and counts its calls)."""

    name = "fake_fast"
    capabilities = Capabilities(
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32}),
        softcap=False,
        empty_segments=False,
        max_head_dim=32,
    )
    calls = 0

    def forward(self, *args, **kwargs):
        type(self).calls += 1
        return super().forward(*args, **kwargs)


class _BrokenBackend(Backend):
    name = "broken"
    capabilities = Capabilities(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}))

    def _probe(self):
        raise ImportError("libbroken.so: cannot open shared object file")


@pytest.fixture
def fake_registry(monkeypatch):
    fake, broken = _NoSoftcapBackend(), _BrokenBackend()
    monkeypatch.setitem(BACKENDS, fake.name, fake)
    monkeypatch.setitem(BACKENDS, broken.name, broken)
    monkeypatch.setitem(AUTO_PRIORITY, "cpu", ("broken", "fake_fast", "reference"))
    _NoSoftcapBackend.calls = 0
    yield fake


def test_auto_skips_backends_that_cannot_run_the_call(fake_registry):
    lens = [4, 3]
    q, k, v, cu, _ = make_inputs(lens)
    # plain call: the fake fast backend runs it (the broken one is skipped with its probe's reason)
    chosen = resolve_backend("auto", q, k, v)
    assert chosen == "fake_fast" and "libbroken.so" in chosen.reason
    varlen_attention(q, k, v, cu, cu, 4, 4)
    assert _NoSoftcapBackend.calls == 1
    # softcap, fp64, D > 32, zero-length segment: auto moves on to the reference
    chosen = resolve_backend("auto", q, k, v, softcap=5.0)
    assert chosen == "reference" and "softcap=5.0 not supported" in chosen.reason
    out = varlen_attention(q, k, v, cu, cu, 4, 4, softcap=5.0)
    assert _NoSoftcapBackend.calls == 1
    torch.testing.assert_close(out, reference_varlen_attention(q, k, v, cu, cu, softcap=5.0))
    q64, k64, v64, cu64, _ = make_inputs(lens, dtype=torch.float64)
    assert resolve_backend("auto", q64, k64, v64) == "reference"
    qd, kd, vd, cud, _ = make_inputs(lens, d=64)
    assert resolve_backend("auto", qd, kd, vd) == "reference"
    qz, kz, vz, cuz, _ = make_inputs([4, 0, 3])
    assert resolve_backend("auto", qz, kz, vz, cu_seqlens_q=cuz, cu_seqlens_k=cuz) == "reference"
    varlen_attention(qz, kz, vz, cuz, cuz, 4, 4)
    assert _NoSoftcapBackend.calls == 1


def test_auto_short_documents_class_uses_its_own_order(fake_registry, monkeypatch):
    """max_seqlen <= AUTO_SHORT_MAX_SEQLEN (a Python int, no sync) switches auto to AUTO_PRIORITY_SHORT; longer
    calls and device types without a short order keep AUTO_PRIORITY."""
    from varpack.attn import AUTO_PRIORITY_SHORT, AUTO_SHORT_MAX_SEQLEN

    assert AUTO_PRIORITY_SHORT["cuda"][0] == "torch_varlen"  # the H200 measurement (RESULTS.md#attention)
    q, k, v, cu, _ = make_inputs([4, 3])
    assert resolve_backend("auto", q, k, v, cu_seqlens_q=cu) == "fake_fast"  # no short order for cpu yet
    monkeypatch.setitem(AUTO_PRIORITY_SHORT, "cpu", ("reference", "fake_fast"))
    chosen = resolve_backend("auto", q, k, v, cu_seqlens_q=cu)  # longest segment 4 from the CPU offsets
    assert chosen == "reference" and "AUTO_PRIORITY_SHORT" in chosen.reason and "max_seqlen 4" in chosen.reason
    long_ = AUTO_SHORT_MAX_SEQLEN + 1
    assert resolve_backend("auto", q, k, v, max_seqlen=long_) == "fake_fast"
    # through varlen_attention: the call's max_seqlen (an upper bound is fine) decides, with no tensor read
    varlen_attention(q, k, v, cu, cu, 4, 4)
    assert _NoSoftcapBackend.calls == 0
    varlen_attention(q, k, v, cu, cu, long_, long_)
    assert _NoSoftcapBackend.calls == 1


def test_forced_backend_raises_with_reason(fake_registry):
    q, k, v, cu, _ = make_inputs([4, 3])
    with pytest.raises(BackendUnavailableError, match="softcap=2.0 not supported"):
        varlen_attention(q, k, v, cu, cu, 4, 4, softcap=2.0, backend="fake_fast")
    qz, kz, vz, cuz, _ = make_inputs([4, 0, 3])
    with pytest.raises(BackendUnavailableError, match="zero-length segments"):
        varlen_attention(qz, kz, vz, cuz, cuz, 4, 4, backend="fake_fast")
    with pytest.raises(BackendUnavailableError, match="probe failed: ImportError: libbroken.so"):
        varlen_attention(q, k, v, cu, cu, 4, 4, backend="broken")
    assert available_backends("cpu")["broken"][0] is False


def test_auto_with_no_capable_backend_raises(monkeypatch, fake_registry):
    monkeypatch.setitem(AUTO_PRIORITY, "cpu", ("broken", "fake_fast"))
    q, k, v, cu, _ = make_inputs([4, 3])
    with pytest.raises(BackendUnavailableError, match="no attention backend can run this call"):
        varlen_attention(q, k, v, cu, cu, 4, 4, softcap=1.0)


def test_docstring_example_runs():
    result = doctest.testmod(attn_interface)
    assert result.attempted > 0 and result.failed == 0


def test_flex_block_mask_built_once_per_batch_and_reused_by_layers(monkeypatch):
    """The block mask is built once per batch (kept on the batch's VarlenMeta) and reused by every layer;
    other mask parameters or the next batch build their own; a call without a meta builds its own."""
    from varpack.attn import flex
    from varpack.varlen import VarlenMeta

    built = []
    original = flex.document_block_mask
    monkeypatch.setattr(flex, "document_block_mask", lambda *a, **kw: built.append(a) or original(*a, **kw))
    lens = [5, 1, 7]
    q, k, v, cu, _ = make_inputs(lens)
    meta = VarlenMeta(cu)
    with torch.no_grad():
        outs = [varlen_attention(q, k, v, meta=meta, backend="flex") for _layer in range(3)]  # one step
        assert len(built) == 1
        varlen_attention(q, k, v, meta=meta, backend="flex", window_size=(2, -1))  # other mask params
        assert len(built) == 2
        varlen_attention(q, k, v, meta=meta, backend="flex")
        assert len(built) == 2
        cu2 = torch.tensor([0, 6, 6, 13], dtype=torch.int32)  # next batch: its own meta, its own mask
        meta2 = VarlenMeta(cu2)
        out2 = varlen_attention(q, k, v, meta=meta2, backend="flex")
        assert len(built) == 3
        torch.testing.assert_close(out2, reference_varlen_attention(q, k, v, cu2, cu2), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs[0], reference_varlen_attention(q, k, v, cu, cu), rtol=1e-5, atol=1e-5)
        varlen_attention(q, k, v, cu, cu, 7, 7, backend="flex")  # no meta: built for this call
        varlen_attention(q, k, v, cu, cu, 7, 7, backend="flex")
        assert len(built) == 5


def test_exported_from_varpack():
    import varpack
    import varpack.attn

    assert varpack.varlen_attention is varpack.attn.varlen_attention


def test_auto_min_head_dim_for_grad_applies_only_to_training(monkeypatch, fake_registry):
    """A backend listed in AUTO_MIN_HEAD_DIM_FOR_GRAD is skipped by auto for a gradient-needing call below its
    verified head dim (the H200's FA4 gave wrong gradients at D=16), but still chosen for inference and when
    forced."""
    from varpack.attn import registry

    monkeypatch.setitem(registry.AUTO_MIN_HEAD_DIM_FOR_GRAD, "fake_fast", 32)
    q, k, v, _, _ = make_inputs([4, 3], d=16)  # leaf tensors that require grad
    assert resolve_backend("auto", q.detach(), k.detach(), v.detach()) == "fake_fast"  # no grad needed
    with torch.no_grad():
        assert resolve_backend("auto", q, k, v) == "fake_fast"
    chosen = resolve_backend("auto", q, k, v)
    assert chosen == "reference" and "verified head dims D >= 32, got D=16" in chosen.reason
    assert resolve_backend("fake_fast", q, k, v) == "fake_fast"
