"""StaticShape + PaddingFreeCollator(static_shape=...): identical shapes for every pack, pad segments of at least
one token (never zero-length), pad tokens unsupervised, real tokens untouched, loud errors for packs that do not
fit (CUDA graphs need static shapes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from varpack.collate import PaddingFreeCollator, StaticShape
from varpack.plan import plan_packs
from varpack.schema import IGNORE_INDEX
from varpack.varlen import validate_cu_seqlens

PAD = 3


def sample(sid, n, seed=0, loss_scale=False):
    rng = np.random.default_rng(seed * 1000 + sid)
    ids = rng.integers(10, 1000, n).tolist()
    labels = [-100] + [t if rng.random() < 0.6 else -100 for t in ids[1:]]
    out = {"input_ids": ids, "labels": labels, "length": n, "sample_id": sid}
    if loss_scale:
        out["loss_scale"] = rng.random(n).astype(np.float32).tolist()
    return out


def pack(lengths, first_id=0, **kw):
    return [sample(first_id + i, n, **kw) for i, n in enumerate(lengths)]


# -- the shape ----------------------------------------------------------------------------------------------
def test_for_packing_holds_the_worst_packs():
    shape = StaticShape.for_packing(100, max_samples=7, multiple_of=16)
    assert shape == StaticShape(tokens=112, segments=8, max_seqlen=105)
    # the worst cases within the bounds all fit, every pad segment >= 1 token and <= max_seqlen
    for lengths in ([100], [1], [1] * 7, [94, 1, 1, 1, 1, 1, 1], [50, 50], [14] * 7):
        pads = shape.pad_lengths(lengths)
        assert len(lengths) + len(pads) == shape.segments
        assert sum(lengths) + pads.sum() == shape.tokens
        assert pads.min() >= 1 and pads.max() <= shape.max_seqlen, (lengths, pads)
    # max_seqlen: 7 one-token samples leave 105 pad tokens for one pad segment
    assert StaticShape.for_packing(100, max_samples=1, multiple_of=8).max_seqlen == 103
    assert StaticShape.for_packing(96, max_samples=32, multiple_of=128).max_seqlen == 96
    with pytest.raises(ValueError, match="max_seqlen=50 is below 105"):
        StaticShape.for_packing(100, max_samples=7, multiple_of=16, max_seqlen=50)


def test_pad_tokens_split_evenly_over_the_pad_segments():
    shape = StaticShape(tokens=20, segments=5, max_seqlen=20)
    assert shape.pad_lengths([3, 4]).tolist() == [5, 4, 4]  # 13 pad tokens over 3 segments
    assert shape.pad_lengths([4, 4, 4, 4]).tolist() == [4]
    assert shape.pad_lengths([4, 4, 4, 4, 4]).tolist() == []  # exactly full: no pad segment needed


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([1] * 6, r"more samples than segments=5"),
        ([15, 6], r"more tokens than tokens=20"),
        ([11, 1], r"sample #0 has 11 tokens, more than max_seqlen=10"),
        ([10, 9], r"3 pad segments of at least one token need 3 pad tokens, only 1 are left"),
        ([4, 4, 4, 4, 3], r"1 pad tokens need a pad segment but all 5 segments hold samples"),
        ([4, 4, 4, 4], None),  # fits (control)
    ],
)
def test_pad_lengths_refuses_what_does_not_fit(lengths, message):
    shape = StaticShape(tokens=20, segments=5, max_seqlen=10)
    if message is None:
        assert shape.pad_lengths(lengths).tolist() == [4]
        return
    with pytest.raises(ValueError, match=message):
        shape.pad_lengths(lengths)


def test_exactly_full_row_with_missing_segments_is_refused():
    with pytest.raises(ValueError, match="fills tokens=8 exactly but needs 2 more segments"):
        StaticShape(tokens=8, segments=3, max_seqlen=8).pad_lengths([8])


def test_a_pad_segment_longer_than_max_seqlen_is_refused():
    with pytest.raises(ValueError, match="make a segment of 15 tokens, more than max_seqlen=8"):
        StaticShape(tokens=16, segments=2, max_seqlen=8).pad_lengths([1])
    assert StaticShape(tokens=16, segments=3, max_seqlen=8).pad_lengths([1]).tolist() == [8, 7]


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"tokens": 0, "segments": 1, "max_seqlen": 1}, ValueError, "tokens must be >= 1"),
        ({"tokens": 8, "segments": 9, "max_seqlen": 8}, ValueError, "segments=9 > tokens=8"),
        ({"tokens": 8, "segments": 2, "max_seqlen": 9}, ValueError, "max_seqlen=9 > tokens=8"),
        ({"tokens": 8, "segments": 2, "max_seqlen": 3}, ValueError, "cannot hold 8 tokens"),
        ({"tokens": 8.0, "segments": 2, "max_seqlen": 4}, TypeError, "tokens must be a positive int"),
        ({"tokens": 8, "segments": True, "max_seqlen": 4}, TypeError, "segments must be a positive int"),
        ({"tokens": 2**31, "segments": 2, "max_seqlen": 2**30}, ValueError, "int32"),
    ],
)
def test_shape_validation(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        StaticShape(**kwargs)


def test_from_plan_is_the_tightest_shape_holding_every_pack():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, 300)
    plan = plan_packs(lengths, 512)
    shape = StaticShape.from_plan(plan, multiple_of=8)
    counts = [len(p) for p in plan.packs]
    assert shape.segments == max(counts) + 1 and shape.tokens % 8 == 0
    assert shape.tokens <= 512 + max(counts) + 8
    for p in plan.packs:
        pads = shape.pad_lengths(lengths[p])
        assert len(p) + len(pads) == shape.segments and pads.min() >= 1
        assert max(lengths[p].max(), pads.max()) <= shape.max_seqlen
    # one multiple smaller would not hold some pack (tight), unless the rounding made room
    need = max(int(lengths[p].sum()) + shape.segments - len(p) for p in plan.packs)
    assert shape.tokens - 8 < need
    # a given bucket: at least the largest pack's sample count (+ 1 when it has pad tokens)
    assert StaticShape.from_plan(plan, segments=shape.segments + 5).segments == shape.segments + 5
    with pytest.raises(ValueError, match=r"pack \d+ holds \d+ samples, more than segments="):
        StaticShape.from_plan(plan, segments=max(counts) - 1)


# -- the collator ---------------------------------------------------------------------------------------------
SHAPE = StaticShape(tokens=32, segments=6, max_seqlen=20)
PACKS = [[5, 1, 7, 4], [16, 9], [2, 3, 2, 3, 2], [13], [16, 12, 1], [20, 3, 3, 3]]


@pytest.mark.parametrize("loss_scale", [False, True])
def test_every_pack_gets_the_same_shapes(loss_scale):
    collate = PaddingFreeCollator(static_shape=SHAPE, pad_token_id=PAD)
    shapes = set()
    for i, lengths in enumerate(PACKS):
        batch = collate([pack(lengths, 10 * i, loss_scale=loss_scale)])
        meta = batch["varlen_meta"]
        shapes.add(
            tuple(
                (k, tuple(v.shape), v.dtype) for k, v in sorted(batch.items()) if isinstance(v, torch.Tensor)
            )
            + (
                (
                    batch["max_length_q"],
                    batch["max_length_k"],
                    meta.max_seqlen_q,
                    meta.num_seqs,
                    meta.total_q,
                ),
            )
        )
        assert meta.has_empty is False  # never a zero-length segment
    assert len(shapes) == 1, shapes
    (only,) = shapes
    assert only[-1] == (20, 20, 20, 6, 32)
    assert dict((k, s) for k, s, _ in only[:-1])["cu_seq_lens_q"] == (7,)


def test_pad_segments_are_unsupervised_restarting_and_after_the_samples():
    lengths = [5, 1, 7, 4]  # 17 real tokens, 15 pad tokens over 2 pad segments: 8 + 7
    samples = pack(lengths, loss_scale=True)
    static = PaddingFreeCollator(static_shape=SHAPE, pad_token_id=PAD)([samples])
    dynamic = PaddingFreeCollator()([samples])
    t = sum(lengths)
    cu = static["cu_seq_lens_q"]
    validate_cu_seqlens(cu, 32)
    assert cu.tolist() == [0, 5, 6, 13, 17, 25, 32]
    # the real part is the dynamic batch, token for token
    for key in ("input_ids", "labels", "position_ids", "loss_scale", "seq_idx"):
        assert torch.equal(static[key][:, :t], dynamic[key]), key
    assert static["sample_ids"] == dynamic["sample_ids"] == [0, 1, 2, 3]
    # the pad: pad id, never supervised, zero weight, positions restart per pad segment, own seq_idx
    assert (static["input_ids"][0, t:] == PAD).all()
    assert (static["labels"][0, t:] == IGNORE_INDEX).all()
    assert (static["loss_scale"][0, t:] == 0).all()
    assert static["position_ids"][0, t:].tolist() == list(range(8)) + list(range(7))
    assert static["seq_idx"][0, t:].tolist() == [4] * 8 + [5] * 7
    # supervised count (num_items_in_batch) and the real token count (cu_seqlens[N]) see only the samples
    assert int((static["labels"] != -100).sum()) == int((dynamic["labels"] != -100).sum())
    assert int(cu[len(static["sample_ids"])]) == t


def test_batch_stats_count_real_tokens_only():
    from varpack.train.trainer import batch_stats

    samples = pack([5, 1, 7, 4])
    static = PaddingFreeCollator(static_shape=SHAPE)([samples])
    dynamic = PaddingFreeCollator()([samples])
    assert batch_stats(static, packs=1) == batch_stats(dynamic, packs=1)
    assert batch_stats(static, packs=1)["tokens"] == 17


def test_multi_plane_positions_restart_in_pad_segments():
    samples = pack([3, 4])
    for s in samples:
        n = len(s["input_ids"])
        s["position_ids"] = [list(range(n)), [7] * n, list(range(100, 100 + n)), [1] * n]
    batch = PaddingFreeCollator(static_shape=SHAPE, position_planes=4)([samples])
    pos = batch["position_ids"]
    assert pos.shape == (4, 1, 32)
    assert pos[1, 0, :7].tolist() == [7] * 7  # the samples' own planes
    assert torch.equal(pos[:, 0, 7:], pos[0:1, 0, 7:].expand(4, -1))  # pad: restarting on every plane
    assert pos[0, 0, 7:].tolist()[:7] == list(range(7))


def test_a_pack_that_does_not_fit_names_its_samples_and_drops_nothing():
    collate = PaddingFreeCollator(static_shape=SHAPE)
    with pytest.raises(
        ValueError, match=r"batch of 7 samples \(sample_id 40, 41, .*more samples than segments=6"
    ):
        collate([pack([1] * 7, 40)])
    with pytest.raises(ValueError, match=r"sample_id 50, 51\).*more tokens than tokens=32"):
        collate([pack([16, 17], 50)])
    with pytest.raises(ValueError, match=r"sample #1 has 21 tokens, more than max_seqlen=20"):
        collate([pack([3, 21], 60)])
    with pytest.raises(ValueError, match=r"3 pad segments of at least one token need 3 pad tokens, only 2"):
        collate([pack([16, 13, 1], 70)])


def test_static_shape_options_are_checked():
    with pytest.raises(ValueError, match="exclusive"):
        PaddingFreeCollator(static_shape=SHAPE, pad_to_multiple_of=8)
    with pytest.raises(TypeError, match="must be a varpack.collate.StaticShape"):
        PaddingFreeCollator(static_shape=(32, 6, 16))
    assert "static_shape=StaticShape(tokens=32" in repr(PaddingFreeCollator(static_shape=SHAPE))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=9), st.integers(1, 64))
def test_any_pack_within_the_bounds_gets_valid_static_boundaries(lengths, multiple_of):
    shape = StaticShape.for_packing(max(40, sum(lengths)), max_samples=9, multiple_of=multiple_of)
    batch = PaddingFreeCollator(static_shape=shape)([pack(lengths)])
    cu = batch["cu_seq_lens_q"]
    validate_cu_seqlens(cu, shape.tokens, max_seqlen=shape.max_seqlen, at_least=True)
    seg = np.diff(cu.numpy())
    assert cu.shape == (shape.segments + 1,) and seg.min() >= 1
    assert seg[: len(lengths)].tolist() == lengths
    assert batch["input_ids"].shape == (1, shape.tokens)


def test_default_rounding_scales_with_the_packing_length():
    """multiple_of not given: auto_multiple_of (a power of two <= 1/16 of the row, 8 to 64). Short packs are
    no longer rounded to 64 (128-token packs: 152-token rows, where a fixed 64 made 192 and padded a third of
    every step); from 1,024 tokens on the shape is the fixed-64 one, as measured on the GPU."""
    from varpack.collate.static import auto_multiple_of

    assert [auto_multiple_of(t) for t in (1, 130, 256, 600, 1024, 8320)] == [8, 8, 16, 32, 64, 64]
    rng = np.random.default_rng(0)
    for packing_length in (128, 256, 512, 1024, 8192):
        lengths = rng.integers(1, packing_length // 2, 400)
        plan = plan_packs(lengths, packing_length)
        auto, fixed = StaticShape.from_plan(plan), StaticShape.from_plan(plan, multiple_of=64)
        counts = np.diff(plan.offsets)
        need = max(int(lengths[p].sum()) + auto.segments - len(p) for p in plan.packs)
        assert auto.segments == int(counts.max()) + 1 and need <= auto.tokens < need + need / 16
        assert auto.tokens % auto_multiple_of(need) == 0
        if packing_length >= 1024:
            assert auto == fixed
        else:
            assert auto.pad_fraction(plan) < fixed.pad_fraction(plan)
        for p in plan.packs:  # every pack still fits
            assert len(auto.pad_lengths(lengths[p])) == auto.segments - len(p)
    plan = plan_packs(np.full(8, 128), 128)  # full 128-token packs: 129 tokens with the one pad segment
    assert StaticShape.from_plan(plan).tokens == 136 and StaticShape.from_plan(plan, multiple_of=64).tokens == 192
    # for_packing reads the same rule
    assert StaticShape.for_packing(128, max_samples=4).tokens == 136
    assert StaticShape.for_packing(8192, max_samples=92).tokens == StaticShape.for_packing(
        8192, max_samples=92, multiple_of=64
    ).tokens


# -- the linear-attention layout: pad segments as one sequence ------------------------------------------------
def _linear_chunks(lengths, tokens):
    pad = tokens - sum(lengths)
    return sum(-(-n // 64) for n in [*lengths, pad] if n)


def test_from_plan_bounds_every_packs_chunks_with_its_pad_as_one_sequence():
    """linear_chunks is the most 64-token chunks of any pack whose pad tokens form one sequence: reached by some
    pack, never exceeded; far below the chunks of the pad segments taken one by one (one chunk each)."""
    rng = np.random.default_rng(1)
    lengths = np.concatenate([rng.integers(1, 400, 120), rng.integers(1, 8, 200)])  # many tiny samples
    plan = plan_packs(lengths, 2048)
    shape = StaticShape.from_plan(plan)
    per_pack = [_linear_chunks(lengths[p].tolist(), shape.tokens) for p in plan.packs]
    assert shape.linear_chunks == max(per_pack)
    separate = max(sum(-(-n // 64) for n in [*lengths[p], *shape.pad_lengths(lengths[p])]) for p in plan.packs)
    assert shape.linear_chunks < separate
    for p in plan.packs:
        shape.check_linear_chunks(lengths[p])
    assert StaticShape.for_packing(512, max_samples=4).linear_chunks is None


def test_collator_gives_linear_offsets_with_the_pads_merged_and_refuses_a_row_beyond_the_bound():
    shape = StaticShape(tokens=200, segments=6, max_seqlen=200, linear_chunks=6)
    collate = PaddingFreeCollator(static_shape=shape, pad_token_id=PAD)
    batch = collate([pack([5, 70, 1])])  # 76 tokens, then 124 pad tokens in 3 pad segments
    meta = batch["varlen_meta"]
    cu = batch["cu_seq_lens_q"].tolist()
    assert len(cu) == 7 and cu[:4] == [0, 5, 75, 76]
    assert meta.cu_seqlens_linear.tolist() == [0, 5, 75, 76, 200, 200, 200]  # one pad sequence, then empty ones
    assert meta.linear_chunk_rows == 6  # 1 + 2 + 1 chunks of the samples and 2 of the pad: at the bound
    # 1 + 2 + 1 + 1 + 1 chunks of the samples and 2 of the pad: 8 > 6, named by its samples
    with pytest.raises(ValueError, match=r"sample_id 10, 11, 12, 13, 14.*holds 8 chunks of 64 tokens, more than linear_chunks=6"):
        collate([pack([60, 70, 1, 1, 1], 10)])
    loose = PaddingFreeCollator(static_shape=StaticShape(tokens=200, segments=6, max_seqlen=200), pad_token_id=PAD)
    one_pad = loose([pack([5, 70, 1, 1, 2], 30)])  # 5 samples, one pad segment: nothing to merge
    assert one_pad["varlen_meta"].cu_seqlens_linear.tolist() == one_pad["cu_seq_lens_q"].tolist()
    assert one_pad["varlen_meta"].linear_chunk_rows is None  # no bound given: the tables take max_chunks
    # a full row (no pad segment) carries the same fields: its own offsets, the shape's bound
    full = PaddingFreeCollator(static_shape=StaticShape(tokens=200, segments=2, max_seqlen=200, linear_chunks=4))
    meta = full([pack([100, 100], 40)])["varlen_meta"]
    assert meta.cu_seqlens_linear.tolist() == [0, 100, 200] and meta.linear_chunk_rows == 4
    assert PaddingFreeCollator()([pack([5, 7])])["varlen_meta"].cu_seqlens_linear is None  # dynamic rows: none


# -- zero-length pad segments (empty_pads) -------------------------------------------------------------------


def test_empty_pads_shape_is_the_longest_pack_itself():
    lengths = [30, 2, 25, 7, 32, 1, 1, 1, 20]
    plan = plan_packs(lengths, 32)
    with_pads, empty = StaticShape.from_plan(plan), StaticShape.from_plan(plan, empty_pads=True)
    assert empty.empty_pads and not with_pads.empty_pads
    assert empty.tokens == 32 < with_pads.tokens  # a full pack needs no token for its pad segment
    assert empty.segments == with_pads.segments and empty.max_seqlen <= with_pads.max_seqlen
    assert empty.pad_fraction(plan) < with_pads.pad_fraction(plan)
    for p in plan.packs:  # every pack of the plan fits
        pads = empty.pad_lengths([lengths[i] for i in p])
        assert pads.min(initial=0) >= 0 and pads.sum() + sum(lengths[i] for i in p) == 32
    assert StaticShape.for_packing(32, max_samples=6, multiple_of=8, empty_pads=True).tokens == 32
    assert StaticShape.for_packing(30, max_samples=6, multiple_of=8, empty_pads=True).tokens == 32
    assert StaticShape.for_packing(32, max_samples=6, multiple_of=8).tokens == 40
    assert empty.describe().endswith(", pad segments may be empty") and "empty" not in with_pads.describe()
    shape = f"T={with_pads.tokens} N={with_pads.segments} max_seqlen={with_pads.max_seqlen}"
    assert with_pads.describe(0.0061) == f"{shape} (pad 0.6%)" and with_pads.describe() == shape
    with pytest.raises(TypeError, match="empty_pads must be a bool"):
        StaticShape(tokens=8, segments=2, max_seqlen=8, empty_pads="yes")


def test_empty_pads_pad_lengths():
    shape = StaticShape(tokens=32, segments=5, max_seqlen=32, empty_pads=True)
    assert shape.pad_lengths([32]).tolist() == [0, 0, 0, 0]  # full: every pad segment zero-length
    assert shape.pad_lengths([30]).tolist() == [1, 1, 0, 0]  # fewer pad tokens than pad segments
    assert shape.pad_lengths([10, 10]).tolist() == [4, 4, 4]
    assert shape.pad_lengths([8, 8, 8, 8]).tolist() == [0]
    with pytest.raises(ValueError, match="more tokens than tokens=32"):
        shape.pad_lengths([20, 13])
    with pytest.raises(ValueError, match="all 5 segments hold samples"):
        shape.pad_lengths([1, 1, 1, 1, 1])
    # the same rows without empty_pads are refused: a pad segment needs a token
    with pytest.raises(ValueError, match="segments are never empty"):
        StaticShape(tokens=32, segments=5, max_seqlen=32).pad_lengths([32])


@pytest.mark.parametrize(
    "lengths, cu, linear",
    [
        ([16, 15, 1], [0, 16, 31, 32, 32, 32], [0, 16, 31, 32, 32, 32]),  # full: merged after the last sample
        ([32], [0, 32, 32, 32, 32, 32], [0, 32, 32, 32, 32, 32]),  # one sample, full
        ([30], [0, 30, 31, 32, 32, 32], [0, 30, 32, 32, 32, 32]),  # the 2 pad tokens as one linear sequence
        ([10, 10], [0, 10, 20, 24, 28, 32], [0, 10, 20, 32, 32, 32]),
    ],
)
def test_empty_pads_collated_row(lengths, cu, linear):
    shape = StaticShape(tokens=32, segments=5, max_seqlen=32, linear_chunks=4, empty_pads=True)
    batch = PaddingFreeCollator(static_shape=shape, pad_token_id=PAD)([pack(lengths)])
    assert batch["cu_seq_lens_q"].tolist() == cu and batch["input_ids"].shape == (1, 32)
    validate_cu_seqlens(batch["cu_seq_lens_q"], 32, max_seqlen=32, at_least=True, allow_empty=True)
    meta = batch["varlen_meta"]
    assert meta.cu_seqlens_linear.tolist() == linear and meta.has_empty == (0 in np.diff(cu))
    t = sum(lengths)
    assert batch["input_ids"][0, t:].eq(PAD).all() and batch["labels"][0, t:].eq(IGNORE_INDEX).all()
    positions, seq_idx = batch["position_ids"][0].tolist(), batch["seq_idx"][0].tolist()
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):  # positions restart and seq_idx counts every segment
        assert positions[a:b] == list(range(b - a)) and seq_idx[a:b] == [n] * (b - a)
