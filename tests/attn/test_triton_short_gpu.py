"""``triton_short`` compiled on the GPU with non-default launch configurations (issue 17's tuning sweep): larger
tiles than ``BLOCKS`` must give the same results, by tests/attn/test_attn_gpu.py's fp32-truth rule."""

from __future__ import annotations

import pytest
import torch

from tests.attn.test_attn_gpu import _check_fp32_truth, _fwd_bwd, _inputs
from varpack.attn import reference_varlen_attention

pytestmark = pytest.mark.gpu

CONFIGS = [  # (config, head dim): three compilations of each kernel, beside the defaults of test_attn_gpu.py
    pytest.param(
        {"fwd": (128, 64, 8, 2), "bwd_dkdv": (32, 128, 8, 2), "bwd_dq": (128, 32, 8, 2)}, 128, id="large"
    ),
    pytest.param(
        {"fwd": (32, 32, 4, 2), "bwd_dkdv": (16, 64, 4, 2), "bwd_dq": (32, 32, 4, 2)}, 64, id="small"
    ),
    pytest.param(
        {"fwd": (128, 128, 8, 2), "bwd_dkdv": (64, 128, 8, 2), "bwd_dq": (128, 64, 8, 2)}, 128, id="largest"
    ),
]


@pytest.mark.parametrize("cfg,d", CONFIGS)
def test_configs_match_reference(cfg, d):
    from varpack.attn import triton_short as ts

    lens = [37, 1, 300, 128, 5, 64, 65, 2]
    q, k, v, dout, cu, _, _ = _inputs(lens, None, 4, 2, d, torch.bfloat16)
    cu = cu.cuda()
    config = ts.TritonShortConfig(**cfg)
    got = _fwd_bwd(
        lambda a, b, c: ts.triton_short_attention(a, b, c, cu, cu, config=config)[0], q, k, v, dout
    )
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    truth = _fwd_bwd(lambda a, b, c: reference_varlen_attention(a, b, c, cu, cu), q32, k32, v32, dout.float())
    plain = _fwd_bwd(lambda a, b, c: reference_varlen_attention(a, b, c, cu, cu, upcast=False), q, k, v, dout)
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        _check_fp32_truth(
            f"triton_short {cfg} {what}", got[i], truth[i], plain[i], torch.bfloat16, 2 if i == 0 else 3
        )
