"""The ``triton_short`` backend (tiles spanning several documents) on the CPU, through Triton's interpreter.

Triton runs interpreted when ``TRITON_INTERPRET=1`` was set before its import (tests/conftest.py does so on a
machine without CUDA); otherwise these tests skip. Tiles are shrunk to 16 tokens so that rows of a few dozen
tokens cross many tile and document edges. Output, log-sum-exp and dq / dk / dv are compared with the
``reference`` backend: in fp32 against fp64 truth (tight), in bf16 / fp16 by the fp32-truth rule of
tests/attn/test_attn_gpu.py (error at most k x plain PyTorch's own low-precision error + rounding).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

# Triton fixes its interpreter mode when it is imported, for the whole process: tests/conftest.py sets
# TRITON_INTERPRET=1 first on a machine without CUDA. On a GPU machine tests/attn/test_attn_gpu.py runs this
# backend compiled, and these interpreter tests skip.
pytest.importorskip("triton")

from tests.attn.test_attn_gpu import _check_fp32_truth  # noqa: E402
from varpack.attn import (  # noqa: E402
    BACKENDS,
    BackendUnavailableError,
    available_backends,
    reference_varlen_attention,
    segment_mask,
    varlen_attention,
)
from varpack.attn import triton_short as ts  # noqa: E402
from varpack.varlen import VarlenMeta  # noqa: E402

SMALL_BLOCKS = {
    "fwd": {256: (16, 16, 4, 1)},
    "bwd_dkdv": {256: (16, 16, 4, 1)},
    "bwd_dq": {256: (16, 16, 4, 1)},
}


@pytest.fixture(autouse=True)
def _interpreted(monkeypatch):
    if not ts._triton_interpreted():
        pytest.skip("Triton was imported compiled in this process (TRITON_INTERPRET=1 not set before it)")
    monkeypatch.delenv(ts.CONFIG_ENV, raising=False)
    for kind, table in SMALL_BLOCKS.items():
        monkeypatch.setitem(ts.BLOCKS, kind, table)


def _inputs(lens_q, lens_k, h, hkv, d, dtype, seed=0):
    lens_k = lens_q if lens_k is None else lens_k
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), h, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), hkv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(sum(lens_q), h, d, generator=g, dtype=torch.float64)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, dout.to(dtype), cu_q, cu_k


def _reference_lse(q, k, cu_q, cu_k, *, causal, window_size, scale):
    """[H, Tq] natural-log log-sum-exp of each query's visible scaled scores, per segment in fp64 (+inf for a
    query that sees no key: flash-attn's convention)."""
    q, k = q.detach().double(), k.detach().double()
    group = q.shape[1] // k.shape[1]
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float64)
    for n in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[n]), int(cu_q[n + 1]), int(cu_k[n]), int(cu_k[n + 1])
        if q1 == q0:
            continue
        ks = k[k0:k1].repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1], ks) * scale
        mask = segment_mask(q1 - q0, k1 - k0, causal=causal, window_size=window_size)
        seg = torch.logsumexp(s.masked_fill(~mask, float("-inf")), dim=-1)
        lse[:, q0:q1] = torch.where(mask.any(-1), seg, torch.full_like(seg, float("inf")))
    return lse


def _run(q, k, v, dout, cu_q, cu_k, causal, window, scale=None, config=None):
    out, lse = ts.triton_short_attention(
        q, k, v, cu_q, cu_k, causal=causal, window_size=window, softmax_scale=scale, config=config
    )
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out, lse, dq, dk, dv


def _reference(q, k, v, dout, cu_q, cu_k, causal, window, scale=None, upcast=True):
    out = reference_varlen_attention(
        q, k, v, cu_q, cu_k, causal=causal, window_size=window, softmax_scale=scale, upcast=upcast
    )
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out, dq, dk, dv


CASES = [
    # (lens_q, lens_k, causal, window, h, hkv, d)
    pytest.param([1, 1, 1, 7, 1, 20, 1, 1], None, True, (-1, -1), 4, 2, 16, id="one-token-docs-gqa"),
    pytest.param([5, 13, 18, 3, 9], None, True, (-1, -1), 4, 1, 16, id="docs-cross-tile-edges-mqa"),
    pytest.param([48], None, True, (-1, -1), 2, 2, 32, id="one-doc-fills-row"),
    pytest.param([7, 12, 4], None, True, (-1, -1), 2, 1, 16, id="T-not-multiple-of-block"),
    pytest.param([5, 13, 18, 3], None, False, (-1, -1), 2, 2, 16, id="noncausal"),
    pytest.param([9, 30, 6], None, True, (4, -1), 4, 2, 16, id="causal-window"),
    pytest.param([9, 30, 6], None, False, (3, 5), 2, 1, 16, id="noncausal-window"),
    pytest.param([6, 0, 19, 0], None, True, (-1, -1), 2, 1, 16, id="zero-length-docs"),
    pytest.param([2, 21, 3], [21, 2, 9], True, (-1, -1), 2, 1, 16, id="q!=k-bottom-right"),
    pytest.param([11, 20], None, True, (-1, -1), 2, 2, 24, id="head-dim-24-padded"),
]


@pytest.mark.parametrize("lens_q,lens_k,causal,window,h,hkv,d", CASES)
def test_fp32_matches_fp64_reference(lens_q, lens_k, causal, window, h, hkv, d):
    _assert_fp32_matches_fp64(lens_q, lens_k, causal, window, h, hkv, d)


