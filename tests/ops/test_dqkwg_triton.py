"""varpack's Triton kernel for ``fla_hybrid``'s ``dq, dk, dw, dg`` step (:func:`chunk_bwd_dqkwg_triton`).

CPU: through Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1`` on a machine without CUDA;
otherwise these skip), against fp64 autograd of the chunk equations (tests/ops/test_fla_hybrid.py's
``_reference``) and against the batched PyTorch step: 1-token sequences, lengths that are not multiples of the
chunk, many sequences, grouped value heads, several key / value blocks; a negative control (boundaries
dropped) must mismatch. GPU (``gpu`` marker): the compiled kernel at Qwen3.5's head size, every launch block
size (fla's own kernel is miscompiled on Hopper at one of them, github.com/fla-org/flash-linear-attention/issues/640), by the fp64-truth rule.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from tests.ops.test_fla_hybrid import _chunks, _problem, _reference  # noqa: E402
from varpack._triton import triton_interpreted  # noqa: E402
from varpack.ops.gated_delta_rule import fla_hybrid as fh  # noqa: E402


def _interpreted_or_skip():
    if not triton_interpreted():
        pytest.skip("Triton was imported compiled in this process (TRITON_INTERPRET=1 not set before it)")


def _run(fn, p, cu, scale, **kw):
    g2 = p["gcum"].float() / math.log(2.0)  # fla's log2 units
    return fn(p["q"], p["k"], p["v_new"], g2, p["h"], p["dh"], p["dv"], p["do"], scale, cu, **kw)


CASES = [[1], [1, 1, 1], [5, 64, 1, 130, 63, 65], [200], [1] * 40 + [70, 3]]


@pytest.mark.parametrize("lengths", CASES)
@pytest.mark.parametrize("Hk,H", [(2, 4), (3, 3)])
def test_triton_dqkwg_fp32_matches_autograd(lengths, Hk, H):
    _interpreted_or_skip()
    p64, cu, _, ch = _problem(lengths, Hk=Hk, H=H)
    scale = 16**-0.5
    ref = _reference(p64, ch, scale)
    p32 = {n: x.float() for n, x in p64.items()}
    got = _run(fh.chunk_bwd_dqkwg_triton, p32, cu, scale, precision="fp32", w_dtype=torch.float32)
    for name, a, b in zip(("dq", "dk", "dw", "dg"), got, ref):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5, msg=name)


@pytest.mark.parametrize("launch", [{"block_k": 16, "block_v": 16}, {"block_k": 32, "block_v": 16}])
def test_triton_dqkwg_several_key_and_value_blocks(launch):
    """K = V = 32 in 16-wide blocks: dg's per-key-block slices and the value loop add up to the truth."""
    _interpreted_or_skip()
    p64, cu, _, ch = _problem([5, 64, 1, 70], Hk=1, H=2, K=32, V=32)
    scale = 0.2
    ref = _reference(p64, ch, scale)
    p32 = {n: x.float() for n, x in p64.items()}
    got = _run(
        fh.chunk_bwd_dqkwg_triton, p32, cu, scale, precision="fp32", w_dtype=torch.float32, launch=launch
    )
    for name, a, b in zip(("dq", "dk", "dw", "dg"), got, ref):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5, msg=name)


def test_triton_dqkwg_mixed_bf16_equals_torch_step():
    """bf16 operands, fp32 accumulation (fla's kernel semantics): the same values as the PyTorch step's
    ``"mixed"`` up to the order of fp32 sums, and within bf16 tolerance of the fp64 truth."""
    _interpreted_or_skip()
    lengths = [5, 64, 1, 130, 63]
    p64, cu, _, ch = _problem(lengths)
    scale = 0.3
    ref = _reference(p64, ch, scale)
    low = ("h", "dh", "q", "k", "v_new", "do", "dv", "w")
    pbf = {n: (x.bfloat16() if n in low else x.float()) for n, x in p64.items()}
    tri = _run(fh.chunk_bwd_dqkwg_triton, pbf, cu, scale, precision="mixed")
    tor = _run(fh.chunk_bwd_dqkwg_torch, pbf, cu, scale, precision="mixed")
    assert tri[2].dtype == torch.bfloat16 and tri[0].dtype == torch.float32
    for name, a, b, truth in zip(("dq", "dk", "dw", "dg"), tri, tor, ref):
        scale_b = float(truth.abs().max())
        # two bf16 ulps: the interpreter's casts to bf16 need not round as PyTorch's do (the GPU test holds
        # the compiled kernel to the fp64-truth rule)
        assert float((a.double() - b.double()).abs().max()) <= 1.6e-2 * scale_b, name
        assert float((a.double() - truth).abs().max()) <= 3e-2 * scale_b, name


