"""Packed DPO == unpacked DPO: per-sequence log-probabilities, the DPO loss and every parameter's gradient of
the policy, for a dense tiny Qwen3 and a gated-delta tiny Qwen3.5 (fp32, CPU).

Packed: the pairs of one pack collated into one row (PaddingFreeCollator), ``DPOObjective.loss`` with a frozen
reference model on the same row (the objective's one segment reduction over ``seq_idx``). Unpacked: every
sequence alone through the model's own path (dense: transformers' sdpa attention; Qwen3.5: its own layers),
log-probabilities by ``log_softmax`` + ``gather`` over the completion, TRL's sigmoid loss averaged over pairs.
Negative control: the models see the row with its boundaries dropped (one segment; the loss side keeps the
real layout) and the comparison must fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests._exact import LOGITS_RTOL, MARGIN, assert_exact, measure
from varpack.collate import PaddingFreeCollator
from varpack.integrations.transformers import enable_varpack
from varpack.models import load_model
from varpack.models.gated_delta import tiny_model
from varpack.train.objectives.dpo import DPOObjective

VOCAB = 512
BETA = 0.5
# (prompt, chosen completion, rejected completion) lengths: a 1-token completion, sequences across the
# 64-token chunk of the gated delta rule
PAIRS = [(5, 3, 7), (2, 1, 4), (30, 40, 36)]
#: a sequence log-probability is a sum of ~40 token log-probabilities (~250 in all): honest gaps are ~2e-7 of it,
#: a pack without boundaries moves it by ~1e-3 of it
LOGPS_RTOL = 2e-6
#: the DPO loss carries the log-probabilities' absolute gaps (times beta), not a relative rounding of its own
DPO_LOSS_RTOL = LOGITS_RTOL


def make_pairs(pairs=PAIRS, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for k, (p, c, r) in enumerate(pairs):
        prompt = torch.randint(1, VOCAB, (p,), generator=g)
        for j, n in enumerate((c, r)):
            ids = torch.cat([prompt, torch.randint(1, VOCAB, (n,), generator=g)])
            labels = ids.clone()
            labels[:p] = -100
            samples.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "sample_id": 2 * k + j})
    return samples


class DropBoundaries(torch.nn.Module):
    """Negative control: the wrapped model sees the row as ONE segment (boundaries dropped)."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, **kw):
        t = kw["input_ids"].shape[1]
        kw["cu_seq_lens_q"] = kw["cu_seq_lens_k"] = torch.tensor([0, t], dtype=torch.int32)
        kw["max_length_q"] = kw["max_length_k"] = t
        kw.pop("varlen_meta")
        kw.pop("seq_idx")
        return self.inner(**kw)


def packed_run(policy, ref, samples, *, sabotage=False):
    batch = PaddingFreeCollator()([samples])
    objective = DPOObjective(beta=BETA, ref_model=DropBoundaries(ref) if sabotage else ref)
    model = DropBoundaries(policy) if sabotage else policy
    policy.zero_grad(set_to_none=True)
    logps, ref_logps, _ = objective.sequence_logps(model, batch)
    loss = objective.loss(model, batch).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}
    return logps.detach(), ref_logps, loss.detach(), grads


def _own_logps(model, sample):
    ids = torch.tensor([sample["input_ids"]])
    labels = torch.tensor(sample["labels"])
    logits = model(input_ids=ids).logits[0, :-1].float()
    target = labels[1:]
    mask = target != -100
    tok = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0)[:, None])[:, 0]
    return (tok * mask).sum()


def unpacked_run(policy, ref, samples, attn=None):
    """Each sequence alone through the model's own path; TRL's sigmoid DPO loss, mean over pairs."""
    models = (policy, ref)
    current = [m.config._attn_implementation for m in models]
    if attn is not None:
        for m in models:
            m.set_attn_implementation(attn)
    try:
        policy.zero_grad(set_to_none=True)
        logps = torch.stack([_own_logps(policy, s) for s in samples])
        with torch.no_grad():
            ref_logps = torch.stack([_own_logps(ref, s) for s in samples])
        delta = (logps[0::2] - ref_logps[0::2]) - (logps[1::2] - ref_logps[1::2])
        loss = -F.logsigmoid(BETA * delta).mean()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in policy.named_parameters() if p.grad is not None}
        return logps.detach(), ref_logps, loss.detach(), grads
    finally:
        for m, impl in zip(models, current):
            m.set_attn_implementation(impl)


def _dense(seed):
    return load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference", seed=seed)


def _gated(seed):
    return enable_varpack(tiny_model("tiny-qwen3.5", seed=seed, vocab_size=VOCAB), linear_backend="chunk")


MODELS = {"tiny-qwen3": (_dense, "sdpa"), "tiny-qwen3.5": (_gated, None)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def models(request):
    build, attn = MODELS[request.param]
    return build(1), build(2), attn  # policy, reference (other weights: a non-trivial log ratio)


def _gaps(a, b):
    """Worst gaps (tests/_exact.py) of run ``a`` against the reference run ``b``: sequence log-probabilities
    (a sum over the completion), the reference model's, the loss, the gradients."""
    logps_a, ref_a, loss_a, grads_a = a
    logps_b, ref_b, loss_b, grads_b = b
    return {
        "logps": measure(logps_a, logps_b, rtol=LOGPS_RTOL, what="logps"),
        "ref_logps": measure(ref_a, ref_b, rtol=LOGPS_RTOL, what="ref_logps"),
        "loss": measure(loss_a, loss_b, rtol=DPO_LOSS_RTOL, what="loss"),
        "grad": measure(grads_a, grads_b, what="gradient"),
    }


def test_packed_dpo_equals_unpacked(models):
    policy, ref, attn = models
    samples = make_pairs()
    packed = packed_run(policy, ref, samples)
    unpacked = unpacked_run(policy, ref, samples, attn)
    assert packed[0].shape == (len(samples),)
    assert float(unpacked[2]) > 0.01 and float(packed[0].abs().min()) > 1.0  # non-trivial values
    assert len(packed[3]) == len(list(policy.parameters()))  # every parameter got a gradient
    found = _gaps(packed, unpacked)
    assert all(g.diff <= g.bound for g in found.values()), {k: str(g) for k, g in found.items()}
    assert_exact(packed[3], unpacked[3])  # names the worst parameter


def test_negative_control_boundaries_dropped(models):
    policy, ref, attn = models
    samples = make_pairs()
    found = _gaps(packed_run(policy, ref, samples, sabotage=True), unpacked_run(policy, ref, samples, attn))
    assert found["logps"].ratio > MARGIN and found["grad"].ratio > MARGIN, {k: str(g) for k, g in found.items()}


def test_gradient_accumulation_denominator(models):
    """Two micro-batches with num_items_in_batch = all pairs == one batch of all pairs."""
    policy, ref, _ = models
    samples = make_pairs()
    objective = DPOObjective(beta=BETA, ref_model=ref)
    collate = PaddingFreeCollator()
    policy.zero_grad(set_to_none=True)
    whole = objective.loss(policy, collate([samples])).loss
    whole.backward()
    g_whole = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad(set_to_none=True)
    parts = [collate([samples[:2]]), collate([samples[2:]])]
    n = sum(objective.count_items(b) for b in parts)
    assert int(n) == 3
    total = sum(objective.loss(policy, b, num_items_in_batch=n).loss for b in parts)
    total.backward()
    assert_exact(total, whole, rtol=DPO_LOSS_RTOL, what="loss")
    assert_exact({n: p.grad for n, p in policy.named_parameters()}, g_whole)