def _assert_fp32_matches_fp64(lens_q, lens_k, causal, window, h, hkv, d, config=None):
    q, k, v, dout, cu_q, cu_k = _inputs(lens_q, lens_k, h, hkv, d, torch.float32)
    got = _run(q, k, v, dout, cu_q, cu_k, causal, window, scale=0.3, config=config)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, dq, dk, dv = _reference(q64, k64, v64, dout.double(), cu_q, cu_k, causal, window, scale=0.3)
    lse = _reference_lse(q64, k64, cu_q, cu_k, causal=causal, window_size=window, scale=0.3)
    assert got[0].dtype == torch.float32 and got[1].shape == (h, sum(lens_q))
    torch.testing.assert_close(got[0].double(), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1].double(), lse, rtol=1e-5, atol=1e-5)  # +inf where no key, on both
    for name, g, want in zip(("dq", "dk", "dv"), got[2:], (dq, dk, dv)):
        torch.testing.assert_close(g.double(), want, rtol=1e-5, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    return got


# -- mask-free tiles (tiles wholly inside one document's visible band skip the mask) --------------------------

CFG_A = {"fwd": (32, 16, 4, 1), "bwd_dkdv": (16, 32, 4, 1), "bwd_dq": (32, 16, 4, 1)}
CFG_B = {"fwd": (16, 32, 4, 1), "bwd_dkdv": (32, 16, 4, 1), "bwd_dq": (16, 32, 4, 1)}
MASK_FREE_CASES = [
    # (lens_q, lens_k, causal, window, h, hkv, d, launch configs): long documents, so tiles lie wholly inside one
    pytest.param([200, 7, 1, 1, 40], None, True, (-1, -1), 4, 2, 16, CFG_A, id="long-doc-gqa"),
    pytest.param([1, 150, 17, 1, 33], None, True, (70, -1), 2, 1, 16, CFG_B, id="causal-window-1-token-docs"),
    pytest.param([120, 9], None, False, (20, 45), 2, 2, 24, CFG_A, id="noncausal-window-d24"),
    # Tq = Tk = 108: the padded last query tile and key tile both run mask-free ([75, 107))
    pytest.param([70, 5, 33], None, False, (-1, -1), 2, 1, 16, CFG_B, id="noncausal"),
    pytest.param([30, 2, 64], [64, 40, 70], True, (-1, -1), 2, 1, 16, CFG_A, id="q!=k-bottom-right"),
]


def _full_tile_counts(lens_q, lens_k, causal, window, cfg):
    """Mask-free loop iterations of each kernel (tiles x steps) under ``cfg`` for these lengths."""
    lens_k = lens_q if lens_k is None else lens_k
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    win = (window[0], 0 if causal else window[1])
    tables = ts.TritonShortTables.build(cu_q, cu_k, sum(lens_q), sum(lens_k), causal=causal, window_size=win)
    (fm, fn), (km, kn), (qm, qn) = (cfg[kind][:2] for kind in ("fwd", "bwd_dkdv", "bwd_dq"))
    counts = {}
    for kind, (lo, hi), step in (
        ("fwd", tables.query_tiles_full(fm, fn), fn),
        ("bwd_dkdv", tables.key_tiles_full(kn, km), km),
        ("bwd_dq", tables.query_tiles_full(qm, qn), qn),
    ):
        counts[kind] = int(((hi - lo) // step).sum())
    return counts


@pytest.mark.parametrize("mask_free", [True, False], ids=["mask-free", "masked-only"])
@pytest.mark.parametrize("lens_q,lens_k,causal,window,h,hkv,d,cfg", MASK_FREE_CASES)
def test_mask_free_on_and_off_match_fp64_reference(lens_q, lens_k, causal, window, h, hkv, d, cfg, mask_free):
    """Both loop splits are exact on cases whose every kernel has mask-free tiles (asserted, so the case
    really runs loop 2), crossing tile and document edges, with windows, q != k lengths, GQA, a padded D."""
    counts = _full_tile_counts(lens_q, lens_k, causal, window, cfg)
    assert min(counts.values()) > 0, counts
    _assert_fp32_matches_fp64(
        lens_q, lens_k, causal, window, h, hkv, d, ts.TritonShortConfig(**cfg, mask_free=mask_free)
    )


# -- PackGQA: a program owns one KV head, its query tile's rows are the group's heads of fewer tokens -----------

PACKED_CASES = [c for c in CASES if c.values[4] > c.values[5]]  # h > hkv: a group to pack


@pytest.mark.parametrize("lens_q,lens_k,causal,window,h,hkv,d", PACKED_CASES)
def test_pack_gqa_matches_fp64_reference(lens_q, lens_k, causal, window, h, hkv, d):
    """Every GQA case of the table packed (16-row tiles: 8 tokens x 2 heads, or 4 x 4): one-token documents,
    zero-length ones, tile and document edges, windows, q != k lengths."""
    cfg = ts.TritonShortConfig(pack_gqa=True)
    for kind in ts.KERNEL_KINDS:  # the case really runs packed in all three kernels
        assert ts._packing(cfg, h // hkv, cfg.blocks(kind, d)[0]) == (True, 16 // (h // hkv)), kind
    _assert_fp32_matches_fp64(lens_q, lens_k, causal, window, h, hkv, d, cfg)


@pytest.mark.parametrize("mask_free", [True, False], ids=["mask-free", "masked-only"])
@pytest.mark.parametrize("lens_q,lens_k,causal,window,h,hkv,d,cfg", [
    c for c in MASK_FREE_CASES if c.values[4] > c.values[5]
])  # fmt: skip
def test_pack_gqa_with_mask_free_tiles_matches_fp64_reference(
    lens_q, lens_k, causal, window, h, hkv, d, cfg, mask_free
):
    """Packed tiles span BLOCK_M / G tokens: the mask-free tables are built for that tile (they still have
    mask-free runs here, asserted), and both loop splits stay exact."""
    group = h // hkv
    packed = {kind: (b[0] // group, *b[1:]) for kind, b in cfg.items()}  # query tiles of BLOCK_M / G tokens
    counts = _full_tile_counts(lens_q, lens_k, causal, window, packed)
    assert min(counts.values()) > 0, counts
    _assert_fp32_matches_fp64(
        lens_q, lens_k, causal, window, h, hkv, d,
        ts.TritonShortConfig(**cfg, mask_free=mask_free, pack_gqa=True),
    )  # fmt: skip


def test_pack_gqa_equals_unpacked_and_is_skipped_where_it_cannot_pack():
    """Packed and unpacked runs agree to rounding (the same sums in another order); a group that does not
    divide BLOCK_M runs unpacked by default (bitwise the unpacked config's results) and is refused when
    pack_gqa is forced; no group (H = Hkv) is the unpacked layout."""
    lens = [5, 13, 18, 3, 9, 1, 30]
    q, k, v, dout, cu, _ = _inputs(lens, None, 8, 2, 16, torch.float32)
    on, off = (
        _run(q, k, v, dout, cu, cu, True, (-1, -1), config=ts.TritonShortConfig(pack_gqa=p))
        for p in (True, False)
    )
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), on, off):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert ts._packing(ts.TritonShortConfig(pack_gqa=None), 3, 16) == (False, 16)  # 3 does not divide 16
    assert ts._packing(ts.TritonShortConfig(pack_gqa=True), 1, 16) == (False, 16)  # a group of one: the same
    assert ts._packing(ts.TritonShortConfig(pack_gqa=False), 4, 16) == (False, 16)
    q3, k3, v3, dout3, cu3, _ = _inputs(lens, None, 6, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="pack_gqa=true needs the GQA group G = H / Hkv = 3 to divide"):
        _run(q3, k3, v3, dout3, cu3, cu3, True, (-1, -1), config=ts.TritonShortConfig(pack_gqa=True))
    on, off = (
        _run(q3, k3, v3, dout3, cu3, cu3, True, (-1, -1), config=ts.TritonShortConfig(pack_gqa=p))
        for p in (None, False)
    )
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), on, off):
        assert torch.equal(a, b), name


def test_pack_gqa_default_packs_from_the_measured_group_size():
    """``pack_gqa=None`` (default): packed at G >= PACK_GQA_MIN_GROUP (4: measured faster on the H200), not at
    G = 2 (slower on the real-lengths mix); True / False force it either way."""
    assert ts.PACK_GQA_MIN_GROUP == 4
    default = ts.TritonShortConfig()
    assert ts._packing(default, 4, 64) == (True, 16) and ts._packing(default, 8, 64) == (True, 8)
    assert ts._packing(default, 2, 64) == (False, 64) and ts._packing(default, 1, 64) == (False, 64)
    assert ts._packing(ts.TritonShortConfig(pack_gqa=True), 2, 64) == (True, 32)
    assert ts._packing(ts.TritonShortConfig(pack_gqa=False), 4, 64) == (False, 64)
    assert ts._packing(default, 32, 16) == (False, 16)  # a group larger than the tile: unpacked
    # short documents (mean <= PACK_GQA_SHORT_MEAN tokens): packed from G = 2 on; forced settings win
    short, long = ts.PACK_GQA_SHORT_MEAN, ts.PACK_GQA_SHORT_MEAN + 1
    assert ts._packing(default, 2, 64, short) == (True, 32) and ts._packing(default, 2, 64, long) == (
        False,
        64,
    )
    assert ts._packing(default, 1, 64, 10.0) == (False, 64)
    assert ts._packing(ts.TritonShortConfig(pack_gqa=False), 2, 64, 10.0) == (False, 64)


def test_tables_carry_the_mean_document_length():
    """``TritonShortTables.mean_q`` = Tq / N from shapes (zero-length documents count), on both build paths."""
    cu = torch.tensor([0, 6, 6, 25, 25, 40], dtype=torch.int32)
    for fused in (True, False):
        t = ts.TritonShortTables.build(cu, cu, 40, 40, causal=True, window_size=(-1, -1), fused=fused)
        assert t.mean_q == 8.0, fused


def test_pack_gqa_negative_control_wrong_head_mapping_fails(monkeypatch):
    """If the packed kernels were launched for a group they do not serve (rows mapped to the wrong query heads:
    GROUP told 2 while H / Hkv = 4), the outputs differ from the reference: the tests above can fail."""
    lens = [5, 13, 18, 3]
    q, k, v, dout, cu, _ = _inputs(lens, None, 4, 1, 16, torch.float32)
    want = _run(q, k, v, dout, cu, cu, True, (-1, -1), config=ts.TritonShortConfig(pack_gqa=False))
    real = ts._packing
    monkeypatch.setattr(
        ts, "_packing", lambda config, group, block_m, mean=None: real(config, 2, block_m, mean)
    )
    got = _run(q, k, v, dout, cu, cu, True, (-1, -1), config=ts.TritonShortConfig(pack_gqa=True))
    assert not torch.allclose(got[0], want[0], rtol=1e-3, atol=1e-3)  # (NaN from unwritten rows also fails)


# -- delta = rowsum(dO * O) computed in the dQ kernel (TritonShortConfig.delta_in_dq) -------------------------


@pytest.mark.parametrize("pack_gqa", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize(
    "lens_q,lens_k,causal,window,h,hkv",
    [
        pytest.param([1, 1, 7, 20, 1, 6], None, True, (-1, -1), 4, 1, id="one-token-docs"),
        pytest.param([6, 0, 19, 0, 9], None, True, (4, -1), 4, 2, id="zero-length-window"),
        pytest.param([2, 21, 3], [21, 2, 9], True, (-1, -1), 4, 2, id="q!=k"),
    ],
)
def test_delta_in_dq_equals_the_separate_pass(lens_q, lens_k, causal, window, h, hkv, pack_gqa):
    """The dQ kernel writes ``delta`` for every (token, head) row -- packed or not, padded last tile left out --
    equal to the preprocessing kernel's; the whole backward equals the separate-pass backward to rounding."""
    q, k, v, dout, cu_q, cu_k = _inputs(lens_q, lens_k, h, hkv, 16, torch.float32)
    tables = ts.TritonShortTables.build(cu_q, cu_k, q.shape[0], k.shape[0], causal=causal, window_size=window)
    scale = 16**-0.5
    config = ts.TritonShortConfig(pack_gqa=pack_gqa)
    with torch.no_grad():
        out, lse = ts._forward(q, k, v, tables, causal, window, scale, config)
        want = ts._backward_delta(dout, out, lse)
        got = torch.full_like(lse, float("nan"))  # every row must be written
        ts._backward_dq(dout, q, k, v, lse, got, tables, causal, window, scale, config, out=out)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(want, (dout.double() * out.double()).sum(-1).T.float(), rtol=1e-5, atol=1e-5)
    fused, separate = (
        _run(q, k, v, dout, cu_q, cu_k, causal, window, config=dataclasses.replace(config, delta_in_dq=d))
        for d in (True, False)
    )
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), fused, separate):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_delta_in_dq_negative_control_dkdv_reads_the_written_delta():
    """Run before the dQ kernel has written it, the dK / dV kernel sees an unwritten delta (NaN here) and dk is
    wrong: the order dQ -> dK / dV of the fused backward is what makes the tests above pass."""
    q, k, v, dout, cu, _ = _inputs([5, 13, 18, 3], None, 4, 2, 16, torch.float32)
    tables = ts.TritonShortTables.build(cu, cu, q.shape[0], q.shape[0], causal=True, window_size=(-1, -1))
    config, scale = ts.TritonShortConfig(), 16**-0.5
    with torch.no_grad():
        out, lse = ts._forward(q, k, v, tables, True, (-1, -1), scale, config)
        delta = torch.full_like(lse, float("nan"))
        dk_early, _ = ts._backward_dkdv(dout, q, k, v, lse, delta, tables, True, (-1, -1), scale, config)
        ts._backward_dq(dout, q, k, v, lse, delta, tables, True, (-1, -1), scale, config, out=out)
        dk, _ = ts._backward_dkdv(dout, q, k, v, lse, delta, tables, True, (-1, -1), scale, config)
    assert torch.isnan(dk_early).any() and not torch.isnan(dk).any()


def test_delta_in_dq_config_flag():
    """Default on; JSON round trip; a non-bool refused."""
    assert ts.TritonShortConfig().delta_in_dq is True
    off = ts.TritonShortConfig.from_json('{"delta_in_dq": false}')
    assert off.delta_in_dq is False and json.loads(off.to_json())["delta_in_dq"] is False
    with pytest.raises(ValueError, match="delta_in_dq must be true or false"):
        ts.TritonShortConfig(delta_in_dq=1)


# -- launch configurations of unpacked kernels (BLOCKS_UNPACKED) ---------------------------------------------


def test_launch_blocks_by_layout(monkeypatch):
    """``BLOCKS`` for a kernel that runs with PackGQA, ``BLOCKS_UNPACKED`` (where it has the entry) for one that
    does not: by group and mean length as :func:`_wants_pack` decides; a config's own value wins over both."""
    packed, unpacked = (64, 16, 4, 3), (64, 32, 4, 2)
    monkeypatch.setitem(ts.BLOCKS, "bwd_dq", {128: packed})
    monkeypatch.setitem(ts.BLOCKS_UNPACKED, "bwd_dq", {128: unpacked})
    monkeypatch.setitem(ts.BLOCKS, "fwd", {128: (64, 32, 4, 2)})
    monkeypatch.delitem(ts.BLOCKS_UNPACKED, "fwd", raising=False)
    cfg = ts.TritonShortConfig()
    long, short = ts.PACK_GQA_SHORT_MEAN + 80, ts.PACK_GQA_SHORT_MEAN - 50
    assert ts._launch_blocks(cfg, "bwd_dq", 128, 4, long) == (packed, True, 16)  # G = 4 packs
    assert ts._launch_blocks(cfg, "bwd_dq", 128, 2, short) == (
        packed,
        True,
        32,
    )  # short documents pack at G = 2
    assert ts._launch_blocks(cfg, "bwd_dq", 128, 2, long) == (unpacked, False, 64)
    assert ts._launch_blocks(cfg, "bwd_dq", 128, 1, short) == (unpacked, False, 64)  # MHA: nothing to pack
    off = ts.TritonShortConfig(pack_gqa=False)
    assert ts._launch_blocks(off, "bwd_dq", 128, 4, short) == (unpacked, False, 64)
    assert ts._launch_blocks(cfg, "fwd", 128, 2, long) == ((64, 32, 4, 2), False, 64)  # no entry: BLOCKS
    own = ts.TritonShortConfig(bwd_dq=(32, 32, 4, 1))
    assert ts._launch_blocks(own, "bwd_dq", 128, 2, long) == ((32, 32, 4, 1), False, 32)


def test_unpacked_kernels_launch_blocks_unpacked_and_stay_exact(monkeypatch):
    """Through the public entry point: unpacked (``pack_gqa`` off) every kernel launches ``BLOCKS_UNPACKED``'s tiles
    (the tables are built for those sizes), packed ones ``BLOCKS``'; both match the fp64 reference."""
    for kind in ts.KERNEL_KINDS:
        monkeypatch.setitem(
            ts.BLOCKS_UNPACKED, kind, {256: (32, 16, 4, 1) if kind != "bwd_dkdv" else (16, 32, 4, 1)}
        )
    lens = [5, 13, 18, 3, 9, 1, 30]
    q, k, v, dout, cu, _ = _inputs(lens, None, 4, 2, 16, torch.float32)
    want = _reference(q, k, v, dout, cu, cu, True, (-1, -1))
    for pack_gqa, q_tile, k_tile in ((False, 32, 32), (True, 8, 16)):  # packed: 16 rows = 8 tokens x 2 heads
        tables = ts.TritonShortTables.build(cu, cu, sum(lens), sum(lens), causal=True, window_size=(-1, 0))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ts, "_tables", lambda *a, t=tables, **kw: t)
            config = ts.TritonShortConfig(pack_gqa=pack_gqa)
            out, _ = ts.triton_short_attention(q, k, v, cu, cu, config=config)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        assert set(tables._tiles) == {("q", q_tile), ("k", k_tile)}, (pack_gqa, tables._tiles)
        for name, g, w in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
            torch.testing.assert_close(
                g, w, rtol=1e-5, atol=2e-5, msg=lambda m, n=name, p=pack_gqa: f"{p} {n}: {m}"
            )


