"""``triton_short`` compiled on the GPU with non-default launch configurations (benchmarks/attention_tune.py's sweep) and with
the mask-free tiles on and off: larger tiles than ``BLOCKS`` and both loop splits must give the same results,
by tests/attn/test_attn_gpu.py's fp32-truth rule; a negative control shows the compiled mask-free loop is taken."""

from __future__ import annotations

import dataclasses

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
MASK_FREE = pytest.mark.parametrize("mask_free", [True, False], ids=["mask-free", "masked-only"])


def _check(lens, h, hkv, d, config, causal=True, window=(-1, -1), name="triton_short"):
    from varpack.attn import triton_short as ts

    q, k, v, dout, cu, _, _ = _inputs(lens, None, h, hkv, d, torch.bfloat16)
    cu = cu.cuda()
    got = _fwd_bwd(
        lambda a, b, c: ts.triton_short_attention(
            a, b, c, cu, cu, causal=causal, window_size=window, config=config
        )[0],
        q, k, v, dout,
    )  # fmt: skip
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    kw = {"causal": causal, "window_size": window}
    truth = _fwd_bwd(
        lambda a, b, c: reference_varlen_attention(a, b, c, cu, cu, **kw), q32, k32, v32, dout.float()
    )
    plain = _fwd_bwd(
        lambda a, b, c: reference_varlen_attention(a, b, c, cu, cu, upcast=False, **kw), q, k, v, dout
    )
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        _check_fp32_truth(f"{name} {what}", got[i], truth[i], plain[i], torch.bfloat16, 2 if i == 0 else 3)
    return got


@MASK_FREE
def test_default_config_at_head_dim_256_matches_reference(mask_free):
    """Head dim 256 (Qwen3.5's full-attention layers), GQA 8/2, the default blocks: forward and every gradient
    by the fp32-truth rule, over segments shorter and longer than a tile; one of the head dims at which ``auto``
    hands captured layers to triton_short (``TRITON_SHORT_GRAPH_HEAD_DIMS``)."""
    from varpack.attn import triton_short as ts
    from varpack.integrations.cuda_graphs import TRITON_SHORT_GRAPH_HEAD_DIMS

    assert 256 in TRITON_SHORT_GRAPH_HEAD_DIMS
    config = ts.TritonShortConfig(mask_free=mask_free)
    _check([519, 37, 1, 300, 128, 5, 64, 65, 2], 8, 2, 256, config, name=f"triton_short D=256 mask_free={mask_free}")


@MASK_FREE
@pytest.mark.parametrize("cfg,d", CONFIGS)
def test_configs_match_reference(cfg, d, mask_free):
    from varpack.attn import triton_short as ts

    config = ts.TritonShortConfig(**cfg, mask_free=mask_free)
    _check([37, 1, 300, 128, 5, 64, 65, 2], 4, 2, d, config, name=f"triton_short {cfg} mask_free={mask_free}")


@pytest.mark.parametrize(
    "causal,window",
    [(True, (-1, -1)), (True, (256, -1)), (False, (-1, -1))],
    ids=["causal", "window", "full"],
)
def test_mask_free_on_and_off_long_and_short_documents(causal, window):
    """bf16, D = 128, the default launch configs (``BLOCKS``): long documents (whose off-diagonal tiles run
    mask-free; asserted from the tables) beside short ones, both splits against fp32 truth."""
    from varpack.attn import triton_short as ts

    lens = [1000, 37, 1, 300, 128, 5, 2000, 64, 65, 2, 700]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    win = (window[0], 0 if causal else window[1])
    tables = ts.TritonShortTables.build(cu, cu, sum(lens), sum(lens), causal=causal, window_size=win)
    for kind in ts.KERNEL_KINDS:
        bm, bn = ts.TritonShortConfig().blocks(kind, 128)[:2]
        lo, hi = tables.key_tiles_full(bn, bm) if kind == "bwd_dkdv" else tables.query_tiles_full(bm, bn)
        assert (hi > lo).any().item(), f"{kind}: no mask-free tile, the case does not test the split"
    for mf in (True, False):
        _check(lens, 8, 2, 128, ts.TritonShortConfig(mask_free=mf), causal, window, f"mask_free={mf}")


