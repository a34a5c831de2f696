"""The ``liger`` backend with uniform weights: Liger's cross-entropy kernel driven chunk by chunk without a host
sync (:class:`varpack.ops.linear_ce.liger._LigerSumLinearCrossEntropy`).

On the CPU a stand-in with the kernel's contract (its argument list, ``reduction="sum"``, the logits rows
overwritten by ``softmax - onehot``, ignored rows zeroed and their loss untouched) checks varpack's part: the
chunking, the gradient GEMMs, the float32 accumulation across chunks, the bias, ``grad_output`` and the loss
division. On CUDA the real kernel is checked against the full-logits loss and for the absence of host syncs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import varpack.ops.linear_ce.dispatch as dispatch
import varpack.ops.linear_ce.liger as liger
from tests.ops.test_linear_ce import IGNORE, _grads, _problem, ref_token_mean
from varpack.ops.linear_ce import linear_cross_entropy


class _StandInKernel:
    """``kernel[grid](**kwargs)`` with liger_cross_entropy_kernel's contract for the arguments varpack passes."""

    arg_names = liger._KERNEL_ARGS

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(**kw):
            assert set(kw) - {"num_warps"} == set(self.arg_names), set(kw) ^ set(self.arg_names)
            assert kw["reduction"] == "sum" and not kw["HAS_WEIGHT"] and not kw["HAS_SOFTCAPPING"]
            x, y, loss = kw["X_ptr"], kw["Y_ptr"], kw["loss_ptr"]
            assert grid == (x.shape[0],) and x.is_contiguous() and kw["n_cols"] == x.shape[1]
            self.launches.append(x.shape[0])
            keep = y != kw["ignore_index"]
            xf = x.float()
            lse = torch.logsumexp(xf, dim=1)
            row_loss = lse - xf.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
            loss.copy_(torch.where(keep, row_loss, loss))
            if kw["HAS_GRADIENTS"]:
                grad = torch.softmax(xf, dim=1) - F.one_hot(y.clamp(min=0), x.shape[1]).to(xf.dtype)
                x.copy_(torch.where(keep.unsqueeze(1), grad, 0).to(x.dtype))

        return launch


def _driven(hidden, weight, bias, labels, chunk, kernel, grad=True):
    return liger._LigerSumLinearCrossEntropy.apply(hidden, weight, bias, labels, IGNORE, chunk, grad, kernel)


def _sum_ref(hidden, weight, bias, labels):
    logits = hidden @ weight.T if bias is None else hidden @ weight.T + bias
    return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")