# -- longest-processing-time-first tile order (TritonShortConfig.lpt) ----------------------------------------


def test_lpt_tile_order_is_a_permutation_longest_loop_first():
    """Per side and tile size: every tile exactly once, loop lengths ``hi - lo`` non-increasing, ties in row order,
    tiles that see nothing (a zero-length document's key tile here) last; cached."""
    lens_q, lens_k = [3, 40, 0, 9, 1, 16], [3, 40, 17, 9, 1, 16]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    for fused in (True, False):
        tables = ts.TritonShortTables.build(
            cu_q, cu_k, sum(lens_q), sum(lens_k), causal=True, window_size=(-1, -1), fused=fused
        )
        for side, block in (("q", 16), ("q", 4), ("k", 16), ("k", 8)):
            order = tables.tile_order(side, block)
            lo, hi = tables.query_tiles(block) if side == "q" else tables.key_tiles(block)
            work = (hi.long() - lo.long()).tolist()
            assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(len(work)))
            ranked = [(-work[t], t) for t in order.tolist()]
            assert ranked == sorted(ranked), (side, block, ranked)  # longest first, ties by tile index
            assert tables.tile_order(side, block) is order
        # the zero-length query document's keys (tokens 43..59) are seen by no query: their key tiles come last
        lo, hi = tables.key_tiles(8)
        empty = [t for t in range(lo.numel()) if hi[t] <= lo[t]]
        assert empty and tables.tile_order("k", 8).tolist()[-len(empty) :] == empty
    with pytest.raises(ValueError, match="side must be"):
        tables.tile_order("x", 16)