def test_negative_control_compiled_mask_free_loop_reads_no_document_ids():
    """Forward with the default configs on the GPU: corrupt the document ids of keys 0..63; the query tiles
    whose mask-free run covers those keys keep a bitwise-equal output with the split on (the compiled loop 2
    is taken and reads no id) and change with it off."""
    from varpack.attn import triton_short as ts

    lens = [1000, 200]
    q, k, v, _, cu, _, _ = _inputs(lens, None, 4, 2, 128, torch.bfloat16)
    cu = cu.cuda()
    tables = ts.TritonShortTables.build(cu, cu, 1200, 1200, causal=True, window_size=(-1, 0))
    bad = tables.doc_k.clone()
    bad[:64] = 7  # no document 7
    leaky = dataclasses.replace(tables, doc_k=bad, _tiles={}, _full_tiles={})
    bm, bn = ts.TritonShortConfig().blocks("fwd", 128)[:2]
    lo, hi = tables.query_tiles_full(bm, bn)
    tiles = ((lo <= 0) & (hi >= 64)).nonzero().flatten().tolist()
    assert len(tiles) > 4, tiles
    rows = torch.cat([torch.arange(t * bm, (t + 1) * bm) for t in tiles]).cuda()
    with torch.no_grad():
        for mask_free in (True, False):
            args = (True, (-1, 0), 128**-0.5, ts.TritonShortConfig(mask_free=mask_free))
            good = ts._forward(q, k, v, tables, *args)[0]
            leak = ts._forward(q, k, v, leaky, *args)[0]
            assert (leak[:64] - good[:64]).abs().max().item() > 1e-2  # diagonal tile: masked either way
            if mask_free:
                assert torch.equal(leak[rows], good[rows])
            else:
                assert (leak[rows] - good[rows]).abs().max().item() > 1e-2


