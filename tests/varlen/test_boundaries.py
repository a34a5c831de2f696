"""Boundary metadata: cu_seqlens from lengths / position ids / segment ids, seq_idx, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.masking_utils import find_packed_sequence_indices
from transformers.modeling_flash_attention_utils import (
    _get_unpad_data,
    prepare_fa_kwargs_from_position_ids,
)

from varpack.varlen import (
    cu_seqlens_from_lengths,
    cu_seqlens_from_position_ids,
    cu_seqlens_from_segment_ids,
    lengths_from_cu_seqlens,
    max_seqlen_from_cu_seqlens,
    seq_idx_from_cu_seqlens,
    seq_idx_on_device,
    validate_cu_seqlens,
)

lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=30)


def positions_for(lengths, start=0):
    """Per-sample restarting positions built with a plain Python loop (independent of the code under test)."""
    out = []
    for n in lengths:
        out.extend(range(start, start + n))
    return torch.tensor([out])


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


# ---------------------------------------------------------------- from lengths
def test_from_lengths_small():
    cu = cu_seqlens_from_lengths([3, 1, 3])
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 4, 7]
    assert cu_seqlens_from_lengths(np.array([5])).tolist() == [0, 5]
    assert cu_seqlens_from_lengths(torch.tensor([2, 2])).tolist() == [0, 2, 4]


@given(lengths_st)
def test_from_lengths_roundtrip(lengths):
    cu = cu_seqlens_from_lengths(lengths)
    assert lengths_from_cu_seqlens(cu).tolist() == lengths
    validate_cu_seqlens(cu, sum(lengths), max_seqlen=max(lengths))


def test_from_lengths_errors():
    with pytest.raises(ValueError, match=r"non-positive entries at indices \[1\] \(values \[0\]\)"):
        cu_seqlens_from_lengths([3, 0, 2])
    assert cu_seqlens_from_lengths([3, 0, 2], allow_empty=True).tolist() == [0, 3, 3, 5]
    with pytest.raises(ValueError, match=r"negative entries at indices \[0\] \(values \[-1\]\)"):
        cu_seqlens_from_lengths([-1, 2], allow_empty=True)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        cu_seqlens_from_lengths([])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        cu_seqlens_from_lengths([[1, 2]])
    with pytest.raises(TypeError, match="integers"):
        cu_seqlens_from_lengths([1.5, 2.0])
    with pytest.raises(ValueError, match="more than int32"):
        cu_seqlens_from_lengths([2**31 - 1, 1])


# ---------------------------------------------------------------- from position ids
def test_one_token_samples():
    # consecutive zeros are two 1-token starts, not one sample
    assert cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 0, 1, 2]])).tolist() == [0, 3, 4, 7]
    assert cu_seqlens_from_position_ids(torch.tensor([[0, 0, 0]])).tolist() == [0, 1, 2, 3]
    assert cu_seqlens_from_position_ids(torch.tensor([[0]])).tolist() == [0, 1]


def test_row_without_zero_and_offset_start():
    # transformers#39814: rows without a 0 broke `position_ids == 0` boundary detection
    assert cu_seqlens_from_position_ids(torch.tensor([[2, 3, 2, 3, 4]])).tolist() == [0, 2, 5]
    assert cu_seqlens_from_position_ids(torch.tensor([[7, 8, 9]])).tolist() == [0, 3]
    assert cu_seqlens_from_position_ids(torch.tensor([[2, 3, 4, 2, 2, 3]])).tolist() == [0, 3, 4, 6]


def test_row_starting_inside_a_sample():
    # the first token always starts a segment, even above the minimum (a row cut mid-sample)
    assert cu_seqlens_from_position_ids(torch.tensor([[5, 6, 0, 1, 2]])).tolist() == [0, 2, 5]


def test_accepts_1d_numpy_and_list():
    assert cu_seqlens_from_position_ids(np.array([0, 1, 0])).tolist() == [0, 2, 3]
    assert cu_seqlens_from_position_ids([[0, 1, 0]]).tolist() == [0, 2, 3]


@settings(max_examples=150, deadline=None)
@given(lengths_st, st.integers(0, 3))
def test_position_ids_roundtrip_and_transformers_agree(lengths, start):
    pos = positions_for(lengths, start)
    cu = cu_seqlens_from_position_ids(pos)
    assert cu.tolist() == cu_seqlens_from_lengths(lengths).tolist()
    validate_cu_seqlens(cu, pos.shape[1], max_seqlen=max(lengths))
    # oracle 1: transformers' FlashAttention kwargs (`== min` rule, transformers#47525)
    (hf_cu, _), (hf_max, _) = prepare_fa_kwargs_from_position_ids(pos)
    assert hf_cu.tolist() == cu.tolist() and int(hf_max) == max(lengths)
    # oracle 2: transformers' mask path (`diff != 1` rule); both rules agree on every row we accept
    seq = find_packed_sequence_indices(pos)
    hf_seq = torch.zeros_like(pos) if seq is None else seq
    assert hf_seq[0].tolist() == seq_idx_from_cu_seqlens(cu, pos.shape[1])[0].tolist()


def test_strict_refuses_ambiguous_rows():
    # the drop 3 -> 1 is not to the row minimum: the `== min` rule sees one sample, the `+1` rule two
    pos = torch.tensor([[0, 1, 2, 3, 1, 2]])
    with pytest.raises(ValueError, match=r"step from 3 to 1 at index 4 .* row minimum 0"):
        cu_seqlens_from_position_ids(pos)
    assert cu_seqlens_from_position_ids(pos, strict=False).tolist() == [0, 6]
    with pytest.raises(ValueError, match=r"step from 2 to 7 at index 3"):
        cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 7, 8]]))


def mrope_like_planes(lengths):
    """[4, 1, T]: text plane restarting per sample, then three planes that jump and repeat (like mRoPE
    positions of image tokens) and are not usable as boundaries."""
    text = positions_for(lengths)[0]
    t = text.clone()
    t[1::3] = 0  # repeated / non-monotonic values
    h = text // 2
    w = text.flip(0)
    return torch.stack([text, t, h, w])[:, None, :]


def test_multiplane_text_plane():
    lengths = [4, 1, 6, 3]
    pos = mrope_like_planes(lengths)
    assert pos.shape == (4, 1, 14)
    assert cu_seqlens_from_position_ids(pos, text_plane=0).tolist() == [0, 4, 5, 11, 14]
    assert cu_seqlens_from_position_ids(pos[:, 0, :], text_plane=0).tolist() == [0, 4, 5, 11, 14]
    # text plane last (negative index) works the same
    assert cu_seqlens_from_position_ids(pos.flip(0), text_plane=-1).tolist() == [0, 4, 5, 11, 14]
    # negative control: reading an mRoPE plane instead gives wrong or refused boundaries
    with pytest.raises(ValueError, match="ambiguous"):
        cu_seqlens_from_position_ids(pos, text_plane=3)
    assert cu_seqlens_from_position_ids(pos, text_plane=1, strict=False).tolist() != [0, 4, 5, 11, 14]


def test_position_ids_shape_errors():
    with pytest.raises(ValueError, match=r"name the plane .* text_plane"):
        cu_seqlens_from_position_ids(torch.zeros(3, 1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"B = 1"):
        cu_seqlens_from_position_ids(torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"B = 1\), got B=2"):
        cu_seqlens_from_position_ids(torch.zeros(3, 2, 5, dtype=torch.long), text_plane=0)
    with pytest.raises(ValueError, match=r"text_plane=4 out of range for 4"):
        cu_seqlens_from_position_ids(torch.zeros(4, 1, 5, dtype=torch.long), text_plane=4)
    with pytest.raises(ValueError, match="one plane"):
        cu_seqlens_from_position_ids(torch.arange(5), text_plane=2)
    with pytest.raises(ValueError, match=r"T = 0"):
        cu_seqlens_from_position_ids(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="must be"):
        cu_seqlens_from_position_ids(torch.zeros(1, 1, 1, 3, dtype=torch.long), text_plane=0)
    with pytest.raises(TypeError, match="integers"):
        cu_seqlens_from_position_ids(torch.zeros(1, 3))


# ---------------------------------------------------------------- from segment ids
def test_segment_ids_with_padding():
    cu, idx = cu_seqlens_from_segment_ids(torch.tensor([[1, 1, 2, 2, 2, 0, 0]]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5]
    assert idx.dtype == torch.int64 and idx.tolist() == [0, 1, 2, 3, 4]
    cu, idx = cu_seqlens_from_segment_ids([0, 3, 3, 0, 3, 5])  # padding inside doc 3 joins its two runs
    assert cu.tolist() == [0, 3, 4] and idx.tolist() == [1, 2, 4, 5]


def test_segment_ids_reused_id_and_errors():
    with pytest.raises(
        ValueError, match=r"segment id 1 forms 2 separate runs in row 0 \(starting at \[0, 3\]\)"
    ):
        cu_seqlens_from_segment_ids([1, 1, 2, 1])
    with pytest.raises(ValueError, match="all 0"):
        cu_seqlens_from_segment_ids([0, 0])
    with pytest.raises(ValueError, match=">= 0"):
        cu_seqlens_from_segment_ids([1, -1])
    with pytest.raises(ValueError, match=r"\[T\] or \[B, T\]"):
        cu_seqlens_from_segment_ids(torch.ones(1, 1, 2, dtype=torch.long))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.booleans()), min_size=1, max_size=6), st.integers(12, 14))
def test_attention_mask_unpad_matches_transformers(rows, width):
    """A [B, T] 0/1 attention mask (left or right padded) unpads like transformers' `_get_unpad_data`."""
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, (n, left) in enumerate(rows):
        if left:
            mask[b, width - n :] = 1
        else:
            mask[b, :n] = 1
    if mask.sum() == 0:
        return
    cu, idx = cu_seqlens_from_segment_ids(mask)
    hf_idx, hf_cu, _ = _get_unpad_data(mask)
    hf_cu = hf_cu[torch.cat([torch.tensor([True]), hf_cu.diff() > 0])]  # we never emit empty rows
    assert idx.tolist() == hf_idx.tolist()
    assert cu.tolist() == hf_cu.tolist()