@pytest.mark.parametrize("pack_gqa", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize(
    "lens_q,lens_k,causal,window,h,hkv",
    [
        pytest.param([1, 1, 7, 40, 1, 6, 2], None, True, (-1, -1), 4, 1, id="one-token-and-long-docs"),
        pytest.param([6, 0, 35, 0, 9], None, True, (4, -1), 4, 2, id="zero-length-window"),
        pytest.param([2, 21, 3], [21, 2, 9], True, (-1, -1), 4, 2, id="q!=k"),
        pytest.param([5, 33, 18, 3], None, False, (-1, -1), 2, 2, id="noncausal"),
    ],
)
def test_lpt_order_and_row_order_agree_bitwise(lens_q, lens_k, causal, window, h, hkv, pack_gqa):
    """Longest-first and row order run the same per-tile computations (no atomics): output, lse and dq / dk / dv
    bitwise equal; both match the fp64 reference."""
    q, k, v, dout, cu_q, cu_k = _inputs(lens_q, lens_k, h, hkv, 16, torch.float32)
    config = ts.TritonShortConfig(pack_gqa=pack_gqa)
    lpt, rows = (
        _run(q, k, v, dout, cu_q, cu_k, causal, window, config=dataclasses.replace(config, lpt=flag))
        for flag in (True, False)
    )
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), lpt, rows):
        assert torch.equal(a, b), name
    want = _reference(q, k, v, dout, cu_q, cu_k, causal, window)
    for name, g, w in zip(("out", "dq", "dk", "dv"), (lpt[0], *lpt[2:]), want):
        torch.testing.assert_close(g, w.to(g.dtype), rtol=1e-5, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_lpt_negative_control_the_kernels_read_the_order(monkeypatch):
    """An order that is not a permutation (every rank mapped to tile 0) leaves the other tiles unwritten, so the
    results no longer match the reference: the 1-D grid's tiles really come from :meth:`tile_order`."""
    lens = [5, 13, 18, 3, 9, 1, 30]
    q, k, v, dout, cu, _ = _inputs(lens, None, 4, 2, 16, torch.float32)
    want = _reference(q, k, v, dout, cu, cu, True, (-1, -1))
    got = _run(q, k, v, dout, cu, cu, True, (-1, -1), config=ts.TritonShortConfig(lpt=True))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=2e-5)
    monkeypatch.setattr(
        ts.TritonShortTables,
        "tile_order",
        lambda self, side, block: torch.zeros(
            triton_tiles(q.shape[0] if side == "q" else k.shape[0], block), dtype=torch.int32
        ),
    )
    bad = _run(q, k, v, dout, cu, cu, True, (-1, -1), config=ts.TritonShortConfig(lpt=True))
    for name, g, w in zip(("out", "dq", "dk", "dv"), (bad[0], *bad[2:]), want):
        assert not torch.allclose(g, w, rtol=1e-3, atol=1e-3), name


