"""The ``triton`` backend of the short conv (``varpack::short_conv`` and its backward op) == the conv run on
each sample alone.

CPU: through Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1`` on a machine without CUDA;
otherwise these skip), against the per-sample ``F.conv1d`` reference (:func:`short_conv_reference`) and
against the ``torch`` backend: 1-token samples, samples shorter than the kernel, empty samples, samples ending
on a block edge, ``T`` not a multiple of the block, several programs along T and D (small launch blocks),
batch rows, non-contiguous x, kernel widths 1..8, bf16; a negative control (boundaries dropped) must mismatch;
``torch.library.opcheck`` on both ops; traced whole by ``torch.compile(fullgraph=True)``. GPU (``gpu`` marker):
the compiled kernels at Qwen3.5's shape, no host sync, captured and replayed as a CUDA graph.
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")

from tests._exact import assert_differs, assert_exact  # noqa: E402
from tests._sync import without_host_sync  # noqa: E402
from tests.ops.test_short_conv import _cu  # noqa: E402
from varpack._triton import triton_interpreted  # noqa: E402
from varpack.ops.short_conv import (  # noqa: E402
    TRITON_MAX_WIDTH,
    resolve_conv_backend,
    short_conv,
    short_conv_reference,
)

sc = importlib.import_module("varpack.ops.short_conv")  # the module: varpack.ops.short_conv names the function


def _interpreted_or_skip():
    if not triton_interpreted():
        pytest.skip("Triton was imported compiled in this process (TRITON_INTERPRET=1 not set before it)")


#: fp32 kernels against the fp32 reference: a few 1e-7 of each tensor's scale honestly; a boundary leak is O(1)
RTOL32 = 2e-5
#: bf16 tensors (output and gradients rounded to bf16: 2^-9 of an element) against the fp32 truth
RTOL_BF16 = 1.5e-2

#: small launches: several programs along T and D, several streams per backward program, prefetch depth 3
SMALL_LAUNCH = {
    "fwd": {"block_t": 8, "block_d": 16, "num_warps": 1},
    "bwd": {"streams": 2, "rows": 8, "block_d": 16, "prefetch": 3, "num_warps": 1},
}

CASES = {
    "mixed": [1, 2, 3, 4, 5, 0, 17, 1, 40],  # 1-token, shorter than W, an empty sample; T = 73
    "block_edges": [16, 16, 32, 8, 3],  # samples ending on the stream and program edges of both launches
    "one_token": [1] * 13,
    "one_sample": [37],
}


def _seq_idx(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]


def _inputs(B, T, D, W, *, dtype=torch.float32, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen).to(dtype)
    w = (0.5 * torch.randn(D, W, generator=gen)).to(dtype)
    b = torch.randn(D, generator=gen).to(dtype) if bias else None
    dy = torch.randn(B, T, D, generator=gen).to(dtype)
    return x, w, b, dy


def _forward_backward(fn, x, w, b, dy, dtype=None):
    """``fn(x, w, b)`` and its gradients for ``x, w, b`` (leaves cast to ``dtype``) with output gradient dy."""
    leaves = [t if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in (x, w, b)]
    y = fn(*leaves)
    wrt = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(y, wrt, dy.to(y.dtype))
    names = ("y", "dx", "dweight", "dbias")[: 1 + len(wrt)]
    return dict(zip(names, (y, *grads)))


def _truth(x, w, b, dy, activation, lengths=None):
    """fp32 autograd of the per-sample reference on the same values (``lengths``: one packed row; else every
    row one sample). fp32, not fp64: the CPU's fp64 depthwise ``conv1d`` is slow, and fp32 rounding is far
    inside :data:`RTOL32`."""
    cu = None if lengths is None else _cu(lengths)
    return _forward_backward(
        lambda x, w, b: short_conv_reference(x, w, b, activation, cu_seqlens=cu), x, w, b, dy, torch.float32
    )


@pytest.fixture(params=["default", "small"])
def launch(request, monkeypatch):
    if request.param == "small":
        monkeypatch.setattr(sc, "SHORT_CONV_TRITON_LAUNCH", SMALL_LAUNCH)
    return request.param


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("bias", [True, False])
def test_triton_conv_equals_per_sample_conv(case, activation, bias, launch):
    _interpreted_or_skip()
    lengths = CASES[case]
    x, w, b, dy = _inputs(1, sum(lengths), 20, 4, bias=bias)
    seq = _seq_idx(lengths)
    got = _forward_backward(
        lambda x, w, b: short_conv(x, w, b, activation, seq_idx=seq, backend="triton"), x, w, b, dy
    )
    assert got["y"].dtype == torch.float32 and got["y"].shape == x.shape
    assert_exact(got, _truth(x, w, b, dy, activation, lengths), rtol=RTOL32, atol=0.0, what=case)


@pytest.mark.parametrize("W", [1, 2, 3, TRITON_MAX_WIDTH])
def test_triton_conv_kernel_widths(W, launch):
    _interpreted_or_skip()
    lengths = [1, 2, 9, 3, 30, 7]
    x, w, b, dy = _inputs(1, sum(lengths), 18, W)
    got = _forward_backward(
        lambda x, w, b: short_conv(x, w, b, "silu", seq_idx=_seq_idx(lengths), backend="triton"), x, w, b, dy
    )
    assert_exact(got, _truth(x, w, b, dy, "silu", lengths), rtol=RTOL32, atol=0.0, what=f"W={W}")


def test_triton_conv_cu_seqlens_and_the_conv1d_weight_layout():
    """``cu_seqlens`` is turned into ``seq_idx`` as on the ``torch`` path; a depthwise ``nn.Conv1d`` weight
    ``[D, 1, W]`` gets its gradient in its own shape."""
    _interpreted_or_skip()
    lengths = CASES["mixed"]
    x, w, b, dy = _inputs(1, sum(lengths), 20, 4)
    got = _forward_backward(
        lambda x, w, b: short_conv(x, w[:, None, :], b, "silu", cu_seqlens=_cu(lengths), backend="triton"),
        x, w, b, dy,
    )  # fmt: skip
    assert_exact(got, _truth(x, w, b, dy, "silu", lengths), rtol=RTOL32, atol=0.0)
    w3 = w[:, None, :].clone().requires_grad_()
    short_conv(x, w3, b, "silu", cu_seqlens=_cu(lengths), backend="triton").sum().backward()
    assert w3.grad.shape == (20, 1, 4)


def _truth_rows(x, w, b, dy, activation, rows):
    """:func:`_truth` of each batch row with its own sample lengths: outputs and input gradients stacked, weight
    and bias gradients summed."""
    each = [_truth(x[i : i + 1], w, b, dy[i : i + 1], activation, r) for i, r in enumerate(rows)]
    return {
        name: torch.cat([t[name] for t in each]) if name in ("y", "dx") else sum(t[name] for t in each)
        for name in each[0]
    }


def test_triton_conv_batch_rows(launch):
    """``B > 1``: rows without boundaries (each row one sample), each row its own ``seq_idx`` ``[B, T]``, and
    one ``[1, T]`` segmentation shared by every row."""
    _interpreted_or_skip()
    B, T, D = 3, 21, 20
    x, w, b, dy = _inputs(B, T, D, 4)
    plain = _forward_backward(lambda x, w, b: short_conv(x, w, b, "silu", backend="triton"), x, w, b, dy)
    assert_exact(plain, _truth(x, w, b, dy, "silu"), rtol=RTOL32, atol=0.0, what="rows")

    rows = [[5, 1, 15], [21], [2, 2, 10, 7]]
    seq = torch.cat([_seq_idx(r) for r in rows])
    per_row = _forward_backward(
        lambda x, w, b: short_conv(x, w, b, "silu", seq_idx=seq, backend="triton"), x, w, b, dy
    )
    want = _truth_rows(x, w, b, dy, "silu", rows)
    assert_exact(per_row, want, rtol=RTOL32, atol=0.0, what="[B, T] seq_idx")
    shared = _forward_backward(
        lambda x, w, b: short_conv(x, w, b, "silu", seq_idx=seq[0:1], backend="triton"), x, w, b, dy
    )
    want = _truth_rows(x, w, b, dy, "silu", [rows[0]] * B)
    assert_exact(shared, want, rtol=RTOL32, atol=0.0, what="[1, T] seq_idx")


def test_triton_conv_strided_inputs():
    """x a slice along T, x a slice of a wider channel dimension (q/k/v split from one projection), x with
    strided channels, dy with strided channels: read through their strides."""
    _interpreted_or_skip()
    rows = [[3, 1, 20, 9], [33]]
    B, T, D = 2, 33, 20
    seq = torch.cat([_seq_idx(r) for r in rows])
    tall, w, b, _ = _inputs(B, T + 5, D, 4)
    wide, _, _, dy_wide = _inputs(B, T + 5, D + 7, 4, seed=1)
    dy = dy_wide[:, :T, :D].transpose(1, 2).contiguous().transpose(1, 2)
    views = {
        "T slice": tall[:, 2 : 2 + T],
        "channel slice": wide[:, :T, 4 : 4 + D],
        "strided channels": wide[:, :T, :D].transpose(1, 2).contiguous().transpose(1, 2),
    }
    for name, x in views.items():
        assert not x.is_contiguous(), name
        got = _forward_backward(
            lambda x, w, b: short_conv(x, w, b, "silu", seq_idx=seq, backend="triton"), x, w, b, dy
        )
        assert_exact(got, _truth_rows(x, w, b, dy, "silu", rows), rtol=RTOL32, atol=0.0, what=name)


@pytest.mark.parametrize("activation", ["silu", None])
def test_triton_conv_equals_the_torch_backend(activation, launch):
    _interpreted_or_skip()
    lengths = CASES["mixed"]
    seq = _seq_idx(lengths)
    x, w, b, dy = _inputs(1, sum(lengths), 20, 4)
    got = _forward_backward(
        lambda x, w, b: short_conv(x, w, b, activation, seq_idx=seq, backend="triton"), x, w, b, dy
    )
    want = _forward_backward(lambda x, w, b: short_conv(x, w, b, activation, seq_idx=seq), x, w, b, dy)
    assert_exact(got, want, rtol=RTOL32, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_conv_low_precision(dtype):
    """bf16 / fp16 tensors, fp32 arithmetic: within the dtype's rounding of the fp32 truth on the same values;
    outputs and gradients in the inputs' dtypes."""
    _interpreted_or_skip()
    lengths = [1, 2, 3, 30, 5, 40]
    x, w, b, dy = _inputs(1, sum(lengths), 20, 4, dtype=dtype)
    got = _forward_backward(
        lambda x, w, b: short_conv(x, w, b, "silu", seq_idx=_seq_idx(lengths), backend="triton"), x, w, b, dy
    )
    assert [t.dtype for t in got.values()] == [dtype] * 4
    assert_exact(got, _truth(x, w, b, dy, "silu", lengths), rtol=RTOL_BF16, atol=0.0, what=str(dtype))


