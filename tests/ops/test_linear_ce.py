"""Linear cross entropy (varpack.ops.linear_ce) == the unfused computation (full logits + F.cross_entropy).

The references below are written independently of the code under test: plain ``hidden @ W.T`` logits,
``F.cross_entropy`` with PyTorch's own reductions, and a Python loop over samples for the sample mean.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from varpack.ops.linear_ce import (
    causal_lm_forward_with_linear_ce,
    linear_ce_backends,
    linear_cross_entropy,
    naive_linear_cross_entropy,
    resolve_linear_ce_backend,
    shift_labels,
)

IGNORE = -100


# ---------------------------------------------------------------------------------------------------------
# references (full logits)
# ---------------------------------------------------------------------------------------------------------


def _logits(hidden, weight, bias):
    out = hidden @ weight.T
    return out if bias is None else out + bias


def ref_token_mean(hidden, weight, labels, bias=None, num_items=None, loss_scale=None):
    logits = _logits(hidden, weight, bias)
    if loss_scale is None:
        total = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    else:
        per = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="none")
        total = (per * loss_scale).sum()
    count = int((labels != IGNORE).sum()) if num_items is None else num_items
    return total / count


def ref_sample_mean(hidden, weight, labels, seq_idx, bias=None, num_items=None):
    return ref_sample_mean_from_logits(_logits(hidden, weight, bias), labels, seq_idx, num_items)


def ref_sample_mean_from_logits(logits, labels, seq_idx, num_items=None):
    means = []
    for s in sorted(set(seq_idx.tolist())):
        sel = seq_idx == s
        if bool((labels[sel] != IGNORE).any()):
            means.append(F.cross_entropy(logits[sel], labels[sel], ignore_index=IGNORE, reduction="mean"))
    n = len(means) if num_items is None else num_items
    return torch.stack(means).sum() / n


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


def _problem(T=13, D=6, V=11, dtype=torch.float64, bias=False, n_samples=3, mask_frac=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(V, D, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(V, generator=g, dtype=dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (T,), generator=g)
    labels[torch.rand(T, generator=g) < mask_frac] = IGNORE
    cuts = sorted(torch.randperm(T - 1, generator=g)[: n_samples - 1].add(1).tolist())
    lengths = [b_ - a for a, b_ in zip([0, *cuts], [*cuts, T])]
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return hidden, weight, b, labels, seq_idx


def _tol(dtype):
    return {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}


# ---------------------------------------------------------------------------------------------------------
# exactness
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_size", [1, 4, 5, 13, 4096])
@pytest.mark.parametrize("bias", [False, True])
def test_token_mean_matches_unfused(dtype, chunk_size, bias):
    hidden, weight, b, labels, _ = _problem(dtype=dtype, bias=bias)
    loss = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=chunk_size, backend="chunked")
    ref = ref_token_mean(hidden, weight, labels, bias=b)
    torch.testing.assert_close(loss, ref.to(loss.dtype), **_tol(dtype))
    for got, want in zip(_grads(loss, hidden, weight, b), _grads(ref, hidden, weight, b)):
        torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_size", [1, 3, 5, 64])
def test_sample_mean_matches_unfused(dtype, chunk_size):
    hidden, weight, b, labels, seq_idx = _problem(T=17, dtype=dtype, bias=True, n_samples=4)
    loss = linear_cross_entropy(
        hidden, weight, labels, bias=b, reduction="sample", seq_idx=seq_idx, chunk_size=chunk_size
    )
    ref = ref_sample_mean(hidden, weight, labels, seq_idx, bias=b)
    torch.testing.assert_close(loss, ref.to(loss.dtype), **_tol(dtype))
    for got, want in zip(_grads(loss, hidden, weight, b), _grads(ref, hidden, weight, b)):
        torch.testing.assert_close(got, want, **_tol(dtype))


def test_sample_mean_skips_unsupervised_samples():
    hidden, weight, _, labels, seq_idx = _problem(T=12, n_samples=3)
    labels[seq_idx == 1] = IGNORE  # sample 1 has nothing to learn: not counted in the sample mean
    loss = linear_cross_entropy(hidden, weight, labels, reduction="sample", seq_idx=seq_idx, chunk_size=5)
    ref = ref_sample_mean(hidden, weight, labels, seq_idx)
    torch.testing.assert_close(loss, ref, **_tol(torch.float64))


def test_loss_scale_matches_unfused():
    hidden, weight, _, labels, _ = _problem(T=11)
    scale = torch.rand(11, dtype=torch.float64) * 2
    loss = linear_cross_entropy(hidden, weight, labels, loss_scale=scale, chunk_size=4)
    ref = ref_token_mean(hidden, weight, labels, loss_scale=scale)
    torch.testing.assert_close(loss, ref, **_tol(torch.float64))
    for got, want in zip(_grads(loss, hidden, weight), _grads(ref, hidden, weight)):
        torch.testing.assert_close(got, want, **_tol(torch.float64))


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_grad_accumulation_two_micro_steps_equal_one_big_step(reduction):
    h1, w, _, l1, s1 = _problem(T=9, seed=1, n_samples=2)
    h2, _, _, l2, s2 = _problem(T=14, seed=2, n_samples=3)
    h1, h2 = h1.detach().requires_grad_(), h2.detach().requires_grad_()
    w = w.detach().requires_grad_()
    if reduction == "token":
        num_items = int((l1 != IGNORE).sum() + (l2 != IGNORE).sum())
    else:
        num_items = sum(
            len({int(s) for s, lab in zip(seq, lab_) if lab != IGNORE}) for seq, lab_ in ((s1, l1), (s2, l2))
        )
    kw = {"reduction": reduction, "num_items_in_batch": num_items, "chunk_size": 4}
    step1 = linear_cross_entropy(h1, w, l1, seq_idx=s1, **kw)
    step1.backward()
    step2 = linear_cross_entropy(h2, w, l2, seq_idx=s2, **kw)
    step2.backward()
    accumulated = (step1 + step2).detach()
    grad_w_acc, g1, g2 = w.grad.clone(), h1.grad.clone(), h2.grad.clone()

    hb = torch.cat([h1, h2]).detach().requires_grad_()
    wb = w.detach().clone().requires_grad_()
    lb, sb = torch.cat([l1, l2]), torch.cat([s1, s2 + int(s1.max()) + 1])
    if reduction == "token":
        big = ref_token_mean(hb, wb, lb)
    else:
        big = ref_sample_mean(hb, wb, lb, sb)
    big.backward()
    torch.testing.assert_close(accumulated, big.detach(), **_tol(torch.float64))
    torch.testing.assert_close(grad_w_acc, wb.grad, **_tol(torch.float64))
    torch.testing.assert_close(torch.cat([g1, g2]), hb.grad, **_tol(torch.float64))


def test_num_items_as_tensor_matches_int():
    hidden, weight, _, labels, _ = _problem()
    a = linear_cross_entropy(hidden, weight, labels, num_items_in_batch=20)
    b = linear_cross_entropy(hidden, weight, labels, num_items_in_batch=torch.tensor(20))
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, ref_token_mean(hidden, weight, labels, num_items=20), **_tol(torch.float64))


def test_all_masked_chunk_and_T_equals_one():
    hidden, weight, _, labels, _ = _problem(T=10, mask_frac=0.0)
    labels[:4] = IGNORE  # the whole first chunk (chunk_size 4) is unsupervised
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=4)
    ref = ref_token_mean(hidden, weight, labels)
    torch.testing.assert_close(loss, ref, **_tol(torch.float64))
    (gh,) = _grads(loss, hidden)
    assert torch.all(gh[:4] == 0)
    torch.testing.assert_close(gh, _grads(ref, hidden)[0], **_tol(torch.float64))

    h1, w1 = hidden[:1].detach().requires_grad_(), weight.detach().requires_grad_()
    one = linear_cross_entropy(h1, w1, torch.tensor([3]))
    ref1 = F.cross_entropy(h1 @ w1.T, torch.tensor([3]))
    torch.testing.assert_close(one, ref1, **_tol(torch.float64))
    for got, want in zip(_grads(one, h1, w1), _grads(ref1, h1, w1)):
        torch.testing.assert_close(got, want, **_tol(torch.float64))


@pytest.mark.parametrize("reduction", ["token", "sample"])
@pytest.mark.parametrize("num_items", [None, 7])
def test_all_masked_batch_is_zero_without_nan(reduction, num_items):
    hidden, weight, b, labels, seq_idx = _problem(bias=True)
    labels[:] = IGNORE
    loss = linear_cross_entropy(
        hidden, weight, labels, bias=b, reduction=reduction, seq_idx=seq_idx, num_items_in_batch=num_items
    )
    assert loss.item() == 0.0
    for g in _grads(loss, hidden, weight, b):
        assert torch.all(g == 0)


def test_no_grad_mode_gives_the_same_loss():
    hidden, weight, _, labels, _ = _problem()
    with torch.no_grad():
        a = linear_cross_entropy(hidden, weight, labels, chunk_size=3)
    b = linear_cross_entropy(hidden, weight, labels, chunk_size=3)
    torch.testing.assert_close(a, b.detach())


def test_grad_output_scales_the_gradients():
    hidden, weight, _, labels, _ = _problem()
    loss = linear_cross_entropy(hidden, weight, labels, chunk_size=4)
    ref = ref_token_mean(hidden, weight, labels)
    for got, want in zip(_grads(3.5 * loss, hidden, weight), _grads(3.5 * ref, hidden, weight)):
        torch.testing.assert_close(got, want, **_tol(torch.float64))


def test_batched_rows_flatten_like_one_stream():
    hidden, weight, _, labels, seq_idx = _problem(T=12, n_samples=2)
    rows_h = hidden.reshape(2, 6, -1)
    rows_seq = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    flat_seq = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3])
    got = linear_cross_entropy(rows_h, weight, labels.reshape(2, 6), reduction="sample", seq_idx=rows_seq)
    want = ref_sample_mean(hidden, weight, labels, flat_seq)
    torch.testing.assert_close(got, want, **_tol(torch.float64))


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_fused_chunk_step_matches_unfused(monkeypatch, reduction):
    """The out-of-place chunk step that torch.compile fuses on CUDA, run eagerly here (compiling on the CPU
    takes ~30 s): same loss and gradients as the unfused reference."""
    import varpack.ops.linear_ce.chunked as chunked

    monkeypatch.setattr(chunked, "_compiled_chunk_fn", lambda: chunked._chunk_loss_and_grad_fused)
    hidden, weight, b, labels, seq_idx = _problem(T=15, bias=True, n_samples=3)
    loss = linear_cross_entropy(
        hidden, weight, labels, bias=b, reduction=reduction, seq_idx=seq_idx, chunk_size=4, compile=True
    )
    ref = (
        ref_token_mean(hidden, weight, labels, bias=b)
        if reduction == "token"
        else ref_sample_mean(hidden, weight, labels, seq_idx, bias=b)
    )
    torch.testing.assert_close(loss, ref, **_tol(torch.float64))
    for got, want in zip(_grads(loss, hidden, weight, b), _grads(ref, hidden, weight, b)):
        torch.testing.assert_close(got, want, **_tol(torch.float64))


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_naive_twin_matches_references_and_chunked(reduction):
    """The package's naive twin (full logits) equals the independent references above, and the chunked
    backend equals it in loss and gradients (bias, loss_scale / num_items_in_batch included)."""
    hidden, weight, b, labels, seq_idx = _problem(T=15, bias=True, n_samples=3, seed=4)
    if reduction == "token":
        scale = torch.rand(labels.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        kw = dict(loss_scale=scale, num_items_in_batch=7)
        ref = ref_token_mean(hidden, weight, labels, bias=b, num_items=7, loss_scale=scale)
    else:
        kw = dict(reduction="sample", seq_idx=seq_idx)
        ref = ref_sample_mean(hidden, weight, labels, seq_idx, bias=b)
    naive = naive_linear_cross_entropy(hidden, weight, labels, bias=b, **kw)
    chunked = linear_cross_entropy(hidden, weight, labels, bias=b, chunk_size=4, backend="chunked", **kw)
    for got in (naive, chunked):
        torch.testing.assert_close(got, ref, **_tol(torch.float64))
    for got, want in zip(_grads(chunked, hidden, weight, b), _grads(naive, hidden, weight, b)):
        torch.testing.assert_close(got, want, **_tol(torch.float64))


def test_package_exports_the_op():
    """``varpack.linear_cross_entropy`` (the package's lazy export) is the op itself."""
    import varpack
    import varpack.ops.linear_ce as op

    assert varpack.linear_cross_entropy is op.linear_cross_entropy


# ---------------------------------------------------------------------------------------------------------
# negative controls: the comparisons above can fail
# ---------------------------------------------------------------------------------------------------------


def test_negative_controls_differ():
    hidden, weight, _, labels, seq_idx = _problem(T=17, n_samples=4, seed=3)
    token = linear_cross_entropy(hidden, weight, labels, reduction="token").item()
    sample_ref = ref_sample_mean(hidden, weight, labels, seq_idx).item()
    assert abs(token - sample_ref) > 1e-3  # wrong reduction is detected
    wrong_items = linear_cross_entropy(
        hidden, weight, labels, num_items_in_batch=int((labels != IGNORE).sum()) + 3
    )
    assert abs(wrong_items.item() - ref_token_mean(hidden, weight, labels).item()) > 1e-3
    unmasked = labels.clone()
    unmasked[unmasked == IGNORE] = 0  # dropping the label mask changes the loss
    assert abs(linear_cross_entropy(hidden, weight, unmasked).item() - token) > 1e-3


# ---------------------------------------------------------------------------------------------------------
# shift_labels, backends, errors
# ---------------------------------------------------------------------------------------------------------


def test_shift_labels_within_row_and_across_samples():
    labels = torch.tensor([[IGNORE, 5, 6, IGNORE, 7, 8]])
    assert shift_labels(labels).tolist() == [5, 6, IGNORE, 7, 8, IGNORE]
    bad_first = torch.tensor([[IGNORE, 5, 6, 9, 7, 8]])  # sample 1's first label is not masked
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1]])
    assert shift_labels(bad_first, seq_idx=seq_idx).tolist() == [5, 6, IGNORE, 7, 8, IGNORE]
    assert shift_labels(torch.tensor([[1, 2], [3, 4]])).tolist() == [2, IGNORE, 4, IGNORE]