def triton_tiles(total: int, block: int) -> int:
    return -(-total // block)


def test_lpt_config_flag():
    """Default off (measured slower on the H200); JSON round trip; a non-bool refused."""
    assert ts.TritonShortConfig().lpt is False
    on = ts.TritonShortConfig.from_json('{"lpt": true}')
    assert on.lpt is True and json.loads(on.to_json())["lpt"] is True
    with pytest.raises(ValueError, match="lpt must be true or false"):
        ts.TritonShortConfig(lpt="yes")


def test_maxnreg_config_parsing_and_launch_options(monkeypatch):
    """Register caps per kernel: JSON object -> sorted checked pairs, round trip, defaults from MAXNREG, refusals
    naming the field; the launch options carry the cap on CUDA only (the interpreter takes no launch options)."""
    cfg = ts.TritonShortConfig.from_json('{"maxnreg": {"bwd_dq": 160, "fwd": 168}}')
    assert cfg.maxnreg == (("bwd_dq", 160), ("fwd", 168))
    assert ts.TritonShortConfig.from_json(cfg.to_json()) == cfg
    assert "maxnreg" not in json.loads(ts.TritonShortConfig().to_json())  # unset: not written
    assert cfg.registers("fwd", 128) == 168 and cfg.registers("bwd_dkdv", 128) is None
    monkeypatch.setitem(ts.MAXNREG, "bwd_dkdv", {128: 200})
    assert cfg.registers("bwd_dkdv", 128) == 200 and cfg.registers("bwd_dkdv", 96) == 200  # bucket 128
    assert cfg.registers("bwd_dkdv", 256) is None and cfg.registers("bwd_dkdv", 64) is None  # other buckets
    assert ts.TritonShortConfig().registers("fwd", 128) == ts.MAXNREG["fwd"][128]  # the default table
    # own tile sizes without a cap: uncapped (the default cap belongs to the default tiles)
    assert ts.TritonShortConfig(fwd=(128, 64, 8, 2)).registers("fwd", 128) is None
    assert ts.TritonShortConfig(fwd=(128, 64, 8, 2), maxnreg=(("fwd", 200),)).registers("fwd", 128) == 200
    assert (
        ts.TritonShortConfig(maxnreg=(("bwd_dkdv", 64),)).registers("bwd_dkdv", 128) == 64
    )  # own beats default
    for bad, match in (
        ('{"maxnreg": {"fwd": 300}}', "32..255"),
        ('{"maxnreg": {"fwd": true}}', "32..255"),
        ('{"maxnreg": {"fwd": 16}}', "32..255"),
        ('{"maxnreg": {"bwd": 128}}', "unknown kernel"),
        ('{"maxnreg": [128]}', "must be an object"),
    ):
        with pytest.raises(ValueError, match=match):
            ts.TritonShortConfig.from_json(bad)
    with pytest.raises(ValueError, match="given twice"):
        ts.TritonShortConfig(maxnreg=(("fwd", 128), ("fwd", 160)))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert ts._launch_opts(4, 3, cuda, 168) == {"num_warps": 4, "num_stages": 3, "maxnreg": 168}
    assert ts._launch_opts(4, 3, cuda) == {"num_warps": 4, "num_stages": 3}
    assert ts._launch_opts(4, 3, cpu, 168) == {}


def test_maxnreg_reaches_every_kernel_launch(monkeypatch):
    """Each kernel launches with its own cap (a spy on the launch options), and the results stay those of the
    uncapped run (the interpreter ignores the cap: this checks the plumbing; bitwise equality of the compiled
    kernels is the GPU test's)."""
    seen = []
    real = ts._launch_opts

    def spy(warps, stages, device, maxnreg=None):
        seen.append(maxnreg)
        return real(warps, stages, device, maxnreg)

    monkeypatch.setattr(ts, "_launch_opts", spy)
    q, k, v, dout, cu_q, cu_k = _inputs([5, 17, 3], None, 4, 2, 32, torch.float32, seed=3)
    runs = []
    for cfg in (
        ts.TritonShortConfig(),
        ts.TritonShortConfig(maxnreg=(("fwd", 168), ("bwd_dkdv", 200), ("bwd_dq", 128))),
    ):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, _ = ts.triton_short_attention(*leaves, cu_q, cu_k, causal=True, config=cfg)
        out.backward(dout)
        runs.append([out.detach(), *(t.grad for t in leaves)])
    # forward, then dQ (delta on the way), then dK/dV; D = 32 is the 64 bucket, where MAXNREG has no default
    assert seen == [None, None, None, 168, 128, 200]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_dp_first_config_flag():
    cfg = ts.TritonShortConfig.from_json('{"dp_first": false}')
    assert cfg.dp_first is False and ts.TritonShortConfig().dp_first is True  # default: dP first
    assert json.loads(cfg.to_json())["dp_first"] is False
    assert ts.TritonShortConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="dp_first must be true or false"):
        ts.TritonShortConfig.from_json('{"dp_first": 1}')


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_dp_first_on_and_off_give_bitwise_equal_results(pack):
    """dP issued before or after the softmax changes the order of independent instructions only: every output and
    gradient bitwise equal (documents of 1 token, documents crossing tiles, a GQA group of 2); exactness against
    the reference is the module's other tests' (the default is dP first)."""
    q, k, v, dout, cu_q, cu_k = _inputs([1, 29, 3, 40, 7], None, 4, 2, 32, torch.bfloat16, seed=5)
    runs = []
    for dp_first in (True, False):
        cfg = ts.TritonShortConfig(pack_gqa=pack, dp_first=dp_first)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = ts.triton_short_attention(*leaves, cu_q, cu_k, causal=True, config=cfg)
        out.backward(dout)
        runs.append([out.detach(), lse, *(t.grad for t in leaves)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert runs[0][2].abs().sum() > 0  # gradients reached q: not a trivially equal zero


# -- fused table builds (two Triton launches instead of ~65 PyTorch ops per call) ---------------------------


def _random_lengths(gen, n, hi, zero_share=0.2):
    lens = torch.randint(1, hi + 1, (n,), generator=gen)
    return torch.where(torch.rand(n, generator=gen) < zero_share, 0, lens).tolist()


@pytest.mark.parametrize("seed", range(4))
def test_fused_tables_equal_the_pytorch_build(seed):
    """Every per-token and per-tile table of the fused launches equals the PyTorch build, integer for integer:
    zero-length documents, one-token ones, q != k lengths, causal / windowed / full masks, given or searched
    document ids, tile sizes 2..64 and loop steps not dividing them."""
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 24, (1,), generator=gen))
    lens_q = _random_lengths(gen, n, 20)
    lens_k = lens_q if seed % 2 == 0 else _random_lengths(gen, n, 20)
    if sum(lens_q) == 0 or sum(lens_k) == 0:
        lens_q, lens_k = [3, *lens_q], [3, *lens_k]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = (
        cu_q
        if lens_k is lens_q
        else torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    )
    tq, tk = sum(lens_q), sum(lens_k)
    for causal, window in (
        (True, (-1, 0)),
        (True, (5, 0)),
        (False, (-1, -1)),
        (False, (3, 7)),
        (False, (0, -1)),
    ):
        kw = dict(causal=causal, window_size=window)
        want = ts.TritonShortTables.build(cu_q, cu_k, tq, tk, **kw, fused=False)
        for given in (None, VarlenMeta(cu_q, None, tq, total_q=tq).seq_idx().reshape(-1)):
            got = ts.TritonShortTables.build(cu_q, cu_k, tq, tk, **kw, doc_q=given, fused=True)
            assert got.fused and not want.fused
            for name in ("doc_q", "doc_k", "lim", "key_lo", "key_hi", "query_lo", "query_hi"):
                a, b = getattr(got, name), getattr(want, name)
                assert a.dtype == b.dtype and torch.equal(a, b), (name, causal, window, a, b)
            for side in ("q", "k"):
                for block, step in ((2, 1), (4, 3), (16, 5), (64, 32)):
                    fused = got.launch_tables(side, block, step, mask_free=True)
                    plain = want.launch_tables(side, block, step, mask_free=True)
                    for what, a, b in zip(("lo", "hi", "full_lo", "full_hi"), fused, plain):
                        assert torch.equal(a, b), (side, block, step, what, causal, window)
                    assert got.launch_tables(side, block, step, mask_free=False)[2] is fused[0]  # not read


