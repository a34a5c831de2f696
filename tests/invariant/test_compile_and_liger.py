"""varpack.integrations.kernels: regional torch.compile (attention outside the graph) and Liger-Kernel layers keep
packed == unpacked (logits and every gradient), with a negative control; one graph serves packs of any shape."""

from __future__ import annotations

import copy

import pytest
import torch

from tests._exact import LOGITS_RTOL, LOSS_RTOL, assert_differs, assert_exact
from tests.invariant.test_dense import (
    VOCAB,
    gemma2_model,
    make_samples,
    max_grad_diff,
    packed_run,
    unpacked_run,
)
from varpack.integrations.kernels import apply_liger_kernels, compile_layers, decoder_layers, liger_available
from varpack.models import load_model

SHAPES = [(5, 1, 7, 4), (9, 4), (2, 3, 2, 3, 2, 3, 6)]


def _compiled_pair(backend):
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    ref = copy.deepcopy(model)  # uncompiled, run with its own sdpa attention one sample at a time
    assert (
        compile_layers(model, backend=backend) == len(decoder_layers(model)) == model.config.num_hidden_layers
    )
    return model, ref


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_layers_packed_equals_unpacked(backend):
    torch._dynamo.reset()
    model, ref = _compiled_pair(backend)
    shapes = (
        SHAPES if backend == "aot_eager" else SHAPES[:2]
    )  # inductor compiles C++ on the CPU: keep it short
    for lengths in shapes:
        samples = make_samples(lengths)
        logits_p, loss_p, grads_p = packed_run(model, samples)
        logits_u, loss_u, grads_u = unpacked_run(ref, samples)
        assert_exact(logits_p, logits_u, rtol=LOGITS_RTOL, what=f"logits {lengths}")
        assert_exact(loss_p, loss_u, rtol=LOSS_RTOL, what=f"loss {lengths}")
        assert len(grads_p) == len(list(model.parameters()))
        assert_exact(grads_p, grads_u, what=f"gradient {lengths}")
        # negative control: the same compiled model with the boundaries dropped must differ clearly
        logits_b, _, grads_b = packed_run(model, samples, sabotage=True)
        assert_differs(logits_b, logits_u, rtol=LOGITS_RTOL, what="logits")
        assert_differs(grads_b, grads_u)


def test_one_graph_for_every_pack_shape():
    """dynamic=True: after the first pack, packs with other token and sample counts add no graph (and the
    attention call is the one graph break per layer, not a trace of the varlen kernel). The first pack's sizes
    equal model widths (T = 16 = head_dim, N + 1 = 4 = heads): compile_layers traces without duck sizing, so
    such a coincidence is not baked into the graph's guards."""
    from torch._dynamo.utils import counters
    from torch.fx.experimental import _config as fx_config

    torch._dynamo.reset()
    counters.clear()
    model, _ = _compiled_pair("aot_eager")
    assert model.config.head_dim == 16 and model.config.num_attention_heads == 4
    packed_run(model, make_samples((5, 6, 5)))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    for lengths in SHAPES + [(16,), (7, 9), (3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 7)]:
        packed_run(model, make_samples(lengths, seed=len(lengths)))
        assert counters["stats"]["unique_graphs"] == graphs, lengths
    assert fx_config.use_duck_shape  # off only while a compiled layer runs
    breaks = counters["graph_break"]
    assert breaks and all("torch.compiler.disable" in reason for reason in breaks), dict(breaks)


def test_compile_layers_refuses_a_model_without_varpack_attention():
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend=None)  # plain sdpa model
    with pytest.raises(ValueError, match="varpack attention"):
        compile_layers(model, backend="aot_eager")
    assert not any(getattr(layer, "_compiled_call_impl", None) for layer in decoder_layers(model))


def test_sft_config_switches_compile_on(tmp_path):
    from tests.train.test_cli_sft import _build

    run = _build(tmp_path, torch_compile=True)
    layers = decoder_layers(run.model)
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)
    assert run.model._varpack_compiled["layers"] == len(layers)
    plain = _build(tmp_path / "plain")
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(plain.model))


@pytest.mark.skipif(not liger_available(), reason="liger-kernel not installed (pip install liger-kernel)")
def test_liger_refuses_an_unsupported_family():
    from torch import nn
    from transformers import PretrainedConfig

    class Odd(nn.Module):
        config = PretrainedConfig()

    Odd.config.model_type = "not-a-family"
    with pytest.raises(ValueError, match="no kernels for model_type 'not-a-family'"):
        apply_liger_kernels(Odd())


