"""Linear cross entropy on the supervised rows only (``max_supervised``): the same loss and gradients as every
row, the LM head on fewer rows, and a bound below the true count refused (never a silent drop).

References are the unfused computation of tests/ops/test_linear_ce.py (full logits, ``F.cross_entropy``).
"""

from __future__ import annotations

import pytest
import torch

import varpack.ops.linear_ce.dispatch as dispatch
from tests.ops.test_linear_ce import (
    IGNORE,
    _fake_liger,
    _grads,
    _packed_batch,
    _problem,
    _tiny_qwen3,
    _tol,
    ref_sample_mean,
    ref_token_mean,
)
from varpack.ops.linear_ce import (
    SUPERVISED_ROWS_MULTIPLE,
    causal_lm_forward_with_linear_ce,
    linear_cross_entropy,
    supervised_rows,
)


def _sparse_problem(T=700, bias=True, seed=0):
    """Most rows are prompts: R = 256 supervised-row slots of T = 700 rows."""
    hidden, weight, b, labels, seq_idx = _problem(T=T, D=6, V=11, bias=bias, n_samples=9, mask_frac=0.75, seed=seed)
    assert 0 < int((labels != IGNORE).sum()) <= SUPERVISED_ROWS_MULTIPLE
    return hidden, weight, b, labels, seq_idx


def _rows_seen(monkeypatch):
    """Record the row count the chunked backend receives."""
    seen = []
    real = dispatch.chunked_linear_cross_entropy

    def spy(hidden, *args, **kwargs):
        seen.append(hidden.shape[0])
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(dispatch, "chunked_linear_cross_entropy", spy)
    return seen


@pytest.mark.parametrize("reduction", ["token", "sample", "loss_scale"])
@pytest.mark.parametrize("slack", [0, 40])
def test_supervised_rows_equal_every_row(monkeypatch, reduction, slack):
    hidden, weight, b, labels, seq_idx = _sparse_problem()
    count = int((labels != IGNORE).sum())
    kw = {"bias": b, "chunk_size": 64, "backend": "chunked"}
    if reduction == "sample":
        kw.update(reduction="sample", seq_idx=seq_idx)
        ref = ref_sample_mean(hidden, weight, labels, seq_idx, bias=b)
    elif reduction == "loss_scale":
        scale = torch.rand(hidden.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 2
        kw.update(loss_scale=scale)
        ref = ref_token_mean(hidden, weight, labels, bias=b, loss_scale=scale)
    else:
        ref = ref_token_mean(hidden, weight, labels, bias=b)
    seen = _rows_seen(monkeypatch)
    loss = linear_cross_entropy(hidden, weight, labels, max_supervised=count + slack, **kw)
    assert seen == [SUPERVISED_ROWS_MULTIPLE]  # the head ran on 256 rows, not 700
    torch.testing.assert_close(loss, ref.to(loss.dtype), **_tol(torch.float64))
    got, want = _grads(loss, hidden, weight, b), _grads(ref, hidden, weight, b)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **_tol(torch.float64))
    # prompt rows get exactly zero gradient; supervised rows get theirs
    assert bool((got[0][labels == IGNORE] == 0).all()) and bool((got[0][labels != IGNORE] != 0).any())


def test_liger_backend_gets_the_supervised_rows_and_the_full_denominator(monkeypatch):
    calls = []
    _fake_liger(monkeypatch, calls)
    monkeypatch.setattr(dispatch, "resolve_linear_ce_backend", lambda *a, **k: ("liger", "test"))
    hidden, weight, b, labels, _ = _sparse_problem()
    count = int((labels != IGNORE).sum())
    loss = linear_cross_entropy(hidden, weight, labels, bias=b, max_supervised=count)
    ref = ref_token_mean(hidden, weight, labels, bias=b)
    torch.testing.assert_close(loss.double(), ref, **_tol(torch.float32))
    for g, w in zip(_grads(loss, hidden, weight, b), _grads(ref, hidden, weight, b)):
        torch.testing.assert_close(g.double(), w, **_tol(torch.float32))
    assert calls and calls[-1]["reduction"] == "sum"