def test_fused_tables_negative_control_and_default():
    """The comparison above can fail: a fused build of other boundaries differs; and the fused build is the
    default where the kernels run (here: the interpreter), the PyTorch one is kept as the reference."""
    cu = torch.tensor([0, 5, 5, 12, 20], dtype=torch.int32)
    other = torch.tensor([0, 6, 6, 12, 20], dtype=torch.int32)
    kw = dict(causal=True, window_size=(-1, 0))
    assert ts.TritonShortTables.build(cu, cu, 20, 20, **kw).fused
    a = ts.TritonShortTables.build(cu, cu, 20, 20, **kw, fused=True)
    b = ts.TritonShortTables.build(other, other, 20, 20, **kw, fused=False)
    assert not torch.equal(a.key_lo, b.key_lo) and not torch.equal(a.doc_q, b.doc_q)
    assert not torch.equal(a.launch_tables("q", 4, 4, True)[0], b.launch_tables("q", 4, 4, True)[0])


def test_mask_free_and_masked_only_agree_bitwise():
    """Loop 2 does the same arithmetic as the masked loop on a tile where the mask keeps everything."""
    lens = [200, 7, 1, 1, 40]
    q, k, v, dout, cu, _ = _inputs(lens, None, 4, 2, 16, torch.float32)
    on, off = (
        _run(q, k, v, dout, cu, cu, True, (-1, -1), config=ts.TritonShortConfig(**CFG_B, mask_free=mf))
        for mf in (True, False)
    )
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), on, off):
        assert torch.equal(a, b), name


def test_shared_and_full_tile_tables_hand_computed():
    """Documents [40, 8, 100] (A = [0, 40), B = [40, 48), C = [48, 148)), causal, 16-row tiles, Tq = 148: the
    last tile has 12 padded rows, which must not empty its range."""
    cu = torch.tensor([0, 40, 48, 148], dtype=torch.int32)
    tables = ts.TritonShortTables.build(cu, cu, 148, 148, causal=True, window_size=(-1, 0))
    big = ts._BIG
    lo, hi = tables.query_tiles_shared(16)  # keys every query of the tile sees: [doc start, first query + 1)
    assert lo.tolist() == [0, 0, big, 48, 48, 48, 48, 48, 48, 48]  # tile 2 holds A and B: empty
    assert hi.tolist() == [1, 17, 0, 49, 65, 81, 97, 113, 129, 145]
    tlo, thi = tables.query_tiles(16)
    assert tlo.tolist() == [0, 0, 0, 48, 48, 48, 48, 48, 48, 48]
    assert thi.tolist() == [16, 32, 48, 64, 80, 96, 112, 128, 144, 148]
    # key steps of 16 from the tile's lo: whole steps inside [lo, hi) of the shared range; none -> [hi, hi)
    lo, hi = tables.query_tiles_full(16, 16)
    assert lo.tolist() == [16, 0, 48, 64, 48, 48, 48, 48, 48, 48]
    assert hi.tolist() == [16, 16, 48, 64, 64, 80, 96, 112, 128, 144]  # last tile: [48, 144), then [144, 148)
    lo, hi = tables.query_tiles_full(16, 32)  # steps of 32 from lo: tile 4's 17 shared keys hold none
    assert lo.tolist() == [16, 32, 48, 64, 80, 48, 48, 48, 48, 48]
    assert hi.tolist() == [16, 32, 48, 64, 80, 80, 80, 112, 112, 144]
    # key tiles: queries that see every key of the tile = [last key, doc end)
    lo, hi = tables.key_tiles_shared(16)
    assert lo.tolist() == [15, 31, big, 63, 79, 95, 111, 127, 143, 147]
    assert hi.tolist() == [40, 40, 0, 148, 148, 148, 148, 148, 148, 148]
    lo, hi = tables.key_tiles_full(16, 16)  # query steps from key_tiles' lo [0, 16, 32, 48, ...]
    assert lo.tolist() == [16, 40, 48, 64, 80, 96, 112, 128, 148, 148]
    assert hi.tolist() == [32, 40, 48, 144, 144, 144, 144, 144, 148, 148]
    # a window of 20 keys: tile 5 (queries 80..95) sees [75, 81) in common, too few for a whole step
    windowed = ts.TritonShortTables.build(cu, cu, 148, 148, causal=True, window_size=(20, 0))
    lo, hi = windowed.query_tiles_shared(16)
    assert (lo[5].item(), hi[5].item()) == (75, 81)
    lo, hi = windowed.query_tiles_full(16, 16)
    assert torch.equal(lo, windowed.query_tiles(16)[1]) and torch.equal(hi, lo)  # no mask-free tile anywhere


