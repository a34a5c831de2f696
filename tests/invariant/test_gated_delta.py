"""Packed == per-sample for Gated DeltaNet layers and whole tiny Qwen3.5 / Qwen3-Next models.

Two negative controls, each of which must make the equivalence check fail: the recurrence without
boundaries, the short convolution without boundaries (the integration module's ops are monkeypatched to
drop them). Whole-model runs use varpack's own attention for the full-attention layers
(``enable_varpack``); the per-sample reference is the unmodified transformers forward on each sample.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import varpack.integrations.gated_delta as gd
from tests._exact import GRAD_RTOL, LOGITS_RTOL, LOSS_RTOL, MARGIN, assert_exact, measure
from varpack.collate import PaddingFreeCollator
from varpack.integrations.gated_delta import patch_linear_attention
from varpack.integrations.transformers import enable_varpack
from varpack.models.gated_delta import tiny_model

MODELS = ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-next"]
LENGTHS = [5, 1, 30, 66, 2]  # 1-token sample, lengths across the 64-token chunk size


@pytest.fixture(scope="module")
def models():
    return {name: tiny_model(name, seed=1, vocab_size=512) for name in MODELS}


def _samples(lengths=LENGTHS, vocab=512, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for L in lengths:
        ids = torch.randint(1, vocab, (L,), generator=gen)
        labels = ids.clone()
        labels[0] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def _gdn_layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


# ------------------------------------------------------------------------------------------------------
# one layer


@pytest.mark.parametrize(
    "name, boundary",
    [("tiny-qwen3.5", "cu_seq_lens_q"), ("tiny-qwen3-next", "cu_seq_lens_q"), ("tiny-qwen3.5", "seq_idx")],
)
def test_layer_packed_equals_per_sample(name, boundary):
    layer = _gdn_layers(tiny_model(name, seed=1, vocab_size=512))[0]
    T = sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(len(LENGTHS), dtype=torch.int32), torch.tensor(LENGTHS))[
        None
    ]
    x = torch.randn(1, T, layer.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True)
    dy = torch.randn(1, T, layer.hidden_size, generator=torch.Generator().manual_seed(1))
    params = [p for p in layer.parameters()]

    ref = torch.cat([layer(x[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
    ref_grads = torch.autograd.grad((ref * dy).sum(), [x, *params])
    assert patch_linear_attention(layer, backend="chunk") == 1
    kw = {"cu_seq_lens_q": cu} if boundary == "cu_seq_lens_q" else {"seq_idx": seq_idx}
    out = layer(x, **kw)
    grads = torch.autograd.grad((out * dy).sum(), [x, *params])
    unpacked = layer(x[:, :5])  # no boundaries: the original forward, unchanged
    names = ["x", *(n for n, _ in layer.named_parameters())]
    assert_exact(out, ref, rtol=LOGITS_RTOL, what="output")
    assert_exact(dict(zip(names, grads)), dict(zip(names, ref_grads)))
    assert torch.equal(unpacked, ref[:, :5])


# ------------------------------------------------------------------------------------------------------
# whole models


def _per_sample(model, samples):
    """Reference: each sample alone through the unmodified forward; token-mean loss over all samples."""
    model.zero_grad(set_to_none=True)
    logits, total, count = [], 0.0, 0
    for s in samples:
        ids = torch.tensor([s["input_ids"]])
        labels = torch.tensor(s["labels"])
        lg = model(input_ids=ids).logits[0]
        logits.append(lg.detach())
        total = total + F.cross_entropy(lg[:-1], labels[1:], ignore_index=-100, reduction="sum")
        count += int((labels[1:] != -100).sum())
    loss = total / count
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(logits), loss.detach(), grads


def _packed(model, samples):
    model.zero_grad(set_to_none=True)
    batch = PaddingFreeCollator()(samples)
    batch.pop("sample_ids", None)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits[0].detach(), out.loss.detach(), grads


def _gaps(logits, loss, grads, logits_ref, loss_ref, grads_ref):
    """The worst gap (tests/_exact.py) of the logits, the loss and the gradients against the reference."""
    return {
        "logits": measure(logits, logits_ref, rtol=LOGITS_RTOL, what="logits"),
        "loss": measure(loss, loss_ref, rtol=LOSS_RTOL, what="loss"),
        "grad": measure(grads, grads_ref, rtol=GRAD_RTOL, what="gradient"),
    }


def _passes(found):
    return all(g.diff <= g.bound for g in found.values())


def _far(gap):
    """A negative control's gap: beyond the bound by tests/_exact.py's MARGIN."""
    return gap.ratio > MARGIN


_REFERENCES: dict = {}


def _max_diffs(model, samples, key=None):
    """The worst gaps (packed vs per-sample) of the logits, the loss and the parameter gradients (reference
    cached by key)."""
    if key is None or key not in _REFERENCES:
        ref = _per_sample(model, samples)
        if key is not None:
            _REFERENCES[key] = ref
    logits_ref, loss_ref, grads_ref = _REFERENCES[key] if key is not None else ref
    logits, loss, grads = _packed(model, samples)
    assert grads.keys() == grads_ref.keys()
    return _gaps(logits, loss, grads, logits_ref, loss_ref, grads_ref)


@pytest.fixture(params=MODELS)
def packed_model(request, models):
    model = models[request.param]
    enable_varpack(model, linear_backend="chunk")
    model._test_name = request.param
    return model


def test_whole_model_packed_equals_per_sample(packed_model):
    diffs = _max_diffs(packed_model, _samples(), key=packed_model._test_name)
    assert _passes(diffs), diffs


def test_negative_control_recurrence_without_boundaries(packed_model, monkeypatch):
    real = gd.gated_delta_rule

    def one_sequence(q, k, v, g, beta, **kw):
        kw.pop("layout", None)
        kw["cu_seqlens"] = torch.tensor([0, q.shape[1]])
        return real(q, k, v, g, beta, **kw)

    monkeypatch.setattr(gd, "gated_delta_rule", one_sequence)
    diffs = _max_diffs(packed_model, _samples(), key=packed_model._test_name)
    assert _far(diffs["logits"]) and _far(diffs["grad"]), diffs  # the equivalence check fails


def test_negative_control_conv_without_boundaries(packed_model, monkeypatch):
    real = gd.short_conv

    def no_boundaries(x, weight, bias=None, activation=None, **kw):
        kw.pop("seq_idx", None)
        kw.pop("cu_seqlens", None)
        kw.pop("cu_seqlens_cpu", None)
        return real(x, weight, bias, activation, **kw)

    monkeypatch.setattr(gd, "short_conv", no_boundaries)
    diffs = _max_diffs(packed_model, _samples(), key=packed_model._test_name)
    assert _far(diffs["logits"]) and _far(diffs["grad"]), diffs


@pytest.mark.parametrize("name", ["tiny-qwen3.5"])
def test_boundaries_reach_layers_only_through_the_model_hook(models, name):
    """transformers releases whose decoder layer calls linear_attn without **kwargs (5.17): the
    per-forward context still delivers the boundaries, also to gradient-checkpointing recomputation."""
    model = models[name]
    enable_varpack(model, linear_backend="chunk")
    handles = [
        layer.register_forward_pre_hook(
            lambda mod, a, kw: (a, {k: v for k, v in kw.items() if k not in ("cu_seq_lens_q", "seq_idx")}),
            with_kwargs=True,
        )
        for layer in _gdn_layers(model)
    ]
    try:
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        diffs = _max_diffs(model, _samples(), key=name)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
        for h in handles:
            h.remove()
    assert _passes(diffs), diffs


@pytest.mark.parametrize("name", MODELS)
def test_unpacked_forward_is_unchanged(name):
    a = tiny_model(name, seed=2, vocab_size=512)
    b = tiny_model(name, seed=2, vocab_size=512)
    assert patch_linear_attention(b) == 3
    assert patch_linear_attention(b, backend="naive") == 3  # idempotent
    ids = torch.randint(1, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


def test_unpacked_rows_through_varpack_path_where_fla_cannot_train(monkeypatch):
    """Where the original forward would call an fla whose backward refuses (Hopper + Triton < 3.7.1), the
    unpacked call takes varpack's path, one sequence per row: same values and gradients as the original."""
    a = tiny_model("tiny-qwen3.5", seed=2, vocab_size=512)
    b = tiny_model("tiny-qwen3.5", seed=2, vocab_size=512)
    patch_linear_attention(b, backend="chunk")
    calls = []
    real = gd._packed_forward
    monkeypatch.setattr(gd, "_original_cannot_train", lambda layer, h: True)
    monkeypatch.setattr(gd, "_packed_forward", lambda *args: calls.append(1) or real(*args))
    ids = torch.randint(1, 512, (2, 70), generator=torch.Generator().manual_seed(0))
    out_a, out_b = a(input_ids=ids).logits, b(input_ids=ids).logits
    assert len(calls) == 3
    assert_exact(out_b, out_a, rtol=LOGITS_RTOL, what="logits")
    out_a.square().mean().backward()
    out_b.square().mean().backward()
    assert_exact({n: p.grad for n, p in b.named_parameters()}, {n: p.grad for n, p in a.named_parameters()})


