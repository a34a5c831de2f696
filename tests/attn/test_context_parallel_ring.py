"""Ring attention's block math and custom backward, on one rank (a group of one: no communication), against
the reference varlen attention: forward and every input gradient, GQA, causal / non-causal, sliding window;
the block mask against the reference's per-segment mask. The multi-rank ring runs in
tests/train/test_context_parallel_gloo.py."""

from __future__ import annotations

import pytest
import torch

from varpack.attn import context_parallel as cpa
from varpack.attn import reference_varlen_attention, segment_mask
from varpack.attn.context_parallel import _block_mask, _ring_plan, ring_attention
from varpack.varlen import VarlenMeta
from varpack.varlen.shard import ContextParallelShard

LENGTHS = [5, 1, 9, 3, 7]


@pytest.mark.parametrize(
    ("causal", "window"), [(True, (-1, -1)), (False, (-1, -1)), (True, (2, 0)), (False, (1, 2))]
)
def test_block_mask_is_the_block_diagonal_of_the_segment_masks(causal, window):
    meta = VarlenMeta.from_lengths(LENGTHS)
    pos = torch.arange(meta.total_q)
    doc = meta.seq_idx()[0].long()
    got = _block_mask(pos, doc, pos, doc, causal, window)
    want = torch.block_diag(*[segment_mask(n, n, causal=causal, window_size=window) for n in LENGTHS])
    assert torch.equal(got, want)


@pytest.mark.parametrize("tile", [1024, 3])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize(("causal", "window"), [(True, (-1, -1)), (False, (-1, -1)), (True, (3, 0))])
def test_one_rank_ring_equals_reference_forward_and_backward(
    heads, kv_heads, causal, window, tile, monkeypatch
):
    """``tile`` 3: query tiles that cut documents, each seeing only its documents' keys."""
    monkeypatch.setattr(cpa, "RING_QUERY_TILE", tile)
    g = torch.Generator().manual_seed(0)
    meta = VarlenMeta.from_lengths(LENGTHS)
    T, D = meta.total_q, 8
    q = torch.randn(T, heads, D, generator=g, dtype=torch.float64).requires_grad_()
    k = torch.randn(T, kv_heads, D, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(T, kv_heads, D, generator=g, dtype=torch.float64).requires_grad_()
    dout = torch.randn(T, heads, D, generator=g, dtype=torch.float64)
    shard = ContextParallelShard.from_offsets(meta.host_offsets()[0], 1, 0).bind(object(), "ring")
    out = ring_attention(q, k, v, meta=meta, shard=shard, causal=causal, window_size=window)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = reference_varlen_attention(
        q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_k, causal=causal, window_size=window, meta=meta
    )
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    # the ring's blocks run in fp32: tolerance of fp32 against the fp64 reference, relative to each scale
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    for a, b in zip(grads, ref_grads):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_ring_refusals():
    meta = VarlenMeta.from_lengths([4, 4])
    shard = ContextParallelShard.from_offsets([0, 4, 8], 1, 0)
    q = torch.randn(8, 2, 4)
    with pytest.raises(ValueError, match="not bound to a process group"):
        ring_attention(q, q, q, meta=meta, shard=shard)
    with pytest.raises(ValueError, match="does not implement softcap=30"):
        ring_attention(q, q, q, meta=meta, shard=shard.bind(object(), "ring"), softcap=30.0)


def test_tiles_skip_what_no_document_of_theirs_can_see(monkeypatch):
    """Tiles of 4 queries over documents [5, 1, 9, 3, 7], one rank: each tile's keys run from its first
    query's document start to its last query (causal) or to that document's end (non-causal)."""
    monkeypatch.setattr(cpa, "RING_QUERY_TILE", 4)
    meta = VarlenMeta.from_lengths(LENGTHS)
    shard = ContextParallelShard.from_offsets(meta.host_offsets()[0], 1, 0)
    assert _ring_plan(shard, meta, True)["tiles"][0] == [
        (0, 4, 0, 4), (4, 8, 0, 8), (8, 12, 6, 12), (12, 16, 6, 16), (16, 20, 15, 20), (20, 24, 18, 24),
        (24, 25, 18, 25),
    ]  # fmt: skip
    assert _ring_plan(shard, meta, False)["tiles"][0][1] == (4, 8, 0, 15)