@pytest.mark.parametrize("Hk,H", [(3, 3), (2, 4)])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_dqkwg_dq_dtype_rounds_the_fp32_dq_once(impl, Hk, H):
    """``dq_dtype`` (the rule without its l2norm: dq final here): dq comes back in that dtype, the fp32 dq
    rounded once (written so by the kernel for ungrouped heads, cast after the group sum otherwise); dk, dw
    and dg unchanged. Negative control: a dq of another problem is not within that rounding."""
    _interpreted_or_skip()
    p64, cu, _, _ = _problem([5, 64, 1, 70], Hk=Hk, H=H)
    low = ("h", "dh", "q", "k", "v_new", "do", "dv", "w")
    pbf = {n: (x.bfloat16() if n in low else x.float()) for n, x in p64.items()}
    fn = fh.chunk_bwd_dqkwg_triton if impl == "triton" else fh.chunk_bwd_dqkwg_torch
    full = _run(fn, pbf, cu, 0.3, precision="mixed")
    got = _run(fn, pbf, cu, 0.3, precision="mixed", dq_dtype=torch.bfloat16)
    assert got[0].dtype == torch.bfloat16 and full[0].dtype == torch.float32
    # one rounding of the same fp32 value (the interpreter's cast may round the other way at a tie: one ulp)
    torch.testing.assert_close(got[0].float(), full[0], atol=0, rtol=2**-7)
    for a, b in zip(got[1:], full[1:]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    other = _run(fn, pbf, cu, 0.5, precision="mixed", dq_dtype=torch.bfloat16)
    assert not torch.allclose(other[0].float(), full[0], atol=0, rtol=2**-7)


def test_triton_dqkwg_negative_control_boundaries_dropped():
    """The same tensors chunked as one sequence (boundaries dropped) must not reproduce the packed truth."""
    _interpreted_or_skip()
    lengths = [5, 64, 1, 130, 63]
    p64, cu, _, ch = _problem(lengths)
    scale = 0.25
    ref = _reference(p64, ch, scale)
    T = sum(lengths)
    n1 = len(_chunks([T]))
    p1 = {n: x.float() for n, x in p64.items()}
    p1 = dict(p1, h=p1["h"][:, :n1].contiguous(), dh=p1["dh"][:, :n1].contiguous())
    got = _run(
        fh.chunk_bwd_dqkwg_triton, p1, torch.tensor([0, T]), scale, precision="fp32", w_dtype=torch.float32
    )
    assert any((a.double() - b).abs().max() > 1e-3 for a, b in zip(got, ref))


def test_triton_dqkwg_rejects_bad_arguments():
    p64, cu, _, _ = _problem([3, 4])
    p32 = {n: x.float() for n, x in p64.items()}
    with pytest.raises(ValueError, match="precision"):
        _run(fh.chunk_bwd_dqkwg_triton, p32, cu, 0.5, precision="input")
    with pytest.raises(ValueError, match="fp64"):
        _run(fh.chunk_bwd_dqkwg_triton, p64, cu, 0.5, precision="fp32")
    with pytest.raises(ValueError, match="chunk of 64"):
        _run(fh.chunk_bwd_dqkwg_triton, p32, cu, 0.5, precision="fp32", chunk_size=32)
    if triton_interpreted():
        with pytest.raises(ValueError, match="h/dh"):
            _run(fh.chunk_bwd_dqkwg_triton, dict(p32, h=p32["h"][:, :1]), cu, 0.5, precision="fp32")
    else:
        with pytest.raises(RuntimeError, match="Triton runs compiled"):
            _run(fh.chunk_bwd_dqkwg_triton, p32, cu, 0.5, precision="fp32")


def test_dqkwg_dispatch_picks_by_device_and_precision(monkeypatch):
    """``auto``: the Triton kernel for CUDA tensors in "mixed" / "fp32", the PyTorch step otherwise; a forced
    impl is obeyed; an unknown one is refused."""
    calls = []
    monkeypatch.setattr(fh, "chunk_bwd_dqkwg_triton", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(fh, "chunk_bwd_dqkwg_torch", lambda *a, **k: calls.append("torch"))

    class _Dev:
        def __init__(self, kind):
            self.device = torch.device(kind) if kind == "cpu" else type("D", (), {"type": kind})()

    fh.chunk_bwd_dqkwg(_Dev("cpu"), precision="mixed")
    fh.chunk_bwd_dqkwg(_Dev("cuda"), precision="mixed")
    fh.chunk_bwd_dqkwg(_Dev("cuda"), precision="fp32")
    fh.chunk_bwd_dqkwg(_Dev("cuda"), precision="input")
    fh.chunk_bwd_dqkwg(_Dev("cuda"), precision="mixed", impl="torch")
    fh.chunk_bwd_dqkwg(_Dev("cpu"), precision="mixed", impl="triton")
    monkeypatch.setattr(fh, "DQKWG_IMPL", "torch")
    fh.chunk_bwd_dqkwg(_Dev("cuda"), precision="mixed")
    assert calls == ["torch", "triton", "triton", "torch", "torch", "triton", "torch"]
    with pytest.raises(ValueError, match="impl"):
        fh.chunk_bwd_dqkwg(_Dev("cpu"), impl="cuda")


# ------------------------------------------------------------------------------------------------------
# GPU: the compiled kernel at Qwen3.5's head size (K = V = 128), every launch block size


@pytest.mark.gpu
@pytest.mark.parametrize("block_k,block_v", [(32, 64), (64, 64), (128, 32), (64, 32)])
@pytest.mark.parametrize("Hk,H", [(4, 8), (8, 8)])
def test_gpu_triton_dqkwg_matches_fp64_truth(block_k, block_v, Hk, H):
    """bf16 inputs on the H200: the Triton step's error against the fp64 step on the same (bf16-valued) inputs
    is at most 2x the PyTorch "mixed" step's own error + bf16 rounding; fp32 precision is tight."""
    if not torch.cuda.is_available() or triton_interpreted():
        pytest.skip("needs CUDA with compiled Triton")
    lengths = [1, 5, 64, 130, 63, 65, 700, 1] + [17] * 20
    p64, cu, _, _ = _problem(lengths, Hk=Hk, H=H, K=128, V=128, seed=3)
    dev = torch.device("cuda")
    low = ("h", "dh", "q", "k", "v_new", "do", "dv", "w")
    pbf = {n: (x.bfloat16() if n in low else x.float()).to(dev) for n, x in p64.items()}
    ptruth = {n: x.double() for n, x in pbf.items()}
    scale = 128**-0.5
    plan = fh.dqkwg_plan(cu, device=dev)
    truth = _run(fh.chunk_bwd_dqkwg_torch, ptruth, cu, scale, precision="fp32", plan=plan)
    ref = _run(fh.chunk_bwd_dqkwg_torch, pbf, cu, scale, precision="mixed", plan=plan)
    launch = {"block_k": block_k, "block_v": block_v}
    got = _run(fh.chunk_bwd_dqkwg_triton, pbf, cu, scale, precision="mixed", plan=plan, launch=launch)
    for name, a, r, t in zip(("dq", "dk", "dw", "dg"), got, ref, truth):
        mag = float(t.abs().max())
        err, ref_err = float((a.double() - t).abs().max()), float((r.double() - t).abs().max())
        assert err <= 2 * ref_err + 8e-3 * mag, (name, err, ref_err, mag)
    p32 = {n: x.float() for n, x in pbf.items()}
    got32 = _run(fh.chunk_bwd_dqkwg_triton, p32, cu, scale, precision="fp32", plan=plan, launch=launch)
    for name, a, t in zip(("dq", "dk", "dw", "dg"), got32, truth):
        assert float((a.double() - t).abs().max()) <= 1e-4 * float(t.abs().max()), name


@pytest.mark.gpu
def test_gpu_triton_dqkwg_70000_one_token_sequences():
    """70,000 one-token chunks: more than CUDA's 65,535 blocks on a grid's second axis (chunks run on the
    first), equal to the PyTorch step."""
    if not torch.cuda.is_available() or triton_interpreted():
        pytest.skip("needs CUDA with compiled Triton")
    lengths = [1] * 70000
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)  # drawn on the GPU: h / dh hold 1.1e9 values each
    T, H, K, V = len(lengths), 4, 64, 64
    cu = torch.arange(T + 1, dtype=torch.int64)

    def r(*s):
        return torch.randn(*s, generator=gen, device=dev)

    p = {
        "q": r(1, T, 2, K).bfloat16(), "k": r(1, T, 2, K).bfloat16(), "v_new": r(1, T, H, V).bfloat16(),
        "do": r(1, T, H, V).bfloat16(), "dv": r(1, T, H, V).bfloat16(), "gcum": -r(1, T, H).abs(),
        "h": r(1, T, H, K, V).bfloat16() * 0.1, "dh": r(1, T, H, K, V).bfloat16() * 0.1,
    }  # fmt: skip
    plan = fh.dqkwg_plan(cu, device=dev)
    tri = _run(fh.chunk_bwd_dqkwg_triton, p, cu, 0.125, precision="mixed", plan=plan)
    tor = _run(fh.chunk_bwd_dqkwg_torch, p, cu, 0.125, precision="mixed", plan=plan)
    for name, a, b in zip(("dq", "dk", "dw", "dg"), tri, tor):
        assert float((a.float() - b.float()).abs().max()) <= 1e-2 * float(b.float().abs().max()), name
