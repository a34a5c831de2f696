"""VarlenMeta: the batch's boundaries built once, validated once, and read by every consumer."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from varpack.collate import PaddingFreeCollator
from varpack.varlen import VarlenMeta, seq_idx_from_cu_seqlens, varlen_meta_from_kwargs


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def test_from_lengths_gives_the_collators_boundaries():
    samples = [{"input_ids": [1] * n, "labels": [-100] + [1] * (n - 1)} for n in (3, 1, 5)]
    batch = PaddingFreeCollator()(samples)
    meta = batch["varlen_meta"]
    assert meta.cu_seqlens_q.tolist() == [0, 3, 4, 9] and meta.cu_seqlens_q.dtype == torch.int32
    assert meta.cu_seqlens_k is meta.cu_seqlens_q and meta.self_attention
    assert (meta.max_seqlen_q, meta.total_q, meta.num_seqs, meta.has_empty) == (5, 9, 3, False)
    assert type(meta.max_seqlen_q) is int
    # transformers' kwargs and seq_idx are views of it
    assert batch["cu_seq_lens_q"] is meta.cu_seqlens_q and batch["max_length_q"] == meta.max_seqlen_q
    assert torch.equal(batch["seq_idx"], seq_idx_from_cu_seqlens(meta.cu_seqlens_q, 9))
    assert batch["seq_idx"] is meta.seq_idx()
    assert VarlenMeta.from_lengths([3, 1, 5]).cu_seqlens_q.tolist() == [0, 3, 4, 9]


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "message"),
    [
        (([0, 3, 2, 7],), {}, ValueError, r"cu_seqlens_q=\[0, 3, 2, 7\] must start at 0, never decrease"),
        (([1, 3, 7],), {}, ValueError, r"cu_seqlens_q\[0\]=1, must be 0"),
        (([0, 3, 7],), {"total_q": 8}, ValueError, r"cu_seqlens_q\[-1\]=7 but the stream has 8 tokens"),
        (([0, 3, 7], None, 3), {}, ValueError, r"max_seqlen_q=3 but the longest segment .* 4 tokens"),
        (([0, 3, 7], [0, 7]), {}, ValueError, r"cu_seqlens_q has 3 entries but cu_seqlens_k has 2"),
        (([0.0, 3.0],), {}, TypeError, r"cu_seqlens_q must hold integers"),
        ((torch.tensor([0, 3]).to("meta"),), {}, ValueError, r"give max_seqlen_q and total_q"),
        (([0, 3], None, torch.tensor(3, device="meta")), {}, TypeError, r"max_seqlen_q must be a Python int"),
        (([0, 2**31],), {}, ValueError, r"cu_seqlens_q has values outside int32"),
    ],
)
def test_construction_validates_once_and_names_the_argument(args, kwargs, exc, message):
    with pytest.raises(exc, match=message):
        VarlenMeta(*args, **kwargs)


def test_upper_bound_max_seqlen_and_empty_segments_are_accepted():
    meta = VarlenMeta(i32([0, 3, 3, 7]), max_seqlen_q=10)
    assert meta.max_seqlen_q == 10 and meta.has_empty is True and meta.num_seqs == 3


def test_device_offsets_are_never_read():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device="meta")  # reading it would raise
    meta = VarlenMeta(cu, max_seqlen_q=4, total_q=7)
    assert meta.has_empty is None and meta.num_seqs == 2 and meta.cu_seqlens_on("meta")[0] is cu


def test_frozen_and_pickles_with_fresh_derived_values():
    meta = VarlenMeta.from_lengths([2, 5])
    with pytest.raises(AttributeError, match="frozen"):
        meta.max_seqlen_q = 9
    meta.memo("x", lambda: 1)
    copy = pickle.loads(pickle.dumps(meta))
    assert copy.cu_seqlens_q.tolist() == [0, 2, 7] and copy.max_seqlen_q == 5 and copy.self_attention
    assert copy.memo("x", lambda: 2) == 2  # derived values are per object, rebuilt lazily


def test_derived_values_are_built_once_per_batch():
    meta = VarlenMeta.from_lengths([2, 5])
    calls = []
    assert meta.memo("k", lambda: calls.append(1) or "v") == "v"
    assert meta.memo("k", lambda: calls.append(1) or "w") == "v"
    assert calls == [1]
    assert meta.seq_idx() is meta.seq_idx()
    assert meta.host_offsets() == ([0, 2, 7], [0, 2, 7])
    q, k = meta.cu_seqlens_on("cpu")
    assert q is meta.cu_seqlens_q and k is q


def test_host_offsets_of_a_cpu_meta_need_no_later_read(monkeypatch):
    meta = VarlenMeta.from_lengths([4, 1, 2])

    def forbidden(*a, **k):
        raise AssertionError("host offsets re-read the tensor")

    monkeypatch.setattr(torch.Tensor, "tolist", forbidden)
    assert meta.host_offsets()[0] == [0, 4, 5, 7]


def test_from_kwargs_builds_once_and_refuses_disagreeing_views():
    cu = i32([0, 3, 7])
    meta = varlen_meta_from_kwargs({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": np.int64(4)}, 7, "m")
    assert meta.cu_seqlens_q is cu and meta.max_seqlen_q == 4
    same = {"varlen_meta": meta, "cu_seq_lens_q": cu, "max_length_q": 4}
    assert varlen_meta_from_kwargs(same, 7, "m") is meta
    moved = {"varlen_meta": meta, "cu_seq_lens_q": cu.clone().to("meta")}  # Trainer's device copy
    assert varlen_meta_from_kwargs(moved, 7, "m") is meta
    with pytest.raises(ValueError, match="cu_seq_lens_q .* disagrees with varlen_meta"):
        varlen_meta_from_kwargs({"varlen_meta": meta, "cu_seq_lens_q": i32([0, 7])}, 7, "m")
    with pytest.raises(ValueError, match="disagrees with varlen_meta's offsets"):
        varlen_meta_from_kwargs({"varlen_meta": meta, "cu_seq_lens_q": i32([0, 2, 7])}, 7, "m")
    with pytest.raises(ValueError, match="max_length_q=5 disagrees"):
        varlen_meta_from_kwargs({"varlen_meta": meta, "max_length_q": 5}, 7, "m")
    with pytest.raises(ValueError, match="m: the packed boundaries cover 7 tokens but the stream has T=8"):
        varlen_meta_from_kwargs({"varlen_meta": meta}, 8, "m")
    with pytest.raises(ValueError, match=r"m: cu_seq_lens_q=\[0, 3, 6\]"):  # named as the caller passed it
        varlen_meta_from_kwargs({"cu_seq_lens_q": i32([0, 3, 6]), "max_length_q": 3}, 7, "m")
    from_seq_idx = varlen_meta_from_kwargs({"seq_idx": i32([[0, 0, 1, 1, 1]])}, 5, "m")
    assert from_seq_idx.cu_seqlens_q.tolist() == [0, 2, 5]
    assert varlen_meta_from_kwargs({}, 5, "m") is None


def test_from_lengths_carries_a_fixed_max_seqlen_bucket():
    meta = VarlenMeta.from_lengths([3, 1, 5], max_seqlen=16)
    assert meta.max_seqlen_q == meta.max_seqlen_k == 16 and meta.flash_attn_kwargs()["max_length_q"] == 16
    with pytest.raises(ValueError, match="max_seqlen_q=4 but the longest segment"):
        VarlenMeta.from_lengths([3, 1, 5], max_seqlen=4)


def test_on_device_moves_the_offsets_once_and_keeps_the_host_facts():
    meta = VarlenMeta.from_lengths([3, 1, 5], max_seqlen=8)
    assert meta.on_device("cpu") is meta
    moved = meta.on_device("meta")  # the meta device: its values cannot be read, so none is
    assert moved is meta.on_device("meta")  # once per batch and device
    assert moved.cu_seqlens_q.device.type == "meta" and moved.cu_seqlens_q is meta.cu_seqlens_on("meta")[0]
    assert moved.cu_seqlens_k is moved.cu_seqlens_q and moved.self_attention
    assert (moved.max_seqlen_q, moved.total_q, moved.num_seqs, moved.has_empty) == (8, 9, 3, False)
    assert moved.host_offsets() == meta.host_offsets()  # read on the host already, never from the device
    assert moved.cu_seqlens_cpu() is meta.cu_seqlens_q
    assert moved.flash_attn_kwargs()["cu_seq_lens_q"] is moved.cu_seqlens_q
    assert not hasattr(moved, "to")  # HF Trainer / accelerate never move it on their own


def test_a_memo_build_may_read_another_memo():
    """A per-batch build that reads another memoized value of the same meta (a Gated DeltaNet layer's chunk
    indices read :meth:`cu_seqlens_cpu`, itself memoized for a device meta) finishes instead of waiting on
    the meta's own lock; the control: the value is built once and kept."""
    import threading

    import torch

    from varpack.varlen import VarlenMeta

    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    device_meta = VarlenMeta(torch.empty(3, dtype=torch.int32, device="meta"), max_seqlen_q=5, total_q=8)
    device_meta._derived[("cu_seqlens", "cpu")] = cu  # as on_device() keeps the host copy
    built, done = [], threading.Event()

    def nested():
        built.append(device_meta.memo("indices", lambda: device_meta.cu_seqlens_cpu().tolist()))
        built.append(device_meta.memo("indices", lambda: None))
        done.set()

    worker = threading.Thread(target=nested, daemon=True)
    worker.start()
    assert done.wait(20), "memo() waited on its own lock"
    assert built == [[0, 3, 8], [0, 3, 8]]


