"""PaddingFreeCollator: one row, aligned fields, boundaries equal to the position resets, loud errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DataCollatorWithFlattening

from varpack.collate import PaddingFreeCollator
from varpack.varlen import cu_seqlens_from_position_ids, validate_cu_seqlens


def make_sample(sid, n, *, seed=0, loss_scale=False, kind="list"):
    rng = np.random.default_rng(seed * 1000 + sid)
    ids = rng.integers(1, 1000, n)
    labels = np.where(rng.random(n) < 0.5, -100, ids)
    labels[0] = -100
    sample = {"input_ids": ids, "labels": labels, "length": n, "sample_id": sid}
    if loss_scale:
        sample["loss_scale"] = rng.random(n).astype(np.float32)
    if kind == "list":
        sample = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in sample.items()}
    elif kind == "tensor":
        sample = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in sample.items()}
    return sample


def as_list(x):
    return x.tolist() if hasattr(x, "tolist") else list(x)


packs_st = st.lists(st.lists(st.integers(1, 25), min_size=1, max_size=5), min_size=1, max_size=5)


@settings(max_examples=120, deadline=None)
@given(
    packs_st,
    st.sampled_from([None, 1, 8, 64]),
    st.booleans(),
    st.sampled_from(["list", "numpy", "tensor"]),
)
def test_fields_aligned_and_boundaries_equal_position_resets(pack_lengths, multiple, loss_scale, kind):
    sid = 0
    packs = []
    for lens in pack_lengths:
        pack = []
        for n in lens:
            pack.append(make_sample(sid, n, loss_scale=loss_scale, kind=kind))
            sid += 1
        packs.append(pack)
    samples = [s for p in packs for s in p]
    batch = PaddingFreeCollator(pad_to_multiple_of=multiple, pad_token_id=7)(packs)

    # independent expectation, built with plain Python loops
    exp_ids, exp_labels, exp_pos, exp_seq, exp_scale, cu = [], [], [], [], [], [0]
    for k, s in enumerate(samples):
        n = len(s["input_ids"])
        exp_ids += as_list(s["input_ids"])
        exp_labels += as_list(s["labels"])
        exp_pos += list(range(n))
        exp_seq += [k] * n
        exp_scale += as_list(s["loss_scale"]) if loss_scale else []
        cu.append(cu[-1] + n)
    total = cu[-1]
    pad = 0 if multiple is None else (-total) % multiple
    if pad:
        exp_ids += [7] * pad
        exp_labels += [-100] * pad
        exp_pos += list(range(pad))
        exp_seq += [len(samples)] * pad
        exp_scale += [0.0] * pad if loss_scale else []
        cu.append(total + pad)

    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].shape == (1, total + pad)
    assert batch["input_ids"][0].tolist() == exp_ids
    assert batch["labels"].dtype == torch.int64 and batch["labels"][0].tolist() == exp_labels
    assert batch["position_ids"].dtype == torch.int64 and batch["position_ids"].shape == (1, total + pad)
    assert batch["position_ids"][0].tolist() == exp_pos
    assert batch["seq_idx"].dtype == torch.int32 and batch["seq_idx"][0].tolist() == exp_seq
    if loss_scale:
        assert batch["loss_scale"].dtype == torch.float32
        np.testing.assert_array_equal(batch["loss_scale"][0].numpy(), np.asarray(exp_scale, np.float32))
    else:
        assert "loss_scale" not in batch
    cu_t = batch["cu_seq_lens_q"]
    assert cu_t is batch["cu_seq_lens_k"] and cu_t.dtype == torch.int32 and cu_t.tolist() == cu
    assert batch["max_length_q"] == batch["max_length_k"] == max(np.diff(cu))
    assert type(batch["max_length_q"]) is int
    validate_cu_seqlens(cu_t, total + pad, max_seqlen=batch["max_length_q"])
    # the boundaries are exactly the resets of the positions (pad included, as one segment)
    assert cu_seqlens_from_position_ids(batch["position_ids"]).tolist() == cu
    assert batch["sample_ids"] == list(range(len(samples)))
    assert set(batch) <= {
        "input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
        "max_length_k", "seq_idx", "loss_scale", "sample_ids", "varlen_meta",
    }  # fmt: skip
    # the boundary object is the one the kwargs are views of
    meta = batch["varlen_meta"]
    assert meta.cu_seqlens_q is cu_t and meta.max_seqlen_q == batch["max_length_q"] and meta.total_q == total + pad
    assert meta.seq_idx() is batch["seq_idx"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=8))
def test_matches_transformers_flattening_collator(lengths):
    """transformers' own DataCollatorWithFlattening is the oracle for the shared keys."""
    samples = [make_sample(i, n) for i, n in enumerate(lengths)]
    ours = PaddingFreeCollator()(samples)
    hf = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(
        [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in samples]
    )
    for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"):
        assert ours[key].dtype == hf[key].dtype, key
        assert torch.equal(ours[key], hf[key]), key
    assert ours["max_length_q"] == hf["max_length_q"]