def test_liger_missing_is_a_clear_error(monkeypatch):
    import varpack.integrations.kernels as K

    monkeypatch.setattr(K, "liger_available", lambda: False)
    with pytest.raises(ImportError, match="pip install liger-kernel"):
        K.apply_liger_kernels(load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference"))


# ---------------------------------------------------------------------------------------------------------
# GPU: Liger's Triton kernels and inductor's CUDA code, in float32 so the packed/unpacked tolerance is tight
# ---------------------------------------------------------------------------------------------------------
def _gpu_pair(liger: bool, compile_: bool):
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="auto").cuda()
    if liger:
        apply_liger_kernels(model)
    ref = copy.deepcopy(model)
    if compile_:
        compile_layers(model)
    return model, ref


@pytest.mark.gpu
@pytest.mark.parametrize("liger,compile_", [(True, False), (False, True)])
def test_gpu_liger_and_compile_packed_equals_unpacked(liger, compile_, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the GPU machine)")
    if liger and not liger_available():
        pytest.skip("liger-kernel not installed")
    torch._dynamo.reset()
    from transformers.models.qwen3 import modeling_qwen3

    for name in ("apply_rotary_pos_emb", "Qwen3RMSNorm", "Qwen3MLP"):  # liger patches them module-wide:
        monkeypatch.setattr(modeling_qwen3, name, getattr(modeling_qwen3, name))  # restored after the test
    model, ref = _gpu_pair(liger, compile_)
    for lengths in SHAPES[:2]:
        samples = make_samples(lengths)
        logits_p, loss_p, grads_p = packed_run(model, samples, device="cuda")
        logits_u, loss_u, grads_u = unpacked_run(ref, samples, device="cuda")
        assert (logits_p - logits_u).abs().max().item() <= 1e-4, lengths
        torch.testing.assert_close(loss_p, loss_u, rtol=1e-5, atol=1e-5)
        assert max_grad_diff(grads_p, grads_u) <= 1e-4, lengths
        logits_b, _, grads_b = packed_run(model, samples, sabotage=True, device="cuda")
        assert (logits_b - logits_u).abs().max().item() > 1e-3
        assert max_grad_diff(grads_b, grads_u) > 1e-3


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3-next"])
def test_compiled_linear_attention_model_packed_equals_per_sample(name):
    """Qwen3.5 / Qwen3-Next (gated delta + full attention; Qwen3-Next adds a mixture of experts): both mixers
    stay outside the compiled graph (traced, the gated-delta chunking is data dependent and recompiled for every
    pack), exact, one graph set for all packs."""
    from torch._dynamo.utils import counters

    from tests.invariant.test_gated_delta import _far, _gaps, _passes, _per_sample, _samples
    from varpack.collate import PaddingFreeCollator
    from varpack.integrations.transformers import enable_varpack
    from varpack.models.gated_delta import tiny_model

    def packed(model, samples, sabotage=False):
        model.zero_grad(set_to_none=True)
        batch = PaddingFreeCollator()(samples)
        batch.pop("sample_ids", None)
        if sabotage:
            t = batch["input_ids"].shape[1]
            batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, t], dtype=torch.int32)
            batch["max_length_q"] = batch["max_length_k"] = t
            batch.pop("varlen_meta")
        out = model(**batch)
        out.loss.backward()
        return out.logits[0].detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(name, seed=1, vocab_size=VOCAB)
    ref = copy.deepcopy(model)  # transformers' own forward, one sample at a time
    enable_varpack(model, linear_backend="chunk")
    compile_layers(model, backend="aot_eager")
    graphs = None
    for lengths in ([5, 1, 30, 66, 2], [40, 41], [3] * 12):
        samples = _samples(lengths, vocab=VOCAB)
        logits_r, loss_r, grads_r = _per_sample(ref, samples)
        logits_p, loss_p, grads_p = packed(model, samples)
        diffs = _gaps(logits_p, loss_p, grads_p, logits_r, loss_r, grads_r)
        assert _passes(diffs), (lengths, {k: str(g) for k, g in diffs.items()})
        assert grads_p.keys() == {n for n, _ in model.named_parameters()}
        graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs, lengths
    logits_b, loss_b, grads_b = packed(model, samples, sabotage=True)
    diffs = _gaps(logits_b, loss_b, grads_b, logits_r, loss_r, grads_r)
    assert _far(diffs["logits"]) and _far(diffs["grad"]), {k: str(g) for k, g in diffs.items()}


