"""Attention sinks and ``Dv != D`` (MLA) on the CUDA backends that declare them (flex, flash_attn_4, sdpa),
forward and backward (dq, dk, dv, and the sinks' gradient), against the fp32 reference by the fp32-truth rule
of tests/attn/test_attn_gpu.py. A backend that does not declare the case must refuse it."""

from __future__ import annotations

import pytest
import torch

from tests.attn.test_attn_gpu import _check_fp32_truth
from varpack.attn import BACKENDS, BackendUnavailableError, reference_varlen_attention, varlen_attention

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
LENS = [37, 1, 300, 128, 5]
CASES = [
    # (sinks, window, h, hkv, d, dv)
    pytest.param(True, (-1, -1), 4, 2, 64, 64, id="sinks-gqa-d64"),
    pytest.param(True, (63, 0), 4, 2, 128, 128, id="sinks-window-d128"),
    pytest.param(False, (-1, -1), 4, 4, 128, 64, id="mla-d128-dv64"),
    pytest.param(False, (-1, -1), 4, 4, 192, 128, id="mla-d192-dv128"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
@pytest.mark.parametrize("sinks_on,window,h,hkv,d,dv", CASES)
@pytest.mark.parametrize("backend", ["flex", "flash_attn_4", "sdpa", "torch_varlen"])
def test_sinks_and_value_head_dim_match_reference(backend, sinks_on, window, h, hkv, d, dv, dtype):
    ok, reason = BACKENDS[backend].is_available()
    if not ok:
        pytest.skip(f"{backend} not installed: {reason}")
    g = torch.Generator(device=DEVICE).manual_seed(0)
    total = sum(LENS)
    q, k, v = (
        torch.randn(total, n, dim, generator=g, device=DEVICE).to(dtype).requires_grad_()
        for n, dim in ((h, d), (hkv, d), (hkv, dv))
    )
    sinks = (torch.randn(h, generator=g, device=DEVICE) * 2).requires_grad_() if sinks_on else None
    dout = torch.randn(total, h, dv, generator=g, device=DEVICE).to(dtype)
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    leaves = [t for t in (q, k, v, sinks) if t is not None]

    def run(*ts):
        qq, kk, vv, *ss = ts
        return varlen_attention(
            qq, kk, vv, cu.to(DEVICE), cu.to(DEVICE), max(LENS), max(LENS), backend=backend,
            window_size=window, sinks=ss[0] if ss else None,
        )  # fmt: skip

    def ref(upcast):
        def fn(*ts):
            qq, kk, vv, *ss = ts
            return reference_varlen_attention(
                qq, kk, vv, cu, cu, window_size=window, upcast=upcast, sinks=ss[0] if ss else None
            )

        return fn

    try:
        out = run(*leaves)
    except BackendUnavailableError as exc:  # a declared limitation (capabilities / the backend's own check)
        pytest.skip(f"{backend} refuses: {exc}")
    got = (out, *torch.autograd.grad(out, leaves, dout))
    truth_leaves = [t.detach().float().requires_grad_() for t in leaves]
    t_out = ref(True)(*truth_leaves)
    truth = (t_out, *torch.autograd.grad(t_out, truth_leaves, dout.float()))
    p_out = ref(False)(*leaves)
    plain = (p_out, *torch.autograd.grad(p_out, leaves, dout))
    names = ("out", "dq", "dk", "dv", "dsinks")
    for i in range(len(got)):
        _check_fp32_truth(f"{backend} {names[i]}", got[i], truth[i], plain[i], dtype, 2 if i == 0 else 3)
    assert out.shape == (total, h, dv)