@pytest.mark.parametrize("mask_free", [True, False], ids=["mask-free", "masked-only"])
def test_negative_control_mask_free_loop_reads_no_document_ids(mask_free):
    """Corrupt the document ids of tokens that a kernel visits only in mask-free tiles: with the mask-free
    split those rows keep the exact result (loop 2 is taken and reads no id); masked-only, they change. Rows
    whose masked tiles read the corrupted ids change either way (the corruption is real)."""
    # query tiles 1-5 (rows 16..95) see keys 0..15 mask-free; key tiles 0-1 see queries 32..47
    lens = [100, 20]
    q, k, v, dout, cu, _ = _inputs(lens, None, 2, 1, 16, torch.float32)
    tables = ts.TritonShortTables.build(cu, cu, 120, 120, causal=True, window_size=(-1, 0))
    lo, hi = tables.query_tiles_full(16, 16)
    assert lo[1:6].tolist() == [0] * 5 and min(hi[1:6].tolist()) >= 16
    lo, hi = tables.key_tiles_full(16, 16)
    assert max(lo[:2].tolist()) <= 32 and min(hi[:2].tolist()) >= 48
    bad_k, bad_q = tables.doc_k.clone(), tables.doc_q.clone()
    bad_k[:16] = 7  # no document 7
    bad_q[32:48] = 7
    leaky_k = dataclasses.replace(tables, doc_k=bad_k, _tiles={}, _full_tiles={})
    leaky_q = dataclasses.replace(tables, doc_q=bad_q, _tiles={}, _full_tiles={})
    cfg = ts.TritonShortConfig(mask_free=mask_free)
    args = (True, (-1, 0), 0.25, cfg)
    with torch.no_grad():
        out, lse = ts._forward(q, k, v, tables, *args)
        out_k = ts._forward(q, k, v, leaky_k, *args)[0]
        dq, dk, dv = ts._backward(dout, q, k, v, out, lse, tables, *args)
        # same out / lse: only the dQ kernel's reads differ
        dq_k = ts._backward(dout, q, k, v, out, lse, leaky_k, *args)[0]
        _, dk_q, dv_q = ts._backward(dout, q, k, v, out, lse, leaky_q, *args)

    def diff(a, b):
        return (a - b).abs().max().item()

    assert diff(out_k[:16], out[:16]) > 1e-2 and diff(dq_k[:16], dq[:16]) > 1e-2  # diagonal tiles: masked
    assert diff(dk_q[32:48], dk[32:48]) > 1e-2 and diff(dv_q[32:48], dv[32:48]) > 1e-2
    pairs = [(out_k[16:96], out[16:96]), (dq_k[16:96], dq[16:96]), (dk_q[:32], dk[:32]), (dv_q[:32], dv[:32])]
    for name, (bad, good) in zip(("out", "dq", "dk", "dv"), pairs):
        if mask_free:
            assert torch.equal(bad, good), name
        else:
            assert diff(bad, good) > 1e-2, name