def test_triton_conv_mixed_dtypes():
    """bf16 x with fp32 weight and bias (an unscaled mixed-precision layer): gradients in each one's dtype."""
    _interpreted_or_skip()
    lengths = [4, 1, 30]
    x, w, b, dy = _inputs(1, sum(lengths), 20, 4)
    xb = x.bfloat16()
    got = _forward_backward(
        lambda x, w, b: short_conv(x, w, b, "silu", seq_idx=_seq_idx(lengths), backend="triton"), xb, w, b, dy
    )
    assert [t.dtype for t in got.values()] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    want = _truth(xb.float(), w, b, dy.bfloat16().float(), "silu", lengths)
    assert_exact(got, want, rtol=RTOL_BF16, atol=0.0)


def test_triton_conv_without_boundaries_leaks_negative_control():
    """seq_idx all zeros (the boundaries dropped): every sample's first W-1 tokens read the previous sample,
    far outside the tolerance the honest runs pass."""
    _interpreted_or_skip()
    lengths = CASES["mixed"]
    x, w, b, dy = _inputs(1, sum(lengths), 20, 4)
    one_sample = _seq_idx(lengths) * 0
    joined = _forward_backward(
        lambda x, w, b: short_conv(x, w, b, "silu", seq_idx=one_sample, backend="triton"), x, w, b, dy
    )
    truth = _truth(x, w, b, dy, "silu", lengths)
    assert_differs(joined["y"], truth["y"], rtol=RTOL32, atol=0.0)
    assert_differs(joined["dx"], truth["dx"], rtol=RTOL32, atol=0.0)
    assert_differs(joined["dweight"], truth["dweight"], rtol=RTOL32, atol=0.0)


