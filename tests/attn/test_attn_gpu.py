"""Every CUDA backend against the reference on the device, forward and backward (dq, dk, dv).

Tolerance by the fp32-truth rule (flash-attn's tests, shared/STYLE.md): with ``truth`` the reference in
fp32 math on the same low-precision inputs and ``plain`` the same reference computed entirely in the
low-precision dtype (``upcast=False``, plain PyTorch), a backend passes when
``|backend - truth| <= k * |plain - truth| + atol`` elementwise-max, k = 2 forward and 3 backward, atol the
dtype's rounding of values of that size. A backend that declares it cannot run a case must refuse it with
BackendUnavailableError.
"""

from __future__ import annotations

import math

import pytest
import torch

from varpack.attn import (
    AUTO_PRIORITY,
    BACKENDS,
    BackendUnavailableError,
    CallSpec,
    available_backends,
    reference_varlen_attention,
    resolve_backend,
    varlen_attention,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
GPU_BACKENDS = [n for n in BACKENDS if n != "reference"]

CASES = [
    # (lens_q, lens_k, causal, window, softcap, h, hkv, d)
    pytest.param([37, 1, 300, 128, 5], None, True, (-1, -1), 0.0, 4, 2, 128, id="causal-gqa-odd"),
    pytest.param([37, 1, 300, 128, 5], None, False, (-1, -1), 0.0, 4, 4, 128, id="noncausal"),
    pytest.param([200, 3, 131], None, True, (64, -1), 0.0, 8, 1, 64, id="causal-window-mqa"),
    pytest.param([200, 3, 131], None, False, (17, 33), 0.0, 4, 2, 64, id="noncausal-window"),
    pytest.param([190, 66], None, True, (-1, -1), 30.0, 4, 2, 128, id="softcap"),
    pytest.param([1], None, True, (-1, -1), 0.0, 4, 2, 128, id="T=1"),
    pytest.param([60, 0, 90], None, True, (-1, -1), 0.0, 4, 2, 128, id="zero-length"),
    pytest.param([20, 150, 33], [150, 20, 33], True, (-1, -1), 0.0, 4, 2, 64, id="q!=k-bottom-right"),
    pytest.param([1000], None, True, (-1, -1), 0.0, 2, 2, 128, id="one-long"),
]


def _inputs(lens_q, lens_k, h, hkv, d, dtype, seed=0):
    lens_k = lens_q if lens_k is None else lens_k
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, generator=g, device=DEVICE, dtype=torch.float32)
    k = torch.randn(sum(lens_k), hkv, d, generator=g, device=DEVICE, dtype=torch.float32)
    v = torch.randn(sum(lens_k), hkv, d, generator=g, device=DEVICE, dtype=torch.float32)
    dout = torch.randn(sum(lens_q), h, d, generator=g, device=DEVICE, dtype=torch.float32)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, dout.to(dtype), cu_q, cu_k, lens_k


def _fwd_bwd(fn, q, k, v, dout):
    out = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out, dq, dk, dv


def _rounding(x: torch.Tensor, dtype: torch.dtype) -> float:
    """flash-attn's atol: twice the rounding error of ``dtype`` on values of x's size."""
    t = x.detach().to(dtype)
    return 2 * ((t + 0.3) - 0.3 - t).abs().max().float().item()


def _check_fp32_truth(name, got, truth, plain, dtype, k):
    err = (got.float() - truth.float()).abs().max().item()
    base = (plain.float() - truth.float()).abs().max().item()
    atol = _rounding(truth, dtype) + 1e-5
    assert math.isfinite(err), f"{name}: non-finite output"
    assert err <= k * base + atol, (
        f"{name}: error {err:.3e} > {k} x plain-PyTorch error {base:.3e} + {atol:.1e}"
    )


#: fp16 beside bf16: every case for varpack's own kernel; for the others (their dtype reaches the library's kernel
#: unchanged, as bf16 does) the cases that cover GQA with odd lengths, a two-sided window at D = 64 and softcap.
FP16_EVERY_CASE = ("triton_short",)
FP16_CASES = ("causal-gqa-odd", "noncausal-window", "softcap")


def _matrix():
    for backend in GPU_BACKENDS:
        for case in CASES:
            for dtype, tag in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
                if tag == "fp16" and backend not in FP16_EVERY_CASE and case.id not in FP16_CASES:
                    continue
                yield pytest.param(backend, *case.values, dtype, id=f"{backend}-{case.id}-{tag}")


