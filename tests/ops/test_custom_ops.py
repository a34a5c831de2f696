"""varpack::varlen_attention and varpack::gated_delta_rule as torch.library custom ops: opcheck, equal to the
direct calls (values and gradients), compiled with fullgraph and no graph break, packed == unpacked through
the op with a negative control, and a tiny Qwen3 compiled whole (fullgraph) equal to eager."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from tests._exact import LOGITS_RTOL, LOSS_RTOL, assert_differs, assert_exact
from tests.invariant.test_dense import VOCAB, make_samples, packed_run, unpacked_run
from varpack.attn import available_backends, varlen_attention
from varpack.attn.custom_op import _varlen_attention, op_backward_kind, varlen_attention_op
from varpack.integrations.kernels import compile_layers
from varpack.models import load_model
from varpack.ops.gated_delta_rule import gated_delta_rule
from varpack.ops.gated_delta_rule.custom_op import _gated_delta_rule, gated_delta_rule_op

LENGTHS = (5, 1, 7, 3)
EXACT = {"rtol": 0.0, "atol": 0.0}


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _qkv(lengths=LENGTHS, h=4, hkv=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return [torch.randn(t, n, d, generator=gen).requires_grad_() for n in (h, hkv, hkv)]


def _gdn_inputs(lengths=(5, 1, 30, 3), hk=1, h=2, k=8, v=8, seed=0, state=True):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    xs = [
        torch.randn(1, t, hk, k, generator=gen),
        torch.randn(1, t, hk, k, generator=gen),
        torch.randn(1, t, h, v, generator=gen),
        torch.nn.functional.logsigmoid(torch.randn(1, t, h, generator=gen)),
        torch.rand(1, t, h, generator=gen),
    ]
    if state:
        xs.append(torch.randn(len(lengths), h, k, v, generator=gen))
    return [x.requires_grad_() for x in xs]


def _grads(out, inputs):
    return torch.autograd.grad(
        (out * torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)).sum(), inputs
    )


# -- opcheck --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "sdpa", "triton_short"])
@pytest.mark.parametrize("window", [(-1, 0), (2, 0)])
def test_attention_opcheck(backend, window):
    if backend == "triton_short" and not available_backends("cpu", torch.float32)[backend][0]:
        pytest.skip(available_backends("cpu", torch.float32)[backend][1])
    q, k, v = _qkv()
    cu = _cu(LENGTHS)
    args = (q, k, v, cu, cu, 7, 7, True, 0.3, window[0], window[1], 0.0, backend)
    torch.library.opcheck(_varlen_attention, args)


@pytest.mark.parametrize("backend", ["chunk", "naive"])
@pytest.mark.parametrize("final", [False, True])
def test_gated_delta_opcheck(backend, final):
    q, k, v, g, beta, h0 = _gdn_inputs()
    cu = torch.tensor([0, 5, 6, 36, 39])
    args = (q, k, v, g, beta, cu, cu, h0, 0.35, final, True, backend, 0)
    torch.library.opcheck(_gated_delta_rule, args)


# -- equal to the direct calls, eager and compiled -------------------------------------------------------
COMPILERS = [None, "eager", "aot_eager"]


def _compiled(fn, compiler):
    if compiler is None:
        return fn
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=compiler)


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize(
    "backend,kw",
    [
        ("reference", {}),
        ("sdpa", {}),
        ("reference", {"window_size": (2, 0), "softcap": 3.0}),
        ("sdpa", {"causal": False, "window_size": (1, 2)}),
        ("auto", {}),
    ],
)
def test_attention_op_equals_varlen_attention(compiler, backend, kw):
    from torch._dynamo.utils import counters

    q, k, v = _qkv()
    cu = _cu(LENGTHS)
    want = varlen_attention(q, k, v, cu, cu, 7, 7, backend=backend, **kw)
    want_grads = _grads(want, (q, k, v))
    counters.clear()
    fn = _compiled(
        lambda q, k, v, cu, m: varlen_attention_op(q, k, v, cu, cu, m, m, backend=backend, **kw), compiler
    )
    got = fn(q, k, v, cu, 7)
    torch.testing.assert_close(got, want, **EXACT)
    for a, b in zip(_grads(got, (q, k, v)), want_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("backend", ["chunk", "naive"])
@pytest.mark.parametrize("final", [False, True])
def test_gated_delta_op_equals_gated_delta_rule(compiler, backend, final):
    from torch._dynamo.utils import counters

    xs = _gdn_inputs()
    cu = torch.tensor([0, 5, 6, 36, 39])
    kw = {"output_final_state": final, "use_qk_l2norm_in_kernel": True, "backend": backend}
    o, s = gated_delta_rule(*xs[:5], initial_state=xs[5], cu_seqlens=cu, **kw)
    loss = (o * torch.linspace(-1, 1, o.numel(), device=o.device).reshape(o.shape)).sum() + (
        s.square().sum() if final else 0
    )
    want = torch.autograd.grad(loss, xs)
    counters.clear()
    fn = _compiled(
        lambda *a: gated_delta_rule_op(*a[:5], initial_state=a[5], cu_seqlens=a[6], **kw), compiler
    )
    o2, s2 = fn(*xs, cu)
    torch.testing.assert_close(o2, o, **EXACT)
    assert (s2 is None) == (not final)
    if final:
        torch.testing.assert_close(s2, s, **EXACT)
    loss2 = (o2 * torch.linspace(-1, 1, o.numel(), device=o.device).reshape(o.shape)).sum() + (
        s2.square().sum() if final else 0
    )
    for a, b in zip(torch.autograd.grad(loss2, xs), want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not counters["graph_break"], dict(counters["graph_break"])


# -- packed == unpacked through the ops, with a negative control -----------------------------------------
def _attention_packed_vs_alone(cu_packed, compiler):
    q, k, v = _qkv()
    fn = _compiled(
        lambda q, k, v, cu, m: varlen_attention_op(q, k, v, cu, cu, m, m, backend="sdpa"), compiler
    )
    t = q.shape[0]
    packed = fn(q, k, v, cu_packed, t)
    grads = _grads(packed, (q, k, v))
    alone, start = [], 0
    for n in LENGTHS:
        qs, ks, vs = (x[start : start + n] for x in (q, k, v))
        alone.append(varlen_attention_op(qs, ks, vs, _cu([n]), _cu([n]), n, n, backend="sdpa"))
        start += n
    alone = torch.cat(alone)
    return (packed - alone).abs().max().item(), max(
        (a - b).abs().max().item() for a, b in zip(grads, _grads(alone, (q, k, v)))
    )


@pytest.mark.parametrize("compiler", [None, "aot_eager"])
def test_attention_op_packed_equals_unpacked(compiler):
    out_diff, grad_diff = _attention_packed_vs_alone(_cu(LENGTHS), compiler)
    assert out_diff <= 1e-6 and grad_diff <= 1e-6
    # negative control: the boundaries dropped (one segment over the whole stream) -> the comparison fails
    out_diff, grad_diff = _attention_packed_vs_alone(_cu([sum(LENGTHS)]), compiler)
    assert out_diff > 1e-2 and grad_diff > 1e-2


def _gdn_packed_vs_alone(cu_packed, compiler, lengths=(5, 1, 30, 3)):
    xs = _gdn_inputs(lengths, state=False)
    kw = {"use_qk_l2norm_in_kernel": True, "backend": "chunk"}
    fn = _compiled(lambda *a: gated_delta_rule_op(*a[:5], cu_seqlens=a[5], **kw)[0], compiler)
    packed = fn(*xs, cu_packed)
    grads = _grads(packed, xs)
    alone, start = [], 0
    for n in lengths:
        alone.append(gated_delta_rule_op(*(x[:, start : start + n] for x in xs), **kw)[0])
        start += n
    alone = torch.cat(alone, dim=1)
    return (packed - alone).abs().max().item(), max(
        (a - b).abs().max().item() for a, b in zip(grads, _grads(alone, xs))
    )


@pytest.mark.parametrize("compiler", [None, "aot_eager"])
def test_gated_delta_op_packed_equals_unpacked(compiler):
    out_diff, grad_diff = _gdn_packed_vs_alone(torch.tensor([0, 5, 6, 36, 39]), compiler)
    assert out_diff <= 1e-5 and grad_diff <= 1e-5
    out_diff, grad_diff = _gdn_packed_vs_alone(torch.tensor([0, 39]), compiler)
    assert out_diff > 1e-2 and grad_diff > 1e-2


# -- errors --------------------------------------------------------------------------------------------
def test_backward_kinds_and_refusals():
    assert op_backward_kind("reference") == op_backward_kind("sdpa") == "recompute"
    assert op_backward_kind("flash_attn") is None and op_backward_kind("flash_attn_3") is None
    assert op_backward_kind("torch_varlen") is None and op_backward_kind("flex") is None  # see _NO_OP_BACKWARD
    assert op_backward_kind("triton_short") == "native"
    with pytest.raises(ValueError, match="unknown attention backend"):
        op_backward_kind("nope")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="must start at 0"):
        varlen_attention_op(q, k, v, _cu([3, 3]), _cu([3, 3]), 3, 3, backend="sdpa")
    xs = _gdn_inputs(state=False)
    with pytest.raises(ValueError, match="chunk_compiled"):
        gated_delta_rule_op(*xs, cu_seqlens=torch.tensor([0, 5, 6, 36, 39]), backend="chunk_compiled")


def test_auto_on_the_op_passes_over_backends_without_an_op_backward(monkeypatch):
    """auto on the op's training path skips a backend that has no backward through the op (on the H200 the
    short-documents class put torch_varlen first and the compiled step refused); without gradients it keeps
    it; a forced backend is still refused. Here sdpa is made backward-less so the CPU exercises the path."""
    from varpack.attn import BackendUnavailableError, custom_op
    from varpack.attn.registry import resolve_spec

    real = custom_op.op_backward_kind
    monkeypatch.setattr(
        custom_op, "op_backward_kind", lambda name, softcap=0.0: None if name == "sdpa" else real(name, softcap=softcap)
    )
    # a fresh cache for the patched rule (the real one may hold the unpatched answer); restored after the test
    monkeypatch.setattr(custom_op, "_no_op_backward", functools.cache(custom_op._no_op_backward.__wrapped__))
    args = ("auto", "cpu", -1, torch.float32, 8, 4, 2, True, (-1, 0), 0.0)
    assert custom_op._resolve_constant(*args, True, 200) == "reference"  # the compiled path's resolution
    assert custom_op._resolve_constant(*args, False, 200) == "sdpa"
    q, k, v = _qkv()
    cu = _cu(LENGTHS)
    got = varlen_attention_op(q, k, v, cu, cu, 7, 7)  # eager op path, needs gradients: reference, not a refusal
    want = varlen_attention(q, k, v, cu, cu, 7, 7, backend="reference")
    torch.testing.assert_close(got, want, **EXACT)
    for a, b in zip(_grads(got, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(BackendUnavailableError, match="no backward through varpack's custom op"):
        varlen_attention_op(q, k, v, cu, cu, 7, 7, backend="sdpa")
    spec = custom_op.CallSpec.from_tensors(q, k, v, causal=True, window_size=(-1, 0), softcap=0.0)
    resolved = resolve_spec("auto", spec, exclude={"sdpa": "why not"})
    assert str(resolved) == "reference" and "sdpa: why not" in resolved.reason
    assert str(resolve_spec("sdpa", spec, exclude={"sdpa": "why not"})) == "sdpa"  # forced: never excluded


# -- a whole Qwen3 decoder layer compiled with fullgraph -------------------------------------------------
SHAPES = [(5, 1, 7, 4), (9, 4), (2, 3, 2, 3, 2, 3, 6)]


def test_tiny_qwen3_fullgraph_through_the_op():
    """compile_layers(custom_ops=True, fullgraph=True): no graph break, one graph set for every pack shape,
    logits / loss / every gradient equal to the same model in eager mode (same backend) and to each sample
    alone; the boundaries dropped fail."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="sdpa")
    eager = copy.deepcopy(model)
    assert compile_layers(model, backend="aot_eager", custom_ops=True, fullgraph=True) == 2
    graphs = None
    for lengths in SHAPES:
        samples = make_samples(lengths)
        logits_c, loss_c, grads_c = packed_run(model, samples)
        graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs > 0, lengths
        logits_e, loss_e, grads_e = packed_run(eager, samples)
        assert_exact(logits_c, logits_e, rtol=LOGITS_RTOL, what=f"logits compiled/eager {lengths}")
        assert_exact(loss_c, loss_e, rtol=LOSS_RTOL, what="loss compiled/eager")
        assert grads_c.keys() == grads_e.keys() and len(grads_c) == len(list(model.parameters()))
        assert_exact(grads_c, grads_e, what=f"gradient compiled/eager {lengths}")
        logits_u, loss_u, grads_u = unpacked_run(eager, samples)
        assert_exact(logits_c, logits_u, rtol=LOGITS_RTOL, what=f"logits {lengths}")
        assert_exact(grads_c, grads_u, what=f"gradient {lengths}")
    assert not counters["graph_break"], dict(counters["graph_break"])
    logits_b, _, grads_b = packed_run(model, samples, sabotage=True)
    assert_differs(logits_b, logits_u, rtol=LOGITS_RTOL, what="logits")
    assert_differs(grads_b, grads_u)


