"""Packed == per-sample for Mamba-2 mixers and whole tiny Mamba-2 / hybrid models (Mamba-2, Bamba, Granite 4
hybrid, Nemotron-H, Falcon-H1, Zamba2): logits, loss and every parameter's gradient, fp32 on the CPU.

The per-sample reference is the unmodified transformers forward on each sample alone (its own PyTorch conv and
chunk scan, its own attention); the packed run is one row through ``enable_varpack`` (varpack attention, the
patched mixers). Two negative controls per model must make the comparison fail: the SSD scan without
boundaries and the short conv without boundaries (the integration module's ops monkeypatched to drop them).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import varpack.integrations.mamba2 as mb
from varpack.collate import PaddingFreeCollator
from varpack.integrations.mamba2 import patch_mamba2_mixers
from varpack.integrations.transformers import enable_varpack
from varpack.models import load_model
from varpack.models.mamba2 import MAMBA2, TINY_MODELS, is_mamba2_mixer, tiny_config

VOCAB = 512
LENGTHS = [5, 1, 30, 66, 2]  # a 1-token sample; the tiny configs' 16-token chunks straddle every boundary
RTOL, ATOL = 1e-4, 1e-6  # fp32: per tensor, max|packed - reference| <= RTOL * max|reference| + ATOL


@pytest.fixture(scope="module")
def models():
    return {name: load_model(name, vocab_size=VOCAB, attn_backend="reference").eval() for name in TINY_MODELS}


def _samples(lengths=LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(1, VOCAB, (n,), generator=gen)
        labels = ids.clone()
        labels[0] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def _per_sample(model, samples):
    """Each sample alone through the unmodified forward; token-mean loss over all samples."""
    model.zero_grad(set_to_none=True)
    logits, total, count = [], 0.0, 0
    for s in samples:
        lg = model(input_ids=torch.tensor([s["input_ids"]])).logits[0]
        labels = torch.tensor(s["labels"])
        logits.append(lg.detach())
        total = total + F.cross_entropy(lg[:-1].float(), labels[1:], ignore_index=-100, reduction="sum")
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


def _excess(a, b):
    """How far ``a`` is from ``b`` in units of the allowed error (<= 1 passes)."""
    return float((a - b).abs().max() / (RTOL * b.abs().max() + ATOL))


_REFERENCES: dict = {}


def _compare(model, name):
    """``{logits, loss, grad}``: the worst excess of packed over per-sample (reference cached per model)."""
    if name not in _REFERENCES:
        _REFERENCES[name] = _per_sample(model, _samples())
    logits_ref, loss_ref, grads_ref = _REFERENCES[name]
    logits, loss, grads = _packed(model, _samples())
    assert grads.keys() == grads_ref.keys()
    return {
        "logits": _excess(logits, logits_ref),
        "loss": _excess(loss, loss_ref),
        "grad": max(_excess(grads[n], grads_ref[n]) for n in grads),
    }


@pytest.fixture(params=TINY_MODELS)
def packed_model(request, models):
    model = models[request.param]
    model._test_name = request.param
    return model


def test_whole_model_packed_equals_per_sample(packed_model):
    assert MAMBA2.linear_layers(packed_model)  # the model has Mamba-2 mixers, all patched
    assert all("_varpack_ssd_original_forward" in m.__dict__ for m in MAMBA2.linear_layers(packed_model))
    diffs = _compare(packed_model, packed_model._test_name)
    assert max(diffs.values()) <= 1, diffs


def test_negative_control_scan_without_boundaries(packed_model, monkeypatch):
    real = mb.ssd_scan

    def one_sequence(*args, **kw):
        for key in ("layout", "cu_seqlens", "seq_idx"):
            kw.pop(key, None)
        return real(*args, **kw)

    monkeypatch.setattr(mb, "ssd_scan", one_sequence)
    diffs = _compare(packed_model, packed_model._test_name)
    assert diffs["logits"] > 20 and diffs["grad"] > 20, diffs  # the equivalence check fails


def test_negative_control_conv_without_boundaries(packed_model, monkeypatch):
    real = mb.short_conv

    def no_boundaries(x, weight, bias=None, activation=None, **kw):
        for key in ("seq_idx", "cu_seqlens", "cu_seqlens_cpu"):
            kw.pop(key, None)
        return real(x, weight, bias, activation, **kw)

    monkeypatch.setattr(mb, "short_conv", no_boundaries)
    diffs = _compare(packed_model, packed_model._test_name)
    assert diffs["logits"] > 20 and diffs["grad"] > 20, diffs


# ------------------------------------------------------------------------------------------------------
# one mixer


def _mixer(name, **overrides):
    config = tiny_config(name, vocab_size=VOCAB, **overrides)
    torch.manual_seed(1)
    return next(m for m in MAMBA2.build(config).modules() if is_mamba2_mixer(m))


@pytest.mark.parametrize(
    "name, overrides, boundary",
    [
        ("tiny-bamba", {}, "cu_seq_lens_q"),
        ("tiny-bamba", {}, "seq_idx"),
        ("tiny-falcon-h1", {}, "cu_seq_lens_q"),  # no gated norm: y * silu(gate)
        ("tiny-falcon-h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": False}, "cu_seq_lens_q"),
        ("tiny-falcon-h1", {"mamba_rms_norm": True, "mamba_norm_before_gate": True}, "seq_idx"),
        ("tiny-nemotron-h", {"time_step_min": 0.5}, "cu_seq_lens_q"),  # time_step_limit (0.5, inf) clamps
    ],
)
def test_mixer_packed_equals_per_sample(name, overrides, boundary):
    layer = _mixer(name, **overrides)
    T = sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(len(LENGTHS), dtype=torch.int32), cu.diff())[None]
    x = torch.randn(1, T, layer.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True)
    dy = torch.randn(1, T, layer.hidden_size, generator=torch.Generator().manual_seed(1))
    params = list(layer.parameters())
    ref = torch.cat([layer(x[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
    ref_grads = torch.autograd.grad((ref * dy).sum(), [x, *params])
    assert patch_mamba2_mixers(layer) == 1
    kw = {"cu_seq_lens_q": cu} if boundary == "cu_seq_lens_q" else {"seq_idx": seq_idx}
    out = layer(x, **kw)
    grads = torch.autograd.grad((out * dy).sum(), [x, *params])
    assert _excess(out, ref) <= 1
    for a, b in zip(grads, ref_grads):
        assert _excess(a, b) <= 1
    assert torch.equal(layer(x[:, :5]), ref[:, :5])  # no boundaries: the original forward, unchanged


def test_unpacked_forward_is_unchanged():
    plain = MAMBA2.build(tiny_config("tiny-zamba2", vocab_size=VOCAB)).eval()
    patched = MAMBA2.build(tiny_config("tiny-zamba2", vocab_size=VOCAB)).eval()
    patched.load_state_dict(plain.state_dict())
    assert (
        patch_mamba2_mixers(patched) == 4 and patch_mamba2_mixers(patched, backend="naive") == 4
    )  # idempotent
    ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(plain(input_ids=ids).logits, patched(input_ids=ids).logits)


def test_boundaries_reach_mixers_through_the_layer_hook(models):
    """A release whose decoder layer calls the mixer without **kwargs: the layer's pre-hook hands the call's
    meta over."""
    model = models["tiny-bamba"]
    strip = ("varlen_meta", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    handles = [
        m.register_forward_pre_hook(
            lambda mod, a, kw: (a, {k: v for k, v in kw.items() if k not in strip}), with_kwargs=True
        )
        for m in MAMBA2.linear_layers(model)
    ]
    try:
        diffs = _compare(model, "tiny-bamba")
    finally:
        for h in handles:
            h.remove()
    assert max(diffs.values()) <= 1, diffs


def test_gradient_checkpointing(models):
    """Recomputation in the backward sees the same boundaries (transformers hands the layer the same
    kwargs)."""
    model = models["tiny-nemotron-h"]
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        diffs = _compare(model, "tiny-nemotron-h")
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    assert max(diffs.values()) <= 1, diffs


def test_packed_guards(models):
    layer = _mixer("tiny-bamba")
    patch_mamba2_mixers(layer)
    x = torch.randn(1, 6, layer.hidden_size)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"one row \[1, T\]"):
        layer(x.expand(2, 6, -1), cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="with a cache"):
        layer(x, cache=object(), cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="positional argument"):
        layer(x, object(), cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match=r"\['initial_states'\]"):
        layer(x, initial_states=torch.zeros(1), cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="cover 6 tokens but the layer got T=5"):
        from varpack.varlen import VarlenMeta

        layer(x[:, :5], varlen_meta=VarlenMeta(cu))
    model = models["tiny-granite4-hybrid"]
    batch = PaddingFreeCollator()(_samples())
    batch.pop("sample_ids")
    with pytest.raises(ValueError, match="use_cache=True"):
        model(**batch, use_cache=True)
    with pytest.raises(ValueError, match="unknown SSD backend 'fast'"):
        patch_mamba2_mixers(model, backend="fast")


def test_unsupported_mixer_settings_refused():
    layer = _mixer("tiny-bamba")
    layer.time_step_limit = None
    with pytest.raises(ValueError, match=r"BambaMixer\(layer_idx=0\): time_step_limit=None is not supported"):
        patch_mamba2_mixers(layer)
    layer = _mixer("tiny-bamba")
    del layer.dt_bias
    with pytest.raises(TypeError, match=r"missing \['dt_bias'\]"):
        patch_mamba2_mixers(layer)
    layer = _mixer("tiny-bamba")
    layer.conv1d.base_layer = layer.conv1d  # what a peft LoRA wrapper looks like
    with pytest.raises(ValueError, match="conv1d carries a LoRA"):
        patch_mamba2_mixers(layer)


@pytest.mark.parametrize("model_type", ["mamba", "jamba"])
def test_mamba1_models_refused_by_name(model_type):
    """Mamba-1 mixers (selective scan, no boundary reset in varpack): refused when enabled, never run
    packed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = (
        {"num_experts": 1, "attn_layer_period": 2, "attn_layer_offset": 1} if model_type == "jamba" else {}
    )
    config = AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=64, **extra
    )
    model = AutoModelForCausalLM.from_config(config)
    # the innermost stateful module and its path are named (MambaMixer at backbone.layers.0.mixer, ...)
    with pytest.raises(ValueError, match=r"Mamba\w*Mixer"):
        enable_varpack(model)