def test_backend_resolution_on_cpu():
    name, reason = resolve_linear_ce_backend("auto", "cpu", uniform_weights=True)
    assert name == "chunked" and reason
    assert linear_ce_backends("cpu")["liger"][0] is False
    with pytest.raises(ValueError, match="liger"):
        resolve_linear_ce_backend("liger", "cpu", uniform_weights=True)
    hidden, weight, _, labels, _ = _problem()
    with pytest.raises(ValueError, match="liger"):
        linear_cross_entropy(hidden, weight, labels, backend="liger")
    with pytest.raises(ValueError, match="backend"):
        linear_cross_entropy(hidden, weight, labels, backend="cuda-magic")


def _fake_liger(monkeypatch, calls):
    """A stand-in for liger_kernel.transformers.functional with Liger's documented semantics (reduction
    "sum" / "none" over non-ignored targets), to check varpack's wrapping arithmetic without CUDA."""
    import sys
    import types

    import varpack.ops.linear_ce.liger as liger_mod

    def liger_fused_linear_cross_entropy(
        input,
        weight,
        target,
        bias=None,
        ignore_index=-100,
        reduction="mean",
        accum_dtype=None,
        chunk_mem_const=1,
    ):
        calls.append({"reduction": reduction, "chunk_mem_const": chunk_mem_const})
        logits = input @ weight.T if bias is None else input @ weight.T + bias
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)

    mod = types.ModuleType("liger_kernel.transformers.functional")
    mod.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", mod)
    # the library function, not the kernel driven directly (tests/ops/test_linear_ce_liger_kernel.py)
    monkeypatch.setattr(liger_mod, "_liger_kernel_probe", lambda: (None, "stand-in library function"))


