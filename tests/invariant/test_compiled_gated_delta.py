"""Gated DeltaNet layers traced whole inside compiled decoder layers (``compile_layers(custom_ops=True)``):
projections, the short convolution (segment index computed in the graph), gates, the gated delta rule as the
``varpack::gated_delta_rule`` custom op, output gate + RMSNorm -- no graph break (``fullgraph=True``).

tiny-qwen3.5 and tiny-qwen3-next (the same mixer; Qwen3-Next adds a mixture of experts), ``aot_eager`` on the
CPU: packed-compiled == each sample alone and == packed-eager (logits, loss, every gradient), one graph per
layer kind for every pack; static-shape packs (pad segments at the end) == dynamic-shape packs, each pad
segment == that segment run alone.

Negative controls, caught by the same assertions: the boundaries dropped (one segment for the row); the
short convolution in the graph given one segment (its taps read across samples); the rule's op given one
segment (its state carried across samples); the pad segments merged into the last sample (its state carried
into them); ``custom_ops=False`` under ``fullgraph=True`` (the mixer's graph break raises).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests._exact import LOGITS_RTOL, LOSS_RTOL, assert_differs, assert_exact
from tests.invariant.test_gated_delta import _per_sample, _samples
from varpack.collate import PaddingFreeCollator, StaticShape
from varpack.integrations import gated_delta as gd
from varpack.integrations.kernels import compile_layers
from varpack.integrations.transformers import enable_varpack
from varpack.models.gated_delta import tiny_model

VOCAB = 512
#: lengths across the 64-token chunk, a 1-token sample, a one-sample pack (no recompilation for N = 1 either)
PACKS = ([5, 1, 30, 66, 2], [40, 41], [3] * 12, [50])
PAD_ID = 7
STATIC = StaticShape.for_packing(104, max_samples=6, multiple_of=8)
STATIC_PACKS = ([5, 1, 30, 66, 2], [40, 41], [3] * 6, [104])


def _models(name, **compile_kw):
    """(compiled varpack model, eager varpack copy, unpatched reference) with the same weights."""
    torch._dynamo.reset()
    ref = tiny_model(name, seed=1, vocab_size=VOCAB)
    model = copy.deepcopy(ref)
    enable_varpack(model, linear_backend="chunk")
    eager = copy.deepcopy(model)
    kw = {"backend": "aot_eager", "custom_ops": True, "fullgraph": True, **compile_kw}
    assert compile_layers(model, **kw) == model.config.num_hidden_layers
    return model, eager, ref


def _run(model, batch):
    """Forward + backward of one collated row: (logits [T, V], loss, grads)."""
    model.zero_grad(set_to_none=True)
    out = model(**{k: v for k, v in batch.items() if k != "sample_ids"})
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits[0].detach(), out.loss.detach(), grads


def _dropped(batch):
    """Sabotage: one segment over the whole row (the boundaries are gone)."""
    t = batch["input_ids"].shape[1]
    bad = dict(batch, cu_seq_lens_q=torch.tensor([0, t], dtype=torch.int32), max_length_q=t, max_length_k=t)
    bad["cu_seq_lens_k"] = bad["cu_seq_lens_q"]
    bad.pop("varlen_meta")
    return bad


def _assert_same(got, want, what):
    assert_exact(got[0], want[0], rtol=LOGITS_RTOL, what=f"logits {what}")
    assert_exact(got[1], want[1], rtol=LOSS_RTOL, what=f"loss {what}")
    assert_exact(got[2], want[2], what=f"gradient {what}")


def _assert_far(got, want, what):
    assert_differs(got[0], want[0], rtol=LOGITS_RTOL, what=f"logits {what}")
    assert_differs(got[2], want[2], what=f"gradient {what}")


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-next"])
def test_compiled_mixer_packed_equals_unpacked_and_eager(name):
    from torch._dynamo.utils import counters

    model, eager, ref = _models(name)
    counters.clear()
    graphs = control = None
    for lengths in PACKS:
        samples = _samples(lengths, vocab=VOCAB)
        batch = PaddingFreeCollator()(samples)
        got = _run(model, batch)
        graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs == 2, lengths  # linear + full-attention layers
        want = _per_sample(ref, samples)
        assert got[2].keys() == {n for n, _ in model.named_parameters()}
        _assert_same(got, want, f"compiled/unpacked {lengths}")
        _assert_same(got, _run(eager, batch), f"compiled/eager {lengths}")
        control = control or (batch, want)  # the first pack: five samples
    assert not counters["graph_break"], dict(counters["graph_break"])
    # negative control: the same compiled model, the boundaries dropped (one segment: no recompilation)
    _assert_far(_run(model, _dropped(control[0])), control[1], "boundaries dropped")
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_mixer_with_gradient_checkpointing():
    """Recomputed compiled layers (gradient checkpointing) trace the mixer whole too and stay exact."""
    torch._dynamo.reset()
    ref = tiny_model("tiny-qwen3.5", seed=1, vocab_size=VOCAB)
    model = copy.deepcopy(ref)
    enable_varpack(model, linear_backend="chunk")
    model.gradient_checkpointing_enable()
    model.train()
    compile_layers(model, backend="aot_eager", custom_ops=True, fullgraph=True)
    samples = _samples(PACKS[0], vocab=VOCAB)
    batch = PaddingFreeCollator()(samples)
    want = _per_sample(ref, samples)
    _assert_same(_run(model, batch), want, "gradient checkpointing")
    _assert_far(_run(model, _dropped(batch)), want, "gradient checkpointing, boundaries dropped")


def _sabotage_conv(monkeypatch):
    """The short convolution in the graph sees one segment: its taps read the previous sample's tokens."""
    monkeypatch.setattr(gd, "seq_idx_on_device", lambda cu, T: torch.zeros(1, T, dtype=torch.int32))