def test_triton_conv_empty_inputs():
    _interpreted_or_skip()
    w, b = torch.randn(6, 4, requires_grad=True), torch.randn(6, requires_grad=True)
    x = torch.randn(1, 0, 6, requires_grad=True)
    y = short_conv(x, w, b, "silu", seq_idx=torch.zeros(1, 0, dtype=torch.int64), backend="triton")
    assert y.shape == (1, 0, 6)
    y.sum().backward()
    assert w.grad.abs().max() == 0 and b.grad.abs().max() == 0 and x.grad.shape == x.shape


def test_triton_conv_refusals():
    _interpreted_or_skip()
    x, w, b, _ = _inputs(1, 10, 6, 4)
    seq = torch.zeros(1, 10, dtype=torch.int32)
    with pytest.raises(ValueError, match="triton short conv backend supports activation None or 'silu'"):
        short_conv(x, w, b, torch.tanh, seq_idx=seq, backend="triton")
    with pytest.raises(ValueError, match="activation must be None"):
        short_conv(x, w, b, "gelu", backend="triton")
    with pytest.raises(ValueError, match=rf"kernel widths 1..{TRITON_MAX_WIDTH}, got W=9"):
        short_conv(x, torch.randn(6, 9), b, backend="triton")
    with pytest.raises(ValueError, match="fp32, bf16 and fp16 tensors, got x in torch.float64"):
        short_conv(x.double(), w, b, backend="triton")
    with pytest.raises(ValueError, match=r"bias must be \[D=6\]"):
        short_conv(x, w, b[:5], backend="triton")
    with pytest.raises(ValueError, match=r"seq_idx must be \[B=1, T=10\]"):
        short_conv(x, w, b, seq_idx=seq[:, :9], backend="triton")
    with pytest.raises(ValueError, match="unknown short conv backend"):
        short_conv(x, w, b, backend="triton2")
    with pytest.raises(ValueError, match="seq_idx is on meta but x is on cpu"):
        sc.short_conv_triton(x, w, b, seq.to("meta"))
    with pytest.raises(ValueError, match="seq_idx must be an integer tensor"):
        sc.short_conv_triton(x, w, b, seq.float())
    with pytest.raises(ValueError, match="dy must be an fp32 / bf16 / fp16 tensor"):
        sc.short_conv_triton_backward(x.double(), x, w, b, seq)
    assert resolve_conv_backend("triton", "cpu") == "triton"
    assert resolve_conv_backend("auto", "cpu") == "torch"  # auto never picks the triton backend
    with pytest.raises(RuntimeError, match="short conv backend 'triton' cannot run on meta"):
        resolve_conv_backend("triton", "meta")