def test_plain_samples_and_single_pack_are_the_same_row():
    samples = [make_sample(i, n) for i, n in enumerate([3, 1, 4])]
    a = PaddingFreeCollator()(samples)
    b = PaddingFreeCollator()([samples])
    c = PaddingFreeCollator()([samples[:2], samples[2:]])
    for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "seq_idx"):
        assert torch.equal(a[key], b[key]) and torch.equal(a[key], c[key])


def test_one_token_samples_and_T_equals_one():
    samples = [make_sample(i, 1) for i in range(3)]
    batch = PaddingFreeCollator()(samples)
    assert batch["cu_seq_lens_q"].tolist() == [0, 1, 2, 3]
    assert batch["position_ids"].tolist() == [[0, 0, 0]]
    assert batch["max_length_q"] == 1
    assert cu_seqlens_from_position_ids(batch["position_ids"]).tolist() == [0, 1, 2, 3]
    one = PaddingFreeCollator()([make_sample(0, 1)])
    assert one["input_ids"].shape == (1, 1) and one["cu_seq_lens_q"].tolist() == [0, 1]


# ---------------------------------------------------------------- padding
def test_pad_is_one_segment():
    samples = [make_sample(0, 5), make_sample(1, 6)]  # T = 11
    batch = PaddingFreeCollator(pad_to_multiple_of=8, pad_token_id=99)(samples)
    assert batch["input_ids"].shape == (1, 16)
    assert batch["input_ids"][0, 11:].tolist() == [99] * 5
    assert batch["labels"][0, 11:].tolist() == [-100] * 5
    assert batch["position_ids"][0, 11:].tolist() == [0, 1, 2, 3, 4]
    # one pad segment (0, 5, 11, 16), never five 1-token segments
    assert batch["cu_seq_lens_q"].tolist() == [0, 5, 11, 16]
    assert batch["seq_idx"][0, 11:].tolist() == [2] * 5
    assert batch["max_length_q"] == 6
    assert batch["sample_ids"] == [0, 1]


def test_no_pad_when_already_a_multiple():
    samples = [make_sample(0, 4), make_sample(1, 4)]
    batch = PaddingFreeCollator(pad_to_multiple_of=8)(samples)
    assert batch["cu_seq_lens_q"].tolist() == [0, 4, 8]


def test_pad_extends_every_token_field():
    s = make_sample(0, 3, loss_scale=True)
    s["token_type_ids"] = [1, 1, 1]
    batch = PaddingFreeCollator(pad_to_multiple_of=4)([s])
    assert batch["loss_scale"][0, 3].item() == 0.0
    assert batch["token_type_ids"][0].tolist() == [1, 1, 1, 0]


@pytest.mark.parametrize("bad", [0, -4, 2.0, True])
def test_bad_pad_to_multiple_of(bad):
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        PaddingFreeCollator(pad_to_multiple_of=bad)


