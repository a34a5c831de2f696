from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from varpack.plan import (
    STRATEGIES,
    STRATEGY_TABLE,
    PackPlan,
    Strategy,
    best_fit_decreasing,
    next_fit,
    plan_packs,
)
from varpack.plan import bfd as bfd_module
from varpack.plan.reference import naive_bfd, naive_next_fit, segment_tree_bfd

# ---------------------------------------------------------------------------------------------- helpers


def csr_to_lists(offsets: np.ndarray, items: np.ndarray) -> list[list[int]]:
    return [items[offsets[p] : offsets[p + 1]].tolist() for p in range(len(offsets) - 1)]


def bfd_both_paths(lengths, L: int) -> list[list[int]]:
    """best_fit_decreasing's bins, after checking that its two implementations of the class-wise step
    (Python lists for small inputs, numpy arrays for large ones) give the same CSR arrays."""
    arr = np.asarray(lengths, np.int64)
    offsets, items = best_fit_decreasing(arr, L)
    if arr.size:
        lo = int(arr.min())
        for impl in (bfd_module._bfd_lists, bfd_module._bfd_arrays):
            o, i = impl(arr, L, lo)
            assert o.tolist() == offsets.tolist() and i.tolist() == items.tolist(), impl.__name__
    return csr_to_lists(offsets, items)


def check_accounting(lengths: list[int], plan: PackPlan) -> None:
    """Every sample is in exactly one pack, or its pieces are (covering what the policy keeps), or it is in
    the overflow report; no pack is over budget; the stats agree with a recount."""
    L = plan.packing_length
    n = len(lengths)
    ov = plan.overflow
    seen = np.concatenate(plan.packs) if plan.num_packs else np.zeros(0, np.int64)
    assert len(seen) == len(set(seen.tolist())), "an id is packed twice"
    packed = set(seen.tolist())
    piece_of: dict[int, list[tuple[int, int]]] = {}
    for pid, (sid, a, b) in plan.pieces.items():
        assert pid >= n
        assert pid in packed, f"piece {pid} not packed"
        piece_of.setdefault(sid, []).append((a, b))
    reported = set(ov["empty_ids"]) | set(ov["dropped_ids"])
    for sid, length in enumerate(lengths):
        if length == 0:
            assert sid in ov["empty_ids"] and sid not in packed
        elif length > L:
            assert sid in ov["overlong_ids"] and sid not in packed
            if ov["policy"] == "drop":
                assert sid in ov["dropped_ids"]
            elif ov["policy"] == "truncate":
                assert sid in ov["truncated_ids"] and piece_of[sid] == [(0, L)]
            else:
                assert sid in ov["split_ids"]
                ranges = sorted(piece_of[sid])
                assert ranges[0][0] == 0 and ranges[-1][1] == length
                assert all(b - a <= L and b > a for a, b in ranges)
                assert all(ranges[k][1] == ranges[k + 1][0] for k in range(len(ranges) - 1))
        else:
            assert sid in packed and sid not in reported and sid not in piece_of
    # nothing else is packed
    assert packed <= set(range(n)) | set(plan.pieces)

    # budget and stats, recounted from the lengths
    def item_len(i: int) -> int:
        if i < n:
            return lengths[i]
        _, a, b = plan.pieces[i]
        return b - a

    pack_tokens = [sum(item_len(i) for i in p.tolist()) for p in plan.packs]
    assert all(0 < t <= L for t in pack_tokens)
    assert plan.pack_lengths.tolist() == pack_tokens
    total = sum(pack_tokens)
    s = plan.stats
    assert s["total_tokens"] == total
    assert s["num_packs"] == len(pack_tokens) == plan.num_packs
    assert s["lower_bound_packs"] == math.ceil(total / L)
    assert s["num_samples"] == n
    if pack_tokens:
        assert s["fill_ratio"] == pytest.approx(total / (len(pack_tokens) * L))
    dropped = sum(x for x in lengths if x > L) if ov["policy"] == "drop" else 0
    dropped += sum(x - L for x in lengths if x > L) if ov["policy"] == "truncate" else 0
    assert ov["tokens_dropped"] == dropped
    assert total + dropped == sum(lengths)