@pytest.mark.parametrize("chunk", [1, 4, 13, 64])  # many chunks, uneven last chunk, exactly one, one larger
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_driven_kernel_equals_full_logits(chunk, bias, dtype):
    hidden, weight, b, labels, _ = _problem(T=13, bias=bias, dtype=dtype)
    kernel = _StandInKernel()
    loss = _driven(hidden, weight, b, labels, chunk, kernel)
    ref = _sum_ref(hidden, weight, b, labels)
    assert kernel.launches == [min(chunk, 13 - s) for s in range(0, 13, chunk)]
    tol = {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(loss.double(), ref.double(), **tol)
    got, want = _grads(0.37 * loss, hidden, weight, b), _grads(0.37 * ref, hidden, weight, b)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("grad", [True, False])
def test_one_chunk_of_logits_alive_at_a_time(grad):
    """Peak memory: when a chunk's logits GEMM runs, no earlier chunk's logits are alive."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    hidden, weight, _, labels, _ = _problem(T=13, V=11)
    vocab, alive = weight.shape[0], []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default and out.shape[-1] == vocab and "out" not in (kwargs or {}):
                assert all(ref() is None for ref in alive), "an earlier chunk's logits are alive during this GEMM"
                alive.append(weakref.ref(out))
            return out

    with torch.set_grad_enabled(grad), Watch():
        _driven(hidden.detach().requires_grad_(grad), weight.detach().requires_grad_(grad), None, labels, 4,
                _StandInKernel(), grad=grad)  # fmt: skip
    assert len(alive) == 4


def test_no_grad_mode_and_empty_input():
    hidden, weight, _, labels, _ = _problem(T=9)
    kernel = _StandInKernel()
    with torch.no_grad():
        loss = _driven(hidden, weight, None, labels, 4, kernel, grad=torch.is_grad_enabled())
    torch.testing.assert_close(loss.double(), _sum_ref(hidden, weight, None, labels).detach(), rtol=1e-6, atol=0)
    empty = torch.zeros(0, 6, dtype=torch.float64, requires_grad=True)
    loss = _driven(empty, weight, None, labels[:0], 4, kernel)
    (gh, gw) = torch.autograd.grad(loss, (empty, weight))
    assert float(loss.detach()) == 0 and gh.shape == (0, 6) and bool((gw == 0).all())


def test_liger_loss_uses_the_driven_kernel_with_the_step_denominator(monkeypatch):
    kernel = _StandInKernel()
    monkeypatch.setattr(liger, "_liger_kernel_probe", lambda: (kernel, "stand-in"))
    monkeypatch.setattr(dispatch, "resolve_linear_ce_backend", lambda *a, **k: ("liger", "test"))
    hidden, weight, b, labels, _ = _problem(T=40, D=6, V=11, bias=True, n_samples=5, mask_frac=0.6)
    count = int((labels != IGNORE).sum())
    for num_items, max_sup in ((None, None), (23, count)):
        loss = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=16, num_items_in_batch=num_items,
                                    max_supervised=max_sup)  # fmt: skip
        ref = ref_token_mean(hidden, weight, labels, bias=b, num_items=num_items)
        torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-7)
        for g, w in zip(_grads(loss, hidden, weight, b), _grads(ref, hidden, weight, b)):
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-7)
    assert kernel.launches  # the driven kernel ran, not the library function


def test_negative_control_a_kernel_that_skips_the_gradient_is_caught():
    """What the exactness test would catch: a launch that leaves one chunk's logits in place of its gradient."""
    hidden, weight, b, labels, _ = _problem(T=13, bias=True)

    class Lazy(_StandInKernel):
        def __getitem__(self, grid):
            real = super().__getitem__(grid)

            def launch(**kw):
                real(**{**kw, "HAS_GRADIENTS": kw["HAS_GRADIENTS"] and len(self.launches) != 1})

            return launch

    got = _grads(_driven(hidden, weight, b, labels, 4, Lazy()), hidden, weight, b)
    want = _grads(_sum_ref(hidden, weight, b, labels), hidden, weight, b)
    assert not torch.allclose(got[0], want[0], rtol=1e-3, atol=1e-3)


def test_probe_refuses_a_kernel_with_other_arguments(monkeypatch):
    import sys
    import types

    class Other:
        arg_names = (*liger._KERNEL_ARGS[:-1], "HAS_GRADIENTS_V2")

    mod = types.ModuleType("liger_kernel.ops.cross_entropy")
    mod.liger_cross_entropy_kernel = Other()
    for name in ("liger_kernel", "liger_kernel.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.cross_entropy", mod)
    kernel, why = liger._liger_kernel_probe.__wrapped__()
    assert kernel is None and "HAS_GRADIENTS_V2" in why and "HAS_GRADIENTS'" in why


# ---------------------------------------------------------------------------------------------------------
# CPU: the real kernel, run by Triton's interpreter
# ---------------------------------------------------------------------------------------------------------


def _interpreted_kernel():
    """Liger's installed kernel where Triton runs interpreted (the CPU suite), with the interpreter's loop-bound
    fix for NumPy >= 2.4 (the kernel loops over vocabulary blocks up to its ``n_cols`` argument)."""
    from varpack._triton import fix_interpreter_index, triton_interpreted

    pytest.importorskip("liger_kernel.ops.cross_entropy")
    if not triton_interpreted():
        pytest.skip("Triton compiles for a GPU in this process: the CUDA tests below run the kernel")
    kernel, why = liger._liger_kernel_probe()
    if kernel is None:
        pytest.fail(f"the installed liger-kernel's kernel is not driven: {why}")
    fix_interpreter_index()
    return kernel


@pytest.mark.parametrize(
    "vocab,chunk,bias", [(300, 4, True), (300, 64, False), (40000, 5, True)]
)  # one vocabulary block, 4 chunks + bias; one chunk; two blocks of 32,768 (the kernel's online softmax)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_kernel_interpreted_equals_full_logits(vocab, chunk, bias, dtype):
    """The installed Liger kernel as varpack drives it: the loss and all three gradients against the loss of
    the full float32 logits, within the rounding of ``dtype`` (relative to each tensor's scale); a negative
    control with the labels shifted by one row is far outside it."""
    kernel = _interpreted_kernel()
    hidden, weight, b, labels, _ = _problem(T=13, D=16, V=vocab, dtype=torch.float32, bias=bias)
    weight = weight.detach().mul(0.3).requires_grad_()
    h, w = (x.detach().to(dtype).requires_grad_() for x in (hidden, weight))
    bb = None if b is None else b.detach().to(dtype).requires_grad_()
    loss = _driven(h, w, bb, labels, chunk, kernel)
    assert loss.dtype == torch.float32
    got = _grads(0.37 * loss, h, w, bb)

    def ref(lab):
        hf, wf = (x.detach().float().requires_grad_() for x in (h, w))
        bf = None if bb is None else bb.detach().float().requires_grad_()
        total = _sum_ref(hf, wf, bf, lab)
        return total, _grads(0.37 * total, hf, wf, bf)

    want_loss, want = ref(labels)
    eps = 1e-5 if dtype == torch.float32 else 2e-2  # float32 sums; bfloat16 stored logits and gradients
    assert _rel(loss.detach(), want_loss.detach()) < eps
    for g, r in zip(got, want):
        assert g.dtype == dtype and _rel(g, r) < eps, (g.dtype, _rel(g, r))
    _, shifted = ref(labels.roll(1))
    assert _rel(got[0], shifted[0]) > 10 * eps


# ---------------------------------------------------------------------------------------------------------
# CUDA: the real kernel
# ---------------------------------------------------------------------------------------------------------


def _cuda_kernel():
    from varpack.ops.linear_ce import linear_ce_backends

    if not linear_ce_backends("cuda")["liger"][0]:
        pytest.skip(linear_ce_backends("cuda")["liger"][1])
    kernel, why = liger._liger_kernel_probe()
    if kernel is None:
        pytest.fail(f"the installed liger-kernel's kernel is not driven: {why}")
    return kernel


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows,chunk,vocab,bias",
    [(6000, 4096, 32000, False), (3000, 4096, 32000, False), (2500, 1024, 151936, True)],
)  # two chunks; one chunk; Qwen3's vocabulary (5 kernel blocks per row), three chunks and a bias
def test_gpu_driven_kernel_equals_full_logits_and_the_library(rows, chunk, vocab, bias):
    kernel = _cuda_kernel()
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    D = 512
    hidden, weight, b, labels, _ = _problem(
        T=rows, D=D, V=vocab, dtype=torch.float32, bias=bias, n_samples=30, mask_frac=0.4
    )
    h0, w0, labels = hidden.detach().cuda(), weight.detach().mul(0.05).cuda(), labels.cuda()
    b0 = None if b is None else b.detach().mul(0.1).cuda()

    def run(fn, dtype):
        h, w = (x.to(dtype, copy=True).requires_grad_() for x in (h0, w0))  # fresh leaves every run
        bb = None if b0 is None else b0.to(dtype, copy=True).requires_grad_()
        loss = fn(h, w, bb)
        loss.backward()
        return (loss.detach().float(), h.grad.float(), w.grad.float()) + (() if bb is None else (bb.grad.float(),))

    driven = run(lambda h, w, bb: _driven(h, w, bb, labels, chunk, kernel), torch.bfloat16)
    library = run(lambda h, w, bb: liger_fused_linear_cross_entropy(h, w, labels, bb, reduction="sum"), torch.bfloat16)
    truth = run(lambda h, w, bb: _sum_ref(h, w, bb, labels), torch.float32)
    for d, lib, t in zip(driven, library, truth):
        # bf16 against the float32 truth no worse than Liger's own function (plus a small margin)
        assert _rel(d, t) <= 1.5 * _rel(lib, t) + 1e-3, (_rel(d, t), _rel(lib, t))
    # negative control: the same check sees a label shifted by one row
    shifted = run(lambda h, w, bb: _driven(h, w, bb, labels.roll(1), chunk, kernel), torch.bfloat16)
    assert _rel(shifted[1], truth[1]) > 10 * (_rel(library[1], truth[1]) + 1e-3)


