"""varpack.collate.shard_batch: one rank's share of a packed row is data-exact -- labels shifted before the
split, positions cut with the tokens, the row's boundaries kept whole -- and the token-mean loss summed over the
shards equals the one-row loss (a shift after the split does not: the negative control)."""

from __future__ import annotations

import pytest
import torch

from varpack.collate import PaddingFreeCollator, shard_batch
from varpack.collate.context_parallel import shifted_targets
from varpack.loss import causal_lm_loss, shifted_lm_loss
from varpack.schema import CP_SHARD, IGNORE_INDEX, SHIFT_LABELS, SHIFT_LOSS_SCALE


def _pack(lengths=(7, 3, 11, 1, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(1, 50, (n,), generator=g).tolist()
        labels = [-100] + ids[1:]
        if i == 2:
            labels[1:4] = [-100] * 3  # a prompt inside
        out.append({"input_ids": ids, "labels": labels, "loss_scale": [0.5 + 0.1 * j for j in range(n)]})
    return out


def test_shifted_targets_stay_inside_each_sample():
    labels = torch.tensor([[-100, 5, 6, -100, 7, 8]])
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1]])
    scale = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    targets, shifted = shifted_targets(labels, seq_idx, scale)
    assert targets.tolist() == [[5, 6, -100, 7, 8, -100]]
    assert shifted.tolist() == [[2.0, 3.0, 0.0, 5.0, 6.0, 0.0]]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shards_cut_every_token_field_and_keep_the_row_boundaries(size):
    batch = PaddingFreeCollator()([_pack()])
    full_targets, full_scale = shifted_targets(batch["labels"], batch["seq_idx"], batch["loss_scale"])
    seen = []
    for rank in range(size):
        shard = shard_batch(batch, rank, size)
        split = shard[CP_SHARD]
        idx = split.index
        seen += idx.tolist()
        assert torch.equal(shard["input_ids"], batch["input_ids"][:, idx])
        assert torch.equal(shard["position_ids"], batch["position_ids"][:, idx])  # the row's positions
        assert torch.equal(shard[SHIFT_LABELS], full_targets[:, idx])
        assert torch.equal(shard[SHIFT_LOSS_SCALE], full_scale[:, idx])
        assert (
            shard["varlen_meta"] is batch["varlen_meta"] and shard["cu_seq_lens_q"] is batch["cu_seq_lens_q"]
        )
        assert "labels" not in shard and "seq_idx" not in shard and "loss_scale" not in shard
    assert sorted(seen) == list(range(batch["input_ids"].shape[1]))


def test_mrope_planes_are_cut_with_the_tokens():
    pack = _pack((5, 4))
    for s in pack:
        n = len(s["input_ids"])
        s["position_ids"] = [list(range(n)), [10 + j for j in range(n)], [20 + j for j in range(n)], [30] * n]
    batch = PaddingFreeCollator()([pack])
    assert batch["position_ids"].shape[0] == 4
    shard = shard_batch(batch, 1, 2)
    assert torch.equal(shard["position_ids"], batch["position_ids"][..., shard[CP_SHARD].index])


def test_token_mean_over_shards_equals_the_row_and_a_shift_after_the_split_does_not():
    batch = PaddingFreeCollator()([_pack()])
    logits = torch.randn(1, batch["input_ids"].shape[1], 50, generator=torch.Generator().manual_seed(1))
    row = causal_lm_loss(logits, batch["labels"], seq_idx=batch["seq_idx"])
    size = 3
    shards = [shard_batch(batch, r, size) for r in range(size)]
    count = sum(int((s[SHIFT_LABELS] != IGNORE_INDEX).sum()) for s in shards)
    total = sum(
        shifted_lm_loss(logits[:, s[CP_SHARD].index], s[SHIFT_LABELS], num_items_in_batch=count)
        for s in shards
    )
    assert float(total) == pytest.approx(float(row), rel=1e-6)
    # negative control: each rank shifts its own (non-contiguous) labels after the split
    wrong = 0.0
    for s in shards:
        local = s[CP_SHARD].take(batch["labels"])
        wrong += float(causal_lm_loss(logits[:, s[CP_SHARD].index], local, num_items_in_batch=count))
    assert abs(wrong - float(row)) > 1e-2 * abs(float(row))


def test_shard_batch_refusals():
    batch = PaddingFreeCollator()([_pack()])
    with pytest.raises(ValueError, match=r"does not know how to split the batch keys \['extra_field'\]"):
        shard_batch({**batch, "extra_field": torch.zeros(1)}, 0, 2)
    with pytest.raises(ValueError, match="needs labels"):
        shard_batch({k: v for k, v in batch.items() if k != "labels"}, 0, 2)
    with pytest.raises(ValueError, match="cannot be split over 64"):
        shard_batch(batch, 0, 64)
    with pytest.raises(ValueError, match="varlen_meta"):
        shard_batch({k: v for k, v in batch.items() if k != "varlen_meta"}, 0, 2)