def test_cli_flags_reach_the_config():
    from varpack.cli.main import build_parser
    from varpack.cli.sft import config_from_args

    args = build_parser().parse_args(["sft", "--torch-compile", "--use-liger-kernel", "--max-steps", "1"])
    config = config_from_args(args)
    assert config.torch_compile and config.use_liger_kernel
    config = config_from_args(build_parser().parse_args(["sft", "--max-steps", "1"]))
    # default: decided per run (tests/train/test_compile_default.py), Liger off
    assert config.torch_compile == "auto" and not config.use_liger_kernel


def test_compiled_layers_with_gradient_checkpointing():
    """Recomputed compiled layers see the same boundaries: grads equal the unpacked ones; without boundaries not."""
    torch._dynamo.reset()
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    ref = copy.deepcopy(model)
    model.gradient_checkpointing_enable()
    model.train()
    compile_layers(model, backend="aot_eager")
    samples = make_samples(SHAPES[0])
    _, _, grads_u = unpacked_run(ref, samples)
    _, _, grads_p = packed_run(model, samples)
    assert_exact(grads_p, grads_u)
    _, _, grads_b = packed_run(model, samples, sabotage=True)
    assert_differs(grads_b, grads_u)


# ---------------------------------------------------------------------------------------------------------
# the other families: Llama, Gemma2-style (softcap + alternating sliding window), vision-language
# ---------------------------------------------------------------------------------------------------------
TEXT_FAMILIES = {  # name: (build, the reference's own attention), as in tests/invariant/test_dense.py MODELS
    "tiny-llama": (lambda: load_model("tiny-llama", vocab_size=VOCAB, attn_backend="reference"), "sdpa"),
    "gemma2": (gemma2_model, "eager"),
}


@pytest.mark.parametrize("name", sorted(TEXT_FAMILIES))
def test_compiled_text_families_packed_equals_unpacked(name):
    """Every pack is exact (test_dense.py's tolerances), the packs after the first add no graph, and the
    same compiled model without boundaries fails."""
    from torch._dynamo.utils import counters

    build, ref_attn = TEXT_FAMILIES[name]
    torch._dynamo.reset()
    counters.clear()
    model = build()
    ref = copy.deepcopy(model)
    assert compile_layers(model, backend="aot_eager") == model.config.num_hidden_layers
    graphs = None
    for lengths in SHAPES:
        samples = make_samples(lengths)
        logits_p, loss_p, grads_p = packed_run(model, samples)
        graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs > 0, lengths
        logits_u, loss_u, grads_u = unpacked_run(ref, samples, ref_attn)
        assert_exact(logits_p, logits_u, rtol=LOGITS_RTOL, what=f"logits {lengths}")
        assert_exact(loss_p, loss_u, rtol=LOSS_RTOL, what=f"loss {lengths}")
        assert len(grads_p) == len(list(model.parameters()))
        assert_exact(grads_p, grads_u, what=f"gradient {lengths}")
    logits_b, _, grads_b = packed_run(model, samples, sabotage=True)
    assert_differs(logits_b, logits_u, rtol=LOGITS_RTOL, what="logits")
    assert_differs(grads_b, grads_u)
    assert counters["stats"]["unique_graphs"] == graphs
    breaks = counters["graph_break"]
    assert breaks and all("torch.compiler.disable" in reason for reason in breaks), dict(breaks)