def _sabotage_rule(monkeypatch):
    """The rule's custom op sees one segment: its recurrent state runs across the samples."""
    real = gd.gated_delta_rule_op

    def whole_row(q, *args, cu_seqlens, cu_seqlens_cpu, **kw):
        one = torch.tensor([0, q.shape[1]], dtype=torch.int32)
        return real(q, *args, cu_seqlens=one.to(cu_seqlens.device), cu_seqlens_cpu=one, **kw)

    monkeypatch.setattr(gd, "gated_delta_rule_op", whole_row)


@pytest.mark.parametrize("sabotage", [_sabotage_conv, _sabotage_rule], ids=["conv", "rule"])
def test_compiled_mixer_negative_controls(sabotage, monkeypatch):
    """Each boundary of the traced mixer matters: with one of them sabotaged in the graph, the packed run
    fails the assertion the honest run passes (tiny-qwen3.5)."""
    sabotage(monkeypatch)
    model, _, ref = _models("tiny-qwen3.5")
    samples = _samples(PACKS[0], vocab=VOCAB)
    _assert_far(_run(model, PaddingFreeCollator()(samples)), _per_sample(ref, samples), sabotage.__name__)


def test_graph_break_without_custom_ops_is_refused_by_fullgraph():
    """``custom_ops=False`` keeps the mixer a graph break (its eager path): ``fullgraph=True`` raises, and
    without it the breaks are counted -- what the zero-break assertions above would see on a regression."""
    from torch._dynamo.exc import Unsupported
    from torch._dynamo.utils import counters

    samples = _samples(PACKS[1], vocab=VOCAB)
    model, _, _ = _models("tiny-qwen3.5", custom_ops=False)
    with pytest.raises(Unsupported):
        _run(model, PaddingFreeCollator()(samples))
    model, _, _ = _models("tiny-qwen3.5", custom_ops=False, fullgraph=False)
    counters.clear()
    _run(model, PaddingFreeCollator()(samples))
    breaks = counters["graph_break"]
    assert breaks and all("torch.compiler.disable" in reason for reason in breaks), dict(breaks)


def _tight(shape, packs):
    """``shape`` with ``linear_chunks`` the most of ``packs`` (as :meth:`StaticShape.from_plan` sets it)."""
    from varpack.varlen import linear_chunk_count

    most = max(linear_chunk_count([*p, shape.tokens - sum(p)]) for p in packs)
    return StaticShape(tokens=shape.tokens, segments=shape.segments, max_seqlen=shape.max_seqlen, linear_chunks=most)


def _static(samples, shape=STATIC):
    return PaddingFreeCollator(static_shape=shape, pad_token_id=PAD_ID)([samples])


def _pad_segments_alone(ref, batch, num_real):
    """The logits of each pad segment run alone through the reference: ``[pad tokens, V]``."""
    cu = batch["cu_seq_lens_q"].tolist()
    ids = batch["input_ids"]
    with torch.no_grad():
        return torch.cat([ref(input_ids=ids[:, a:b]).logits[0] for a, b in zip(cu[num_real:-1], cu[num_real + 1 :])])