def test_linear_offsets_merge_the_trailing_segments_and_travel_with_the_meta():
    """cu_seqlens_linear (the collator's pad segments as one sequence for the linear-attention layers): built by
    from_lengths from the first merged segment, checked to be such a merge within linear_chunk_rows, copied by
    on_device (its CPU copy kept: no device read), pickled with the meta."""
    meta = VarlenMeta.from_lengths([5, 70, 1, 40, 3, 81], linear_from=3, linear_chunk_rows=6)
    assert meta.cu_seqlens_linear.tolist() == [0, 5, 75, 76, 200, 200, 200]
    assert meta.cu_seqlens_linear.dtype == torch.int32 and meta.linear_chunk_rows == 6
    assert meta.cu_seqlens_linear_cpu() is meta.cu_seqlens_linear
    copy = pickle.loads(pickle.dumps(meta))
    assert copy.cu_seqlens_linear.tolist() == meta.cu_seqlens_linear.tolist() and copy.linear_chunk_rows == 6
    moved = meta.on_device("meta")  # values unreadable there: none is read
    assert moved.cu_seqlens_linear.device.type == "meta" and moved.linear_chunk_rows == 6
    assert moved.cu_seqlens_linear_cpu() is meta.cu_seqlens_linear
    assert VarlenMeta.from_lengths([2, 5]).cu_seqlens_linear is None
    assert VarlenMeta.from_lengths([2, 5]).cu_seqlens_linear_cpu() is None