# -- GPU: the native FA4 backward against the recompute path ---------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_attn_4", "torch_varlen", "flex", "triton_short"])
def test_gpu_op_equals_varlen_attention(backend):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the GPU machine)")
    from varpack.attn import BackendUnavailableError

    gen = torch.Generator().manual_seed(0)
    lengths = (100, 3, 250, 17)
    t = sum(lengths)
    q, k, v = (
        torch.randn(t, n, 64, generator=gen).to("cuda", torch.bfloat16).requires_grad_() for n in (8, 2, 2)
    )
    cu = _cu(lengths)
    try:
        want = varlen_attention(q, k, v, cu, cu, 250, 250, backend=backend)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    want_grads = _grads(want.float(), (q, k, v))
    if op_backward_kind(backend) is None:
        # torch_varlen, flex: forward through the op, a call that needs gradients refused (never another path)
        with torch.no_grad():
            got = varlen_attention_op(q, k, v, cu, cu, 250, 250, backend=backend)
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=0)
        with pytest.raises(BackendUnavailableError, match="no backward through varpack's custom op"):
            varlen_attention_op(q, k, v, cu, cu, 250, 250, backend=backend)
        return
    assert op_backward_kind(backend) == "native", backend  # FA4 4.0.0b36: the native pair is wired
    got = varlen_attention_op(q, k, v, cu, cu, 250, 250, backend=backend)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(_grads(got.float(), (q, k, v)), want_grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_auto_trains_short_documents_through_the_op():
    """The H200 failure this guards: a pack of short documents (max_seqlen <= AUTO_SHORT_MAX_SEQLEN) put
    torch_varlen first in auto's order, which has no backward through the op, and the compiled training step
    (benchmarks/train.py varpack_lce_compile_ops) refused. Through the op auto must now pick a backend with a
    backward (the first of auto's order that has one), with output and gradients equal to that backend's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the GPU machine)")
    from varpack.attn import custom_op, resolve_backend
    from varpack.attn.registry import resolve_spec

    gen = torch.Generator().manual_seed(0)
    lengths = (120, 110, 128, 117, 3)  # short class, mean 95.6: above the AUTO_TRITON_SHORT row's 88
    t = sum(lengths)
    q, k, v = (
        torch.randn(t, n, 128, generator=gen).to("cuda", torch.bfloat16).requires_grad_() for n in (8, 2, 2)
    )
    cu = _cu(lengths)
    eager = str(resolve_backend("auto", q, k, v, cu_seqlens_q=cu, max_seqlen=128))
    spec = custom_op.CallSpec.from_tensors(
        q, k, v, causal=True, window_size=(-1, 0), max_seqlen=128, mean_seqlen=t / len(lengths)
    )
    name = str(resolve_spec("auto", spec, exclude=custom_op._no_op_backward(True, 0.0)))
    assert op_backward_kind(name) is not None, name
    if op_backward_kind(eager) is not None:
        pytest.skip(f"auto picks {eager} here, which has an op backward: the exclusion is not exercised")
    got = varlen_attention_op(q, k, v, cu, cu, 128, 128)  # refused before the fix when eager had no op backward
    want = varlen_attention(q, k, v, cu, cu, 128, 128, backend=name)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(_grads(got.float(), (q, k, v)), _grads(want.float(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    print(f"auto: {eager} for varlen_attention, {name} through the op")


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_attention_backward_fake_strides_match_the_implementation(layout):
    """The backward op's fake (meta) outputs have the strides its implementation returns, also for q / k / v
    that are strided views (heads-first projections transposed to ``[T, H, D]``, as a Qwen3.5 full-attention
    layer hands them over): inductor asserts the real strides against the fake ones (a fake that copied the
    inputs' strides failed on an H200 with ``expected ... stride 512==256``). Control: in the strided case the
    inputs' own strides differ from what the implementation returns, so a fake copying them would fail here."""
    from varpack.attn import custom_op  # noqa: F401 - registers the ops

    T, H, D = 12, 2, 8
    gen = torch.Generator().manual_seed(0)

    def make():
        x = torch.randn(H, T, D, generator=gen)
        return x.transpose(0, 1) if layout == "strided" else x.transpose(0, 1).contiguous()

    q, k, v = make(), make(), make()
    assert (q.is_contiguous()) == (layout == "contiguous")
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out = torch.randn(T, H, D, generator=gen)
    lse = torch.empty(0, dtype=torch.float32)
    args = (out.clone(), q, k, v, out, lse, cu, cu, 7, 7, True, D**-0.5, -1, -1, 0.0, "reference")
    real = torch.ops.varpack.varlen_attention_backward.default(*args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.varpack.varlen_attention_backward.default(
            *(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        )
    assert [t.stride() for t in fake] == [t.stride() for t in real], ([t.stride() for t in fake], real)
    assert [t.shape for t in fake] == [q.shape, k.shape, v.shape]
    copied = [x.stride() for x in (q, k, v)]
    assert (copied == [t.stride() for t in real]) == (layout == "contiguous"), copied