# ---------------------------------------------------------------------------------------------- BFD core


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 40).flatmap(
        lambda L: st.tuples(st.just(L), st.lists(st.integers(1, L), min_size=0, max_size=60))
    )
)
def test_bfd_equals_naive_bfd(case):
    L, lengths = case
    got = bfd_both_paths(lengths, L)
    want = naive_bfd(lengths, L)
    assert got == want  # same bins, same order, same items
    assert sorted(tuple(sorted(lengths[i] for i in b)) for b in got) == sorted(
        tuple(sorted(lengths[i] for i in b)) for b in want
    )


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from([2, 3, 7, 16, 100]).flatmap(
        lambda L: st.tuples(st.just(L), st.lists(st.integers(1, max(1, L // 3)), max_size=80))
    )
)
def test_bfd_equals_naive_bfd_many_small_items(case):
    # many equal small lengths: exercises the "one pack takes r // s items in a row" step
    L, lengths = case
    assert bfd_both_paths(lengths, L) == naive_bfd(lengths, L)


@pytest.mark.parametrize("L", [1, 64, 4096, 70000])
def test_bfd_equals_segment_tree_bfd_medium(L):
    rng = np.random.default_rng(L)
    n = 4000
    lengths = np.clip(rng.lognormal(np.log(max(L, 2) / 8), 1.0, n).astype(np.int64), 1, L)
    assert bfd_both_paths(lengths, L) == segment_tree_bfd(lengths.tolist(), L)


def test_bfd_paths_dispatch_by_size_and_agree_at_scale():
    # above _LISTS_BELOW items the numpy-array step runs; both give the same packs on a real-sized input
    rng = np.random.default_rng(7)
    n = bfd_module._LISTS_BELOW + 1000
    lengths = np.clip(rng.lognormal(np.log(200), 1.2, n).astype(np.int64), 1, 4096)
    offsets, items = best_fit_decreasing(lengths, 4096)
    for impl in (bfd_module._bfd_lists, bfd_module._bfd_arrays):
        o, i = impl(lengths, 4096, int(lengths.min()))
        assert np.array_equal(o, offsets) and np.array_equal(i, items), impl.__name__
    # negative control: two items' lengths swapped move them to other packs, and the comparison sees it
    swapped = lengths.copy()
    a, b = int(np.argmax(lengths)), int(np.argmin(lengths))
    swapped[[a, b]] = swapped[[b, a]]
    _, other = bfd_module._bfd_lists(swapped, 4096, int(swapped.min()))
    assert not np.array_equal(other, items)


def test_segment_tree_reference_equals_naive():
    rng = np.random.default_rng(3)
    for _ in range(50):
        L = int(rng.integers(1, 50))
        lengths = rng.integers(1, L + 1, int(rng.integers(0, 40))).tolist()
        assert segment_tree_bfd(lengths, L) == naive_bfd(lengths, L)


def test_bfd_rejects_out_of_range_lengths():
    with pytest.raises(ValueError, match="item 1 has length 9"):
        best_fit_decreasing(np.array([3, 9]), 8)
    with pytest.raises(ValueError, match="item 0 has length 0"):
        best_fit_decreasing(np.array([0, 3]), 8)


# ---------------------------------------------------------------------------------------------- next-fit


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 30).flatmap(lambda L: st.tuples(st.just(L), st.lists(st.integers(1, L), max_size=60))))
def test_next_fit_equals_naive_and_preserves_order(case):
    L, lengths = case
    offsets, items = next_fit(np.asarray(lengths, np.int64), L)
    got = csr_to_lists(offsets, items)
    assert got == naive_next_fit(lengths, L)
    assert [i for b in got for i in b] == list(range(len(lengths)))


def test_next_fit_crosses_blocks_with_huge_capacity():
    # capacity larger than the internal block of 2**20 items: bin starts jump over whole blocks
    lengths = np.ones(3 * (1 << 20) + 5, np.int64)
    offsets, _ = next_fit(lengths, 1 << 21)
    assert offsets.tolist() == [0, 1 << 21, lengths.size]


def test_sequential_plan_preserves_dataset_order_with_pieces():
    lengths = [3, 0, 11, 2, 5, 4]
    plan = plan_packs(lengths, 5, strategy="sequential", overflow="split")
    flat = np.concatenate(plan.packs).tolist()
    as_sample = [i if i < 6 else plan.pieces[i][0] for i in flat]
    assert as_sample == [0, 2, 2, 2, 3, 4, 5]
    # next-fit over [3, 5, 5, 1, 2, 5, 4] with L=5
    assert [p.tolist() for p in plan.packs] == [[0], [6], [7], [8, 3], [4], [5]]


# ---------------------------------------------------------------------------------------------- plan_packs


lengths_strategy = st.integers(1, 50).flatmap(
    lambda L: st.tuples(st.just(L), st.lists(st.integers(0, 3 * L), max_size=50))
)


@settings(max_examples=200, deadline=None)
@given(
    lengths_strategy,
    st.sampled_from(STRATEGIES),  # every registered strategy
    st.sampled_from(["drop", "truncate", "split"]),
)
def test_every_sample_accounted_once(case, strategy, overflow):
    L, lengths = case
    plan = plan_packs(lengths, L, strategy=strategy, overflow=overflow)
    check_accounting(lengths, plan)


@settings(max_examples=100, deadline=None)
@given(lengths_strategy)
def test_bfd_plan_matches_naive_bfd_on_items(case):
    # with pieces: the items are (sample or piece) in dataset order; BFD over their lengths == naive BFD
    L, lengths = case
    plan = plan_packs(lengths, L, overflow="split")
    items: list[int] = []
    item_len: list[int] = []
    pieces_by_sample: dict[int, list[int]] = {}
    for pid, (sid, _, _) in plan.pieces.items():
        pieces_by_sample.setdefault(sid, []).append(pid)
    for sid, x in enumerate(lengths):
        if 0 < x <= L:
            items.append(sid)
            item_len.append(x)
        for pid in sorted(pieces_by_sample.get(sid, [])):
            items.append(pid)
            a, b = plan.pieces[pid][1:]
            item_len.append(b - a)
    want = [[items[i] for i in b] for b in naive_bfd(item_len, L)]
    assert [p.tolist() for p in plan.packs] == want


# ------------------------------------------------------------------------------------- strategy table


@pytest.mark.parametrize("name", STRATEGIES)
def test_registered_strategy_keeps_the_contract(name):
    """Every entry of STRATEGY_TABLE: CSR packs over a permutation of the items, none over budget,
    deterministic, ValueError for a length outside 1..capacity (the contract in varpack.plan.strategies)."""
    pack = STRATEGY_TABLE[name].pack
    rng = np.random.default_rng(0)
    for L in (1, 7, 64, 4096):
        lengths = rng.integers(1, L + 1, size=500, dtype=np.int64)
        offsets, items = pack(lengths, L)
        assert offsets.dtype == np.int64 and items.dtype == np.int64
        assert offsets[0] == 0 and offsets[-1] == lengths.size and (np.diff(offsets) > 0).all()
        assert np.array_equal(np.sort(items), np.arange(lengths.size))
        sums = np.add.reduceat(lengths[items], offsets[:-1])
        assert (sums <= L).all()
        again = pack(lengths.copy(), L)
        assert np.array_equal(again[0], offsets) and np.array_equal(again[1], items)
        for bad in (0, L + 1):
            with pytest.raises(ValueError, match="item 3 has length"):
                pack(np.concatenate([lengths[:3], [bad], lengths[3:]]), L)
    empty_offsets, empty_items = pack(np.zeros(0, np.int64), 8)
    assert empty_offsets.tolist() == [0] and empty_items.size == 0


def test_plan_packs_dispatches_through_the_table_with_shared_overflow(monkeypatch):
    """A strategy added to the table is reachable by name; it only sees items in 1..L (the overflow policy
    ran before, the same for every strategy) and its packs become the plan's."""
    seen: list[list[int]] = []

    def one_per_pack(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
        seen.append(lengths.tolist())
        n = lengths.shape[0]
        return np.arange(n + 1, dtype=np.int64), np.arange(n, dtype=np.int64)[::-1].copy()

    monkeypatch.setitem(STRATEGY_TABLE, "one-per-pack", Strategy(one_per_pack, "one item per pack"))
    lengths = [3, 0, 11, 2]
    plan = plan_packs(lengths, 4, strategy="one-per-pack", overflow="split")
    assert seen == [[3, 4, 4, 3, 2]]  # sample 0, pieces of sample 2 (in place), sample 3; empty left out
    assert [p.tolist() for p in plan.packs] == [[3], [6], [5], [4], [0]]
    assert plan.strategy == "one-per-pack" and plan.pack_lengths.tolist() == [2, 3, 4, 4, 3]
    ref = plan_packs(lengths, 4, strategy="bfd", overflow="split")
    assert plan.overflow == ref.overflow and plan.pieces == ref.pieces
    check_accounting(lengths, plan)
    with pytest.raises(ValueError, match="packing_strategy must be one of"):
        plan_packs(lengths, 4, strategy="nope")


def test_one_token_samples():
    # TRL #4554: short sequences must stay whole, a 1-token sample is a sample like any other
    plan = plan_packs([1], 8)
    assert [p.tolist() for p in plan.packs] == [[0]] and plan.total_tokens == 1
    plan = plan_packs([1, 1, 1, 1], 1)
    assert sorted(p.tolist() for p in plan.packs) == [[0], [1], [2], [3]]
    plan = plan_packs([7, 1, 1, 7], 8)
    assert sorted(sorted(p.tolist()) for p in plan.packs) == [[0, 1], [2, 3]]
    plan = plan_packs([1, 1, 1], 8, strategy="sequential")
    assert [p.tolist() for p in plan.packs] == [[0, 1, 2]]


@pytest.mark.parametrize("strategy", ["bfd", "sequential"])
def test_budget_8193_vs_8192(strategy):
    # TRL #3887: with seq_length 8192 + 1 BFD stopped packing (3000 packs for 3000 samples instead of ~1500)
    lengths = np.random.default_rng(0).normal(4096, 512, 3000).astype(int).clip(100, 8192)
    for mult in (1, 2, 4):
        a = plan_packs(lengths, 8192 * mult, strategy=strategy)
        b = plan_packs(lengths, 8192 * mult + 1, strategy=strategy)
        assert abs(a.num_packs - b.num_packs) <= 0.01 * a.num_packs, (mult, a.num_packs, b.num_packs)
        if strategy == "bfd":  # the bug gave one pack per sample; BFD here is within 10% of the bound
            assert b.num_packs <= 1.1 * b.lower_bound_packs
        check_accounting(lengths.tolist(), b)


def test_overlong_error_lists_ids_and_lengths():
    lengths = [5, 9, 3, 12]
    with pytest.raises(ValueError) as exc:
        plan_packs(lengths, 8)
    msg = str(exc.value)
    assert "2 sample(s)" in msg and "1: 9" in msg and "3: 12" in msg and "packing_length=8" in msg


def test_overlong_error_truncates_listing():
    lengths = [10] * 25
    with pytest.raises(ValueError, match=r"25 sample\(s\).*19: 10, \.\.\. and 5 more"):
        plan_packs(lengths, 8)


def test_overlong_drop():
    plan = plan_packs([5, 9, 3], 8, overflow="drop")
    assert plan.overflow["dropped_ids"] == [1] and plan.overflow["overlong_lengths"] == [9]
    assert plan.overflow["tokens_dropped"] == 9 and plan.pieces == {}
    assert sorted(np.concatenate(plan.packs).tolist()) == [0, 2]


def test_overlong_truncate():
    plan = plan_packs([5, 9, 3], 8, overflow="truncate")
    assert plan.overflow["truncated_ids"] == [1] and plan.overflow["tokens_dropped"] == 1
    assert plan.pieces == {3: (1, 0, 8)}
    assert sorted(np.concatenate(plan.packs).tolist()) == [0, 2, 3]
    assert plan.total_tokens == 16


def test_overlong_split():
    plan = plan_packs([5, 20, 3], 8, overflow="split")
    assert plan.overflow["split_ids"] == [1] and plan.overflow["tokens_dropped"] == 0
    assert plan.pieces == {3: (1, 0, 8), 4: (1, 8, 16), 5: (1, 16, 20)}
    assert sorted(np.concatenate(plan.packs).tolist()) == [0, 2, 3, 4, 5]
    assert plan.total_tokens == 28


def test_empty_samples_reported_not_packed():
    plan = plan_packs([0, 4, 0], 8)
    assert plan.overflow["empty_ids"] == [0, 2]
    assert [p.tolist() for p in plan.packs] == [[1]]
    assert plan.stats["num_empty"] == 2


def test_no_samples():
    plan = plan_packs([], 8)
    assert plan.num_packs == 0 and plan.packs == [] and plan.fill_ratio == 0.0
    assert plan.stats["lower_bound_packs"] == 0


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(lengths=[1, -2], packing_length=8), ValueError, "1: -2"),
        (dict(lengths=[1.5], packing_length=8), TypeError, "float64"),
        (dict(lengths=[[1, 2]], packing_length=8), ValueError, "1-D"),
        (dict(lengths=[1], packing_length=0), ValueError, "packing_length must be >= 1"),
        (dict(lengths=[1], packing_length=True), TypeError, "packing_length"),
        (dict(lengths=[1], packing_length=8.0), TypeError, "packing_length"),
        (dict(lengths=[1], packing_length=8, strategy="ffd"), ValueError, "packing_strategy"),
        (dict(lengths=[1], packing_length=8, overflow="wrap"), ValueError, "overflow"),
        (dict(lengths=[1], packing_length=8, seed=-1), ValueError, "seed"),
    ],
)
def test_bad_input(kwargs, exc, match):
    lengths = kwargs.pop("lengths")
    L = kwargs.pop("packing_length")
    with pytest.raises(exc, match=match):
        plan_packs(lengths, L, **kwargs)