# ---------------------------------------------------------------- multi-plane positions
def mrope_sample(sid, n, *, vision_at=None):
    """[4, n] positions: text plane 0..n-1, then t/h/w planes that repeat inside an 'image' span."""
    s = make_sample(sid, n)
    text = np.arange(n)
    t, h, w = text.copy(), text.copy(), text.copy()
    if vision_at is not None:
        a, b = vision_at
        t[a:b] = a
        h[a:b] = a + (np.arange(b - a) // 2)
        w[a:b] = a + (np.arange(b - a) % 2)
        t[b:], h[b:], w[b:] = t[b:] - 1, h[b:] - 1, w[b:] - 1
    s["position_ids"] = np.stack([text, t, h, w]).tolist()
    return s


def test_three_d_positions_with_text_plane():
    samples = [mrope_sample(0, 7, vision_at=(2, 6)), make_sample(1, 3), mrope_sample(2, 5, vision_at=(1, 5))]
    batch = PaddingFreeCollator(pad_to_multiple_of=8)(samples)
    pos = batch["position_ids"]
    assert pos.shape == (4, 1, 16) and pos.dtype == torch.int64
    cu = batch["cu_seq_lens_q"]
    assert cu.tolist() == [0, 7, 10, 15, 16]
    # boundaries from lengths equal the text plane's resets
    assert cu_seqlens_from_position_ids(pos, text_plane=0).tolist() == cu.tolist()
    # the samples' own planes are kept in place; the text-only sample gets arange on every plane
    assert pos[:, 0, :7].tolist() == samples[0]["position_ids"]
    assert pos[:, 0, 7:10].tolist() == [[0, 1, 2]] * 4
    assert pos[:, 0, 10:15].tolist() == samples[2]["position_ids"]
    assert pos[:, 0, 15:].tolist() == [[0]] * 4  # the pad segment, all planes
    # negative control: an mRoPE plane does not give the boundaries
    with pytest.raises(ValueError, match="ambiguous"):
        cu_seqlens_from_position_ids(pos, text_plane=1)


def test_text_plane_elsewhere_and_forced_planes():
    s = mrope_sample(0, 6, vision_at=(1, 5))
    s["position_ids"] = s["position_ids"][1:] + s["position_ids"][:1]  # text plane last
    batch = PaddingFreeCollator(text_plane=3)([s, make_sample(1, 2)])
    assert batch["position_ids"].shape == (4, 1, 8)
    assert cu_seqlens_from_position_ids(batch["position_ids"], text_plane=3).tolist() == [0, 6, 8]
    text_only = PaddingFreeCollator(position_planes=4)([make_sample(0, 3)])
    assert text_only["position_ids"].shape == (4, 1, 3)
    assert text_only["position_ids"][:, 0].tolist() == [[0, 1, 2]] * 4


def test_text_plane_must_restart_per_sample():
    s = mrope_sample(5, 6)
    s["position_ids"][0] = [3, 4, 5, 6, 7, 8]  # text plane continues from a previous sample
    with pytest.raises(
        ValueError,
        match=r"sample 5 \(#1 of the batch\): the text plane of position_ids is 3 at token 0, expected 0",
    ):
        PaddingFreeCollator()([make_sample(0, 3), s])
    with pytest.raises(
        ValueError,
        match=r"sample 6 \(#0 of the batch\): the text plane of position_ids is 1 at token 2, expected 2",
    ):
        PaddingFreeCollator(text_plane=1)([mrope_sample(6, 6, vision_at=(1, 5))])


def test_position_plane_count_mismatch():
    a = mrope_sample(0, 4)
    b = make_sample(1, 3)
    b["position_ids"] = [[0, 1, 2]] * 3
    with pytest.raises(
        ValueError,
        match=r"sample 1 \(#1 of the batch\): field 'position_ids' has shape \(3, 3\), expected \[4, 3\]",
    ):
        PaddingFreeCollator()([a, b])
    with pytest.raises(
        ValueError,
        match=r"sample 0 \(#0 of the batch\): field 'position_ids' has shape \(4, 4\), expected \[3, 4\]",
    ):
        PaddingFreeCollator(position_planes=3)([a])


def test_one_d_position_ids_are_checked():
    s = make_sample(0, 3)
    s["position_ids"] = [0, 1, 2]
    assert PaddingFreeCollator()([s])["position_ids"].tolist() == [[0, 1, 2]]
    s["position_ids"] = [[0, 1, 2]]  # one plane given as [1, L]: still a [1, T] row
    assert PaddingFreeCollator()([s])["position_ids"].tolist() == [[0, 1, 2]]
    assert PaddingFreeCollator(position_planes=1)([s])["position_ids"].shape == (1, 1, 3)
    s["position_ids"] = [0, 1, 1]
    with pytest.raises(ValueError, match="text plane"):
        PaddingFreeCollator()([s])


# ---------------------------------------------------------------- optional fields and media
def test_mm_token_type_ids_filled_for_text_only_samples():
    a = mrope_sample(0, 4)
    a["mm_token_type_ids"] = [0, 1, 1, 0]
    batch = PaddingFreeCollator()([make_sample(1, 2), a])
    assert batch["mm_token_type_ids"].tolist() == [[0, 0, 0, 1, 1, 0]]


def test_media_concatenated_in_pack_order():
    def vl(sid, n, grids):
        s = make_sample(sid, n)
        rows = sum(t * h * w for t, h, w in grids)
        s["pixel_values"] = torch.full((rows, 6), float(sid))
        s["image_grid_thw"] = torch.tensor(grids)
        return s

    packs = [[vl(3, 5, [[1, 2, 2]]), make_sample(4, 2)], [vl(1, 4, [[1, 2, 4], [1, 2, 2]])]]
    batch = PaddingFreeCollator()(packs)
    assert batch["pixel_values"].shape == (16, 6)
    assert batch["pixel_values"][:, 0].tolist() == [3.0] * 4 + [1.0] * 12
    assert batch["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 4], [1, 2, 2]]
    assert batch["sample_ids"] == [3, 4, 1]
    # nested lists work too
    s = vl(0, 3, [[1, 1, 2]])
    s["pixel_values"] = s["pixel_values"].tolist()
    s["image_grid_thw"] = s["image_grid_thw"].tolist()
    out = PaddingFreeCollator()([s])
    assert out["pixel_values"].shape == (2, 6) and out["image_grid_thw"].dtype == torch.int64


def test_media_consistency_errors():
    s = make_sample(8, 3)
    s["pixel_values"] = torch.zeros(5, 6)
    s["image_grid_thw"] = torch.tensor([[1, 2, 2]])
    with pytest.raises(
        ValueError,
        match=r"sample 8 \(#0 of the batch\): 'pixel_values' has 5 patch rows but 'image_grid_thw'",
    ):
        PaddingFreeCollator()([s])
    del s["image_grid_thw"]
    with pytest.raises(
        ValueError, match=r"sample 8 \(#0 of the batch\) has 'pixel_values' but no 'image_grid_thw'"
    ):
        PaddingFreeCollator()([s])


def test_extra_and_ignored_fields():
    s = make_sample(0, 3)
    s["advantages"] = [0.5, 0.5, 0.5]
    s["id"] = "row-17"
    with pytest.raises(
        ValueError,
        match=r"sample 0 \(#0 of the batch\) has unknown field 'advantages' \(all unknown: \['advantages', 'id'\]\)",
    ):
        PaddingFreeCollator()([s])
    batch = PaddingFreeCollator(extra_fields=["advantages"], ignore_fields=["id"])([s])
    assert batch["advantages"].dtype == torch.float32 and batch["advantages"].tolist() == [[0.5, 0.5, 0.5]]
    assert "id" not in batch
    with pytest.raises(ValueError, match="already known"):
        PaddingFreeCollator(extra_fields=["labels"])


def test_attention_mask_all_ones_is_dropped_zero_is_refused():
    s = make_sample(2, 3)
    s["attention_mask"] = [1, 1, 1]
    assert "attention_mask" not in PaddingFreeCollator()([s])
    s["attention_mask"] = [1, 1, 0]
    with pytest.raises(ValueError, match=r"sample 2 \(#1 of the batch\): attention_mask contains 0"):
        PaddingFreeCollator()([make_sample(0, 2), s])


# ---------------------------------------------------------------- errors
def test_token_field_length_mismatch_names_sample_and_field():
    s = make_sample(42, 5, loss_scale=True)
    s["loss_scale"] = s["loss_scale"][:4]
    with pytest.raises(
        ValueError,
        match=r"sample 42 \(#1 of the batch\): token-aligned field 'loss_scale' has length 4, but input_ids has 5",
    ):
        PaddingFreeCollator()([make_sample(0, 2, loss_scale=True), s])
    s = make_sample(43, 5)
    s["labels"] = s["labels"] + [-100]
    with pytest.raises(
        ValueError, match=r"sample 43 \(#0 of the batch\): token-aligned field 'labels' has length 6"
    ):
        PaddingFreeCollator()([s])


def test_first_label_must_be_ignored():
    s = make_sample(9, 4)
    s["labels"][0] = 5
    with pytest.raises(ValueError, match=r"sample 9 \(#1 of the batch\): labels\[0\] is 5, must be -100"):
        PaddingFreeCollator()([[make_sample(0, 3)], [s]])


def test_missing_and_partial_fields():
    s = make_sample(3, 4)
    del s["labels"]
    with pytest.raises(ValueError, match=r"sample 3 \(#1 of the batch\) has no 'labels'"):
        PaddingFreeCollator()([make_sample(0, 2), s])
    a, b = make_sample(0, 2, loss_scale=True), make_sample(1, 2)
    with pytest.raises(
        ValueError, match=r"sample 1 \(#1 of the batch\) has no 'loss_scale' while 1 other samples"
    ):
        PaddingFreeCollator()([a, b])


def test_sample_without_id_is_named_by_position():
    s = make_sample(0, 3)
    del s["sample_id"]
    s["labels"][0] = 1
    with pytest.raises(ValueError, match=r"sample #1 of the batch \(no sample_id\)"):
        PaddingFreeCollator()([make_sample(5, 2), s])


def test_empty_inputs():
    with pytest.raises(ValueError, match="empty batch"):
        PaddingFreeCollator()([])
    with pytest.raises(ValueError, match="no samples"):
        PaddingFreeCollator()([[], []])
    s = make_sample(4, 1)
    s["input_ids"], s["labels"], s["length"] = [], [], 0
    with pytest.raises(ValueError, match=r"sample 4 \(#1 of the batch\) has 0 tokens"):
        PaddingFreeCollator()([make_sample(0, 2), s])


def test_length_field_checked():
    s = make_sample(6, 4)
    s["length"] = 5
    with pytest.raises(
        ValueError, match=r"sample 6 \(#0 of the batch\): field 'length' is 5 but input_ids has 4 tokens"
    ):
        PaddingFreeCollator()([s])


@pytest.mark.parametrize(
    "bad", [[1, 2**70], [1, "x"], [1, 2.5], np.array([1.0, 2.0]), torch.tensor([1.0, 2.0])]
)
def test_non_integer_token_ids_are_refused_not_truncated(bad):
    s = {"input_ids": bad, "labels": [-100, 2], "sample_id": 3}
    with pytest.raises(
        ValueError, match=r"sample 3 \(#1 of the batch\): field 'input_ids' cannot be converted to int64"
    ):
        PaddingFreeCollator()([make_sample(0, 2), s])


def test_bad_types_and_shapes():
    with pytest.raises(TypeError, match="wrap it in a list"):
        PaddingFreeCollator()(make_sample(0, 2))
    with pytest.raises(TypeError, match="expected a sample dict or a pack"):
        PaddingFreeCollator()([1, 2])
    with pytest.raises(TypeError, match=r"pack 0 item 1 is a str"):
        PaddingFreeCollator()([[make_sample(0, 2), "x"]])
    s = make_sample(7, 3, kind="tensor")
    s["input_ids"] = s["input_ids"][None]
    with pytest.raises(
        ValueError, match=r"sample 7 \(#0 of the batch\): field 'input_ids' must be 1-D .* has shape \(1, 3\)"
    ):
        PaddingFreeCollator()([s])
