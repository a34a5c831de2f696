"""The online packer (varpack.plan.streaming): every item once, leftovers at the end, overflow policies as
plan_packs, a buffer >= the data gives the global plan, resumable state, chunking does not matter."""

from __future__ import annotations

import json

import numpy as np
import pytest

from varpack.plan import STRATEGIES, plan_packs
from varpack.plan.report import summary_text
from varpack.plan.streaming import PackBatch, StreamingPacker


def _lengths(n=3000, seed=0, hi=700):
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(5.0, 1.0, size=n).astype(np.int64) + 1, hi)


def _items(batches):
    """[(sample_id, start, stop)] of the packs, pack after pack."""
    out = []
    for b in batches:
        for ids, starts, stops in b:
            out.extend(zip(ids.tolist(), starts.tolist(), stops.tolist()))
    return out


def _packs(batches):
    return [list(zip(i.tolist(), s.tolist(), e.tolist())) for b in batches for i, s, e in b]


def _plan_items(plan):
    """The global plan's packs as [(sample_id, start, stop)] per pack."""
    out = []
    for p in range(plan.num_packs):
        a, b = plan.offsets[p], plan.offsets[p + 1]
        out.append(
            [
                (int(i), 0, int(n)) if i < plan.num_samples else plan.pieces[int(i)]
                for i, n in zip(plan.items[a:b], plan.item_lengths[a:b])
            ]
        )
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("overflow", ["drop", "truncate", "split"])
def test_buffer_at_least_the_data_gives_the_global_plan(strategy, overflow):
    lengths = _lengths(800, seed=1, hi=2000)
    L = 1024
    plan = plan_packs(lengths, L, strategy=strategy, overflow=overflow)
    packer = StreamingPacker(L, buffer_size=len(lengths) * 2, strategy=strategy, overflow=overflow)
    first = packer.add(lengths)
    assert first.num_packs == 0  # nothing is packed before the buffer is full or the stream ends
    last = packer.finish()
    assert _packs([last]) == _plan_items(plan)
    assert packer.fill_ratio == pytest.approx(plan.fill_ratio, abs=0, rel=1e-15)
    assert packer.num_packs == plan.num_packs and packer.final_packs == plan.num_packs
    for key in ("empty_ids", "overlong_ids", "dropped_ids", "truncated_ids", "split_ids", "num_pieces"):
        assert packer.report[key] == plan.overflow[key], key
    assert packer.report["tokens_dropped"] == plan.overflow["tokens_dropped"]


@pytest.mark.parametrize("buffer_size", [2, 7, 64, 500])
@pytest.mark.parametrize("overflow", ["drop", "truncate", "split"])
def test_every_item_exactly_once_and_leftovers_at_the_end(buffer_size, overflow):
    lengths = _lengths(1500, seed=2, hi=900)
    lengths[[3, 10, 400]] = [0, 0, 0]
    L = 512
    packer = StreamingPacker(L, buffer_size=buffer_size, overflow=overflow)
    flowing = packer.add(lengths)
    assert flowing.num_packs > 0  # full packs come out while the stream flows
    left = packer.buffered
    assert left < buffer_size and (left > 0 or buffer_size == 2)
    last = packer.finish()
    assert packer.buffered == 0
    assert len(_items([last])) == left and last.num_packs == packer.final_packs
    got = sorted(_items([flowing, last]))
    # what plan_packs makes of the same lengths is the set of items to pack (pieces for overlong samples)
    plan = plan_packs(lengths, L, overflow=overflow)
    want = sorted(x for p in _plan_items(plan) for x in p)
    assert got == want
    for b in (flowing, last):
        assert (b.pack_lengths <= L).all() and (b.pack_lengths > 0).all()
    assert packer.report["empty_ids"] == [3, 10, 400]
    assert packer.num_samples == len(lengths) and packer.input_tokens == int(lengths.sum())


def test_chunking_does_not_change_the_packs():
    lengths = _lengths(2000, seed=3)
    whole = StreamingPacker(1024, buffer_size=100, overflow="split")
    a = [whole.add(lengths), whole.finish()]
    one = StreamingPacker(1024, buffer_size=100, overflow="split")
    b = [one.add(int(n)) for n in lengths] + [one.finish()]
    assert _packs(a) == _packs(b)


def test_state_dict_resumes_exactly():
    lengths = _lengths(3000, seed=4, hi=1500)
    ref = StreamingPacker(1024, buffer_size=200, overflow="split")
    want = _packs([ref.add(lengths), ref.finish()])
    p = StreamingPacker(1024, buffer_size=200, overflow="split")
    head = p.add(lengths[:1234])
    state = json.loads(json.dumps(p.state_dict()))
    q = StreamingPacker(1024, buffer_size=200, overflow="split")
    q.load_state_dict(state)
    tail = [q.add(lengths[1234:], np.arange(1234, len(lengths))), q.finish()]
    assert _packs([head] + tail) == want
    assert q.num_packs == ref.num_packs and q.report == ref.report
    other = StreamingPacker(1024, buffer_size=100, overflow="split")
    with pytest.raises(ValueError, match="buffer_size"):
        other.load_state_dict(state)