def test_bfd_fill_on_realistic_lengths():
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(5.5, 0.9, 20000).astype(np.int64), 1, 4096)
    plan = plan_packs(lengths, 4096)
    assert plan.num_packs <= math.ceil(1.005 * plan.lower_bound_packs)
    seq = plan_packs(lengths, 4096, strategy="sequential")
    assert seq.num_packs > plan.num_packs  # next-fit is worse than BFD here


def test_deterministic():
    rng = np.random.default_rng(2)
    lengths = rng.integers(0, 300, 5000)
    a = plan_packs(lengths, 256, overflow="split")
    b = plan_packs(lengths.tolist(), 256, overflow="split")
    assert np.array_equal(a.items, b.items) and np.array_equal(a.offsets, b.offsets)
    assert a.fingerprint == b.fingerprint


def test_pack_accessor():
    plan = plan_packs([3, 5, 2, 6, 1], 8)
    assert [plan.pack(i).tolist() for i in range(plan.num_packs)] == [p.tolist() for p in plan.packs]
    assert plan.pack(-1).tolist() == plan.packs[-1].tolist()
    with pytest.raises(IndexError, match="out of range"):
        plan.pack(plan.num_packs)


# ---------------------------------------------------------------------------------------------- order, save/load


def test_pack_order_per_epoch():
    plan = plan_packs(np.full(200, 3), 8, seed=7)
    o0, o1 = plan.pack_order(0), plan.pack_order(1)
    assert sorted(o0.tolist()) == list(range(plan.num_packs)) == sorted(o1.tolist())
    assert not np.array_equal(o0, o1)
    assert np.array_equal(o0, plan.pack_order(0))
    other = plan_packs(np.full(200, 3), 8, seed=8)
    assert not np.array_equal(o0, other.pack_order(0))
    assert np.array_equal(other.items, plan.items)  # seed changes order, not packs
    with pytest.raises(ValueError, match="epoch"):
        plan.pack_order(-1)