# -- the custom ops ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias,seq,activation", [(True, True, "silu"), (False, False, "none")])
def test_short_conv_opcheck(bias, seq, activation):
    _interpreted_or_skip()
    lengths = [3, 1, 9]
    x, w, b, dy = _inputs(1, sum(lengths), 6, 4, bias=bias)
    s = _seq_idx(lengths) if seq else None
    x, w = x.requires_grad_(), w.requires_grad_()
    b = b.requires_grad_() if b is not None else None
    torch.library.opcheck(sc._short_conv_op, (x, w, b, s, activation))
    args = (dy, x.detach(), w.detach(), b.detach() if b is not None else None, s, activation)
    torch.library.opcheck(sc._short_conv_backward_op, args)


# -- split output: q, k, v as three contiguous tensors ---------------------------------------------------------
def _split_run(backend, split, x, w, b, dy, seq, swap_grads=False):
    """The split conv's outputs and the gradients of ``sum_i <y_i, dy_i>``, dy cut as the outputs."""
    leaves = [t if t is None else t.detach().requires_grad_() for t in (x, w, b)]
    ys = short_conv(*leaves, "silu", seq_idx=seq, backend=backend, split=split)
    dys = list(torch.split(dy, split, -1))
    if swap_grads:
        dys[0], dys[1] = dys[1], dys[0]
    wrt = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(ys, wrt, dys)
    return {"y": torch.cat(ys, -1), **dict(zip(("dx", "dweight", "dbias"), grads))}, ys