def test_overflow_error_names_the_sample():
    p = StreamingPacker(100, buffer_size=10)
    with pytest.raises(ValueError, match=r"sample 7 is longer than packing_length=100 \(150 tokens\)"):
        p.add([5, 6, 150], sample_ids=[5, 6, 7])
    assert p.num_samples == 2  # the samples before it were added


def test_fill_small_buffer_is_reported_and_rendered():
    lengths = _lengths(2000, seed=5)
    p = StreamingPacker(2048, buffer_size=50)
    p.add(lengths)
    text = summary_text(p.summary(data="stream"))
    assert "bfd over a buffer of 50 samples" in text and "in the buffer, not packed yet" in text
    p.finish()
    s = p.summary(data="stream")
    assert s["fill_ratio"] == s["total_tokens"] / (s["num_packs"] * 2048)
    assert s["total_tokens"] == int(lengths.sum())
    assert f"{s['final_packs']:,} final pack(s)" in summary_text(s)


def test_bad_settings_and_after_finish():
    with pytest.raises(ValueError, match="buffer_size must be >= 2"):
        StreamingPacker(10, buffer_size=1)
    with pytest.raises(ValueError, match="overflow"):
        StreamingPacker(10, overflow="wrap")
    p = StreamingPacker(10, buffer_size=4)
    p.finish()
    with pytest.raises(RuntimeError, match="reset"):
        p.add([1])
    assert PackBatch.concat([]).num_packs == 0


def test_overflow_error_loses_no_emitted_pack():
    """``add([3, 5, 2, 4, 6, 100])`` under ``error``: the pack of samples 0 and 1 is emitted while the samples
    before the overlong one are added; it was lost with the exception (yet counted in num_packs), so a caller
    that caught the error and called finish() never saw samples 0 and 1."""
    p = StreamingPacker(8, buffer_size=4)
    with pytest.raises(ValueError, match=r"sample 5 is longer than packing_length=8 \(100 tokens\)"):
        p.add([3, 5, 2, 4, 6, 100])
    # the caller's state after the error, saved and restored: the emitted pack travels with it
    q = StreamingPacker(8, buffer_size=4)
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    got = _packs([p.finish()])
    assert sorted(x for pack in got for x in pack) == [(i, 0, n) for i, n in enumerate([3, 5, 2, 4, 6])]
    assert sorted(s for s, _, _ in got[0]) == [0, 1]  # the pack the buffer emitted first
    assert p.num_packs == len(got)
    assert _packs([q.finish()]) == got
    # the next add() returns it as well (before its own packs)
    r = StreamingPacker(8, buffer_size=4)
    with pytest.raises(ValueError, match="sample 5"):
        r.add([3, 5, 2, 4, 6, 100])
    assert sorted(s for s, _, _ in _packs([r.add([1])])[0]) == [0, 1]
    assert r.add([1]).num_packs == 0  # returned once


def _supervised(labels):
    """``supervised`` over per-sample label lists (the rule of varpack.data.dataset.supervised_ranges)."""

    def f(ids, starts, stops):
        rng = zip(ids.tolist(), starts.tolist(), stops.tolist())
        return np.array([any(x != -100 for x in labels[i][a + 1 : b]) for i, a, b in rng], bool)

    return f


def _labels(lengths, seed=0):
    """Labels with a prompt part, some samples with none supervised, some only at their end."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths.tolist():
        kind = rng.integers(0, 4)
        cut = {0: n // 3, 1: n, 2: max(n - 5, 0), 3: 1}[int(kind)]  # 1: nothing supervised
        out.append([-100] * min(max(cut, 1), n) + [7] * max(n - max(cut, 1), 0))
    return out


@pytest.mark.parametrize("overflow", ["drop", "truncate", "split"])
def test_items_without_a_supervised_token_are_left_out_as_in_a_plan(overflow):
    """With ``supervised``, the streaming packer leaves out exactly the items the global plan leaves out
    (reported by id), and with a buffer >= the data it gives the same packs."""
    lengths = _lengths(600, seed=7, hi=2000)
    lengths[[5, 9]] = 0
    labels = _labels(lengths)
    sup = _supervised(labels)
    L = 1024
    plan = plan_packs(lengths, L, overflow=overflow, supervised=sup)
    ov = plan.overflow
    assert ov["unsupervised_ids"] and (overflow == "drop" or ov["unsupervised_pieces"])
    packer = StreamingPacker(L, buffer_size=len(lengths) * 2, overflow=overflow)
    packer.add(lengths, supervised=sup)
    assert _packs([packer.finish()]) == _plan_items(plan)
    assert packer.report == ov
    # in small buffers and one sample at a time: the same items, the same report
    small = StreamingPacker(L, buffer_size=16, overflow=overflow)
    got = [small.add(int(n), [i], supervised=sup) for i, n in enumerate(lengths)] + [small.finish()]
    assert sorted(_items(got)) == sorted(x for p in _plan_items(plan) for x in p)
    assert small.report == ov
    summary = small.summary(data="stream")
    assert summary["num_unsupervised"] == len(ov["unsupervised_ids"]) + len(ov["unsupervised_pieces"])
    text = summary_text(summary)
    assert "no supervised token" in text and f"sample {ov['unsupervised_ids'][0]}" in text
    # negative control: without supervised the unsupervised items are packed
    plain = plan_packs(lengths, L, overflow=overflow)
    assert plain.overflow["unsupervised_ids"] == [] and plain.total_tokens > plan.total_tokens