def test_save_load_roundtrip(tmp_path):
    lengths = [5, 20, 0, 3, 7, 1]
    plan = plan_packs(lengths, 8, overflow="split", seed=3)
    path = plan.save(tmp_path / "plan")
    assert path.name == "plan.npz"
    back = PackPlan.load(path, lengths=lengths)
    assert [p.tolist() for p in back.packs] == [p.tolist() for p in plan.packs]
    assert back.pieces == plan.pieces and back.overflow == plan.overflow and back.stats == plan.stats
    assert np.array_equal(back.pack_order(2), plan.pack_order(2))


def test_load_refuses_other_lengths_or_settings(tmp_path):
    lengths = [5, 6, 3, 7]
    path = plan_packs(lengths, 8).save(tmp_path / "p.npz")
    with pytest.raises(ValueError, match="fingerprint"):
        PackPlan.load(path, lengths=[5, 6, 3, 8])
    with pytest.raises(ValueError, match="fingerprint"):
        PackPlan.load(path, lengths=[6, 5, 3, 7])  # same multiset, other order
    PackPlan.load(path, lengths=np.array(lengths, np.int32))  # dtype does not matter
    other = plan_packs(lengths, 9).save(tmp_path / "q.npz")
    assert PackPlan.load(other).fingerprint != PackPlan.load(path).fingerprint