def test_original_cannot_train_probes_fla_at_the_layers_own_head_dims(monkeypatch):
    """The unpacked call's check (is fla's backward usable?) probes at the layer's (Hk, H, K, V), as the packed
    path does: otherwise `varpack check` on CUDA autotunes fla a second time at the default probe dims and
    prints a second autotune notice naming dims the model does not have."""
    model = tiny_model("tiny-qwen3.5", vocab_size=512)
    layer = next(m for m in model.modules() if gd._is_gdn(m))
    asked = []
    monkeypatch.setattr(gd, "load_fla", lambda: (object(), None, "ok"))

    def status(device, dims=None):  # fla's forward runs, its backward is refused (the H200 stack)
        asked.append(dims)
        return (True, "ok"), (False, "fla backward refused")

    monkeypatch.setattr(gd, "fla_gated_delta_status", status)
    h = types.SimpleNamespace(device=torch.device("cuda", 0))  # a CUDA hidden state: only its device is read
    assert gd._original_cannot_train(layer.train(), h)
    assert asked == [gd.layer_head_dims(layer)] and asked[0] == (2, 4, 16, 16)


def test_packed_guards():
    model = tiny_model("tiny-qwen3.5", vocab_size=512)
    patch_linear_attention(model, backend="chunk")
    ids = torch.randint(1, 512, (1, 10))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="one row"):
        model(input_ids=torch.randint(1, 512, (2, 10)), cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="use_cache=True"):
        model(input_ids=ids, cu_seq_lens_q=cu, use_cache=True)
    from transformers import DynamicCache

    with pytest.raises(ValueError, match="cache"):
        model(input_ids=ids, cu_seq_lens_q=cu, past_key_values=DynamicCache(config=model.config))
    with pytest.raises(
        ValueError, match=r"cu_seq_lens_q=\[0, 4, 9\] must start at 0, never decrease and end at the token count 10 \(T=10\)"
    ):
        model(input_ids=ids, cu_seq_lens_q=torch.tensor([0, 4, 9], dtype=torch.int32))
    layer = _gdn_layers(model)[0]
    with pytest.raises(ValueError, match="incremental decoding cannot be combined with packing"):
        layer(torch.randn(1, 10, 64), cache=DynamicCache(config=model.config), cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="unknown linear-attention backend 'triton'"):
        patch_linear_attention(model, backend="triton")