def _reads_and_scalars(num_layers):
    """Value reads of the boundary offsets and tensor-to-scalar conversions in one packed step of tiny-bamba
    with ``num_layers`` layers (every layer but the second a Mamba-2 mixer)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.integrations.test_transformers import _Watched

    model = load_model(
        "tiny-bamba",
        vocab_size=VOCAB,
        attn_backend="reference",
        config_overrides={"num_hidden_layers": num_layers},
    )
    batch = PaddingFreeCollator()(_samples())
    batch.pop("sample_ids")
    batch.pop("varlen_meta")  # built by the guard from the watched offsets, once per forward
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = batch["cu_seq_lens_q"].as_subclass(_Watched)
    _Watched.reads = []

    class Scalars(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                Scalars.count += 1
            return func(*args, **(kwargs or {}))

    with Scalars():
        model(**batch).loss.backward()
    return len(_Watched.reads), Scalars.count


def test_no_per_layer_host_reads():
    """The boundaries are read once per batch (the guard's check, the SSD layout kept on the meta), not per
    mixer, and nothing is turned into a Python scalar (no host sync on a device)."""
    reads_2, scalars_2 = _reads_and_scalars(2)  # 1 mixer
    reads_6, scalars_6 = _reads_and_scalars(6)  # 5 mixers
    assert reads_2 == reads_6 <= 2  # the guard's check, the meta's seq_idx
    assert scalars_2 == scalars_6 == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", TINY_MODELS)
def test_gpu_check_bf16(name, monkeypatch):
    """On the GPU: bf16, backends auto (attention, SSD scan, short conv), by the fp32-truth rule of ``varpack
    check``; the sabotaged run (boundaries dropped) fails."""
    import varpack.collate
    from tests.test_check import _Sabotaged
    from varpack.check import check_exactness

    model = load_model(name, dtype=torch.bfloat16, device="cuda", attn_backend="auto")
    rows = _samples([300, 1, 717, 77, 129])
    res = check_exactness(model, rows, backend="auto")
    assert res["passed"], res["failures"]
    print(f"{name}: SSD {mb.ssd_backend(model, 'cuda')}; logit err packed/unpacked vs fp32 "
          f"{res['logit_err_packed']:.3g}/{res['logit_err_unpacked']:.3g}")  # fmt: skip
    monkeypatch.setattr(varpack.collate, "PaddingFreeCollator", _Sabotaged)
    assert not check_exactness(model, rows, backend="auto")["passed"]


@pytest.mark.parametrize("name", ["tiny-bamba", "tiny-falcon-h1"])
def test_compiled_layers_packed_equals_per_sample(name):
    """Regional torch.compile (``varpack sft``'s default on CUDA; aot_eager here): the Mamba-2 mixers run as
    graph breaks beside varpack attention, and the packed step still equals each sample alone."""
    from varpack.integrations.kernels import compile_layers, decoder_layers

    torch._dynamo.reset()
    model = load_model(name, vocab_size=VOCAB, attn_backend="reference").eval()
    ref = _per_sample(model, _samples())
    assert (
        compile_layers(model, backend="aot_eager")
        == len(decoder_layers(model))
        == model.config.num_hidden_layers
    )
    logits, loss, grads = _packed(model, _samples())
    assert _excess(logits, ref[0]) <= 1 and _excess(loss, ref[1]) <= 1
    assert grads.keys() == ref[2].keys() and max(_excess(grads[n], ref[2][n]) for n in grads) <= 1
