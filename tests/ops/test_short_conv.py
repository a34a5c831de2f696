"""Short causal depthwise conv with boundaries == the conv run on each sample alone."""

from __future__ import annotations

import pytest
import torch

from tests._sync import without_host_sync
from varpack.ops import resolve_conv_backend, short_conv, short_conv_reference


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _case(lengths, D=12, W=4, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    x = torch.randn(1, T, D, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(D, W, generator=gen).to(dtype).requires_grad_()
    b = torch.randn(D, generator=gen).to(dtype).requires_grad_()
    return x, w, b


LENGTHS = [1, 2, 3, 4, 5, 0, 17, 1, 40]


@pytest.mark.parametrize("boundary", ["cu_seqlens", "seq_idx", "seq_idx_2d"])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_with_boundaries_equals_per_sample_conv(boundary, activation):
    x, w, b = _case(LENGTHS)
    cu = _cu(LENGTHS)
    seq_idx = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    kw = (
        {"cu_seqlens": cu}
        if boundary == "cu_seqlens"
        else {"seq_idx": seq_idx if boundary == "seq_idx" else seq_idx[None]}
    )
    y = short_conv(x, w, b, activation, **kw)
    y_ref = short_conv_reference(x, w, b, activation, cu_seqlens=cu)
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-5)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad((y * dy).sum(), [x, w, b])
    grads_ref = torch.autograd.grad((y_ref * dy).sum(), [x, w, b])
    for a, r in zip(grads, grads_ref):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


def test_reference_is_transformers_causal_conv1d_per_sample():
    """The per-sample reference agrees with transformers' own ``causal_conv1d_fn`` (the model's conv)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    x, w, b = _case(LENGTHS)
    cu = _cu(LENGTHS).tolist()
    pieces = [
        causal_conv1d_fn(x[:, a:c].transpose(1, 2), w, b, activation="silu").transpose(1, 2)
        for a, c in zip(cu[:-1], cu[1:])
        if c > a
    ]
    torch.testing.assert_close(
        short_conv(x, w, b, "silu", cu_seqlens=_cu(LENGTHS)), torch.cat(pieces, 1), atol=1e-6, rtol=1e-5
    )


def test_without_boundaries_the_conv_leaks_negative_control():
    x, w, b = _case([6, 6])
    y_ref = short_conv_reference(x, w, b, cu_seqlens=_cu([6, 6]))
    y_joined = short_conv(x, w, b)  # one sample: taps 1..3 of sample 2 read sample 1
    assert (y_joined[:, :6] - y_ref[:, :6]).abs().max() < 1e-6
    assert (y_joined[:, 6:9] - y_ref[:, 6:9]).abs().max() > 1e-2
    assert (y_joined[:, 9:] - y_ref[:, 9:]).abs().max() < 1e-6  # from tap W on, no boundary is in reach


def test_conv1d_weight_layout_bf16_and_batch_rows():
    x, w, b = _case([30], dtype=torch.bfloat16)
    y = short_conv(x, w[:, None, :], b)  # nn.Conv1d depthwise weight [D, 1, W]
    assert y.dtype == torch.bfloat16
    y_ref = short_conv_reference(x.float(), w.float(), b.float())
    torch.testing.assert_close(y.float(), y_ref, atol=2e-2, rtol=2e-2)
    xb = torch.randn(3, 9, 12)
    torch.testing.assert_close(short_conv(xb, w.float(), None), short_conv_reference(xb, w.float(), None))


def test_errors():
    x, w, b = _case([5, 5])
    with pytest.raises(ValueError, match="batch dimension must be 1.*B=2"):
        short_conv(torch.randn(2, 10, 12), w, b, cu_seqlens=_cu([5, 5]))
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]=9 but the stream has 10 tokens"):
        short_conv(x, w, b, cu_seqlens=_cu([5, 4]))
    with pytest.raises(ValueError, match=r"weight must be \[D=12, W\]"):
        short_conv(x, w[:5], b)
    with pytest.raises(ValueError, match=r"seq_idx must be \[B=1, T=10\]"):
        short_conv(x, w, b, seq_idx=torch.zeros(1, 9, dtype=torch.int32))
    with pytest.raises(TypeError, match="seq_idx must be an integer tensor"):
        short_conv(x, w, b, seq_idx=torch.zeros(1, 10))
    with pytest.raises(ValueError, match="activation must be None"):
        short_conv(x, w, b, "gelu")
    with pytest.raises(RuntimeError, match="short conv backend 'fla' cannot run on cpu"):
        short_conv(x, w, b, cu_seqlens=_cu([5, 5]), backend="fla")
    assert resolve_conv_backend("auto", "cpu") == "torch"


@pytest.mark.gpu
def test_gpu_conv_matches_reference_and_fla_if_usable():
    x, w, b = _case(LENGTHS * 20, D=256)
    x, w, b = (t.detach().cuda().requires_grad_() for t in (x, w, b))
    cu = _cu(LENGTHS * 20)
    y = short_conv(x, w, b, "silu", cu_seqlens=cu)
    y_ref = short_conv_reference(x, w, b, "silu", cu_seqlens=cu)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    from varpack.ops.short_conv import fla_conv_status

    conv_forward, _ = fla_conv_status("cuda", (256, 4))  # the probe at this test's (D, W): one autotune
    if not conv_forward[0]:
        pytest.skip(f"fla conv unusable here: {conv_forward[1]}")
    xb, wb = x.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    with torch.no_grad():
        y_fla = short_conv(
            xb, wb, None, "silu", cu_seqlens=cu.cuda(), cu_seqlens_cpu=cu.long(), backend="fla"
        )
    y32 = short_conv_reference(xb.float(), wb.float(), None, "silu", cu_seqlens=cu)
    assert (y_fla.float() - y32).abs().max() < 2e-2 * y32.abs().max() + 1e-3


@pytest.mark.gpu
def test_gpu_fla_conv_with_chunk_indices_is_sync_free_and_exact():
    """fla's short conv given the batch's chunk indices (varpack.ops._fla.fla_chunk_indices): the same output
    as the reference, and forward + backward on a new batch's tensors make no host sync (without them fla
    builds its own with a blocking copy)."""
    from varpack.ops._fla import fla_chunk_indices
    from varpack.ops.short_conv import fla_conv_status

    D = 256
    if not all(s[0] for s in fla_conv_status("cuda", (D, 4))):
        pytest.skip("fla conv unusable here")
    lengths = LENGTHS * 20
    x, w, _ = _case(lengths, D=D)
    cu = _cu(lengths).long()

    xc, wc = x.detach().cuda().bfloat16(), w.detach().cuda().bfloat16()

    def step():
        xb, wb = xc.clone().requires_grad_(), wc.clone().requires_grad_()
        y = short_conv(
            xb, wb, None, "silu", cu_seqlens=cu.cuda(non_blocking=True), cu_seqlens_cpu=cu,
            chunk_indices=fla_chunk_indices(cu, "cuda"), backend="fla",
        )  # fmt: skip
        y.float().sum().backward()
        return y

    y = step()
    y32 = short_conv_reference(x.bfloat16().float(), w.bfloat16().float(), None, "silu", cu_seqlens=cu)
    assert (y.float().cpu() - y32).abs().max() < 2e-2 * y32.abs().max() + 1e-3
    without_host_sync(step)