@pytest.mark.gpu
def test_gpu_liger_step_without_host_sync(monkeypatch):
    """``backend="liger"`` forward and backward with the LM head on the supervised rows and the step count as
    an int: no host sync. Negative control: Liger's own function (its ``.item()``) is caught by the same check."""
    from tests._sync import without_host_sync

    _cuda_kernel()
    T, D, V = 4096, 256, 8000
    hidden, weight, _, labels, _ = _problem(T=T, D=D, V=V, dtype=torch.float32, n_samples=20, mask_frac=0.4)
    labels = labels.cuda()
    count = int((labels != IGNORE).sum())
    h0, w0 = hidden.detach().cuda().bfloat16(), weight.detach().mul(0.05).cuda().bfloat16()

    def step():
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = linear_cross_entropy(h, w, labels, backend="liger", max_supervised=count, num_items_in_batch=count)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    want = step()  # Triton compiles outside the check
    got = without_host_sync(step)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    monkeypatch.setattr(liger, "_liger_kernel_probe", lambda: (None, "negative control"))
    with pytest.raises(RuntimeError, match="synchroniz"):
        without_host_sync(step)


@pytest.mark.parametrize("backend", ["driven", "chunked"])
def test_grad_output_scales_16bit_gradients_in_float32(backend):
    """``loss / num_items``: the stored bf16 gradients are multiplied by ``1 / num_items`` in float32 and rounded
    once, not by ``1 / num_items`` rounded to bf16 first (which would scale them all by up to 0.4%: the control)."""
    from varpack.ops.linear_ce.chunked import chunked_linear_cross_entropy

    hidden, weight, b, labels, _ = _problem(T=13, bias=True, dtype=torch.float32)
    h, w, bias = (x.detach().bfloat16().requires_grad_() for x in (hidden, weight, b))
    tw = (labels != IGNORE).float()

    def grads(scale):
        if backend == "driven":
            loss = _driven(h, w, bias, labels, 4, _StandInKernel())
        else:
            loss = chunked_linear_cross_entropy(h, w, bias, labels, tw, 4, compile=False)
        return torch.autograd.grad(loss * scale, (h, w, bias))

    c = 1.0 / 6151
    for one, scaled in zip(grads(1.0), grads(c)):
        assert scaled.dtype == torch.bfloat16
        assert torch.equal(scaled, (one.float() * c).to(torch.bfloat16))
        assert not torch.equal(scaled, one * torch.tensor(c).to(torch.bfloat16))  # control: scale rounded first