def test_liger_wrapping_is_exact_for_token_and_per_token_weights(monkeypatch):
    import varpack.ops.linear_ce as lce
    from varpack.ops.linear_ce.liger import _liger_loss

    calls = []
    _fake_liger(monkeypatch, calls)
    hidden, weight, b, labels, seq_idx = _problem(T=17, bias=True, n_samples=3)
    tw = lce.token_loss_weights(labels, num_items_in_batch=9, dtype=torch.float64)
    got = _liger_loss(hidden, weight, b, labels, tw, torch.tensor(9.0, dtype=torch.float64), IGNORE, 8)
    want = ref_token_mean(hidden, weight, labels, bias=b, num_items=9)
    torch.testing.assert_close(got.double(), want, **_tol(torch.float32))
    assert calls[-1]["reduction"] == "sum" and calls[-1]["chunk_mem_const"] == 1  # V / (D * chunks) < 1
    tw = lce.token_loss_weights(labels, reduction="sample", seq_idx=seq_idx, dtype=torch.float64)
    got = _liger_loss(hidden, weight, b, labels, tw, None, IGNORE, 8)
    torch.testing.assert_close(
        got.double(), ref_sample_mean(hidden, weight, labels, seq_idx, bias=b), **_tol(torch.float32)
    )
    assert calls[-1]["reduction"] == "none"