# ---------------------------------------------------------------- seq_idx, max_seqlen
@given(st.lists(st.integers(0, 20), min_size=1, max_size=20).filter(lambda x: sum(x) > 0))
def test_seq_idx_matches_naive(lengths):
    cu = cu_seqlens_from_lengths(lengths, allow_empty=True)
    seq = seq_idx_from_cu_seqlens(cu, sum(lengths))
    naive = [i for i, n in enumerate(lengths) for _ in range(n)]
    assert seq.dtype == torch.int32 and seq.shape == (1, sum(lengths))
    assert seq[0].tolist() == naive
    assert max_seqlen_from_cu_seqlens(cu) == max(lengths)
    assert isinstance(max_seqlen_from_cu_seqlens(cu), int)


@given(st.lists(st.integers(0, 20), min_size=1, max_size=20).filter(lambda x: sum(x) > 0))
def test_seq_idx_on_device_matches_naive(lengths):
    """The traceable builder (no host read) equals the host one, zero-length segments included."""
    cu = cu_seqlens_from_lengths(lengths, allow_empty=True)
    naive = [i for i, n in enumerate(lengths) for _ in range(n)]
    for offsets in (cu, cu.to(torch.int64)):
        seq = seq_idx_on_device(offsets, sum(lengths))
        assert seq.dtype == torch.int32 and seq.shape == (1, sum(lengths))
        assert seq[0].tolist() == naive


