"""DPO loss pieces: the loss equals TRL 1.16's DPOTrainer._compute_loss on the same log-probabilities (TRL's own
code runs on a stand-in trainer and model), the segment reduction of sequence_logps, the pair-layout and
settings checks."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from varpack.train.objectives import OBJECTIVES, get_objective
from varpack.train.objectives.dpo import DPOObjective, dpo_loss, pair_layout, sequence_logps

trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")


def _trl_loss(chosen, rejected, ref_chosen, ref_rejected, *, beta, label_smoothing, loss_type):
    """TRL's own ``DPOTrainer._compute_loss`` with precomputed reference log-probs; the stand-in model returns
    per-token log-probs whose sum over the completion is the given per-sequence value."""
    pairs, seq = chosen.shape[0], 5
    logps = torch.cat([chosen, rejected])  # TRL's batch: [chosen..., rejected...]
    log_probs = torch.zeros(2 * pairs, seq - 1, dtype=torch.float64)
    log_probs[:, 0] = logps * 0.25
    log_probs[:, 2] = logps * 0.75
    outputs = SimpleNamespace(
        log_probs=log_probs,
        entropy=torch.zeros(2 * pairs, seq - 1),
        mean_logits=torch.zeros(2 * pairs, seq - 1),
        is_top1=torch.zeros(2 * pairs, seq - 1, dtype=torch.bool),
    )
    identity = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=identity,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    completion_mask = torch.zeros(2 * pairs, seq, dtype=torch.long)
    completion_mask[:, 1:] = 1
    inputs = {
        "input_ids": torch.ones(2 * pairs, seq, dtype=torch.long),
        "attention_mask": torch.ones(2 * pairs, seq, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    return trl_dpo.DPOTrainer._compute_loss(trainer, lambda **kw: outputs, inputs, False)


@pytest.mark.parametrize(
    "loss_type, beta, label_smoothing",
    [
        ("sigmoid", 0.1, 0.0),
        ("sigmoid", 2.0, 0.0),
        ("robust", 0.1, 0.1),
        ("robust", 0.5, 0.3),
        ("robust", 0.1, 0.0),
    ],
)
def test_dpo_loss_equals_trl(loss_type, beta, label_smoothing):
    g = torch.Generator().manual_seed(0)
    c, r, rc, rr = (-50 * torch.rand(6, generator=g, dtype=torch.float64) for _ in range(4))
    ours = dpo_loss(c, r, rc, rr, beta=beta, label_smoothing=label_smoothing, loss_type=loss_type).mean()
    theirs = _trl_loss(c, r, rc, rr, beta=beta, label_smoothing=label_smoothing, loss_type=loss_type)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    # the comparison can fail: swapping chosen and rejected changes TRL's loss
    swapped = _trl_loss(r, c, rr, rc, beta=beta, label_smoothing=label_smoothing, loss_type=loss_type)
    assert abs(float(swapped - ours)) > 1e-3


def test_sequence_logps_is_a_segment_sum():
    """One index_add_ over the row == log_softmax + gather summed per segment (a loop, here only)."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 6, 4]
    t, v = sum(lengths), 11
    logits = torch.randn(1, t, v, generator=g)
    labels = torch.randint(0, v, (1, t), generator=g)
    seq_idx = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))[None]
    starts = [0, 3, 4, 10]
    labels[0, starts] = -100
    labels[0, 6] = -100  # an unsupervised token inside a sample
    got = sequence_logps(logits, labels, seq_idx, 4)
    logp = torch.log_softmax(logits[0], -1)
    want = torch.zeros(4)
    for s, (a, n) in enumerate(zip(starts, lengths)):
        for i in range(a + 1, a + n):
            if labels[0, i] != -100:
                want[s] += logp[i - 1, labels[0, i]]
    torch.testing.assert_close(got, want)
    assert got[1] == 0  # a 1-token sample scores nothing
    # a first label that is not -100 is still never predicted from the previous sample (seq_idx masks it)
    labels2 = labels.clone()
    labels2[0, 4] = 3
    torch.testing.assert_close(sequence_logps(logits, labels2, seq_idx, 4), got)
    with pytest.raises(ValueError, match="must be"):
        sequence_logps(logits, labels[:, :-1], seq_idx, 4)


def test_pair_layout():
    assert pair_layout([4, 5, 0, 1]) == 2
    with pytest.raises(ValueError, match="whole preference pairs, chosen then rejected"):
        pair_layout([5, 4])
    with pytest.raises(ValueError, match="whole preference pairs"):
        pair_layout([0, 1, 2])
    with pytest.raises(ValueError, match="needs the batch's sample_ids"):
        pair_layout(None)


def test_settings_refused():
    with pytest.raises(ValueError, match="has no effect on loss_type='sigmoid'"):
        DPOObjective(label_smoothing=0.1)
    with pytest.raises(ValueError, match="beta must be a finite number > 0"):
        DPOObjective(beta=0.0)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\)"):
        DPOObjective(loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="loss_type must be one of"):
        DPOObjective(loss_type="ipo")


def test_registered_and_needs_a_reference():
    assert "dpo" in OBJECTIVES and get_objective("dpo").name == "dpo"
    batch = {
        "sample_ids": [0, 1],
        "labels": torch.tensor([[-100, 1]]),
        "seq_idx": torch.zeros(1, 2, dtype=torch.int32),
        "input_ids": torch.tensor([[1, 1]]),
        "cu_seq_lens_q": torch.tensor([0, 1, 2], dtype=torch.int32),
    }

    def model(**kw):
        return SimpleNamespace(logits=torch.zeros(1, 2, 4))

    with pytest.raises(ValueError, match="needs a reference model"):
        get_objective("dpo").loss(model, batch)
