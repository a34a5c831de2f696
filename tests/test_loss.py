"""causal_lm_loss: packed == unpacked for token and sample reductions, boundary safety, accumulation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from varpack.loss import causal_lm_loss, count_loss_items

V = 37
LENGTHS = (6, 1, 9, 4, 2)


def make(lengths=LENGTHS, seed=0, dtype=torch.float32):
    """Per-sample logits/labels (labels[0] = -100, a prompt part unsupervised) and their packed row."""
    g = torch.Generator().manual_seed(seed)
    logits, labels = [], []
    for n in lengths:
        logits.append(torch.randn(n, V, generator=g).to(dtype))
        lab = torch.randint(0, V, (n,), generator=g)
        lab[: max(1, n // 3)] = -100
        labels.append(lab)
    packed_logits = torch.cat(logits)[None]
    packed_labels = torch.cat(labels)[None]
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]
    return logits, labels, packed_logits, packed_labels, seq_idx


def per_sample_ce(logit, label):
    """Independent oracle: torch's own mean CE of one unpacked sample (None when nothing is supervised)."""
    target = label[1:]
    if (target != -100).sum() == 0:
        return None, 0
    return F.cross_entropy(logit[:-1].float(), target, ignore_index=-100, reduction="sum"), int(
        (target != -100).sum()
    )


def test_token_equals_unpacked():
    logits, labels, pl, plab, seq = make()
    sums = [per_sample_ce(lg, lb) for lg, lb in zip(logits, labels)]
    total = sum(s for s, _ in sums if s is not None)
    count = sum(c for _, c in sums)
    expected = total / count
    torch.testing.assert_close(causal_lm_loss(pl, plab), expected)
    torch.testing.assert_close(causal_lm_loss(pl, plab, seq_idx=seq), expected)