def test_load_rejects_non_plan(tmp_path):
    np.savez(tmp_path / "x.npz", a=np.arange(3))
    with pytest.raises(ValueError, match="not a varpack plan"):
        PackPlan.load(tmp_path / "x.npz")


@pytest.mark.parametrize("overflow", ["error", "drop", "truncate", "split"])
def test_items_without_a_supervised_token_are_left_out_and_reported(overflow):
    """A long prompt truncated away from its answer, a split piece of prompt only, a sample whose labels are
    all -100: each trains nothing, so it is in no pack, and the report names it (sample id, token range)."""
    labels = {
        0: [-100, 1, 2],  # supervised
        1: [-100] * 8 + [5, 6],  # 10 tokens, the answer after token 8
        2: [-100, -100],  # nothing supervised
        3: [-100] * 13 + [9],  # 14 tokens: pieces [0, 6), [6, 12) of prompt, [12, 14) with the answer
    }
    lengths = [3, 10, 2, 14] if overflow != "error" else [3, 2]
    if overflow == "error":
        labels = {0: labels[0], 1: labels[2]}
    calls = []

    def supervised(ids, starts, stops):
        calls.append(len(ids))
        rng = zip(ids.tolist(), starts.tolist(), stops.tolist())
        return np.array([any(x != -100 for x in labels[i][a + 1 : b]) for i, a, b in rng])

    plan = plan_packs(lengths, 6, overflow=overflow, supervised=supervised)
    ov = plan.overflow
    assert calls == [plan.num_items + len(ov["unsupervised_ids"]) + len(ov["unsupervised_pieces"])]
    n = plan.num_samples
    packed = {(int(i), 0, lengths[int(i)]) if i < n else plan.pieces[int(i)] for i in plan.items}
    want = {
        "error": ({(0, 0, 3)}, [1], []),
        "drop": ({(0, 0, 3)}, [2], []),
        "truncate": ({(0, 0, 3)}, [2], [[1, 0, 6], [3, 0, 6]]),
        "split": ({(0, 0, 3), (1, 6, 10), (3, 12, 14)}, [2], [[1, 0, 6], [3, 0, 6], [3, 6, 12]]),
    }[overflow]
    assert packed == want[0]
    assert ov["unsupervised_ids"] == want[1] and ov["unsupervised_pieces"] == want[2]
    assert sorted(plan.pieces) == list(range(plan.num_samples, plan.num_samples + len(plan.pieces)))
    assert ov["num_pieces"] == len(plan.pieces)
    gone = sum(b - a for _, a, b in want[2]) + sum(lengths[i] for i in want[1])
    cut = {"error": 0, "drop": 10 + 14, "truncate": 4 + 8, "split": 0}[overflow]
    assert ov["tokens_dropped"] == gone + cut == sum(lengths) - plan.total_tokens
    assert plan.stats["num_unsupervised"] == len(want[1]) + len(want[2])
    with pytest.raises(ValueError, match="groups"):
        plan_packs([3, 2], 6, groups=[0, 0], supervised=supervised)
    with pytest.raises(ValueError, match="one bool per range"):
        plan_packs([3, 2], 6, supervised=lambda i, a, b: np.ones(1, bool))