def test_labels_out_of_range_fail_without_a_host_read(monkeypatch):
    """A label that is neither ignore_index nor in [0, V) fails the call (torch._assert_async: a device assert
    on CUDA), for every backend; CPU labels are named by the host check before it."""
    from varpack.ops.linear_ce.dispatch import assert_labels_in_range

    labels = torch.tensor([IGNORE, 0, 5, 10])
    assert_labels_in_range(labels, 11, IGNORE)
    for bad in (-1, 11):
        with pytest.raises(RuntimeError, match=r"a label outside \[0, V=11\) that is not ignore_index=-100"):
            assert_labels_in_range(torch.tensor([0, bad, IGNORE]), 11, IGNORE)
    seen = []
    monkeypatch.setattr(dispatch, "assert_labels_in_range", lambda *a: seen.append(a[1:]))
    hidden, weight, _, labels, _ = _problem(T=9)
    linear_cross_entropy(hidden, weight, labels, backend="chunked")
    assert seen == [(11, IGNORE)]  # every call checks, whatever the device


def test_autocast_float32_hidden_runs_in_the_autocast_dtype(monkeypatch):
    """Under autocast a float32 ``hidden`` (and weight, bias) reaches the driven kernel in the autocast dtype:
    the same loss and gradients as casting by hand, float32 gradients back."""
    kernel = _StandInKernel()
    monkeypatch.setattr(liger, "_liger_kernel_probe", lambda: (kernel, "stand-in"))
    monkeypatch.setattr(dispatch, "resolve_linear_ce_backend", lambda *a, **k: ("liger", "test"))
    hidden, weight, b, labels, _ = _problem(T=20, bias=True, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=8)
    got = _grads(loss, hidden, weight, b)
    h, w, bb = (x.detach().bfloat16().requires_grad_() for x in (hidden, weight, b))
    want_loss = linear_cross_entropy(h, w, labels, bias=bb, chunk_size=8)
    want = _grads(want_loss, h, w, bb)
    torch.testing.assert_close(loss, want_loss)
    for g, ref in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, ref.float())


def test_float32_bias_with_16bit_hidden_and_weight(monkeypatch):
    """A float32 bias beside bf16 hidden states and head is cast like the head (the logits stay bf16)."""
    kernel = _StandInKernel()
    monkeypatch.setattr(liger, "_liger_kernel_probe", lambda: (kernel, "stand-in"))
    monkeypatch.setattr(dispatch, "resolve_linear_ce_backend", lambda *a, **k: ("liger", "test"))
    hidden, weight, b, labels, _ = _problem(T=20, bias=True, dtype=torch.float32)
    h, w = (x.detach().bfloat16().requires_grad_() for x in (hidden, weight))
    bias = b.detach().requires_grad_()
    loss = linear_cross_entropy(h, w, labels, bias=bias, chunk_size=8)
    ref = linear_cross_entropy(h, w, labels, bias=bias, chunk_size=8, backend="chunked")
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)
    assert bias.grad is None and _grads(loss, bias)[0].dtype == torch.float32