def test_seq_idx_on_device_traces_without_breaks():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(seq_idx_on_device, backend="aot_eager", fullgraph=True, dynamic=True)
    for lengths in ([3, 1, 3], [5, 0, 2, 9], [4]):
        cu = cu_seqlens_from_lengths(lengths, allow_empty=True)
        assert fn(cu, sum(lengths)).tolist() == seq_idx_from_cu_seqlens(cu, sum(lengths)).tolist()
    assert not counters["graph_break"]
    with pytest.raises(TypeError, match="integer tensor"):
        seq_idx_on_device(torch.tensor([0.0, 3.0]), 3)


def test_seq_idx_checks_total():
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]=7 but the stream has 8 tokens"):
        seq_idx_from_cu_seqlens(i32([0, 3, 7]), 8)


def test_max_seqlen_errors():
    with pytest.raises(ValueError, match="at least 2"):
        max_seqlen_from_cu_seqlens(i32([0]))


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("cu", "total", "kwargs", "exc", "message"),
    [
        (torch.tensor([0, 3, 7]), 7, {}, ValueError, r"dtype is torch.int64, must be torch.int32"),
        (i32([[0, 3, 7]]), 7, {}, ValueError, r"1-D \[N\+1\], got shape \(1, 3\)"),
        (i32([0]), 0, {}, ValueError, r"at least 2 entries \(\[0, T\]\), got 1"),
        (i32([1, 3, 7]), 7, {}, ValueError, r"cu_seqlens\[0\]=1, must be 0"),
        (i32([0, 3, 7]), 8, {}, ValueError, r"cu_seqlens\[-1\]=7 but the stream has 8 tokens"),
        (
            i32([0, 3, 3, 7]),
            7,
            {},
            ValueError,
            r"not strictly increasing: cu_seqlens\[1\]=3, cu_seqlens\[2\]=3",
        ),
        (
            i32([0, 5, 3, 7]),
            7,
            {"allow_empty": True},
            ValueError,
            r"decreasing: cu_seqlens\[1\]=5, cu_seqlens\[2\]=3",
        ),
        (
            i32([0, 3, 7]),
            7,
            {"max_seqlen": 3},
            ValueError,
            r"max_seqlen=3 but the longest segment .* 4 tokens",
        ),
        (
            i32([0, 3, 7]),
            7,
            {"max_seqlen": torch.tensor(4, device="meta")},  # a device tensor: reading it would sync
            TypeError,
            r"max_seqlen must be a Python int .* tensor on meta",
        ),
        (i32([0, 3, 7]), 7, {"max_seqlen": 4.0}, TypeError, r"max_seqlen must be an integer .* float 4.0"),
        ([0, 3, 7], 7, {}, TypeError, r"must be a torch.Tensor, got list"),
    ],
)
def test_validate_names_the_violation(cu, total, kwargs, exc, message):
    with pytest.raises(exc, match=message):
        validate_cu_seqlens(cu, total, **kwargs)


def test_validate_accepts_valid():
    validate_cu_seqlens(i32([0, 3, 4, 7]), 7, max_seqlen=3)
    validate_cu_seqlens(i32([0, 3, 3, 7]), 7, allow_empty=True, max_seqlen=4)
    validate_cu_seqlens(i32([0, 1]), 1, max_seqlen=1)
