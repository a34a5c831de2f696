"""Attention sinks and a value head dim other than the query / key one (MLA) in varlen_attention: the reference
against an independent dense formula, sdpa / flex against the reference (forward; sdpa also backward, sinks'
gradient included), FA4's sink-gradient rule on the CPU, and the backends that do not declare a feature
refusing it. Negative controls: dropping the sinks, or attending across segments, changes the output."""

from __future__ import annotations

import pytest
import torch

from varpack.attn import BackendUnavailableError, varlen_attention
from varpack.attn._base import Backend, CallSpec, Capabilities
from varpack.attn.flash_attn4 import _SinkGradient
from varpack.attn.registry import BACKENDS

CU = torch.tensor([0, 5, 6, 13, 17], dtype=torch.int32)  # a 1-token segment among longer ones
T, H, HKV = 17, 4, 2


def _inputs(d=16, dv=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, d, generator=g, dtype=dtype)
    k = torch.randn(T, HKV, d, generator=g, dtype=dtype)
    v = torch.randn(T, HKV, dv, generator=g, dtype=dtype)
    sinks = torch.randn(H, generator=g, dtype=dtype)
    return q, k, v, sinks


def _dense(q, k, v, sinks, window=None):
    """Independent formula: per segment, the scores of its queries and keys, one extra column per head holding
    the sink logit, causal / window mask, softmax over keys + sink, the sink column dropped."""
    scale = q.shape[-1] ** -0.5
    outs = []
    cu = CU.tolist()
    for a, b in zip(cu, cu[1:]):
        qs, ks, vs = q[a:b], k[a:b].repeat_interleave(H // HKV, 1), v[a:b].repeat_interleave(H // HKV, 1)
        scores = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        n = b - a
        i, j = torch.arange(n)[:, None], torch.arange(n)[None]
        allowed = j <= i if window is None else (j <= i) & (j >= i - window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.view(H, 1, 1).expand(H, n, 1)], dim=-1)
        probs = scores.softmax(-1)[..., :n]
        outs.append(torch.einsum("hij,jhd->ihd", probs, vs))
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("dv", [16, 8])
def test_reference_with_sinks_and_value_head_dim_matches_dense_formula(window, dv):
    q, k, v, sinks = _inputs(dv=dv)
    w = (-1, -1) if window is None else (window, 0)
    out = varlen_attention(q, k, v, CU, CU, 7, 7, backend="reference", sinks=sinks, window_size=w)
    assert out.shape == (T, H, dv)
    torch.testing.assert_close(out, _dense(q, k, v, sinks, window), rtol=1e-10, atol=1e-12)
    no_sinks = varlen_attention(q, k, v, CU, CU, 7, 7, backend="reference", window_size=w)
    torch.testing.assert_close(no_sinks, _dense(q, k, v, None, window), rtol=1e-10, atol=1e-12)
    assert float((no_sinks - out).abs().max()) > 1e-2  # negative control: the sinks matter


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize(("sinks_on", "dv"), [(True, 16), (False, 8), (True, 8)])
def test_sdpa_and_flex_match_reference_forward(backend, sinks_on, dv):
    q, k, v, sinks = (t.float() for t in _inputs(dv=dv))
    sinks = sinks if sinks_on else None
    ref = varlen_attention(q, k, v, CU, CU, 7, 7, backend="reference", sinks=sinks)
    with torch.no_grad():
        out = varlen_attention(q, k, v, CU, CU, 7, 7, backend=backend, sinks=sinks)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dv", [16, 8])
def test_sdpa_gradients_match_reference_sinks_included(dv):
    base = _inputs(dv=dv)
    grads = {}
    for backend in ("reference", "sdpa"):
        leaves = [t.clone().requires_grad_(True) for t in base]
        q, k, v, sinks = leaves
        out = varlen_attention(q, k, v, CU, CU, 7, 7, backend=backend, sinks=sinks)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads[backend] = [t.grad for t in leaves]
    for name, a, b in zip("qkvs", grads["reference"], grads["sdpa"]):
        assert b is not None and float(b.abs().max()) > 0, name
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-11, msg=f"grad of {name}")


def test_fa4_sink_gradient_rule_matches_autograd():
    """FA4 returns no sink gradient: _SinkGradient adds -sum_i exp(sink - lse_i) (dout_i . out_i), with FA4's
    lse (sinks included); here out / lse come from the reference (sinks detached, as FA4's kernel sees them)."""
    q, k, v, sinks = _inputs()
    sinks.requires_grad_(True)
    ref = varlen_attention(q, k, v, CU, CU, 7, 7, backend="reference", sinks=sinks)
    weight = torch.linspace(-1, 1, ref.numel(), dtype=ref.dtype).view_as(ref)
    (expected,) = torch.autograd.grad((ref * weight).sum(), sinks)

    out = varlen_attention(q, k, v, CU, CU, 7, 7, backend="reference", sinks=sinks.detach())
    scale = q.shape[-1] ** -0.5
    lse = torch.empty(H, T, dtype=q.dtype)
    cu = CU.tolist()
    for a, b in zip(cu, cu[1:]):
        ks = k[a:b].repeat_interleave(H // HKV, 1)
        scores = torch.einsum("ihd,jhd->hij", q[a:b], ks) * scale
        n = b - a
        scores = scores.masked_fill(torch.arange(n)[None] > torch.arange(n)[:, None], float("-inf"))
        full = torch.cat([scores, sinks.detach().view(H, 1, 1).expand(H, n, 1)], dim=-1)
        lse[:, a:b] = full.logsumexp(-1)
    wrapped = _SinkGradient.apply(out, sinks, lse)
    (got,) = torch.autograd.grad((wrapped * weight).sum(), sinks)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_backends_that_do_not_declare_a_feature_refuse_it():
    for name in ("torch_varlen", "flash_attn", "flash_attn_3", "triton_short"):
        cap = BACKENDS[name].capabilities
        assert not cap.sinks and not cap.distinct_v_head_dim, name

    class AnyDevice(Backend):
        name = "any"
        capabilities = Capabilities(devices=frozenset({"*"}), dtypes=frozenset({torch.float32}))

    backend = AnyDevice()
    base = CallSpec(device=torch.device("cpu"), dtype=torch.float32, head_dim=24, num_heads=4, num_kv_heads=2)
    assert backend.supports(base) == (True, "ok")
    ok, why = backend.supports(CallSpec(**{**base.__dict__, "sinks": True}))
    assert not ok and "sinks" in why
    ok, why = backend.supports(CallSpec(**{**base.__dict__, "head_dim_v": 16}))
    assert not ok and "Dv=16" in why
    BACKENDS["any"] = backend
    try:
        q, k, v, sinks = (t.float() for t in _inputs())
        with pytest.raises(BackendUnavailableError, match="'any' cannot run this call: attention sinks"):
            varlen_attention(q, k, v, CU, CU, 7, 7, backend="any", sinks=sinks)
    finally:
        del BACKENDS["any"]


def test_sinks_shape_is_checked():
    q, k, v, sinks = _inputs()
    with pytest.raises(ValueError, match=r"sinks must have shape \(H,\)"):
        varlen_attention(q, k, v, CU, CU, 7, 7, backend="reference", sinks=sinks[:2])