def test_token_matches_transformers_for_causal_lm_loss():
    """Oracle: transformers' ForCausalLMLoss on the right-padded unpacked batch (one row per sample)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits, labels, pl, plab, _ = make()
    t = max(LENGTHS)
    padded_logits = torch.zeros(len(LENGTHS), t, V)
    padded_labels = torch.full((len(LENGTHS), t), -100)
    for i, (lg, lb) in enumerate(zip(logits, labels)):
        padded_logits[i, : len(lb)] = lg
        padded_labels[i, : len(lb)] = lb
    hf = ForCausalLMLoss(padded_logits, padded_labels, vocab_size=V)
    torch.testing.assert_close(causal_lm_loss(pl, plab), hf)
    # and the padded rows themselves (B > 1) give the same value through causal_lm_loss
    torch.testing.assert_close(causal_lm_loss(padded_logits, padded_labels), hf)


def test_sample_equals_unpacked():
    logits, labels, pl, plab, seq = make()
    means = []
    for lg, lb in zip(logits, labels):
        if (lb[1:] != -100).any():
            means.append(F.cross_entropy(lg[:-1], lb[1:], ignore_index=-100))  # torch's mean per sample
    assert len(means) < len(LENGTHS)  # the 1-token sample (and 2-token one) have no supervised target
    expected = torch.stack(means).mean()
    torch.testing.assert_close(causal_lm_loss(pl, plab, reduction="sample", seq_idx=seq), expected)


def test_shift_would_leak_without_the_first_label_rule():
    """With a supervised first label, the last token of sample n would be scored on sample n+1's first token:
    the packed loss then differs from the unpacked one, unless seq_idx masks the crossing predictions."""
    logits, labels, pl, plab, seq = make()
    leaky = plab.clone()
    starts = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0)[:-1].tolist()])
    leaky[0, starts] = 3  # every sample's first label supervised
    unpacked_total, unpacked_count = 0.0, 0
    for lg, lb in zip(logits, labels):
        lb = lb.clone()
        lb[0] = 3  # unpacked, the first label is never a target anyway (nothing predicts it)
        s, c = per_sample_ce(lg, lb)
        if s is not None:
            unpacked_total, unpacked_count = unpacked_total + s, unpacked_count + c
    expected = unpacked_total / unpacked_count
    leaked = causal_lm_loss(pl, leaky)
    assert (leaked - expected).abs().item() > 1e-3
    torch.testing.assert_close(causal_lm_loss(pl, leaky, seq_idx=seq), expected)


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_gradient_accumulation_equals_one_batch(reduction):
    """Micro-batches scaled by the step's global count sum to the single-batch loss and gradient."""
    logits, labels, _, _, _ = make(lengths=(6, 1, 9, 4, 2, 7, 3))
    split = [(0, 4), (4, 5), (5, 7)]  # three uneven micro-batches (packs)

    def pack(lo, hi):
        lg = torch.cat(logits[lo:hi])[None].clone().requires_grad_(True)
        lb = torch.cat(labels[lo:hi])[None]
        seq = torch.cat([torch.full((len(labels[i]),), i - lo, dtype=torch.int32) for i in range(lo, hi)])[
            None
        ]
        return lg, lb, seq

    whole_lg, whole_lb, whole_seq = pack(0, 7)
    whole = causal_lm_loss(whole_lg, whole_lb, reduction=reduction, seq_idx=whole_seq)
    whole.backward()

    micro = [pack(lo, hi) for lo, hi in split]
    n_items = sum(count_loss_items(lb, reduction=reduction, seq_idx=seq) for _, lb, seq in micro)
    expected_items = count_loss_items(whole_lb, reduction=reduction, seq_idx=whole_seq)
    assert n_items == expected_items
    acc = 0.0
    for lg, lb, seq in micro:
        loss = causal_lm_loss(lg, lb, reduction=reduction, seq_idx=seq, num_items_in_batch=n_items)
        loss.backward()
        acc = acc + loss.detach()
    torch.testing.assert_close(acc, whole.detach())
    grads = torch.cat([lg.grad for lg, _, _ in micro], dim=1)
    torch.testing.assert_close(grads, whole_lg.grad)
    # without the global count each micro-batch is its own mean: the sum is not the step's mean
    naive = sum(causal_lm_loss(lg, lb, reduction=reduction, seq_idx=seq) for lg, lb, seq in micro) / len(
        micro
    )
    assert (naive - whole).abs().item() > 1e-4


def test_num_items_tensor_and_count():
    _, _, pl, plab, seq = make()
    n = count_loss_items(plab)
    assert n == int((plab[0, 1:] != -100).sum())
    torch.testing.assert_close(
        causal_lm_loss(pl, plab, num_items_in_batch=torch.tensor(n)), causal_lm_loss(pl, plab)
    )
    assert count_loss_items(plab, reduction="sample", seq_idx=seq) == 4  # all but the 1-token sample


def test_bf16_logits_computed_in_fp32():
    _, _, pl, plab, _ = make(dtype=torch.bfloat16)
    loss = causal_lm_loss(pl, plab)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, causal_lm_loss(pl.float(), plab))


def test_loss_scale_weights_tokens():
    _, _, pl, plab, seq = make()
    scale = torch.rand(plab.shape, generator=torch.Generator().manual_seed(1))
    target = plab[0, 1:]
    valid = target != -100
    per_token = F.cross_entropy(pl[0, :-1], target.clamp(min=0), reduction="none")
    expected = (per_token * scale[0, 1:] * valid).sum() / valid.sum()
    torch.testing.assert_close(causal_lm_loss(pl, plab, loss_scale=scale), expected)
    ones = torch.ones_like(scale)
    torch.testing.assert_close(causal_lm_loss(pl, plab, loss_scale=ones), causal_lm_loss(pl, plab))


def test_nothing_supervised_is_zero_with_graph():
    lg = torch.randn(1, 4, V, requires_grad=True)
    loss = causal_lm_loss(lg, torch.full((1, 4), -100))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.count_nonzero(lg.grad) == 0