@pytest.mark.parametrize("backend,lens_q,lens_k,causal,window,softcap,h,hkv,d,dtype", list(_matrix()))
def test_backend_matches_reference(backend, lens_q, lens_k, causal, window, softcap, h, hkv, d, dtype):
    q, k, v, dout, cu_q_cpu, cu_k_cpu, lens_k = _inputs(lens_q, lens_k, h, hkv, d, dtype)
    kwargs = dict(causal=causal, window_size=window, softcap=softcap)
    has_empty = 0 in lens_q or 0 in lens_k
    ok, reason = BACKENDS[backend].is_available()
    if not ok:
        pytest.skip(f"{backend} not installed: {reason}")
    # A declared limitation must raise (cu_seqlens on the CPU: zero-length segments are detectable).
    try:
        resolve_backend(backend, q, k, v, **kwargs, cu_seqlens_q=cu_q_cpu, cu_seqlens_k=cu_k_cpu)
    except BackendUnavailableError as exc:
        with pytest.raises(BackendUnavailableError):
            varlen_attention(q, k, v, cu_q_cpu, cu_k_cpu, max(lens_q), max(lens_k), backend=backend, **kwargs)
        pytest.skip(f"{backend} declares it cannot run this case: {exc}")
    # The hot path: cu_seqlens already on the GPU (zero-length segments are the caller's declaration).
    cu_q, cu_k = cu_q_cpu.to(DEVICE), cu_k_cpu.to(DEVICE)
    if has_empty and not BACKENDS[backend].capabilities.empty_segments:
        pytest.skip("zero-length segments not declared")

    def run(qq, kk, vv):
        return varlen_attention(qq, kk, vv, cu_q, cu_k, max(lens_q), max(lens_k), backend=backend, **kwargs)

    def ref(upcast):
        return lambda qq, kk, vv: reference_varlen_attention(qq, kk, vv, cu_q, cu_k, upcast=upcast, **kwargs)

    got = _fwd_bwd(run, q, k, v, dout)
    truth = _fwd_bwd(ref(True), *(t.detach().float().requires_grad_() for t in (q, k, v)), dout.float())
    plain = _fwd_bwd(ref(False), q, k, v, dout)
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        _check_fp32_truth(f"{backend} {what}", got[i], truth[i], plain[i], dtype, 2 if i == 0 else 3)
    assert got[0].shape == (sum(lens_q), h, d) and got[0].dtype == dtype


@pytest.mark.parametrize("backend", ["flex", "reference"])
def test_fp32_backends_on_gpu(backend):
    lens = [37, 1, 300, 5]
    q, k, v, dout, cu, _, _ = _inputs(lens, None, 4, 2, 64, torch.float32)
    cu = cu.to(DEVICE)

    def run(qq, kk, vv):
        return varlen_attention(qq, kk, vv, cu, cu, 300, 300, backend=backend)

    got = _fwd_bwd(run, q, k, v, dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = _fwd_bwd(lambda a, b, c: reference_varlen_attention(a, b, c, cu, cu), q64, k64, v64, dout.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=2e-4, atol=2e-4)


def test_negative_control_dense_causal_over_stream_differs():
    lens = [37, 1, 300, 128, 5]
    q, k, v, _, cu, _, _ = _inputs(lens, None, 4, 4, 128, torch.bfloat16)
    with torch.no_grad():
        out = varlen_attention(q, k, v, cu.to(DEVICE), cu.to(DEVICE), 300, 300)
        dense = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True
        )[0].transpose(0, 1)
    assert (out.float() - dense.float()).abs().max().item() > 1e-3


def test_auto_picks_a_capable_backend_and_says_why():
    q, k, v, dout, cu, _, _ = _inputs([37, 1, 300], None, 4, 2, 128, torch.bfloat16)
    chosen = resolve_backend("auto", q, k, v)
    assert chosen in AUTO_PRIORITY["cuda"] and chosen.reason
    print(f"auto on {torch.cuda.get_device_name()}: {chosen} -- {chosen.reason}")
    print(available_backends(DEVICE, torch.bfloat16))
    ok, reason = BACKENDS[chosen].supports(CallSpec.from_tensors(q, k, v))
    assert ok, reason
    # softcap: auto moves past backends without softcap
    chosen = resolve_backend("auto", q, k, v, softcap=10.0)
    assert BACKENDS[chosen].capabilities.softcap


@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_no_host_sync_per_layer(backend):
    """After the first layer of a batch (block mask built), a layer never synchronizes with the host."""
    q, k, v, dout, cu, _, _ = _inputs([37, 1, 300, 128, 5], None, 4, 2, 128, torch.bfloat16)
    cu = cu.to(DEVICE)
    if BACKENDS[backend].capabilities.host_sync:
        pytest.skip(f"{backend} declares that it reads cu_seqlens on the host")
    try:
        resolve_backend(backend, q, k, v)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))

    torch.compiler.reset()  # a fresh compile cache, as one model's training has (see integrations/test_transformers.py)

    def layer():
        out = varlen_attention(q, k, v, cu, cu, 300, 300, backend=backend)
        torch.autograd.grad(out, (q, k, v), dout)

    layer()  # first layer of the batch: compile / build the BlockMask
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            layer()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_flex_block_mask_reused_across_layers_on_gpu(monkeypatch):
    from varpack.attn import flex
    from varpack.varlen import VarlenMeta

    if not BACKENDS["flex"].is_available()[0]:
        pytest.skip("no FlexAttention")
    built = []
    original = flex.document_block_mask
    monkeypatch.setattr(flex, "document_block_mask", lambda *a, **kw: built.append(a) or original(*a, **kw))
    q, k, v, _, cu, _, _ = _inputs([37, 1, 300], None, 4, 2, 128, torch.bfloat16)
    meta = VarlenMeta(cu.cpu(), max_seqlen_q=300)
    with torch.no_grad():
        for _ in range(4):
            varlen_attention(q, k, v, meta=meta, backend="flex")
    assert len(built) == 1
