"""Static-shape packs (``PaddingFreeCollator(static_shape=...)``): packed-static == packed-dynamic ==
each sample alone, for the real tokens' logits, the loss (token and sample mean, plain and linear CE) and every
gradient, on tiny-qwen3 with the CPU attention backends; the pad segments behave as independent sequences;
every pack has the same shapes, so a compiled layer (custom ops, ``dynamic=False``) is traced once.

Negative controls: the boundaries dropped; the pad tokens supervised; the pad segments merged into the last
sample's segment (the real tokens cannot see that under causal attention -- they never attend forward -- so it
is caught by the pad segments' own logits, which must equal each pad segment run alone); dynamic-shape packs
through the same ``dynamic=False`` compile, which must recompile.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests._exact import LOGITS_RTOL, LOSS_RTOL, assert_differs, assert_exact
from tests.invariant.test_dense import VOCAB, make_samples, model_inputs, unpacked_run
from varpack.collate import PaddingFreeCollator, StaticShape
from varpack.loss import causal_lm_loss
from varpack.models import load_model

PAD_ID = 7
SHAPE = StaticShape.for_packing(32, max_samples=6, multiple_of=8)  # tokens 40, segments 7, max_seqlen 34
PACKS = [(5, 1, 7, 4), (9, 4), (2, 3, 2, 3, 2, 3), (31,), (16, 15, 1)]
BACKENDS = ["reference", "sdpa", "flex", "torch_varlen", "triton_short"]


def _model(backend):
    from varpack.attn import BackendUnavailableError, resolve_backend

    q = torch.zeros(4, 4, 16, requires_grad=True)
    try:
        resolve_backend(backend, q, q[:, :2], q[:, :2], cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32))
    except BackendUnavailableError as exc:
        pytest.skip(f"{backend} cannot run here: {exc}")
    return load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend=backend)


def static_batch(samples, shape=SHAPE):
    return PaddingFreeCollator(static_shape=shape, pad_token_id=PAD_ID)([samples])


def run(model, batch, *, reduction="token", num_items=None):
    """Forward + backward of one collated row: (logits [T, V], loss, grads)."""
    model.zero_grad(set_to_none=True)
    logits = model(**model_inputs(batch)).logits
    loss = causal_lm_loss(
        logits, batch["labels"], seq_idx=batch["seq_idx"], reduction=reduction, num_items_in_batch=num_items
    )
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits[0].detach(), loss.detach(), grads


def pad_segments_alone(model, batch, num_real):
    """The logits of each pad segment run alone, as an ordinary one-sequence batch: ``[pad tokens, V]``."""
    cu = batch["cu_seq_lens_q"].tolist()
    out = []
    with torch.no_grad():
        for start, stop in zip(cu[num_real:-1], cu[num_real + 1 :]):
            if start == stop:  # a zero-length pad segment (empty_pads) has no logits
                continue
            out.append(model(input_ids=batch["input_ids"][:, start:stop]).logits[0])
    return torch.cat(out)


def merge_pads_into_last_sample(batch, num_real):
    """Sabotage: the pad segments become part of the last sample's segment (boundaries after it dropped)."""
    bad = dict(batch)
    cu = batch["cu_seq_lens_q"]
    bad["cu_seq_lens_q"] = bad["cu_seq_lens_k"] = torch.cat([cu[:num_real], cu[-1:]])
    bad.pop("varlen_meta")
    return bad


@pytest.mark.parametrize("backend", BACKENDS)
def test_static_equals_dynamic_equals_unpacked(backend):
    model = _model(backend)
    for lengths in PACKS:
        samples = make_samples(lengths, seed=len(lengths))
        t = sum(lengths)
        static = static_batch(samples)
        dynamic = PaddingFreeCollator()([samples])
        assert static["input_ids"].shape == (1, SHAPE.tokens) and static["max_length_q"] == SHAPE.max_seqlen
        logits_s, loss_s, grads_s = run(model, static)
        logits_d, loss_d, grads_d = run(model, dynamic)
        logits_u, loss_u, grads_u = unpacked_run(model, samples)
        assert_exact(logits_s[:t], logits_d, rtol=LOGITS_RTOL, what=f"logits static/dynamic {lengths}")
        assert_exact(logits_s[:t], logits_u, rtol=LOGITS_RTOL, what=f"logits static/unpacked {lengths}")
        assert_exact(loss_s, loss_d, rtol=LOSS_RTOL, what="loss static/dynamic")
        assert_exact(loss_s, loss_u, rtol=LOSS_RTOL, what="loss static/unpacked")
        assert len(grads_s) == len(list(model.parameters()))  # every parameter got a gradient
        assert_exact(grads_s, grads_d, what=f"gradient static/dynamic {lengths}")
        assert_exact(grads_s, grads_u, what=f"gradient static/unpacked {lengths}")
        # the pad segments are independent sequences: each one's logits are those of it run alone
        pads = pad_segments_alone(model, static, len(lengths))
        assert_exact(logits_s[t:], pads, rtol=LOGITS_RTOL, what=f"pad segments' logits {lengths}")