@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-qwen3.5-vl"])
def test_compiled_vl_model_packed_equals_per_sample(name):
    """Qwen3-VL / Qwen3.5-VL with real images: only the text decoder layers are compiled (the vision tower
    stays eager), each pack equals its samples run alone (test_vision_language.py's tolerances), the packs after the
    first add no graph (the first has 3 samples: N + 1 = 4 = the mRoPE planes of position_ids), and the same
    compiled model without boundaries fails."""
    pytest.importorskip("PIL")
    pytest.importorskip("skimage")
    from torch._dynamo.utils import counters

    from tests.invariant.test_vision_language import (
        CHATS,
        assert_packed_exact,
        encode,
        per_sample_run,
        varpack_model,
    )
    from tests.invariant.test_vision_language import packed_run as vl_packed_run
    from varpack.collate import PaddingFreeCollator
    from varpack.data.media import image_processor_for
    from varpack.data.tokenizer import load_tokenizer
    from varpack.models.qwen_vl import tiny_config, tiny_model

    tok = load_tokenizer("qwen3")
    proc = image_processor_for(tiny_config("tiny-qwen3-vl"), min_pixels=32 * 32, max_pixels=128 * 128)
    torch._dynamo.reset()
    counters.clear()
    ref_model = tiny_model(name)
    model = varpack_model(ref_model)
    assert compile_layers(model, backend="aot_eager") == model.config.text_config.num_hidden_layers
    assert decoder_layers(model) == list(model.model.language_model.layers)
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(model))
    visual = model.model.visual
    assert not any(getattr(m, "_compiled_call_impl", None) for m in visual.modules())
    graphs = None
    for chats in ([CHATS[0], CHATS[1], CHATS[2]], [CHATS[4], CHATS[3]], [CHATS[5], CHATS[1]]):
        samples = encode(chats, tok, proc, ref_model)
        batch = PaddingFreeCollator()(samples)
        got = vl_packed_run(model, batch)
        graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs > 0, chats
        ref = per_sample_run(ref_model, samples)
        assert_packed_exact(ref, got, f"{name} compiled")
        assert any(n.startswith("model.visual.") for n in got[2])  # the images went through the tower
    t = batch["input_ids"].shape[1]
    bad = dict(batch, cu_seq_lens_q=torch.tensor([0, t], dtype=torch.int32), max_length_q=t, max_length_k=t)
    bad["cu_seq_lens_k"] = bad["cu_seq_lens_q"]
    bad.pop("varlen_meta")
    logits_b, _, grads_b = vl_packed_run(model, bad)
    assert_differs(logits_b, ref[0], rtol=LOGITS_RTOL, what="logits")
    assert_differs(grads_b, ref[2])
    assert counters["stats"]["unique_graphs"] == graphs
    breaks = counters["graph_break"]
    assert breaks and all("torch.compiler.disable" in reason for reason in breaks), dict(breaks)
    assert not any(getattr(m, "_compiled_call_impl", None) for m in visual.modules())


@pytest.mark.skipif(not liger_available(), reason="liger-kernel not installed (pip install liger-kernel)")
def test_liger_patch_failure_is_a_clear_error(monkeypatch):
    """A family Liger lists but cannot patch (its own NotImplementedError / ImportError) is a ValueError naming
    the model type, not a raw traceback from inside liger."""
    from liger_kernel.transformers import monkey_patch

    def refuse(model=None, **kw):
        raise NotImplementedError("liger_rotary_pos_emb is not available for Qwen3 models")

    monkeypatch.setitem(monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN, "qwen3", refuse)
    with pytest.raises(ValueError, match="cannot patch Qwen3ForCausalLM \\(model_type 'qwen3'\\).*not available"):
        apply_liger_kernels(load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference"))


def test_liger_and_compile_are_refused_together(tmp_path, capsys, monkeypatch):
    """Liger's layers + regional compile fail inside dynamo (seen on the H200): refused both ways round, by the
    library calls and by `varpack sft` before any encoding, with the reason and the choice to make."""
    import varpack.integrations.kernels as K
    import varpack.train.sft as vt  # build_sft (and the load_and_encode it calls) live here
    from varpack.cli.main import main

    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    model._varpack_liger = ["rms_norm"]  # what apply_liger_kernels leaves on a patched model
    with pytest.raises(ValueError, match="Choose one"):
        compile_layers(model, backend="aot_eager")
    assert not any(getattr(layer, "_compiled_call_impl", None) for layer in decoder_layers(model))

    compiled = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    compile_layers(compiled, backend="aot_eager")
    monkeypatch.setattr(K, "liger_available", lambda: True)  # the refusal comes before liger is imported
    with pytest.raises(ValueError, match="Choose one"):
        K.apply_liger_kernels(compiled)

    def no_encoding(*a, **k):
        raise AssertionError("encoded before refusing")

    monkeypatch.setattr(vt, "load_and_encode", no_encoding)
    code = main(
        ["sft", "--use-liger-kernel", "--torch-compile", "--max-steps", "1", "--output-dir", str(tmp_path / "o")]
    )
    assert code == 1 and "--torch-compile" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_liger_then_compile_is_refused():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the GPU machine)")
    if not liger_available():
        pytest.skip("liger-kernel not installed")
    from transformers.models.qwen3 import modeling_qwen3

    saved = dict(vars(modeling_qwen3))
    try:
        model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="auto").cuda()
        apply_liger_kernels(model)
        with pytest.raises(ValueError, match="Choose one"):
            compile_layers(model)
    finally:  # liger patches the modeling module itself
        for name, value in saved.items():
            if vars(modeling_qwen3).get(name) is not value:
                setattr(modeling_qwen3, name, value)