def test_tiny_model_names_and_overrides():
    m = tiny_model(
        "tiny-qwen3-next",
        vocab_size=1000,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
    )
    assert m.config.vocab_size == 1000 and len(_gdn_layers(m)) == 1
    big = tiny_model("tiny-qwen3.5")  # default vocabulary: the real Qwen3.5 one, so real tokens fit
    assert type(big).__name__ == "Qwen3_5ForCausalLM" and big.config.vocab_size == 248320
    with pytest.raises(ValueError, match="unknown tiny linear-attention model 'tiny-mamba'"):
        tiny_model("tiny-mamba")


# ------------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("linear_backend", ["auto", "chunk"])
def test_gpu_whole_model_packed_equals_per_sample(name, linear_backend):
    model = tiny_model(name, seed=1, vocab_size=512).cuda()
    enable_varpack(model, linear_backend=linear_backend)
    samples = _samples(LENGTHS * 3)
    logits_ref, loss_ref, grads_ref = _per_sample_on(model, samples, "cuda")
    model.zero_grad(set_to_none=True)
    batch = PaddingFreeCollator()(samples)
    batch.pop("sample_ids", None)
    batch = {
        k: (v.cuda() if isinstance(v, torch.Tensor) and k not in ("cu_seq_lens_q", "cu_seq_lens_k") else v)
        for k, v in batch.items()
    }
    out = model(**batch)
    out.loss.backward()
    assert float((out.logits[0].detach() - logits_ref).abs().max()) < 1e-3
    assert abs(float(out.loss - loss_ref)) < 1e-4
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert float((p.grad - grads_ref[n]).abs().max()) < 1e-3, n


def _per_sample_on(model, samples, device):
    model.zero_grad(set_to_none=True)
    logits, total, count = [], 0.0, 0
    for s in samples:
        ids = torch.tensor([s["input_ids"]], device=device)
        labels = torch.tensor(s["labels"], device=device)
        lg = model(input_ids=ids).logits[0]
        logits.append(lg.detach())
        total = total + F.cross_entropy(lg[:-1], labels[1:], ignore_index=-100, reduction="sum")
        count += int((labels[1:] != -100).sum())
    (total / count).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(logits), (total / count).detach(), grads


@pytest.mark.gpu
def test_gpu_packed_forward_has_no_host_sync_per_layer():
    model = tiny_model(
        "tiny-qwen3.5",
        vocab_size=512,
        num_hidden_layers=6,
        layer_types=["linear_attention"] * 5 + ["full_attention"],
    ).cuda()
    patch_linear_attention(model, backend="chunk")
    samples = _samples([100, 3, 300, 64])
    batch = PaddingFreeCollator()(samples)
    ids = batch["input_ids"].cuda()
    cu = batch["cu_seq_lens_q"]
    model(input_ids=ids, cu_seq_lens_q=cu)  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    layers = _gdn_layers(model)
    # the model hook prepares the boundaries once per forward; the 5 linear layers then never sync
    calls = []

    def strict(*_):
        torch.cuda.set_sync_debug_mode("error")
        calls.append(1)

    def relaxed(*_):
        torch.cuda.set_sync_debug_mode("default")

    for layer in layers[1:]:
        layer.register_forward_pre_hook(strict)
        layer.register_forward_hook(relaxed)
    try:
        model(input_ids=ids, cu_seq_lens_q=cu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(calls) == len(layers) - 1