def test_supervised_count_and_sample_mean_see_only_the_samples():
    model = _model("reference")
    samples = make_samples((5, 1, 7, 4))
    static, dynamic = static_batch(samples), PaddingFreeCollator()([samples])
    n_static, n_dynamic = (int((b["labels"][:, 1:] != -100).sum()) for b in (static, dynamic))
    assert n_static == n_dynamic  # num_items_in_batch: real supervised tokens only
    for reduction, num_items in (("token", n_static), ("sample", None)):
        _, loss_s, grads_s = run(model, static, reduction=reduction, num_items=num_items)
        _, loss_d, grads_d = run(model, dynamic, reduction=reduction, num_items=num_items)
        assert_exact(loss_s, loss_d, rtol=LOSS_RTOL, what=f"loss ({reduction})")
        assert_exact(grads_s, grads_d, what=f"gradient ({reduction})")


def test_linear_ce_loss_static_equals_dynamic():
    from varpack.ops.linear_ce import causal_lm_forward_with_linear_ce

    model = _model("sdpa")
    samples = make_samples((9, 4, 2, 11))
    results = []
    for batch in (static_batch(samples), PaddingFreeCollator()([samples])):
        batch = {k: v for k, v in batch.items() if k != "sample_ids"}
        model.zero_grad(set_to_none=True)
        n = int((batch["labels"][:, 1:] != -100).sum())
        loss = causal_lm_forward_with_linear_ce(
            model, dict(batch, use_cache=False), num_items_in_batch=n, backend="chunked", chunk_size=8
        )
        loss.backward()
        results.append((loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    (loss_s, grads_s), (loss_d, grads_d) = results
    assert_exact(loss_s, loss_d, rtol=LOSS_RTOL, what="loss")
    assert_exact(grads_s, grads_d)


# -- negative controls ------------------------------------------------------------------------------------
def test_negative_controls_fail():
    model = _model("reference")
    lengths = (5, 1, 7, 4)
    samples = make_samples(lengths)
    t = sum(lengths)
    static = static_batch(samples)
    logits_u, loss_u, grads_u = unpacked_run(model, samples)
    logits_s, _, _ = run(model, static)
    pads = pad_segments_alone(model, static, len(lengths))

    # 1. the boundaries dropped (one segment over the row): the real tokens see each other
    dropped = dict(static, cu_seq_lens_q=torch.tensor([0, SHAPE.tokens], dtype=torch.int32))
    dropped["cu_seq_lens_k"] = dropped["cu_seq_lens_q"]
    dropped["max_length_q"] = dropped["max_length_k"] = SHAPE.tokens
    dropped.pop("varlen_meta")
    logits_b, _, grads_b = run(model, dropped)
    assert_differs(logits_b[:t], logits_u, rtol=LOGITS_RTOL, what="logits")
    assert_differs(grads_b, grads_u)

    # 2. the pad tokens supervised: the loss and the gradients change
    supervised = dict(static, labels=static["labels"].clone())
    supervised["labels"][0, t + 1 :] = PAD_ID
    _, loss_p, grads_p = run(model, supervised)
    assert_differs(loss_p, loss_u, rtol=LOSS_RTOL, what="loss")
    assert_differs(grads_p, grads_u)

    # 3. the pad segments merged into the last sample: the real tokens cannot tell (causal: nothing attends
    # forward), the pad segments' own logits can
    merged = merge_pads_into_last_sample(static, len(lengths))
    logits_m, loss_m, _ = run(model, merged)
    assert_exact(logits_m[:t], logits_u, rtol=LOGITS_RTOL, what="logits")
    assert_exact(loss_m, loss_u, rtol=LOSS_RTOL, what="loss")
    assert_exact(logits_s[t:], pads, rtol=LOGITS_RTOL, what="pad logits")  # the check passes on the right batch
    assert_differs(logits_m[t:], pads, rtol=LOGITS_RTOL, what="pad logits")  # ... and fails on the merged one


# -- one compiled graph for every static pack -------------------------------------------------------------
def test_static_packs_trace_one_graph_without_breaks():
    """compile_layers(custom_ops=True, fullgraph=True, dynamic=False): static packs of different contents never
    recompile (what CUDA graphs need: mode="reduce-overhead" records one graph per traced shape); the same
    compile recompiles for dynamic-shape packs (the control). Compiled == eager for logits and gradients."""
    from torch._dynamo.utils import counters

    from varpack.integrations.kernels import compile_layers

    torch._dynamo.reset()
    counters.clear()
    model = _model("sdpa")
    eager = copy.deepcopy(model)
    assert compile_layers(model, backend="aot_eager", custom_ops=True, fullgraph=True, dynamic=False) == 2
    graphs = None
    for lengths in PACKS:
        samples = make_samples(lengths, seed=len(lengths))
        batch = static_batch(samples)
        logits_c, loss_c, grads_c = run(model, batch)
        graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs > 0, lengths
        logits_e, loss_e, grads_e = run(eager, batch)
        assert_exact(logits_c, logits_e, rtol=LOGITS_RTOL, what=f"logits compiled/eager {lengths}")
        assert_exact(loss_c, loss_e, rtol=LOSS_RTOL, what="loss compiled/eager")
        assert_exact(grads_c, grads_e, what=f"gradient compiled/eager {lengths}")
    assert not counters["graph_break"], dict(counters["graph_break"])
    for lengths in PACKS[:2]:  # control: dynamic shapes through the same dynamic=False compile recompile
        run(model, PaddingFreeCollator()([make_samples(lengths)]))
    assert counters["stats"]["unique_graphs"] > graphs


# -- GPU: the layers replayed as CUDA graphs ----------------------------------------------------------------
def _on_cuda(batch):
    """The model's batch on the GPU with the boundaries too (``VarlenMeta.on_device``): a CUDA graph takes no
    CPU input."""
    meta = batch["varlen_meta"].on_device("cuda")
    out = {
        k: v.cuda() if isinstance(v, torch.Tensor) else v
        for k, v in batch.items()
        if k not in ("sample_ids", "cu_seq_lens_q", "cu_seq_lens_k")
    }
    out["varlen_meta"] = meta
    out.update(meta.flash_attn_kwargs())
    return out


def cuda_backend_or_skip(backend: str, dtype: torch.dtype) -> None:
    """Skip unless there is a CUDA device and varpack attention ``backend`` runs there in ``dtype`` (head dim 64,
    with gradients)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run on the GPU machine)")
    from varpack.attn import BackendUnavailableError, resolve_backend

    q = torch.zeros(8, 4, 64, device="cuda", dtype=dtype, requires_grad=True)
    try:
        resolve_backend(backend, q, q, q, cu_seqlens_q=torch.tensor([0, 8], dtype=torch.int32))
    except BackendUnavailableError as exc:
        pytest.skip(f"{backend}: {exc}")


def assert_step_close(got, want, tol: float, what) -> float:
    """A captured step ``(logits, loss, grads)`` against the eager one: logits within ``tol`` of their scale, the
    loss within ``tol``, every gradient within ``tol`` of its own scale, the same gradient names. Returns the
    logits' scale (for a negative control's bound)."""
    (logits_c, loss_c, grads_c), (logits_e, loss_e, grads_e) = got, want
    scale = logits_e.float().abs().max().item()
    assert (logits_c.float() - logits_e.float()).abs().max().item() <= tol * max(scale, 1.0), what
    torch.testing.assert_close(loss_c.float(), loss_e.float(), rtol=tol, atol=tol)
    assert grads_c.keys() == grads_e.keys(), what
    for name in grads_c:
        ref = grads_e[name].float()
        diff = (grads_c[name].float() - ref).abs().max().item()
        assert diff <= tol * max(ref.abs().max().item(), 1e-3), (what, name, diff)
    return scale


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("backend", "dtype", "empty_pads", "inductor_options"),
    [
        pytest.param("triton_short", torch.float32, False, None, id="triton_short-fp32"),
        pytest.param("triton_short", torch.float32, True, None, id="triton_short-fp32-empty_pads"),
        pytest.param("flash_attn_4", torch.bfloat16, False, None, id="flash_attn_4-bf16"),
        pytest.param("triton_short", torch.bfloat16, True, {"max_autotune": True, "coordinate_descent_tuning": True},
                     id="triton_short-bf16-empty_pads-max_autotune"),
        pytest.param("triton_short", torch.bfloat16, True, {"triton.enable_pdl": True},
                     id="triton_short-bf16-empty_pads-pdl"),
        pytest.param("triton_short", torch.bfloat16, True, {"triton.mix_order_reduction": False},
                     id="triton_short-bf16-empty_pads-no_mix_order_reduction"),
    ],
)
def test_gpu_cuda_graph_layers_equal_eager(backend, dtype, empty_pads, inductor_options):
    """compile_layers(custom_ops=True, fullgraph=True, dynamic=False, mode="reduce-overhead") on static packs:
    every layer captured (inductor's cudagraph_or_error on: a skipped graph raises), one dynamo graph for every
    pack, logits / loss / every gradient equal to the same model run eagerly; the boundaries dropped differ.
    With ``empty_pads`` the full packs' pad segments are all zero-length (repeated offsets in the captured
    boundaries); with ``inductor_options`` the layers compile with them in place of the mode
    (``graph_compile_kw``: GEMM autotuning and epilogue fusion for max_autotune)."""
    shape = EMPTY if empty_pads else SHAPE
    cuda_backend_or_skip(backend, dtype)
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    from varpack.integrations.kernels import compile_layers

    torch._dynamo.reset()
    counters.clear()
    model = load_model(
        "tiny-qwen3", vocab_size=VOCAB, attn_backend=backend, config_overrides={"head_dim": 64}
    ).to("cuda", dtype)
    eager = copy.deepcopy(model)
    from varpack.integrations.cuda_graphs import graph_compile_kw

    try:
        compile_kw = graph_compile_kw(inductor_options)
    except ValueError as exc:  # an option this torch's inductor does not have
        pytest.skip(str(exc))
    compile_layers(model, **compile_kw)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    graphs = None
    with inductor_config.patch({"triton.cudagraph_or_error": True}):
        for _ in range(2):  # the second pass replays the recorded graphs
            for lengths in PACKS:
                batch = _on_cuda(static_batch(make_samples(lengths, seed=len(lengths)), shape))
                torch.compiler.cudagraph_mark_step_begin()
                logits_c, loss_c, grads_c = run(model, batch)
                graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
                assert counters["stats"]["unique_graphs"] == graphs, lengths
                logits_e, loss_e, grads_e = run(eager, batch)
                scale = assert_step_close((logits_c, loss_c, grads_c), (logits_e, loss_e, grads_e), tol, lengths)
                assert len(grads_c) == len(list(model.parameters()))
        assert counters["inductor"]["cudagraph_skips"] == 0
        assert not counters["graph_break"], dict(counters["graph_break"])
        dropped = dict(batch)  # negative control: one segment over the row
        dropped.pop("varlen_meta")
        cu = torch.tensor([0, shape.tokens], dtype=torch.int32)
        dropped["cu_seq_lens_q"] = dropped["cu_seq_lens_k"] = cu
        dropped["max_length_q"] = dropped["max_length_k"] = shape.tokens
        logits_b, _, _ = run(eager, dropped)
        assert (logits_b.float() - logits_e.float()).abs().max().item() > 10 * tol * max(scale, 1.0)


def test_lora_in_static_layers_traces_one_graph_without_breaks():
    """LoRA (peft, ``all-linear``, no dropout) injected into layers compiled for static packs (custom ops,
    fullgraph, ``dynamic=False``; the order of ``varpack sft``: compile, then peft wraps the model): no graph
    break, no recompilation across packs, compiled == the eager LoRA model for logits and every gradient (the
    adapters' included). Negative control: the adapters change the logits (a graph traced before peft's
    injection, i.e. without the adapters, would equal the base model and fail the comparison)."""
    from torch._dynamo.utils import counters

    from varpack.integrations.kernels import compile_layers
    from varpack.train.config import SFTConfig
    from varpack.train.lora import apply_lora

    pytest.importorskip("peft")
    torch._dynamo.reset()
    counters.clear()
    settings = SFTConfig(lora=True, lora_dropout=0.0)
    base = _model("sdpa")
    model = copy.deepcopy(base)
    eager = apply_lora(copy.deepcopy(base), settings, init_lora_weights=False)
    compile_layers(model, backend="aot_eager", custom_ops=True, fullgraph=True, dynamic=False)
    model = apply_lora(model, settings, init_lora_weights=False)
    eager.load_state_dict(model.state_dict())
    graphs = None
    for lengths in PACKS:
        batch = static_batch(make_samples(lengths, seed=len(lengths)))
        logits_c, loss_c, grads_c = run(model, batch)
        graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs > 0, lengths
        logits_e, loss_e, grads_e = run(eager, batch)
        assert any("lora_" in name for name in grads_c) and grads_c.keys() == grads_e.keys()
        assert_exact(logits_c, logits_e, rtol=LOGITS_RTOL, what=f"logits compiled/eager LoRA {lengths}")
        assert_exact(loss_c, loss_e, rtol=LOSS_RTOL, what="loss compiled/eager LoRA")
        assert_exact(grads_c, grads_e, what=f"gradient compiled/eager LoRA {lengths}")
        with torch.no_grad():
            plain = base(**model_inputs(batch)).logits[0]
        assert_differs(logits_c, plain, rtol=LOGITS_RTOL, what="the adapters in the compiled layers")
    assert not counters["graph_break"], dict(counters["graph_break"])


# ---------------------------------------------------------------------------------------------------------
# zero-length pad segments (StaticShape(empty_pads=True)): T is the longest pack itself
# ---------------------------------------------------------------------------------------------------------

EMPTY = StaticShape.for_packing(32, max_samples=6, multiple_of=8, empty_pads=True)  # tokens 32, segments 7
EMPTY_BACKENDS = ["reference", "sdpa", "flex", "torch_varlen", "triton_short"]


@pytest.mark.parametrize("backend", EMPTY_BACKENDS)
def test_empty_pad_segments_equal_dynamic_and_unpacked(backend):
    """Full packs (every pad segment zero-length), packs with fewer pad tokens than pad segments (some
    zero-length) and roomy packs: the real tokens' logits, the loss and every gradient equal the dynamic pack and
    the samples alone; the non-empty pad segments are independent sequences."""
    model = _model(backend)
    assert EMPTY.tokens == 32 and EMPTY.segments == 7
    for lengths in [(16, 15, 1), (31,), (5, 1, 7, 4, 11), (30,), (9, 4), (2, 3, 2, 3, 2, 3)]:
        samples = make_samples(lengths, seed=len(lengths))
        t = sum(lengths)
        static = static_batch(samples, EMPTY)
        cu = static["cu_seq_lens_q"].tolist()
        assert static["input_ids"].shape == (1, 32) and len(cu) == 8 and cu[len(lengths)] == t
        assert (32 - t < 7 - len(lengths)) == (cu.count(32) > 1 + (t < 32))  # zero-length pads where pads are short
        logits_s, loss_s, grads_s = run(model, static)
        logits_d, loss_d, grads_d = run(model, PaddingFreeCollator()([samples]))
        logits_u, loss_u, grads_u = unpacked_run(model, samples)
        assert_exact(logits_s[:t], logits_d, rtol=LOGITS_RTOL, what=f"logits static/dynamic {lengths}")
        assert_exact(logits_s[:t], logits_u, rtol=LOGITS_RTOL, what=f"logits static/unpacked {lengths}")
        assert_exact(loss_s, loss_d, rtol=LOSS_RTOL, what=f"loss static/dynamic {lengths}")
        assert_exact(loss_s, loss_u, rtol=LOSS_RTOL, what=f"loss static/unpacked {lengths}")
        assert_exact(grads_s, grads_d, what=f"gradient static/dynamic {lengths}")
        assert_exact(grads_s, grads_u, what=f"gradient static/unpacked {lengths}")
        if t < 32:
            pads = pad_segments_alone(model, static, len(lengths))
            assert_exact(logits_s[t:], pads, rtol=LOGITS_RTOL, what=f"pad segments' logits {lengths}")


def test_empty_pad_segments_negative_control():
    """What the test above would catch: the boundaries after the first sample dropped (a full pack), and the
    zero-length pad segments' repeated offsets replaced by the last sample's (the samples merged)."""
    model = _model("reference")
    samples = make_samples((16, 15, 1), seed=3)
    static = static_batch(samples, EMPTY)
    logits_s, _, grads_s = run(model, static)
    logits_u, _, grads_u = unpacked_run(model, samples)
    bad = dict(static)
    cu = static["cu_seq_lens_q"]
    bad["cu_seq_lens_q"] = bad["cu_seq_lens_k"] = torch.cat([cu[:1], cu[2:]])  # samples 0 and 1 merged
    bad.pop("varlen_meta")
    bad["seq_idx"] = torch.where(static["seq_idx"] == 1, 0, static["seq_idx"])
    logits_b, _, grads_b = run(model, bad)
    assert_exact(logits_s, logits_u, rtol=LOGITS_RTOL, what="logits")
    assert_differs(logits_b, logits_u, rtol=LOGITS_RTOL, what="logits with two samples merged")
    assert_differs(grads_b, grads_u, what="gradient with two samples merged")


def test_empty_pads_only_where_attention_and_mixers_take_them(monkeypatch):
    from varpack.integrations import cuda_graphs
    from varpack.integrations.cuda_graphs import EMPTY_PADS_BY_DEFAULT, empty_pads_ok, static_shape_for
    from varpack.plan import plan_packs

    dense = load_model("tiny-qwen3", vocab_size=VOCAB)
    assert empty_pads_ok(dense, "triton_short") and empty_pads_ok(dense, "sdpa")
    assert not empty_pads_ok(dense, "flash_attn_4")  # its Capabilities refuse zero-length segments
    assert not empty_pads_ok(dense, "auto")  # chosen per call: may be FA4
    assert not empty_pads_ok(dense, "no_such_backend")
    hybrid = load_model("tiny-qwen3.5", vocab_size=VOCAB)
    assert not empty_pads_ok(hybrid, "triton_short")  # recurrent layers: not verified on zero-length pads
    plan = plan_packs([32, 20, 12, 5, 3, 30], 32)
    with_empty = static_shape_for(plan, dense, "triton_short", empty_pads=True)
    without = static_shape_for(plan, dense, "flash_attn_4", empty_pads=True)
    assert not static_shape_for(plan, dense, "triton_short", empty_pads=False).empty_pads
    assert static_shape_for(plan, dense, "triton_short").empty_pads == EMPTY_PADS_BY_DEFAULT
    assert with_empty.empty_pads and with_empty.tokens == 32
    assert not without.empty_pads and without.tokens > 32
    assert with_empty.pad_fraction(plan) < without.pad_fraction(plan)
    for default in (True, False):  # empty_pads=None follows the switch, where the backend and mixers allow it
        monkeypatch.setattr(cuda_graphs, "EMPTY_PADS_BY_DEFAULT", default)
        assert static_shape_for(plan, dense, "triton_short").empty_pads == default
        assert not static_shape_for(plan, dense, "flash_attn_4").empty_pads
        assert not static_shape_for(plan, hybrid, "triton_short").empty_pads


def test_empty_pad_segments_are_refused_where_attention_would_not_take_them(monkeypatch):
    """The packing guard refuses a batch with zero-length segments for a named backend whose Capabilities lack
    them (FlashAttention-4) and for ``auto`` in compiled layers (resolved when traced, without the offsets);
    eager ``auto`` and backends that take them run."""
    from varpack.integrations.transformers import PackingGuardError

    samples = make_samples((16, 15, 1), seed=3)
    batch = static_batch(samples, EMPTY)
    assert batch["varlen_meta"].has_empty
    model = _model("reference")
    state = model._varpack_state
    monkeypatch.setattr(state, "backend", "flash_attn_4")
    with pytest.raises(PackingGuardError, match="zero-length segments.*'flash_attn_4' does not take"):
        model(**model_inputs(batch))
    monkeypatch.setattr(state, "backend", "auto")
    layer = model.model.layers[0]
    layer.compile(backend="eager")  # compiled layers, as compile_layers makes them
    model(**model_inputs(batch))  # no backend that refuses zero-length segments runs on the CPU
    import varpack.attn.registry as registry

    real = registry.available_backends
    monkeypatch.setattr(  # a machine where FlashAttention-4 runs
        registry, "available_backends", lambda device=None, dtype=None: {**real(device, dtype), "flash_attn_4": (True, "")}
    )
    with pytest.raises(PackingGuardError, match=r"compiled layers resolve attention 'auto' when traced.*flash_attn_4"):
        model(**model_inputs(batch))
    layer._compiled_call_impl = None
    model(**model_inputs(batch))  # eager auto: resolved per call with the offsets read
    monkeypatch.setattr(state, "backend", "flash_attn_4")
    model(**model_inputs(static_batch(samples)))  # pad segments of one token or more: not refused