@pytest.mark.parametrize("split", [[8, 8, 8], [4, 4, 16], [24], [1, 22, 1]])
@pytest.mark.parametrize("bias", [True, False])
def test_triton_conv_split_equals_the_whole_conv(split, bias, launch):
    """``split=`` writes each channel group into its own contiguous tensor and takes the groups' gradients
    where they lie: values and every gradient equal the per-sample reference of the whole conv; the torch
    backend's split (cut and copied) gives the same. Negative control: the first two groups' gradients
    swapped change dx."""
    _interpreted_or_skip()
    lengths = CASES["mixed"]
    x, w, b, dy = _inputs(1, sum(lengths), 24, 4, bias=bias)
    seq = _seq_idx(lengths)
    want = _truth(x, w, b, dy, "silu", lengths)
    got, ys = _split_run("triton", split, x, w, b, dy, seq)
    assert [tuple(y.shape) for y in ys] == [(1, sum(lengths), n) for n in split]
    assert all(y.is_contiguous() for y in ys)
    assert_exact(got, want, rtol=RTOL32, what="triton split")
    on_torch, parts = _split_run("torch", split, x, w, b, dy, seq)
    assert all(y.is_contiguous() for y in parts)
    assert_exact(on_torch, want, rtol=RTOL32, what="torch split")
    if len(split) > 1 and split[0] == split[1]:
        swapped, _ = _split_run("triton", split, x, w, b, dy, seq, swap_grads=True)
        assert_differs(swapped["dx"], want["dx"], rtol=RTOL32, what="swapped group gradients")


def test_triton_conv_split_refusals_and_opcheck():
    _interpreted_or_skip()
    lengths = [3, 1, 9]
    x, w, b, dy = _inputs(1, sum(lengths), 6, 4)
    s = _seq_idx(lengths)
    for bad in ([3, 2], [3, 4], [6, 0], []):
        with pytest.raises(ValueError, match="split must be positive channel counts summing to D=6"):
            short_conv(x, w, b, "silu", seq_idx=s, backend="triton", split=bad)
        with pytest.raises(ValueError, match="split must be positive channel counts summing to D=6"):
            short_conv(x, w, b, "silu", seq_idx=s, split=bad)
    with pytest.raises(ValueError, match="output gradients for split"):
        sc.short_conv_triton_split_backward([dy], x, w, b, s, "silu", [2, 4])
    with pytest.raises(ValueError, match=r"channels 2:6"):
        sc.short_conv_triton_split_backward([dy[..., :2], dy[..., :2]], x, w, b, s, "silu", [2, 4])
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    for l2norm in ([0, 0], [2, 2]):
        torch.library.opcheck(sc._short_conv_split_op, (x, w, b, s, "silu", [2, 4], l2norm))
        dys = [dy[..., :2].contiguous(), dy[..., 2:]]
        args = (dys, x.detach(), w.detach(), b.detach(), s, "silu", [2, 4], l2norm)
        torch.library.opcheck(sc._short_conv_split_backward_op, args)


# -- split output with q and k L2-normalised per head (a Gated DeltaNet layer's q, k, v) -----------------------
def _l2norm_truth(x, w, b, dy, activation, lengths, split, l2norm):
    """fp32 autograd of the per-sample reference conv, cut as ``split``, each group ``l2norm`` names normalised
    per head by the rule's own ``l2norm``: values and gradients, the output gradient ``dy`` cut likewise."""
    from varpack.ops.gated_delta_rule._common import l2norm as rule_l2norm

    def fn(x, w, b):
        y = short_conv_reference(x, w, b, activation, cu_seqlens=_cu(lengths))
        parts = []
        for part, hd in zip(torch.split(y, split, -1), l2norm):
            parts.append(rule_l2norm(part.unflatten(-1, (-1, hd))).flatten(-2) if hd else part)
        return torch.cat(parts, -1)

    return _forward_backward(fn, x, w, b, dy, torch.float32)


def _l2norm_run(backend, split, l2norm, activation, x, w, b, dy, seq):
    leaves = [t if t is None else t.detach().requires_grad_() for t in (x, w, b)]
    ys = short_conv(*leaves, activation, seq_idx=seq, backend=backend, split=split, l2norm=l2norm)
    wrt = [t for t in leaves if t is not None]
    grads = torch.autograd.grad(ys, wrt, list(torch.split(dy.to(ys[0].dtype), split, -1)))
    return {"y": torch.cat(ys, -1), **dict(zip(("dx", "dweight", "dbias"), grads))}