def test_a_bound_below_the_true_count_raises():
    hidden, weight, b, labels, _ = _sparse_problem()
    count = int((labels != IGNORE).sum())
    labels = labels.clone()
    extra = (labels == IGNORE).nonzero()[: SUPERVISED_ROWS_MULTIPLE + 1 - count, 0]
    labels[extra] = 1  # one more supervised label than the 256 rows can hold
    with pytest.raises(RuntimeError, match="more supervised labels than max_supervised"):
        linear_cross_entropy(hidden, weight, labels, bias=b, max_supervised=count, backend="chunked")


def test_negative_control_a_shuffled_gather_changes_the_loss(monkeypatch):
    """What the exactness test would catch: gathered labels out of step with their rows."""
    hidden, weight, b, labels, _ = _sparse_problem()
    count = int((labels != IGNORE).sum())
    good = linear_cross_entropy(hidden, weight, labels, bias=b, max_supervised=count, backend="chunked")
    real = dispatch.supervised_rows

    def rolled(h, lab, tw, bound, ignore):
        h, lab, tw = real(h, lab, tw, bound, ignore)
        return h.roll(1, 0), lab, tw

    monkeypatch.setattr(dispatch, "supervised_rows", rolled)
    bad = linear_cross_entropy(hidden, weight, labels, bias=b, max_supervised=count, backend="chunked")
    assert abs(float(bad.detach()) - float(good.detach())) > 1e-3


def test_supervised_rows_refuses_a_bound_below_the_count():
    hidden, _, _, labels, _ = _sparse_problem(bias=False)
    labels = labels.clone()
    labels[: SUPERVISED_ROWS_MULTIPLE + 1] = 1  # 257 supervised rows, bound 10 -> 256 slots
    tw = torch.ones(hidden.shape[0], dtype=torch.float64)
    with pytest.raises(RuntimeError, match="max_supervised=10"):
        supervised_rows(hidden, labels, tw, 10, IGNORE)


def test_rows_layout():
    g = torch.Generator().manual_seed(1)
    T = 600
    hidden = torch.randn(T, 4, generator=g, dtype=torch.float64)
    labels = torch.full((T,), IGNORE)
    pos = torch.tensor([3, 10, 11, 598])
    labels[pos] = torch.tensor([1, 2, 3, 4])
    tw = torch.rand(T, generator=g, dtype=torch.float64)
    h, lab, w = supervised_rows(hidden, labels, tw, 4, IGNORE)
    assert h.shape == (SUPERVISED_ROWS_MULTIPLE, 4)
    torch.testing.assert_close(h[:4], hidden[pos])
    assert lab[:4].tolist() == [1, 2, 3, 4] and bool((lab[4:] == IGNORE).all())
    torch.testing.assert_close(w[:4], tw[pos])
    assert bool((w[4:] == 0).all())
    # no saving possible: the inputs come back as they are
    out = supervised_rows(hidden[:200], labels[:200], tw[:200], 4, IGNORE)
    assert out[0].data_ptr() == hidden.data_ptr() and out[0].shape[0] == 200
    # nothing supervised: one block of ignored rows, loss 0
    none = torch.full((T,), IGNORE)
    h, lab, w = supervised_rows(hidden, none, tw, 0, IGNORE)
    assert h.shape[0] == SUPERVISED_ROWS_MULTIPLE and bool((lab == IGNORE).all()) and float(w.sum()) == 0


@pytest.mark.parametrize("bad", [-1, 2.5, True, "7"])
def test_bad_bound_is_refused(bad):
    hidden, weight, _, labels, _ = _sparse_problem(bias=False)
    with pytest.raises(ValueError, match="max_supervised must be a non-negative int"):
        linear_cross_entropy(hidden, weight, labels, max_supervised=bad, backend="chunked")


def test_hf_model_with_the_collator_count_equals_every_row(monkeypatch):
    """A packed HF batch: the bound is the unshifted labels' count (what the collator's batch_stats hold)."""
    model = _tiny_qwen3()
    batch = _packed_batch([150, 220, 90, 300])
    count = int((batch["labels"] != IGNORE).sum())
    seen = _rows_seen(monkeypatch)
    full = causal_lm_forward_with_linear_ce(model, batch, chunk_size=128, backend="chunked")
    fewer = causal_lm_forward_with_linear_ce(model, batch, chunk_size=128, backend="chunked", max_supervised=count)
    assert seen[0] == 760 and seen[1] < 760
    torch.testing.assert_close(fewer, full, **_tol(torch.float64))
    params = [p for p in model.parameters() if p.requires_grad]
    for g, w in zip(torch.autograd.grad(fewer, params), torch.autograd.grad(full, params)):
        torch.testing.assert_close(g, w, **_tol(torch.float64))