@pytest.mark.parametrize(
    "h,hkv,cfg",
    [
        (8, 2, None),  # BLOCKS: fwd 64 rows = 16 tokens x 4 heads
        (16, 8, None),  # Qwen3-0.6B's group of 2
        (16, 2, {"fwd": (128, 64, 8, 2), "bwd_dkdv": (64, 128, 8, 2), "bwd_dq": (128, 32, 8, 2)}),
    ],
    ids=["g4-blocks", "g2-blocks", "g8-large"],
)
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (True, (256, -1))], ids=["causal", "window"])
def test_pack_gqa_matches_reference(h, hkv, cfg, causal, window):
    """PackGQA compiled (rows = the group's query heads of BLOCK_M / G tokens): short and long documents, by the
    fp32-truth rule, and equal to the unpacked run up to bf16 rounding of the same sums."""
    from varpack.attn import triton_short as ts

    lens = [1000, 37, 1, 300, 128, 5, 2000, 64, 65, 2, 700, 17, 90]
    config = ts.TritonShortConfig(**(cfg or {}), pack_gqa=True)
    for kind in ts.KERNEL_KINDS:
        assert ts._packing(config, h // hkv, config.blocks(kind, 128)[0])[0], kind
    got = _check(lens, h, hkv, 128, config, causal, window, f"pack_gqa {h}/{hkv} {cfg}")
    plain = _check(lens, h, hkv, 128, dataclasses.replace(config, pack_gqa=False), causal, window, "unpacked")
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        torch.testing.assert_close(got[i].float(), plain[i].float(), rtol=2e-2, atol=2e-2, msg=what)


@pytest.mark.parametrize("h,hkv", [(16, 4), (16, 8)], ids=["g4-packed", "g2-unpacked"])
def test_delta_in_dq_matches_reference_and_the_separate_pass(h, hkv):
    """delta = rowsum(dO * O) computed in the compiled dQ kernel (the default) vs its own preprocessing pass:
    both by the fp32-truth rule, and equal to each other up to fp32 rounding of the row sums."""
    from varpack.attn import triton_short as ts

    lens = [1000, 37, 1, 300, 128, 5, 2000, 64, 65, 2, 700, 17, 90]
    fused = _check(lens, h, hkv, 128, ts.TritonShortConfig(), name=f"delta_in_dq {h}/{hkv}")
    separate = _check(lens, h, hkv, 128, ts.TritonShortConfig(delta_in_dq=False), name="delta pass")
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        torch.testing.assert_close(fused[i].float(), separate[i].float(), rtol=1e-2, atol=1e-2, msg=what)


@pytest.mark.parametrize("h,hkv", [(16, 4), (16, 8)], ids=["g4-packed", "g2"])
def test_lpt_order_matches_reference_and_row_order_bitwise(h, hkv):
    """The longest-first tile order (1-D grid, the default) compiled: by the fp32-truth rule, bitwise equal to the
    row-order 2-D grid (the same per-tile work, no atomics); negative control: an order mapping every rank to
    tile 0 leaves the other tiles unwritten and the output differs."""
    from varpack.attn import triton_short as ts

    lens = [1000, 37, 1, 300, 128, 5, 2000, 64, 65, 2, 700, 17, 90]
    lpt = _check(lens, h, hkv, 128, ts.TritonShortConfig(lpt=True), name=f"lpt {h}/{hkv}")
    rows = _check(lens, h, hkv, 128, ts.TritonShortConfig(lpt=False), name="row order")
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        assert torch.equal(lpt[i], rows[i]), what
    q, k, v, _, cu, _, _ = _inputs(lens, None, h, hkv, 128, torch.bfloat16)
    cu = cu.cuda()
    tables = ts.TritonShortTables.build(cu, cu, sum(lens), sum(lens), causal=True, window_size=(-1, 0))
    config = ts.TritonShortConfig(lpt=True)
    with torch.no_grad():
        good = ts._forward(q, k, v, tables, True, (-1, 0), 128**-0.5, config)[0]
        good_copy = torch.full_like(good, float("nan"))  # its freed block is what the next output reuses
        order = tables.tile_order(
            "q", ts._packing(config, h // hkv, config.blocks("fwd", 128)[0], tables.mean_q)[1]
        )
        assert sorted(order.tolist()) == list(range(order.numel()))
        order.zero_()  # the cached order, now every rank -> tile 0
        del good_copy
        bad = ts._forward(q, k, v, tables, True, (-1, 0), 128**-0.5, config)[0]
    assert not torch.allclose(bad.float(), good.float(), rtol=1e-2, atol=1e-2)


def _compiled(fn, maxnreg):
    """The compiled kernels of ``fn`` (every device) whose launch options carried this register cap."""
    found = []
    for caches in fn.device_caches.values():
        found += [k for k in caches[0].values() if getattr(k.metadata, "maxnreg", None) == maxnreg]
    return found


@pytest.mark.parametrize("h,hkv", [(16, 4), (16, 8)], ids=["g4-packed", "g2"])
def test_maxnreg_caps_match_reference_bitwise_and_reach_ptxas(h, hkv):
    """Register caps (the default MAXNREG, explicit caps on every kernel, and none) compiled: by the fp32-truth
    rule and bitwise equal to each other (the same instructions, another register allocation). The caps must
    reach the compiled kernels: each capped kernel uses at most its cap of registers (the uncapped forward
    takes 187 at D = 128; ptxas ``-v``, benchmarks/RESULTS.md) -- a cap lost on the way fails here."""
    from varpack.attn import _triton_short_kernels as kern
    from varpack.attn import triton_short as ts

    lens = [1000, 37, 1, 300, 128, 5, 2000, 64, 65, 2, 700, 17, 90]
    caps = (("bwd_dkdv", 200), ("bwd_dq", 160), ("fwd", 120))
    runs = {
        "default": _check(lens, h, hkv, 128, ts.TritonShortConfig(), name=f"maxnreg default {h}/{hkv}"),
        "capped": _check(lens, h, hkv, 128, ts.TritonShortConfig(maxnreg=caps), name="capped"),
        "uncapped": _check(
            lens, h, hkv, 128, ts.TritonShortConfig(maxnreg=tuple((k, 255) for k, _ in caps)), name="uncapped"
        ),
    }
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        assert torch.equal(runs["default"][i], runs["capped"][i]), what
        assert torch.equal(runs["default"][i], runs["uncapped"][i]), what
    for fn, cap in ((kern.attn_bwd_dkdv, 200), (kern.attn_bwd_dq, 160), (kern.attn_fwd, 120)):
        compiled = _compiled(fn, cap)
        assert compiled, f"{fn.__name__}: no kernel compiled with maxnreg={cap}"
        assert all(k.n_regs <= cap for k in compiled), (fn.__name__, [k.n_regs for k in compiled])
    uncapped = _compiled(kern.attn_fwd, 255)
    assert uncapped and max(k.n_regs for k in uncapped) > 120  # the control: without the cap it takes more


@pytest.mark.parametrize("h,hkv", [(16, 4), (16, 8)], ids=["g4-packed", "g2"])
def test_dp_first_on_and_off_match_reference_bitwise(h, hkv):
    """The backward's dP matmul issued before the softmax (``dp_first``, the default) or after dV's update (the
    earlier order) compiled: each by the fp32-truth rule, and bitwise equal to each other (independent
    instructions in another order; the same operations on the same values)."""
    from varpack.attn import triton_short as ts

    lens = [1000, 37, 1, 300, 128, 5, 2000, 64, 65, 2, 700, 17, 90]
    base = _check(lens, h, hkv, 128, ts.TritonShortConfig(), name=f"dp first {h}/{hkv}")
    got = _check(lens, h, hkv, 128, ts.TritonShortConfig(dp_first=False), name=f"dp after dV {h}/{hkv}")
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        assert torch.equal(base[i], got[i]), what