@pytest.mark.parametrize("static_boundaries", [False, True], ids=["cpu-offsets", "device-tables"])
def test_static_packs_equal_dynamic_and_pads_carry_no_state(static_boundaries):
    """Static-shape packs through one ``dynamic=False`` compile (no recompilation across packs): the real
    tokens' logits, the loss and every gradient equal the dynamic-shape eager run. The gated delta rule runs
    the pad segments as one sequence (the meta's ``cu_seqlens_linear``), which starts from a zero state: the
    first pad segment's logits equal that segment alone. Controls: the pad segments merged into the last
    sample (state and convolution carried into them) fail the pad check; linear offsets that merge two
    samples fail the real tokens' check (the rule reads ``cu_seqlens_linear``).

    ``device-tables``: the Gated DeltaNet layers marked as CUDA-graph layers are
    (``_varpack_static_boundaries``, what ``compile_layers_as_graphs`` sets): the traced rule gets no CPU copy
    of the offsets (no CPU tensor in a captured graph; fla_hybrid then builds its tables on the device;
    :func:`test_static_boundary_layer_passes_no_cpu_offsets`)."""
    from torch._dynamo.utils import counters

    model, eager, ref = _models("tiny-qwen3.5", dynamic=False)
    if static_boundaries:
        from varpack.models.registry import is_gated_delta_layer

        for m in model.modules():
            if is_gated_delta_layer(m):
                m._varpack_static_boundaries = True
    counters.clear()
    graphs = None
    for lengths in STATIC_PACKS:
        samples = _samples(lengths, vocab=VOCAB, seed=len(lengths))
        t = sum(lengths)
        static = _static(samples)
        assert static["input_ids"].shape == (1, STATIC.tokens) and static["input_ids"].shape[1] > t
        meta = static["varlen_meta"]
        cu = static["cu_seq_lens_q"]
        n = len(lengths)
        if cu.numel() - 1 > n + 1:  # two or more pad segments: one sequence for the rule
            lin = meta.cu_seqlens_linear
            assert lin[: n + 1].tolist() == cu[: n + 1].tolist() and (lin[n + 1 :] == STATIC.tokens).all()
        got = _run(model, static)
        graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs == 2, lengths
        want = _run(eager, PaddingFreeCollator()(samples))
        _assert_same((got[0][:t], got[1], got[2]), want, f"static/dynamic {lengths}")
        first = int(cu[n + 1] - cu[n])
        pads = _pad_segments_alone(ref, static, n)[:first]
        assert_exact(got[0][t : t + first], pads, rtol=LOGITS_RTOL, what=f"first pad segment's logits {lengths}")
    assert not counters["graph_break"], dict(counters["graph_break"])
    # control: linear offsets merging two samples (30 and 66 tokens: a leak the rule must show)
    lengths = STATIC_PACKS[0]
    samples = _samples(lengths, vocab=VOCAB, seed=len(lengths))
    static = _static(samples)
    good = static["varlen_meta"]
    leaky = good.cu_seqlens_linear.clone()
    leaky[3] = leaky[2]  # segment 3 spans samples 2 and 3, segment 2 is empty
    from varpack.varlen import VarlenMeta

    bad_meta = VarlenMeta(
        good.cu_seqlens_q, max_seqlen_q=good.max_seqlen_q, total_q=good.total_q, cu_seqlens_linear=None,
    )  # fmt: skip
    object.__setattr__(bad_meta, "cu_seqlens_linear", leaky)  # past the meta's check, as a wrong producer would
    leak = dict(static, varlen_meta=bad_meta)
    t = sum(lengths)
    # the leak enters through the rule's state alone (attention keeps its own offsets): 40-45x the bound here
    assert_differs(_run(model, leak)[0][:t], _run(eager, PaddingFreeCollator()(samples))[0], rtol=LOGITS_RTOL,
                   margin=10, what="real logits with two samples merged in cu_seqlens_linear")  # fmt: skip
    lengths = STATIC_PACKS[-1]
    samples = _samples(lengths, vocab=VOCAB, seed=len(lengths))
    static = _static(samples)
    t = sum(lengths)
    n = len(lengths)
    cu = static["cu_seq_lens_q"]
    pads = _pad_segments_alone(ref, static, n)[: int(cu[n + 1] - cu[n])]
    # control: the pad segments merged into the last sample's segment
    bad = dict(static)
    cu = static["cu_seq_lens_q"]
    merged = torch.cat([cu[: len(lengths)], cu[-1:]])
    merged = torch.cat([merged, merged[-1:].expand(cu.numel() - merged.numel())])  # same N: no recompile
    bad["cu_seq_lens_q"] = bad["cu_seq_lens_k"] = merged
    bad["max_length_q"] = bad["max_length_k"] = STATIC.tokens  # the merged segment is longer than max_seqlen
    bad.pop("varlen_meta")
    logits_m = _run(model, bad)[0]
    assert_differs(logits_m[t : t + pads.shape[0]], pads, rtol=LOGITS_RTOL,
                   what="first pad segment's logits (pads merged into the last sample)")  # fmt: skip