LOW_PRECISION_CASES = [
    pytest.param([1, 1, 9, 1, 22, 3, 1, 10], None, True, (-1, -1), 4, 2, 32, id="short-docs-gqa"),
    pytest.param([37], None, True, (-1, -1), 2, 1, 16, id="one-doc"),
    pytest.param([9, 30, 6], None, True, (5, -1), 2, 2, 16, id="window"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("lens_q,lens_k,causal,window,h,hkv,d", LOW_PRECISION_CASES)
def test_low_precision_fp32_truth_rule(lens_q, lens_k, causal, window, h, hkv, d, dtype):
    q, k, v, dout, cu_q, cu_k = _inputs(lens_q, lens_k, h, hkv, d, dtype)
    got = _run(q, k, v, dout, cu_q, cu_k, causal, window)
    got = (got[0], *got[2:])
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    truth = _reference(q32, k32, v32, dout.float(), cu_q, cu_k, causal, window)
    plain = _reference(q, k, v, dout, cu_q, cu_k, causal, window, upcast=False)
    assert got[0].dtype == dtype
    for i, what in enumerate(("out", "dq", "dk", "dv")):
        _check_fp32_truth(f"triton_short {what}", got[i], truth[i], plain[i], dtype, 2 if i == 0 else 3)


def test_through_varlen_attention_with_meta_reuses_the_tables():
    """The public entry point with the batch's VarlenMeta: same result as the reference, and the per-batch
    tables are built once and reused by a second layer."""
    lens = [3, 17, 1, 12, 6]
    q, k, v, dout, cu, _ = _inputs(lens, None, 4, 2, 16, torch.float32)
    meta = VarlenMeta.from_lengths(lens)
    out = varlen_attention(q, k, v, meta=meta, backend="triton_short")
    want = reference_varlen_attention(q, k, v, cu, cu)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    built = []
    real_build = ts.TritonShortTables.build

    def counting_build(*args, **kwargs):
        built.append(1)
        return real_build(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ts.TritonShortTables, "build", counting_build)
        again = varlen_attention(q, k, v, meta=meta, backend="triton_short")
    assert built == [] and torch.equal(again, out)
    torch.autograd.grad(out, (q, k, v), dout)  # the backward runs through the memoised tables too


def test_tiles_skip_keys_outside_their_documents():
    """The per-tile key range covers exactly the documents of the tile (so a tile of short documents visits
    one or two key tiles, not the row): here 16-token query tiles over documents of 8 tokens."""
    lens = [8] * 8
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    tables = ts.TritonShortTables.build(cu, cu, 64, 64, causal=True, window_size=(-1, 0))
    lo, hi = tables.query_tiles(16)
    assert lo.tolist() == [0, 16, 32, 48] and hi.tolist() == [16, 32, 48, 64]
    lo, hi = tables.key_tiles(16)  # the queries that see each key tile: the same documents
    assert lo.tolist() == [0, 16, 32, 48] and hi.tolist() == [16, 32, 48, 64]
    tables = ts.TritonShortTables.build(cu, cu, 64, 64, causal=True, window_size=(2, 0))
    lo, hi = tables.query_tiles(16)
    assert lo.tolist() == [0, 16, 32, 48] and hi.tolist() == [16, 32, 48, 64]


def test_negative_control_document_ids_all_zero_differs():
    """With the per-token document ids forced to one document, the same kernels attend across samples and
    the result differs from the per-document reference (so the comparisons above can fail); the first
    document, which sees no other sample either way, still agrees."""
    lens = [5, 13, 18, 3, 9]
    q, k, v, dout, cu, _ = _inputs(lens, None, 2, 1, 16, torch.float32)
    tables = ts.TritonShortTables.build(cu, cu, sum(lens), sum(lens), causal=True, window_size=(-1, 0))
    one = torch.tensor([0, sum(lens)], dtype=torch.int32)
    leaky = ts.TritonShortTables.build(one, one, sum(lens), sum(lens), causal=True, window_size=(-1, 0))
    assert not leaky.doc_q.any() and not leaky.doc_k.any()  # every token in document 0
    good = ts._TritonShortFunction.apply(q, k, v, tables, True, (-1, 0), 0.25, None)[0]
    bad = ts._TritonShortFunction.apply(q, k, v, leaky, True, (-1, 0), 0.25, None)[0]
    want = reference_varlen_attention(q, k, v, cu, cu, softmax_scale=0.25)
    torch.testing.assert_close(good, want, rtol=1e-5, atol=1e-5)
    assert (bad - want).abs().max().item() > 1e-2
    torch.testing.assert_close(bad[:5], want[:5], rtol=1e-5, atol=1e-5)


def test_declared_limits_and_cpu_without_interpreter(monkeypatch):
    q, k, v, _, cu, _ = _inputs([4, 3], None, 2, 2, 16, torch.float32)
    with pytest.raises(BackendUnavailableError, match="softcap=2.0 not supported"):
        varlen_attention(q, k, v, cu, cu, 4, 4, softcap=2.0, backend="triton_short")
    assert available_backends("cpu", torch.float32)["triton_short"][0]
    ok, reason = available_backends("cuda", torch.float32)["triton_short"]
    assert not ok
    monkeypatch.setattr(
        ts, "_triton_interpreted", lambda: False
    )  # as in a process that imported triton compiled
    ok, reason = available_backends("cpu", torch.float32)["triton_short"]
    assert not ok and "TRITON_INTERPRET=1" in reason
    with pytest.raises(BackendUnavailableError, match="only under Triton's interpreter"):
        varlen_attention(q, k, v, cu, cu, 4, 4, backend="triton_short")
    assert BACKENDS["triton_short"].capabilities.backward


def test_softmax_scale_default_is_inverse_sqrt_d():
    lens = [6, 10]
    q, k, v, _, cu, _ = _inputs(lens, None, 2, 2, 16, torch.float32)
    out, _ = ts.triton_short_attention(q, k, v, cu, cu)
    want = reference_varlen_attention(q, k, v, cu, cu, softmax_scale=1 / math.sqrt(16))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_custom_op_native_backward_matches_the_autograd_function():
    """Through ``varpack::varlen_attention`` (the torch.compile path) the backend runs its own backward kernel
    on the forward's lse: same output and gradients as the autograd.Function path."""
    from varpack.attn.custom_op import op_backward_kind, varlen_attention_op

    assert op_backward_kind("triton_short") == "native"
    lens = [3, 17, 1, 12]
    q, k, v, dout, cu, _ = _inputs(lens, None, 4, 2, 16, torch.float32)
    got = varlen_attention_op(q, k, v, cu, cu, 17, 17, backend="triton_short")
    want = varlen_attention(q, k, v, cu, cu, 17, 17, backend="triton_short")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# -- launch configurations (tuned on the H200 without editing code) ---------------------------------------------


def test_config_from_env_json_and_validation(monkeypatch):
    assert ts.active_config() == ts.TritonShortConfig()  # unset: BLOCKS decides
    assert ts.active_config().blocks("fwd", 16) == SMALL_BLOCKS["fwd"][256]
    monkeypatch.setenv(ts.CONFIG_ENV, '{"fwd": [32, 16, 2, 3], "bwd_dq": {"BLOCK_M": 16, "BLOCK_N": 32, '
                       '"num_warps": 4, "num_stages": 1}}')  # fmt: skip
    cfg = ts.active_config()
    assert cfg.blocks("fwd", 128) == (32, 16, 2, 3) and cfg.blocks("bwd_dq", 64) == (16, 32, 4, 1)
    assert cfg.blocks("bwd_dkdv", 16) == SMALL_BLOCKS["bwd_dkdv"][256]  # left out: BLOCKS
    assert ts.TritonShortConfig.from_json(cfg.to_json()) == cfg
    assert cfg.mask_free and json.loads(cfg.to_json())["mask_free"] is True  # default: on
    monkeypatch.setenv(ts.CONFIG_ENV, '{"mask_free": false, "fwd": [32, 16, 2, 3]}')
    off = ts.active_config()
    assert off == ts.TritonShortConfig(fwd=(32, 16, 2, 3), mask_free=False)
    assert ts.TritonShortConfig.from_json(off.to_json()) == off
    explicit = ts.TritonShortConfig(fwd=(64, 64, 4, 2))
    assert ts.active_config(explicit) is explicit  # an argument wins over the variable
    assert json.loads(ts.TritonShortConfig().to_json())["pack_gqa"] is None  # default: by group size
    for value in (True, False, None):
        monkeypatch.setenv(ts.CONFIG_ENV, json.dumps({"pack_gqa": value}))
        assert ts.active_config() == ts.TritonShortConfig(pack_gqa=value)
        assert ts.TritonShortConfig.from_json(ts.active_config().to_json()) == ts.active_config()
    for bad, match in [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"bwd": [16, 16, 4, 1]}', "unknown kernel"),
        ('{"fwd": [24, 16, 4, 1]}', "power of two"),
        ('{"fwd": [16, 8, 4, 1]}', "power of two"),
        ('{"fwd": [16, 16, 3, 1]}', "num_warps"),
        ('{"fwd": [16, 16, 4, 0]}', "num_stages"),
        ('{"fwd": [16, 16, 4]}', "BLOCK_M, BLOCK_N"),
        ('{"fwd": {"BLOCK_M": 16}}', "exactly the keys"),
        ('{"mask_free": 1}', "mask_free must be true or false"),
        ('{"mask_free": "false"}', "mask_free must be true or false"),
        ('{"mask_free": null}', "mask_free must be true or false"),
        ('{"pack_gqa": 1}', "pack_gqa must be true, false or null"),
        ('{"pack_gqa": "auto"}', "pack_gqa must be true, false or null"),
        ('{"fwd": [16.9, 16, 4, 1]}', "integers"),  # never truncated to 16
        ('{"fwd": [true, 16, 4, 1]}', "integers"),
        ('{"fwd": "16161"}', "integers"),
    ]:
        monkeypatch.setenv(ts.CONFIG_ENV, bad)
        with pytest.raises(ValueError, match=match) as err:
            ts.active_config()
        assert ts.CONFIG_ENV in str(err.value)  # names the variable a user set (and the field, by match)
    q, k, v, _, cu, _ = _inputs([4, 3], None, 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="triton_short config"):  # a bad override is an error, never ignored
        ts.triton_short_attention(q, k, v, cu, cu)


@pytest.mark.parametrize("how", ["argument", "env"])
def test_config_override_is_used_and_exact(monkeypatch, how):
    """Other tile shapes (32-token query tiles, 16-token key tiles and the reverse for dK/dV) give the same
    results, and the launches really use them (the per-tile tables are built for those tile sizes)."""
    lens = [5, 13, 18, 3, 9, 1, 30]
    q, k, v, dout, cu, _ = _inputs(lens, None, 4, 2, 16, torch.float32)
    cfg = ts.TritonShortConfig(  # unpacked: a query tile is BLOCK_M tokens (short documents pack from G = 2)
        fwd=(32, 16, 4, 1), bwd_dkdv=(16, 32, 4, 1), bwd_dq=(32, 16, 4, 1), pack_gqa=False
    )
    if how == "env":
        monkeypatch.setenv(ts.CONFIG_ENV, cfg.to_json())
    tables = ts.TritonShortTables.build(cu, cu, sum(lens), sum(lens), causal=True, window_size=(-1, 0))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ts, "_tables", lambda *a, **kw: tables)
        out, _ = ts.triton_short_attention(q, k, v, cu, cu, config=cfg if how == "argument" else None)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert tables.fused  # the default where the kernels run: one launch per tile size
    assert set(tables._tiles) == {("q", 32), ("k", 32)}
    assert set(tables._full_tiles) == {("q_launch", 32, 16), ("k_launch", 32, 16)}  # row order: no tile order
    want = _reference(q, k, v, dout, cu, cu, True, (-1, -1))
    for g, w in zip((out, dq, dk, dv), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=2e-5)