def test_sft_objective_passes_the_batch_stats_count(monkeypatch):
    from varpack.schema import BATCH_STATS
    from varpack.train.objectives.sft import CausalLMObjective

    model = _tiny_qwen3()
    batch = _packed_batch([150, 220, 90, 300])
    count = int((batch["labels"] != IGNORE).sum())
    seen = _rows_seen(monkeypatch)
    monkeypatch.setattr(dispatch, "resolve_linear_ce_backend", lambda *a, **k: ("chunked", "test"))
    plain = CausalLMObjective().loss(model, dict(batch), linear_ce=True).loss
    stats = {"packs": 1, "samples": 4, "tokens": 760, "supervised_tokens": count}
    with_stats = CausalLMObjective().loss(model, {**batch, BATCH_STATS: stats}, linear_ce=True).loss
    assert seen == [760, -(-count // SUPERVISED_ROWS_MULTIPLE) * SUPERVISED_ROWS_MULTIPLE]
    torch.testing.assert_close(with_stats, plain, **_tol(torch.float64))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["chunked", "liger"])
def test_gpu_supervised_rows_without_host_sync(backend):
    from tests._sync import without_host_sync
    from varpack.ops.linear_ce import linear_ce_backends

    if backend == "liger" and not linear_ce_backends("cuda")["liger"][0]:
        pytest.skip(linear_ce_backends("cuda")["liger"][1])
    T, D, V = 8192, 512, 32000
    hidden, weight, _, labels, _ = _problem(T=T, D=D, V=V, dtype=torch.float32, n_samples=40, mask_frac=0.4)
    h = hidden.detach().cuda().bfloat16().requires_grad_()
    w = weight.detach().mul(0.05).cuda().bfloat16().requires_grad_()
    labels = labels.cuda()
    count = int((labels != IGNORE).sum())
    full = linear_cross_entropy(h, w, labels, backend=backend)
    g_full = _grads(full, h, w)
    # the gather itself reads nothing on the host (Liger's own count read stays Liger's)
    rows = without_host_sync(
        lambda: supervised_rows(h, labels, torch.ones(T, device="cuda"), count, IGNORE)[0].shape[0]
    )
    assert rows == -(-count // SUPERVISED_ROWS_MULTIPLE) * SUPERVISED_ROWS_MULTIPLE < T
    fewer = linear_cross_entropy(h, w, labels, backend=backend, max_supervised=count)
    g_fewer = _grads(fewer, h, w)
    torch.testing.assert_close(fewer, full, rtol=2e-3, atol=2e-3)
    for a, b in zip(g_fewer, g_full):
        err = (a.float() - b.float()).norm() / b.float().norm()
        assert err < 1e-2, err


@pytest.mark.gpu
def test_gpu_chunked_linear_ce_step_without_host_sync():
    """The chunked backend's forward and backward with the LM head on the supervised rows and a step count given
    as a Python int or a CPU tensor: no host sync (a CUDA graph step relies on it). Negative control: a scalar
    made with ``torch.tensor(..., device="cuda")`` (a copy from pageable memory) is caught by the same check."""
    from tests._sync import without_host_sync

    T, D, V = 4096, 256, 8000
    hidden, weight, _, labels, _ = _problem(T=T, D=D, V=V, dtype=torch.float32, n_samples=20, mask_frac=0.4)
    labels = labels.cuda()
    count = int((labels != IGNORE).sum())
    h0, w0 = hidden.detach().cuda().bfloat16(), weight.detach().mul(0.05).cuda().bfloat16()

    def step(num_items):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = linear_cross_entropy(h, w, labels, backend="chunked", max_supervised=count, num_items_in_batch=num_items)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    want = step(count)  # compiles the chunk kernels outside the check
    for num_items in (count, torch.tensor(count)):
        got = without_host_sync(lambda n=num_items: step(n))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="synchroniz"):
        without_host_sync(lambda: torch.tensor(float(count), device="cuda"))