@pytest.mark.parametrize(
    ("split", "l2norm"),
    [([16, 16, 8], [8, 8, 0]), ([12, 12, 12], [6, 6, 0]), ([16, 8], [16, 0]), ([8, 8], [0, 4])],
)
@pytest.mark.parametrize("activation", ["silu", None])
def test_triton_conv_split_l2norm_equals_conv_then_l2norm(split, l2norm, activation, launch):
    """``l2norm=`` normalises the named groups per head inside the kernels (forward, and the backward from the
    recomputed pre-activation): values and every gradient equal the per-sample reference conv followed by the
    gated delta rule's ``l2norm``; the torch backend gives the same. Head sizes that are not a power of two
    (6: masked lanes) included. Negative controls: the wrong head size, and no boundaries, change the result."""
    _interpreted_or_skip()
    lengths = CASES["mixed"]
    x, w, b, dy = _inputs(1, sum(lengths), sum(split), 4, bias=True, seed=3)
    seq = _seq_idx(lengths)
    want = _l2norm_truth(x, w, b, dy, activation, lengths, split, l2norm)
    got = _l2norm_run("triton", split, l2norm, activation, x, w, b, dy, seq)
    assert_exact(got, want, rtol=RTOL32, what="triton split + l2norm")
    assert_exact(_l2norm_run("torch", split, l2norm, activation, x, w, b, dy, seq), want, rtol=RTOL32,
                 what="torch split + l2norm")  # fmt: skip
    other = [hd // 2 if hd else 0 for hd in l2norm]
    assert_differs(_l2norm_run("triton", split, other, activation, x, w, b, dy, seq)["dx"], want["dx"],
                   rtol=RTOL32, what="l2norm over half heads")  # fmt: skip
    leaked = _l2norm_run("triton", split, l2norm, activation, x, w, b, dy, torch.zeros_like(seq))
    assert_differs(leaked["y"], want["y"], rtol=RTOL32, what="l2norm without boundaries")


def test_triton_conv_split_l2norm_bf16_rounds_once():
    """bf16 in and out: the norm is taken in fp32 before rounding, so the normalised q and k and every gradient
    are within bf16 rounding of the fp32 truth."""
    _interpreted_or_skip()
    lengths = CASES["block_edges"]
    split, l2norm = [16, 16, 16], [8, 8, 0]
    x, w, b, dy = _inputs(1, sum(lengths), sum(split), 4, dtype=torch.bfloat16, seed=4)
    want = _l2norm_truth(x, w, b, dy, "silu", lengths, split, l2norm)
    got = _l2norm_run("triton", split, l2norm, "silu", x, w, b, dy, _seq_idx(lengths))
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert_exact(got, want, rtol=RTOL_BF16, what="bf16 split + l2norm")


def test_triton_conv_split_l2norm_refusals():
    _interpreted_or_skip()
    lengths = [3, 1, 9]
    x, w, b, _ = _inputs(1, sum(lengths), 12, 4)
    s = _seq_idx(lengths)
    with pytest.raises(ValueError, match="split is missing"):
        short_conv(x, w, b, "silu", seq_idx=s, backend="triton", l2norm=[4])
    with pytest.raises(ValueError, match="l2norm names 1 groups, split 2"):
        short_conv(x, w, b, "silu", seq_idx=s, backend="triton", split=[6, 6], l2norm=[3])
    with pytest.raises(ValueError, match="got 4 for a group of 6 channels"):
        short_conv(x, w, b, "silu", seq_idx=s, backend="triton", split=[6, 6], l2norm=[4, 0])
    with pytest.raises(ValueError, match="at most 256"):
        sc.short_conv_triton_split(torch.zeros(1, 2, 512), torch.zeros(512, 4), None, None, "silu", [512],
                                   l2norm=[512])  # fmt: skip


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_triton_conv_compiles_whole(compiler):
    """A layer-like function calling ``short_conv(..., backend="triton")`` traced by
    ``torch.compile(fullgraph=True)`` (no graph break): the same values and gradients as eager."""
    _interpreted_or_skip()
    from torch._dynamo.utils import counters

    lengths = CASES["mixed"]
    seq = _seq_idx(lengths)
    x, w, b, dy = _inputs(1, sum(lengths), 20, 4)

    def layer(x, w, b, seq_idx):
        h = short_conv(x * 2.0, w[:, None, :], b, "silu", seq_idx=seq_idx, backend="triton")
        return h * 0.5

    want = _forward_backward(lambda x, w, b: layer(x, w, b, seq), x, w, b, dy)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True, backend=compiler)
    got = _forward_backward(lambda x, w, b: compiled(x, w, b, seq), x, w, b, dy)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert_exact(got, want, rtol=1e-6, atol=0.0, what=compiler)