#: packs of other token counts T, sample counts N and longest samples max_seqlen than the first (a single-sample
#: pack, N = 1, included): after the first pack none may add a graph
PACK_SHAPES = [(40, 24), (5, 6, 5), (63,), (2, 3, 2, 3, 2, 3, 6), (30, 1, 17, 9)]


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5"])
@pytest.mark.parametrize("dynamic", [True, False])
def test_no_graph_after_the_first_pack(name, dynamic):
    """Compiled layers (``compile_layers``, attention and Gated DeltaNet mixers as graph breaks) trained over
    packs of new T, N and max_seqlen compile no graph after the first pack: the pack's sizes and its Python-int
    ``max_length_q/k`` are symbolic from the first trace. Negative control (``dynamic=False``): a graph
    specialised to the first pack's sizes recompiles for the second, so the count would catch it."""
    from torch._dynamo.utils import counters

    from tests.invariant.test_gated_delta import _samples
    from varpack.collate import PaddingFreeCollator
    from varpack.integrations.transformers import enable_varpack
    from varpack.models.gated_delta import tiny_model

    torch._dynamo.reset()
    counters.clear()
    if name == "tiny-qwen3":
        model = load_model(name, vocab_size=VOCAB, attn_backend="reference")
    else:
        model = tiny_model(name, seed=1, vocab_size=VOCAB)
        enable_varpack(model, linear_backend="chunk")
    model.train()
    compile_layers(model, backend="aot_eager", dynamic=dynamic)
    counts = []
    for i, lengths in enumerate(PACK_SHAPES):
        batch = PaddingFreeCollator()(_samples(lengths, vocab=VOCAB, seed=i))
        batch.pop("sample_ids", None)
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        counts.append(counters["stats"]["unique_graphs"])
    assert counts[0] > 0
    if dynamic:
        assert counts == [counts[0]] * len(PACK_SHAPES), counts
    else:
        assert counts[1] > counts[0], counts


def test_dynamic_inductor_options():
    """Layers compiled by inductor for dynamic shapes get ``triton.mix_order_reduction_non_strict_mode`` (no
    guard on the token count from the mix-order reduction's size thresholds); not for other backends, static
    shapes or a given ``mode`` (torch takes ``mode`` or ``options``); the caller's options win."""
    from varpack.integrations.kernels import DYNAMIC_INDUCTOR_OPTIONS, dynamic_inductor_options

    key = "triton.mix_order_reduction_non_strict_mode"
    assert DYNAMIC_INDUCTOR_OPTIONS == {key: True}
    assert hasattr(torch._inductor.config.triton, key.split(".")[1])  # the torch this package is tested on has it
    for dynamic in (True, None):
        assert dynamic_inductor_options("inductor", dynamic, {}) == {"options": {key: True}}
    assert dynamic_inductor_options("inductor", True, {"fullgraph": True, "options": {key: False, "a.b": 1}}) == {
        "fullgraph": True, "options": {key: False, "a.b": 1},
    }
    assert dynamic_inductor_options("inductor", True, {"options": {"a.b": 1}}) == {"options": {key: True, "a.b": 1}}
    assert dynamic_inductor_options("aot_eager", True, {}) == {}
    assert dynamic_inductor_options("inductor", False, {}) == {}
    assert dynamic_inductor_options("inductor", True, {"mode": "max-autotune"}) == {"mode": "max-autotune"}


def test_compile_layers_passes_the_dynamic_inductor_options(monkeypatch):
    """compile_layers hands the options to every layer's ``compile``; aot_eager layers get none (negative
    control of the recorder)."""
    seen = []
    original = torch.nn.Module.compile

    def record(self, *args, **kwargs):
        seen.append(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", record)
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    n = compile_layers(model)
    assert len(seen) == n and all(
        kw["options"] == {"triton.mix_order_reduction_non_strict_mode": True} for kw in seen
    ), seen
    seen.clear()
    compile_layers(load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference"), backend="aot_eager")
    assert seen and all("options" not in kw for kw in seen), seen