def test_errors():
    _, _, pl, plab, seq = make()
    with pytest.raises(ValueError, match="needs seq_idx"):
        causal_lm_loss(pl, plab, reduction="sample")
    with pytest.raises(ValueError, match="reduction"):
        causal_lm_loss(pl, plab, reduction="mean")
    with pytest.raises(ValueError, match="does not match labels shape"):
        causal_lm_loss(pl[:, :-1], plab)
    with pytest.raises(ValueError, match="seq_idx shape"):
        causal_lm_loss(pl, plab, seq_idx=seq[:, :-1])
    for bad in (-1, -0.5, float("nan")):
        with pytest.raises(ValueError, match="num_items_in_batch must be a count >= 0"):
            causal_lm_loss(pl, plab, num_items_in_batch=bad)
    with pytest.raises(ValueError, match="needs seq_idx"):
        count_loss_items(plab, reduction="sample")


def test_count_tensor_matches_count():
    from varpack.loss import count_loss_items_tensor

    _, _, _, plab, seq = make()
    for reduction in ("token", "sample"):
        n = count_loss_items(plab, reduction=reduction, seq_idx=seq)
        t = count_loss_items_tensor(plab, reduction=reduction, seq_idx=seq)
        assert t.dim() == 0 and int(t) == n


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_zero_count_is_one_rule_for_a_number_and_a_tensor(reduction):
    """num_items_in_batch=0 (a step without any supervised item): a Python 0 and tensor(0) give the same loss
    (0 with zero gradients when nothing is supervised; the sum over 1 otherwise), never an error for one and a
    value for the other."""
    seq = torch.zeros(1, 4, dtype=torch.int32)
    for zero in (0, 0.0, torch.tensor(0)):
        lg = torch.randn(1, 4, V, requires_grad=True)
        labels = torch.full((1, 4), -100)
        loss = causal_lm_loss(lg, labels, reduction=reduction, seq_idx=seq, num_items_in_batch=zero)
        assert loss.item() == 0.0
        loss.backward()
        assert torch.count_nonzero(lg.grad) == 0
    _, _, pl, plab, seq = make()
    one = causal_lm_loss(pl, plab, reduction=reduction, seq_idx=seq, num_items_in_batch=1)
    for zero in (0, torch.tensor(0)):
        got = causal_lm_loss(pl, plab, reduction=reduction, seq_idx=seq, num_items_in_batch=zero)
        assert torch.equal(got, one)


def test_denominator_of_a_host_count_is_filled_on_the_device_not_copied():
    """A Python count, or a one-element CPU tensor going to another device, becomes ``torch.full`` there (a copy
    from pageable host memory would wait for the stream: a host sync; the GPU side is
    tests/ops/test_linear_ce_supervised_rows.py's sync test); the values follow one rule."""
    from varpack.loss import loss_denominator

    for n, want in ((5, 5.0), (5.0, 5.0), (0, 1.0), (torch.tensor(7), 7.0), (torch.tensor([0.0]), 1.0)):
        got = loss_denominator(n, torch.device("cpu"))
        assert got.shape == () and got.dtype == torch.float32 and got.item() == want
    fills = []
    real_full = torch.full

    def spy(*args, **kwargs):
        fills.append(kwargs.get("device"))
        return real_full(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "full", spy)
        for n in (3, torch.tensor(3)):
            out = loss_denominator(n, torch.device("meta"))
            assert out.device.type == "meta" and out.shape == ()
    assert fills == [torch.device("meta")] * 2
    with pytest.raises(ValueError, match="num_items_in_batch must be a count >= 0"):
        loss_denominator(torch.tensor(-1), torch.device("meta"))  # a host value is read, so it is checked
    clamped = loss_denominator(torch.tensor(-1), torch.device("cpu"))  # a tensor where it lives: clamped
    assert clamped.item() == 1.0