@pytest.mark.parametrize("static_boundaries", [True, False])
def test_static_boundary_layer_passes_no_cpu_offsets(static_boundaries, monkeypatch):
    """The traced Gated DeltaNet forward of a layer marked for CUDA graphs hands the rule device offsets only
    (``cu_seqlens_cpu=None``); an unmarked layer (the control) hands it the meta's CPU copy. Same output."""
    from varpack.models.registry import is_gated_delta_layer
    from varpack.varlen import VarlenMeta

    torch._dynamo.reset()
    model = tiny_model("tiny-qwen3.5", seed=1, vocab_size=VOCAB)
    enable_varpack(model, linear_backend="chunk")
    layer = next(m for m in model.modules() if is_gated_delta_layer(m))
    seen, real = [], gd.gated_delta_rule_op

    def recording(*args, cu_seqlens_cpu, **kw):
        seen.append(cu_seqlens_cpu)
        return real(*args, cu_seqlens_cpu=cu_seqlens_cpu, **kw)

    monkeypatch.setattr(gd, "gated_delta_rule_op", recording)
    meta = VarlenMeta.from_lengths([5, 70, 1])
    hidden = torch.randn(1, 76, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    want = gd._packed_forward(layer, hidden, None, meta)
    if static_boundaries:
        layer._varpack_static_boundaries = True
    got = gd._traced_packed_forward(layer, hidden, None, meta)
    assert len(seen) == 1
    assert (seen[0] is None) == static_boundaries
    assert_exact(got, want, rtol=LOGITS_RTOL, what="traced / eager mixer")


@pytest.mark.gpu
@pytest.mark.parametrize(("attn", "dtype"), [("triton_short", torch.float32), ("flash_attn_4", torch.bfloat16)])
def test_gpu_hybrid_layers_replayed_as_cuda_graphs_equal_eager(attn, dtype):
    """tiny-qwen3.5 (Gated DeltaNet at Qwen3.5's head size, fla_hybrid) compiled for CUDA graphs
    (:func:`varpack.integrations.cuda_graphs.compile_layers_as_graphs`) on static packs: every layer captured
    (a skipped graph raises), one graph set for every pack, and each pack -- replayed on graphs recorded for
    other segmentations -- equals the same model run eagerly (logits, loss, every gradient). Negative control:
    the eager model with the boundaries dropped differs."""
    from tests.invariant.test_static_shapes import _on_cuda, assert_step_close, cuda_backend_or_skip

    cuda_backend_or_skip(attn, dtype)
    pytest.importorskip("fla")
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    from varpack.integrations.cuda_graphs import compile_layers_as_graphs, model_refusal

    torch._dynamo.reset()
    counters.clear()
    dims = dict(
        head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
        linear_value_head_dim=128,
    )  # fmt: skip  (the GPU tests' fla head shape: one autotune)
    model = tiny_model("tiny-qwen3.5", seed=1, vocab_size=VOCAB, **dims).to("cuda", dtype)
    enable_varpack(model, backend=attn, linear_backend="fla_hybrid")
    eager = copy.deepcopy(model)
    assert model_refusal(model, device="cuda", autocast=True) is None  # fp32 + triton_short: the test's own choice
    compile_layers_as_graphs(model, device="cuda")
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    tight = _tight(STATIC, STATIC_PACKS)
    graphs = batch = None
    with inductor_config.patch({"triton.cudagraph_or_error": True}):
        for _ in range(2):  # the second pass replays graphs recorded on the first pass's packs
            for lengths in STATIC_PACKS:  # chunk tables of the plan's bound (linear_chunks), not max_chunks
                batch = _on_cuda(_static(_samples(lengths, vocab=VOCAB, seed=len(lengths)), tight))
                assert batch["varlen_meta"].linear_chunk_rows == tight.linear_chunks
                torch.compiler.cudagraph_mark_step_begin()
                logits_c, loss_c, grads_c = _run(model, batch)
                graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
                assert counters["stats"]["unique_graphs"] == graphs, lengths
                logits_e, loss_e, grads_e = _run(eager, batch)
                scale = assert_step_close((logits_c, loss_c, grads_c), (logits_e, loss_e, grads_e), tol, lengths)
                assert grads_c.keys() == {n for n, _ in model.named_parameters()}
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert not counters["graph_break"], dict(counters["graph_break"])
    dropped = _dropped(batch)
    dropped["cu_seq_lens_q"] = dropped["cu_seq_lens_k"] = dropped["cu_seq_lens_q"].cuda()
    logits_b = _run(eager, dropped)[0]
    assert (logits_b.float() - logits_e.float()).abs().max().item() > 10 * tol * max(scale, 1.0)
