"""PackedDataset: packs of a real PackPlan, pieces cut right, every sample once per epoch, workers, Trainer."""

from __future__ import annotations

import pickle
from collections import Counter

import datasets
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from varpack.collate import PaddingFreeCollator
from varpack.data.dataset import PackedDataset, sample_lengths
from varpack.plan import plan_packs
from varpack.varlen import cu_seqlens_from_position_ids, validate_cu_seqlens


def encoded(lengths, seed=0):
    """Encoded samples as the encode stage writes them (ids unique per sample so mix-ups show)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = (i * 1000 + np.arange(n)).tolist()
        labels = [t if rng.random() < 0.6 else -100 for t in ids]
        labels[:1] = [-100] * min(n, 1)
        out.append({"input_ids": ids, "labels": labels, "length": n, "source": f"doc{i}"})
    return out


LENGTHS = np.random.default_rng(1).integers(1, 60, 97).tolist()


def hf(rows):
    return datasets.Dataset.from_list(rows)


@pytest.fixture(params=["list", "hf"])
def data(request):
    rows = encoded(LENGTHS)
    return rows if request.param == "list" else hf(rows)


def L(x):
    return np.asarray(x).tolist()


def check_item_matches_source(rows, item):
    for s in item:
        src = rows[s["sample_id"]]
        assert L(s["input_ids"]) == src["input_ids"] and L(s["labels"]) == src["labels"]
        assert s["length"] == src["length"] == len(s["input_ids"])


def test_items_are_the_plan_packs_in_epoch_order(data):
    plan = plan_packs(LENGTHS, 128, seed=3)
    ds = PackedDataset(data, plan, epoch=2)
    assert len(ds) == plan.num_packs
    order = plan.pack_order(2)
    rows = encoded(LENGTHS)
    for i in (0, 1, len(ds) - 1):
        item = ds[i]
        if isinstance(data, datasets.Dataset):  # flat numeric columns come as numpy views of Arrow buffers
            assert all(isinstance(s["input_ids"], np.ndarray) for s in item)
        assert [s["sample_id"] for s in item] == plan.packs[order[i]].tolist()
        check_item_matches_source(rows, item)
    assert [s["sample_id"] for s in ds[-1]] == [s["sample_id"] for s in ds[len(ds) - 1]]
    with pytest.raises(IndexError, match="out of range"):
        ds[len(ds)]
    plain = PackedDataset(data, plan, shuffle=False)
    assert [[s["sample_id"] for s in plain[i]] for i in range(len(plain))] == [p.tolist() for p in plan.packs]


def test_epoch_reshuffle_changes_order_not_content():
    plan = plan_packs(LENGTHS, 64, seed=0)
    ds = PackedDataset(encoded(LENGTHS), plan)
    first = [tuple(s["sample_id"] for s in ds[i]) for i in range(len(ds))]
    ds.set_epoch(1)
    second = [tuple(s["sample_id"] for s in ds[i]) for i in range(len(ds))]
    assert first != second and sorted(first) == sorted(second)
    ds.set_epoch(0)
    assert [tuple(s["sample_id"] for s in ds[i]) for i in range(len(ds))] == first


def seen_sample_ids(loader):
    seen = []
    for batch in loader:
        validate_cu_seqlens(
            batch["cu_seq_lens_q"], batch["input_ids"].shape[1], max_seqlen=batch["max_length_q"]
        )
        assert cu_seqlens_from_position_ids(batch["position_ids"]).tolist() == batch["cu_seq_lens_q"].tolist()
        seen += batch["sample_ids"]
    return seen


@pytest.mark.parametrize("kind", ["list", "hf"])
def test_dataloader_two_workers_every_sample_once_per_epoch(kind):
    rows = encoded(LENGTHS)
    plan = plan_packs(LENGTHS, 100, seed=5)
    ds = PackedDataset(rows if kind == "list" else hf(rows), plan)
    loader = DataLoader(ds, batch_size=2, num_workers=2, collate_fn=PaddingFreeCollator(pad_to_multiple_of=8))
    orders = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        seen = seen_sample_ids(loader)
        assert Counter(seen) == Counter(range(len(LENGTHS))), f"epoch {epoch}"
        orders.append(seen)
    assert orders[0] != orders[1]


def test_collated_rows_carry_the_source_tokens(data):
    rows = encoded(LENGTHS)
    ds = PackedDataset(data, plan_packs(LENGTHS, 128))
    batch = PaddingFreeCollator()([ds[0], ds[1]])
    expected_ids = [t for sid in batch["sample_ids"] for t in rows[sid]["input_ids"]]
    expected_labels = [t for sid in batch["sample_ids"] for t in rows[sid]["labels"]]
    assert batch["input_ids"][0].tolist() == expected_ids
    assert batch["labels"][0].tolist() == expected_labels


def test_picklable():
    ds = PackedDataset(hf(encoded(LENGTHS)), plan_packs(LENGTHS, 128), epoch=1)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.epoch == 1
    assert [s["sample_id"] for s in clone[3]] == [s["sample_id"] for s in ds[3]]


# ---------------------------------------------------------------- pieces of overlong samples
@pytest.mark.parametrize("kind", ["list", "hf"])
def test_split_pieces_are_cut_on_every_token_field(kind):
    lengths = [3, 10, 2, 9]
    rows = encoded(lengths)
    for r in rows:
        r["loss_scale"] = [float(t % 7) for t in r["input_ids"]]
        r["position_ids"] = [list(range(r["length"]))] * 4  # [4, L] text-first planes
        r["labels"] = [-100] + r["input_ids"][1:]  # every later token supervised: the cut must re-mask
    plan = plan_packs(lengths, 4, overflow="split")
    ds = PackedDataset(rows if kind == "list" else hf(rows), plan, shuffle=False)
    covered: dict[int, list[tuple[int, int]]] = {}
    items = [s for i in range(len(ds)) for s in ds[i]]
    for s in items:
        src = rows[s["sample_id"]]
        if "piece_id" not in s:
            assert L(s["input_ids"]) == src["input_ids"]
            covered.setdefault(s["sample_id"], []).append((0, src["length"]))
            continue
        a, b = s["piece_range"]
        assert plan.pieces[s["piece_id"]] == (s["sample_id"], a, b)
        assert L(s["input_ids"]) == src["input_ids"][a:b]
        assert L(s["loss_scale"]) == src["loss_scale"][a:b]
        assert L(s["labels"]) == [-100] + src["labels"][a + 1 : b]
        assert s["length"] == b - a
        # text plane restarts, the other planes keep the whole sample's values (as slice_mm_sample does)
        assert np.asarray(s["position_ids"]).tolist() == [list(range(b - a))] + [list(range(a, b))] * 3
        covered.setdefault(s["sample_id"], []).append((a, b))
    # every token of every sample is in exactly one item
    for sid, ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == lengths[sid]
        assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))
    assert sorted(covered) == [0, 1, 2, 3]
    # the source rows were not modified by the cuts
    assert rows[1]["labels"][4] != -100
    batch = PaddingFreeCollator()([ds[i] for i in range(len(ds))])
    assert (
        cu_seqlens_from_position_ids(batch["position_ids"], text_plane=0).tolist()
        == batch["cu_seq_lens_q"].tolist()
    )
    assert Counter(batch["sample_ids"]) == Counter({0: 1, 1: 3, 2: 1, 3: 3})


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 30), min_size=1, max_size=25),
    st.integers(4, 24),
    st.sampled_from(["drop", "truncate", "split"]),
    st.integers(0, 3),
)
def test_every_token_once_per_epoch_or_reported(lengths, packing_length, overflow, epoch):
    """Property: each epoch covers every kept token of every sample exactly once; the rest is reported."""
    rows = encoded(lengths)
    plan = plan_packs(lengths, packing_length, overflow=overflow, seed=1)
    ds = PackedDataset(rows, plan, epoch=epoch)
    tokens: Counter = Counter()
    for i in range(len(ds)):
        pack = ds[i]
        assert sum(len(s["input_ids"]) for s in pack) <= packing_length
        for s in pack:
            assert L(s["labels"])[0] == -100
            a, b = s.get("piece_range", (0, lengths[s["sample_id"]]))
            assert L(s["input_ids"]) == rows[s["sample_id"]]["input_ids"][a:b]
            tokens.update((s["sample_id"], t) for t in range(a, b))
    assert max(tokens.values(), default=1) == 1
    report = plan.overflow
    for sid, n in enumerate(lengths):
        kept = sum(1 for t in range(n) if (sid, t) in tokens)
        if n == 0:
            assert sid in report["empty_ids"]
        elif n <= packing_length or overflow == "split":
            assert kept == n
        elif overflow == "truncate":
            assert kept == packing_length and sid in report["truncated_ids"]
        else:
            assert kept == 0 and sid in report["dropped_ids"]


def test_truncate_keeps_the_head_and_numpy_fields():
    lengths = [3, 9]
    rows = encoded(lengths)
    rows[1] = {k: (np.asarray(v) if isinstance(v, list) else v) for k, v in rows[1].items()}
    before = rows[1]["labels"].copy()
    plan = plan_packs(lengths, 5, overflow="truncate")
    ds = PackedDataset(rows, plan, shuffle=False)
    piece = next(s for i in range(len(ds)) for s in ds[i] if "piece_id" in s)
    assert piece["piece_range"] == (0, 5) and piece["input_ids"].tolist() == list(range(1000, 1005))
    assert piece["labels"][0] == -100
    np.testing.assert_array_equal(rows[1]["labels"], before)  # a copy was cut, not a view


def test_pieces_of_media_samples_go_through_the_multimodal_slicer():
    """An image sample is cut by varpack.data.multimodal.slice_mm_sample: never through an image."""
    # 11 tokens: text, <vision_start> image (4 pad tokens: grid 1x4x4 = 16 patches, merge 2x2) <vision_end>,
    # text; the image span with its delimiters is tokens [2, 8)
    mm = [0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    rows = encoded([2, 11])
    rows[1]["mm_token_type_ids"] = mm
    rows[1]["pixel_values"] = [[float(k)] * 3 for k in range(16)]
    rows[1]["image_grid_thw"] = [[1, 4, 4]]
    ok = PackedDataset(rows, plan_packs([2, 11], 8, overflow="split"), shuffle=False)  # cut at 8: legal
    pieces = sorted(
        (s for i in range(len(ok)) for s in ok[i] if "piece_id" in s), key=lambda s: s["piece_range"]
    )
    head, tail = pieces
    assert head["piece_range"] == (0, 8) and np.asarray(head["image_grid_thw"]).tolist() == [[1, 4, 4]]
    assert len(head["pixel_values"]) == 16 and "pixel_values" not in tail
    assert L(head["labels"])[0] == -100 and L(tail["labels"])[0] == -100
    batch = PaddingFreeCollator()([ok[i] for i in range(len(ok))])
    assert batch["pixel_values"].shape == (16, 3)
    bad = PackedDataset(rows, plan_packs([2, 11], 5, overflow="split"), shuffle=False)  # cut at 5: inside
    with pytest.raises(ValueError, match=r"sample 1: cut at token 5 .* falls inside image"):
        [bad[i] for i in range(len(bad))]


# ---------------------------------------------------------------- plan check
def test_plan_for_other_samples_is_refused():
    rows = encoded(LENGTHS)
    plan = plan_packs(LENGTHS, 128)
    with pytest.raises(
        ValueError, match=rf"made for {len(LENGTHS)} samples but the dataset has {len(LENGTHS) - 1}"
    ):
        PackedDataset(rows[:-1], plan)
    other = encoded(LENGTHS[:10] + [LENGTHS[10] + 1] + LENGTHS[11:])
    with pytest.raises(
        ValueError, match=rf"sample 10 has {LENGTHS[10] + 1} tokens, the plan packed it as {LENGTHS[10]}"
    ):
        PackedDataset(other, plan)
    with pytest.raises(ValueError, match="fingerprint"):
        PackedDataset(hf(other), plan)
    # same lengths, other settings: the fingerprint also covers packing_length/strategy/overflow
    PackedDataset(rows, plan)
    PackedDataset(other, plan, check=False)  # explicitly unchecked


def test_sample_lengths_without_length_column():
    rows = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in encoded([4, 1, 7])]
    assert sample_lengths(rows).tolist() == [4, 1, 7]
    assert sample_lengths(hf(rows)).tolist() == [4, 1, 7]
    assert sample_lengths(hf(rows).select([2, 0])).tolist() == [7, 4]
    with pytest.raises(ValueError, match="neither"):
        sample_lengths([{"labels": [1]}])


def test_bad_arguments():
    plan = plan_packs([1, 2], 4)
    with pytest.raises(TypeError, match="PackPlan"):
        PackedDataset(encoded([1, 2]), object())
    with pytest.raises(TypeError, match="sequence of dicts"):
        PackedDataset(42, plan)
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        PackedDataset(encoded([1, 2]), plan, epoch=-1)


# ---------------------------------------------------------------- HF Trainer
def test_hf_trainer_sees_every_sample_once(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    lengths = [5, 9, 3, 12, 7, 1, 8, 4]
    rows = [{**r, "input_ids": [t % 90 + 1 for t in r["input_ids"]]} for r in encoded(lengths)]
    for r in rows:
        r["labels"] = [-100] + r["input_ids"][1:]
    ds = PackedDataset(hf(rows), plan_packs(lengths, 16))
    collator = PaddingFreeCollator()
    seen: list[int] = []

    def recording(features):
        batch = collator(features)
        seen.extend(batch["sample_ids"])
        return batch

    config = LlamaConfig(
        vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=1, num_train_epochs=1, report_to=[],
        remove_unused_columns=False, use_cpu=True, save_strategy="no", logging_strategy="no",
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=ds, data_collator=recording)
    result = trainer.train()
    assert np.isfinite(result.training_loss)
    assert Counter(seen) == Counter(range(len(lengths)))
    assert result.global_step == len(ds)


def test_supervised_ranges_read_through_arrow_equal_the_rows(monkeypatch):
    """supervised_ranges over a datasets.Dataset (Arrow blocks, also after select() reorders the rows) answers
    as over the list of rows: a range holds a supervised token when a label other than -100 follows its
    first token."""
    import datasets

    from varpack.data import dataset as dataset_module
    from varpack.data.dataset import supervised_ranges

    rng = np.random.default_rng(0)
    rows = []
    for _ in range(50):
        n = int(rng.integers(1, 30))
        labels = [-100] * n
        for t in rng.choice(n, size=min(n, int(rng.integers(0, 3))), replace=False).tolist():
            labels[t] = t  # labels[0] may be set: it is never counted
        rows.append({"input_ids": list(range(n)), "labels": labels})
    sids = rng.integers(0, 50, size=400)
    lens = np.array([len(rows[i]["labels"]) for i in sids])
    starts = (rng.random(400) * lens).astype(np.int64)
    stops = starts + 1 + (rng.random(400) * (lens - starts)).astype(np.int64)
    want = np.array(
        [any(x != -100 for x in rows[i]["labels"][a + 1 : b]) for i, a, b in zip(sids, starts, stops)]
    )
    assert want.any() and not want.all()
    monkeypatch.setattr(dataset_module, "_LABEL_ROWS", 7)  # several blocks
    hf = datasets.Dataset.from_list(rows)
    assert (supervised_ranges(rows)(sids, starts, stops) == want).all()
    assert (supervised_ranges(hf)(sids, starts, stops) == want).all()
    perm = rng.permutation(50)
    picked = hf.select(perm.tolist())  # an indices mapping over the Arrow table
    inv = np.argsort(perm)
    assert (supervised_ranges(picked)(inv[sids], starts, stops) == want).all()
    with pytest.raises(ValueError, match="no 'labels'"):
        supervised_ranges(datasets.Dataset.from_list([{"input_ids": [1, 2]}]))