# -- GPU -----------------------------------------------------------------------------------------------------
def _gpu_lengths(T, n, seed):
    """``n`` sample lengths summing to ``T``: ``n - 4`` between random cut points, then 1, 2, 1 and 2 tokens."""
    gen = torch.Generator().manual_seed(seed)
    cuts = (torch.randperm(T - 7, generator=gen)[: n - 5] + 1).sort().values.tolist()
    return [c - a for a, c in zip([0, *cuts], [*cuts, T - 6])] + [1, 2, 1, 2]


@pytest.mark.gpu
def test_gpu_triton_conv_at_the_model_shape_and_in_a_cuda_graph():
    """T = 8192, D = 6144, W = 4, bf16, ~70 samples: the compiled kernels equal the fp32 reference within bf16
    rounding and the ``torch`` backend within one bf16 rounding; forward + backward make no host sync; captured
    once as a CUDA graph, then replayed after another segmentation is copied into ``seq_idx``: equal to the
    eager call on the new segmentation. Negative control: the captured segmentation's result does not match the
    new one's."""
    if not torch.cuda.is_available() or triton_interpreted():
        pytest.skip("needs CUDA with compiled Triton")
    dev = torch.device("cuda")
    T, D, W = 8192, 6144, 4
    first, second = _gpu_lengths(T, 70, 0), _gpu_lengths(T, 70, 1)
    assert sum(first) == sum(second) == T
    x, w, b, dy = (t.to(dev) for t in _inputs(1, T, D, W, dtype=torch.bfloat16, seed=2))

    def triton_step(seq):
        return _forward_backward(
            lambda x, w, b: short_conv(x, w, b, "silu", seq_idx=seq, backend="triton"), x, w, b, dy
        )

    def truth(lengths):
        cu = _cu(lengths)

        def ref(x, w, b):
            return short_conv_reference(x, w, b, "silu", cu_seqlens=cu)

        return _forward_backward(ref, x, w, b, dy.float(), torch.float32)

    seq = _seq_idx(first).to(dev, torch.int32)
    got = triton_step(seq)
    want = truth(first)
    assert_exact(got, want, rtol=RTOL_BF16, atol=0.0, what="triton vs reference")
    torch_path = _forward_backward(lambda x, w, b: short_conv(x, w, b, "silu", seq_idx=seq), x, w, b, dy)
    assert_exact(got, torch_path, rtol=RTOL_BF16, atol=0.0, what="triton vs torch backend")

    without_host_sync(lambda: triton_step(seq))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        triton_step(seq)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = triton_step(seq)
    for lengths in (second, first, second):
        seq.copy_(_seq_idx(lengths).to(dev, torch.int32))
        graph.replay()
        assert_exact(outs, truth(lengths), rtol=RTOL_BF16, atol=0.0, what="graph replay")
    assert_differs(outs["y"], truth(first)["y"], rtol=RTOL_BF16, atol=0.0, margin=5.0)


@pytest.mark.gpu
def test_gpu_triton_conv_split_l2norm_at_the_model_shape():
    """Qwen3.5's q, k, v (16 heads of 128 each, T = 8192, bf16, ~70 samples) with q and k L2-normalised in the
    compiled kernels: within bf16 rounding of the fp32 per-sample conv followed by the rule's ``l2norm``, values
    and every gradient, with no host sync. Negative control: the norm over 64-channel halves misses."""
    if not torch.cuda.is_available() or triton_interpreted():
        pytest.skip("needs CUDA with compiled Triton")
    dev = torch.device("cuda")
    lengths = _gpu_lengths(8192, 70, 0)
    split, l2norm = [2048, 2048, 2048], [128, 128, 0]
    x, w, b, dy = (t.to(dev) for t in _inputs(1, 8192, sum(split), 4, dtype=torch.bfloat16, seed=5))
    seq = _seq_idx(lengths).to(dev, torch.int32)
    got = _l2norm_run("triton", split, l2norm, "silu", x, w, b, dy, seq)
    want = _l2norm_truth(x, w, b, dy, "silu", lengths, split, l2norm)
    assert_exact(got, want, rtol=RTOL_BF16, atol=0.0, what="triton split + l2norm at the model shape")
    without_host_sync(lambda: _l2norm_run("triton", split, l2norm, "silu", x, w, b, dy, seq))
    halves = _l2norm_run("triton", split, [64, 64, 0], "silu", x, w, b, dy, seq)
    q = slice(0, split[0])  # the q channels alone: v's larger scale would set the bound
    assert_differs(halves["y"][..., q], want["y"][..., q], rtol=RTOL_BF16, atol=0.0, margin=5.0)