@pytest.mark.parametrize(("tokens", "chunk"), [(8192, 4096), (16384, 4096), (8192, 2048), (12000, 4096)])
def test_liger_chunk_mem_const_gives_the_requested_chunk(tokens, chunk):
    from varpack.ops.linear_ce.liger import _liger_chunk_kwargs

    def fn(input, weight, target, bias=None, chunk_mem_const=1):
        pass

    V, D = 151936, 1024  # Qwen3-0.6B head
    c = _liger_chunk_kwargs(
        fn, torch.empty(tokens, D, device="meta"), torch.empty(V, D, device="meta"), chunk
    )["chunk_mem_const"]
    inc_factor = -(-V // (c * D))  # Liger 0.8.5: chunk = next_pow2(cdiv(BT, cdiv(V, C * H)))
    liger_chunk = 1 << (-(-tokens // inc_factor) - 1).bit_length()
    assert chunk <= liger_chunk <= 2 * chunk
    assert (
        _liger_chunk_kwargs(lambda input, weight, target: None, torch.empty(4, 2), torch.empty(3, 2), 2) == {}
    )


def test_auto_resolution_on_cuda_with_liger(monkeypatch):
    import varpack.ops.linear_ce.dispatch as lce

    monkeypatch.setattr(lce, "_liger_probe", lambda: (True, "liger-kernel importable", True))
    assert resolve_linear_ce_backend("auto", "cuda", uniform_weights=True)[0] == "liger"
    assert resolve_linear_ce_backend("auto", "cuda", uniform_weights=False)[0] == "chunked"
    assert resolve_linear_ce_backend("liger", "cuda", uniform_weights=False)[0] == "liger"
    # float64: Liger's kernel computes in float32, so auto takes chunked and a forced liger is refused
    assert resolve_linear_ce_backend("auto", "cuda", uniform_weights=True, dtype=torch.float64)[0] == "chunked"
    assert resolve_linear_ce_backend("auto", "cuda", uniform_weights=True, dtype=torch.bfloat16)[0] == "liger"
    with pytest.raises(ValueError, match="float64 hidden states"):
        resolve_linear_ce_backend("liger", "cuda", uniform_weights=True, dtype=torch.float64)
    monkeypatch.setattr(lce, "AUTO_PREFERS_LIGER", False)
    assert resolve_linear_ce_backend("auto", "cuda", uniform_weights=True)[0] == "chunked"
    monkeypatch.setattr(lce, "_liger_probe", lambda: (True, "liger-kernel importable", False))
    with pytest.raises(ValueError, match="per-token"):
        resolve_linear_ce_backend("liger", "cuda", uniform_weights=False)


def test_bad_inputs_raise_with_values():
    hidden, weight, _, labels, seq_idx = _problem()
    with pytest.raises(ValueError, match="seq_idx"):
        linear_cross_entropy(hidden, weight, labels, reduction="sample")
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, labels, reduction="mean")
    with pytest.raises(ValueError, match=r"labels\[0\]=11"):
        bad = labels.clone()
        bad[0] = 11
        linear_cross_entropy(hidden, weight, bad)
    with pytest.raises(ValueError, match="T=13"):
        linear_cross_entropy(hidden, weight, labels[:5])
    with pytest.raises(ValueError, match="D=6"):
        linear_cross_entropy(hidden, weight[:, :4], labels)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        linear_cross_entropy(hidden, weight, labels, num_items_in_batch=-1)
    # 0 (a step with nothing supervised) divides by 1, a Python number and a tensor alike (varpack.loss's rule)
    one = linear_cross_entropy(hidden, weight, labels, num_items_in_batch=1)
    for zero in (0, torch.tensor(0)):
        assert torch.equal(linear_cross_entropy(hidden, weight, labels, num_items_in_batch=zero), one)
    with pytest.raises(TypeError, match="integer"):
        linear_cross_entropy(hidden, weight, labels.float())


# ---------------------------------------------------------------------------------------------------------
# Hugging Face model: loss and every parameter gradient equal the logits path
# ---------------------------------------------------------------------------------------------------------


def _tiny_qwen3(dtype=torch.float64, tie=True):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(dtype)


def _packed_batch(lengths, vocab=97, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids, labels, pos, seq = [], [], [], []
    for n, length in enumerate(lengths):
        x = torch.randint(0, vocab, (length,), generator=g)
        lab = x.clone()
        lab[0] = IGNORE
        lab[1 : max(2, length // 3)] = IGNORE  # a prompt
        ids.append(x)
        labels.append(lab)
        pos.append(torch.arange(length))
        seq.append(torch.full((length,), n, dtype=torch.int32))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "input_ids": torch.cat(ids)[None],
        "labels": torch.cat(labels)[None],
        "position_ids": torch.cat(pos)[None],
        "seq_idx": torch.cat(seq)[None],
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
    }


def _logits_path_loss(model, batch, reduction, num_items=None):
    """Independent reference: full logits from model(**batch), shift, F.cross_entropy, loop over samples."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits[0].float() if model.dtype != torch.float64 else model(**inputs).logits[0]
    labels, seq = batch["labels"][0], batch["seq_idx"][0]
    targets = torch.cat([labels[1:], torch.tensor([IGNORE])])
    targets[:-1][seq[1:] != seq[:-1]] = IGNORE
    if reduction == "token":
        total = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
        return total / (int((targets != IGNORE).sum()) if num_items is None else num_items)
    return ref_sample_mean_from_logits(logits, targets, seq, num_items)


def _param_grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return dict(
        zip([n for n, p in model.named_parameters() if p.requires_grad], torch.autograd.grad(loss, params))
    )


@pytest.mark.parametrize("reduction", ["token", "sample"])
@pytest.mark.parametrize("tie", [True, False])
def test_hf_model_loss_and_param_grads_equal_logits_path(reduction, tie):
    model = _tiny_qwen3(tie=tie)
    batch = _packed_batch([9, 14, 5])
    fused = causal_lm_forward_with_linear_ce(model, batch, reduction=reduction, chunk_size=8)
    ref = _logits_path_loss(model, batch, reduction)
    torch.testing.assert_close(fused, ref, **_tol(torch.float64))
    got, want = _param_grads(model, fused), _param_grads(model, ref)
    assert set(got) == set(want) and len(got) > 10
    for name in want:
        torch.testing.assert_close(got[name], want[name], **_tol(torch.float64), msg=name)


def test_hf_model_matches_varpack_causal_lm_loss_with_num_items():
    loss_mod = pytest.importorskip("varpack.loss")
    model = _tiny_qwen3()
    batch = _packed_batch([7, 12])
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    ref = loss_mod.causal_lm_loss(
        model(**inputs).logits, batch["labels"], seq_idx=batch["seq_idx"], num_items_in_batch=40
    )
    fused = causal_lm_forward_with_linear_ce(model, batch, num_items_in_batch=40)
    torch.testing.assert_close(fused, ref.to(fused.dtype), **_tol(torch.float32))  # causal_lm_loss is fp32


def test_hf_model_negative_control_wrong_reduction_differs():
    model = _tiny_qwen3()
    batch = _packed_batch([4, 16])
    fused = causal_lm_forward_with_linear_ce(model, batch, reduction="token")
    ref = _logits_path_loss(model, batch, "sample")
    assert abs(fused.item() - ref.item()) > 1e-3


@pytest.mark.parametrize("attr, value", [("final_logit_softcapping", 30.0), ("lm_head_multiplier", 0.5)])
def test_hf_model_refuses_transformed_logits(attr, value):
    """Gemma-style softcapping, Falcon-H1's lm_head_multiplier (...): the plain head would give another loss;
    refused, and the trainer's ``loss_impl="auto"`` takes the logits path for such a model."""
    import types

    from varpack.train.trainer import PackedLossMixin

    model = _tiny_qwen3()
    trainer = types.SimpleNamespace(loss_impl="auto", accelerator=types.SimpleNamespace(unwrap_model=lambda m: m))
    assert PackedLossMixin._linear_ce_choice(trainer, model) == (True, "loss_impl auto")
    setattr(model.config, attr, value)
    with pytest.raises(ValueError, match=f"{attr}={value}"):
        causal_lm_forward_with_linear_ce(model, _packed_batch([5]))
    use, why = PackedLossMixin._linear_ce_choice(trainer, model)
    assert not use and f"{attr}={value}" in why


def test_hf_model_packed_with_varpack_attention_equals_per_sample():
    """Packed batch through enable_varpack == each sample alone through the plain model (logits path)."""
    integ = pytest.importorskip("varpack.integrations.transformers")
    if not hasattr(integ, "enable_varpack"):
        pytest.skip("enable_varpack not available yet")
    lengths = [6, 11, 4]
    batch = _packed_batch(lengths)
    plain = _tiny_qwen3()
    packed_model = integ.enable_varpack(_tiny_qwen3(), backend="reference")
    fused = causal_lm_forward_with_linear_ce(packed_model, batch, reduction="sample")
    # per-sample unpacked reference: each sample alone (no boundaries needed)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    means = []
    for a, b in zip(starts[:-1], starts[1:]):
        ids, lab = batch["input_ids"][:, a:b], batch["labels"][0, a:b]
        logits = plain(input_ids=ids).logits[0]
        means.append(F.cross_entropy(logits[:-1], lab[1:], ignore_index=IGNORE))
    ref = torch.stack(means).mean()
    torch.testing.assert_close(fused, ref, **_tol(torch.float64))
    # negative control: without boundaries the packed stream mixes samples
    dense = {
        k: v
        for k, v in batch.items()
        if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    }
    dense["position_ids"] = torch.arange(sum(lengths))[None]
    leaked = causal_lm_forward_with_linear_ce(plain, dense, reduction="sample")
    assert abs(leaked.item() - ref.item()) > 1e-3
    # the top model's packing guards run although the base model is called directly
    with pytest.raises(ValueError, match="use_cache"):
        causal_lm_forward_with_linear_ce(packed_model, dict(batch, use_cache=True), reduction="sample")


# ---------------------------------------------------------------------------------------------------------
# GPU (run on the device machine)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["chunked", "liger"])
@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_gpu_bf16_close_to_fp32_reference(backend, reduction):
    if backend == "liger" and not linear_ce_backends("cuda")["liger"][0]:
        pytest.skip(linear_ce_backends("cuda")["liger"][1])
    T, D, V = 3000, 256, 32000
    hidden, weight, _, labels, seq_idx = _problem(T=T, D=D, V=V, dtype=torch.float32, n_samples=12)
    hidden32 = hidden.detach().cuda().requires_grad_()
    weight32 = weight.detach().mul(0.05).cuda().requires_grad_()
    labels, seq_idx = labels.cuda(), seq_idx.cuda()
    hb = hidden32.detach().bfloat16().requires_grad_()
    wb = weight32.detach().bfloat16().requires_grad_()
    kw = {"reduction": reduction, "seq_idx": seq_idx}
    if reduction == "token":
        ref = ref_token_mean(hb.detach().float().requires_grad_(), wb.detach().float(), labels)
    else:
        ref = ref_sample_mean(hb.detach().float(), wb.detach().float(), labels, seq_idx)
    loss = linear_cross_entropy(hb, wb, labels, chunk_size=1024, backend=backend, **kw)
    torch.testing.assert_close(loss.float(), ref.float(), rtol=2e-2, atol=2e-2)
    # gradients vs the unfused bf16 path (same precision): relative error of the whole tensor
    hr, wr = hb.detach().clone().requires_grad_(), wb.detach().clone().requires_grad_()
    logits = (hr @ wr.T).float()
    if reduction == "token":
        unfused = F.cross_entropy(logits, labels, ignore_index=IGNORE)
    else:
        unfused = ref_sample_mean_from_logits(logits, labels, seq_idx)
    for got, want in zip(_grads(loss, hb, wb), _grads(unfused, hr, wr)):
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < 2e-2, err


@pytest.mark.gpu
def test_gpu_compiled_chunk_equals_eager_chunk():
    T, D, V = 2500, 128, 5000
    hidden, weight, _, labels, _ = _problem(T=T, D=D, V=V, dtype=torch.float32)
    h, w, lab = (
        hidden.detach().cuda().requires_grad_(),
        weight.detach().cuda().requires_grad_(),
        labels.cuda(),
    )
    eager = linear_cross_entropy(h, w, lab, chunk_size=1000, compile=False)
    ge = _grads(eager, h, w)
    fused = linear_cross_entropy(h, w, lab, chunk_size=1000, compile=True)
    gf = _grads(fused, h, w)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(gf, ge):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_gpu_peak_memory_below_unfused():
    T, D, V = 8192, 1024, 151936
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    weight = (0.02 * torch.randn(V, D, device="cuda", dtype=torch.bfloat16, generator=g)).requires_grad_()
    labels = torch.randint(0, V, (T,), device="cuda", generator=g)

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn().backward()
        torch.cuda.synchronize()
        hidden.grad = weight.grad = None
        return torch.cuda.max_memory_allocated() - base

    unfused = peak(lambda: F.cross_entropy((hidden @ weight.T).float(), labels))
    fused = peak(lambda: linear_cross_entropy(hidden, weight, labels, backend="chunked", chunk_size=2048))
    assert fused < unfused / 2, (fused, unfused)