@pytest.mark.parametrize(
    ("linear", "rows", "message"),
    [
        ([0, 5, 76, 76, 200], None, "equal cu_seqlens_q up to an entry and T after it"),  # not T after the merge
        ([0, 3, 75, 200, 200], None, "equal cu_seqlens_q up to an entry and T after it"),  # a real boundary moved
        ([0, 5, 75, 76], None, r"must be \[N\+1\]"),
        ([0, 200, 200, 200, 200], None, "equal cu_seqlens_q up to an entry and T after it"),  # all merged
        ([0, 5, 75, 76, 200], 5, "holds 6 chunks of 64 tokens, more than linear_chunk_rows=5"),
    ],
)
def test_linear_offsets_are_checked(linear, rows, message):
    cu = torch.tensor([0, 5, 75, 76, 200], dtype=torch.int32)
    assert VarlenMeta(cu, cu_seqlens_linear=torch.tensor([0, 5, 75, 200, 200]), linear_chunk_rows=5).num_seqs == 4
    with pytest.raises(ValueError, match=message):
        VarlenMeta(cu, cu_seqlens_linear=torch.tensor(linear), linear_chunk_rows=rows)


def test_linear_chunk_rows_needs_linear_offsets():
    with pytest.raises(ValueError, match="linear_chunk_rows needs"):
        VarlenMeta(torch.tensor([0, 3]), linear_chunk_rows=2)
    with pytest.raises(ValueError, match="linear_chunk_rows needs linear_from"):
        VarlenMeta.from_lengths([3], linear_chunk_rows=2)
    with pytest.raises(ValueError, match="linear_from=2 is not a segment index"):
        VarlenMeta.from_lengths([3, 4], linear_from=2)
    with pytest.raises(ValueError, match="the first segment is never merged"):
        VarlenMeta.from_lengths([3, 4], linear_from=0)
    for bad in (1.5, True):
        with pytest.raises(TypeError, match="linear_from must be an integer"):
            VarlenMeta.from_lengths([3, 4], linear_from=bad)
    cu, lin = torch.tensor([0, 3, 7]), torch.tensor([0, 3, 7])
    with pytest.raises(ValueError, match=r"linear_chunk_rows must be a host integer >= 1 \(a count of 64-token"):
        VarlenMeta(cu, cu_seqlens_linear=lin, linear_chunk_rows=-1)
    with pytest.raises(TypeError, match="linear_chunk_rows must be a host integer"):
        VarlenMeta(cu, cu_seqlens_linear=lin, linear_chunk_rows=2.0)
    assert VarlenMeta.from_lengths([9], linear_from=0).cu_seqlens_linear.tolist() == [0, 9]  # one segment
