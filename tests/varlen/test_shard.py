"""The context-parallel split of a packed row (varpack.varlen.shard): zigzag / contiguous positions and the
ContextParallelShard that carries them."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from varpack.varlen.shard import ContextParallelShard, contiguous_split, split_row, zigzag_split


def _work(parts, offsets):
    """Causal attention work of each rank: for every query, the keys before it in its document (itself included)."""
    cu = np.asarray(offsets)
    starts = cu[np.searchsorted(cu, np.concatenate(parts), side="right") - 1]
    out, at = [], 0
    for p in parts:
        out.append(float((p - starts[at : at + len(p)] + 1).sum()))
        at += len(p)
    return np.array(out)


def test_zigzag_one_document_gives_each_rank_a_front_and_a_back_chunk():
    assert [p.tolist() for p in zigzag_split([0, 10], 2)] == [[0, 1, 2, 8, 9], [3, 4, 5, 6, 7]]
    assert [p.tolist() for p in zigzag_split([0, 8], 4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_every_position_once_in_row_order_and_token_counts_within_one(size):
    rng = np.random.default_rng(size)
    for _ in range(50):
        lengths = rng.integers(0, 40, size=rng.integers(1, 30))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        if offsets[-1] < size:
            continue
        parts = zigzag_split(offsets, size)
        assert sorted(np.concatenate(parts).tolist()) == list(range(int(offsets[-1])))
        assert all((np.diff(p) > 0).all() for p in parts)
        counts = [len(p) for p in parts]
        assert max(counts) - min(counts) <= 1, counts  # the extra tokens of each document go round the ranks


@pytest.mark.parametrize("size", [2, 4, 8])
def test_zigzag_balances_causal_work_where_contiguous_does_not(size):
    offsets = [0, 4000, 4100, 7000, 7003, 9000]  # long and short documents
    zig = _work(zigzag_split(offsets, size), offsets)
    cont = _work(contiguous_split(offsets, size), offsets)
    assert zig.max() / zig.mean() < 1.01, zig
    assert cont.max() / cont.mean() > 1.1, cont


def test_split_errors():
    with pytest.raises(ValueError, match="unknown context-parallel split 'stripes'"):
        split_row([0, 4], 2, "stripes")
    with pytest.raises(ValueError, match="never decrease"):
        zigzag_split([0, 5, 3], 2)
    with pytest.raises(ValueError, match="size must be an int >= 1"):
        zigzag_split([0, 4], 0)
    with pytest.raises(ValueError, match="3 tokens cannot be split over 4"):
        ContextParallelShard.from_offsets([0, 3], 4, 0)


def test_shard_views_inverse_and_take():
    shard = ContextParallelShard.from_offsets([0, 10, 13], 2, 1)
    assert shard.counts == (7, 6) and shard.num_local == 6 and shard.total == 13
    assert torch.equal(shard.order[shard.inverse()], torch.arange(13))
    assert torch.equal(torch.cat(shard.parts()), shard.order)
    x = torch.arange(13).reshape(1, 13) * 10
    assert torch.equal(shard.take(x), shard.index.reshape(1, -1) * 10)
    with pytest.raises(ValueError, match="the row 13"):
        shard.take(torch.zeros(1, 12))
    with pytest.raises(AttributeError, match="frozen"):
        shard.rank = 0


def test_shard_refuses_parts_that_are_not_the_row():
    with pytest.raises(ValueError, match="do not cover the row"):
        ContextParallelShard([[0, 1], [1, 2]], 0)
    with pytest.raises(ValueError, match="must increase"):
        ContextParallelShard([[1, 0], [2, 3]], 0)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        ContextParallelShard([[0], [1]], 2)


def test_shard_pickles_without_its_group_and_bind_shares_derived_values():
    shard = ContextParallelShard.from_offsets([0, 5, 9], 2, 0, full_input_ids=torch.arange(9))
    bound = shard.bind(object(), "ring")
    assert bound.group is not None and bound.attention == "ring" and shard.group is None
    assert bound.memo("k", lambda: 1) == 1 and shard.memo("k", lambda: 2) == 1  # one memo for both
    again = pickle.loads(pickle.dumps(bound))
    assert again.group is None and again.attention is None
    assert torch.equal(again.order, shard.order) and torch.equal(again.full_input_ids, torch.arange(9))
    assert again.rank == 0 and again.counts == shard.counts
