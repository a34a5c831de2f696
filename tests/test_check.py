"""check_exactness: passes on real models, fails when the boundaries are sabotaged; `varpack check` CLI."""

from __future__ import annotations

import json

import pytest
import torch

import varpack.collate
from varpack.check import check_exactness
from varpack.models import load_model

VOCAB = 512
KEYS = {"max_abs_logit_diff", "loss_packed", "loss_unpacked", "max_abs_grad_diff", "backend", "passed"}


def samples(lengths=(9, 1, 6, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        labels = [-100] + ids[1:]
        out.append({"input_ids": ids, "labels": labels})
    return out


class _Sabotaged(varpack.collate.PaddingFreeCollator):
    """Drops the boundaries of multi-sample batches: one segment spanning the whole row."""

    def __call__(self, features):
        batch = super().__call__(features)
        t = batch["input_ids"].shape[1]
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, t], dtype=torch.int32)
        batch["max_length_q"] = batch["max_length_k"] = t
        batch["seq_idx"] = torch.zeros_like(batch["seq_idx"])
        batch.pop("varlen_meta")
        return batch


@pytest.fixture(scope="module")
def qwen():
    return load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")


def test_check_passes_fp32(qwen):
    res = check_exactness(qwen, samples(), backend="reference")
    assert KEYS <= res.keys()
    assert res["passed"], res["failures"]
    assert res["max_abs_logit_diff"] <= 1e-5
    assert res["backend"] == "reference" and res["reference_attn"] == "sdpa"
    assert res["num_tokens"] == 20 and res["num_samples"] == 4
    assert res["num_params"] == len(list(qwen.parameters()))
    assert not qwen.training and qwen.config._attn_implementation == "varpack_reference"


def test_check_auto_reports_reason(qwen):
    res = check_exactness(qwen, samples(), backend="auto")
    from varpack.attn import BACKENDS

    assert res["passed"], res["failures"]
    assert res["backend"] in BACKENDS and res["backend"] != "auto"
    assert "auto" in res["backend_reason"]


def test_check_fails_when_boundaries_are_sabotaged(qwen, monkeypatch):
    monkeypatch.setattr(varpack.collate, "PaddingFreeCollator", _Sabotaged)
    res = check_exactness(qwen, samples(), backend="reference")
    assert not res["passed"]
    assert res["max_abs_logit_diff"] > 1e-3 and res["max_abs_grad_diff"] > 1e-3
    assert any("logit" in f for f in res["failures"])


def test_check_bf16_fp32_truth_rule(qwen, monkeypatch):
    res = check_exactness(qwen, samples(), backend="reference", dtype=torch.bfloat16)
    assert res["passed"], res["failures"]
    assert res["dtype"] == "bfloat16" and res["logit_err_unpacked"] > 0  # bf16 noise is real, and tolerated
    assert next(qwen.parameters()).dtype == torch.float32  # the caller's model was not cast
    monkeypatch.setattr(varpack.collate, "PaddingFreeCollator", _Sabotaged)
    bad = check_exactness(qwen, samples(), backend="reference", dtype=torch.bfloat16)
    assert not bad["passed"]


def test_check_llama_eval_mode_restored():
    model = load_model("tiny-llama", vocab_size=VOCAB, attn_backend="reference").train()
    res = check_exactness(model, samples(lengths=(3, 5, 1)), backend="reference")
    assert res["passed"], res["failures"]
    assert model.training and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-next"])
def test_check_linear_attention_models(name, monkeypatch):
    """Hybrid models (gated-delta linear attention + full attention) through the same check."""
    model = load_model(name, vocab_size=VOCAB, attn_backend="reference")
    res = check_exactness(model, samples(lengths=(6, 1, 9)), backend="reference")
    assert res["passed"], res["failures"]
    assert res["gated_delta_backend"] == "chunk" and "auto on cpu" in res["gated_delta_reason"]
    monkeypatch.setattr(varpack.collate, "PaddingFreeCollator", _Sabotaged)
    assert not check_exactness(model, samples(lengths=(6, 1, 9)), backend="reference")["passed"]


def test_check_bad_samples(qwen):
    with pytest.raises(ValueError, match="at least one sample"):
        check_exactness(qwen, [])
    with pytest.raises(ValueError, match="labels"):
        check_exactness(qwen, [{"input_ids": [1, 2], "labels": [1, 2]}])  # first label must be -100


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    data = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    turns = [("Say hi.", "Hi!"), ("2+2?", "4"), ("Name a color.", "Blue.")]
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in turns
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    return str(data)


def test_cli_check_json(chat_file, capsys):
    from varpack.cli.main import main

    code = main(["check", "--model", "tiny-llama", "--data", chat_file, "--json", "--num-samples", "3"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["passed"] is True
    assert KEYS <= out.keys() and out["num_samples"] == 3


def test_cli_check_text_fail_exit_code(chat_file, monkeypatch, capsys):
    from varpack.cli.main import main

    monkeypatch.setattr(varpack.collate, "PaddingFreeCollator", _Sabotaged)
    args = [
        "check",
        "--model",
        "tiny-qwen3",
        "--data",
        chat_file,
        "--num-samples",
        "3",
        "--attn-backend",
        "reference",
    ]
    code = main(args)
    out = capsys.readouterr().out
    assert code == 1 and "FAIL" in out and "max |logit diff|" in out


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-qwen3", "qwen3-0.6b-shape"])
def test_gpu_check_bf16_auto(name, monkeypatch):
    """On the GPU: bf16, backend auto, by the fp32-truth rule; the sabotaged run fails."""
    model = load_model(name, dtype=torch.bfloat16, device="cuda", attn_backend="auto")
    vocab = model.config.vocab_size
    rows = samples(lengths=(300, 1, 717, 77, 129)) if name != "tiny-qwen3" else samples()
    rows = [{**r, "input_ids": [t % vocab for t in r["input_ids"]]} for r in rows]
    res = check_exactness(model, rows, backend="auto")
    assert res["passed"], res["failures"]
    assert res["backend"] != "reference", res["backend_reason"]  # a real kernel ran
    print(
        f"{name}: backend {res['backend']} ({res['backend_reason']}); logit err packed/unpacked vs fp32 "
        f"{res['logit_err_packed']:.3g}/{res['logit_err_unpacked']:.3g}"
    )
    monkeypatch.setattr(varpack.collate, "PaddingFreeCollator", _Sabotaged)
    assert not check_exactness(model, rows, backend="auto")["passed"]


@pytest.mark.gpu
def test_gpu_check_tiny_qwen35_bf16_gated_delta_on_fla_kernels(monkeypatch):
    """tiny-qwen3.5 in bf16 on CUDA, backend auto with fla_hybrid allowed: the gated delta rule runs on fla's
    kernels (fla, or fla_hybrid where fla refuses its backward) and the check passes by the fp32-truth rule;
    sabotaged fails."""
    pytest.importorskip("fla")
    from varpack.ops.gated_delta_rule import dispatch

    monkeypatch.setattr(dispatch, "AUTO_FLA_HYBRID", True)
    model = load_model("tiny-qwen3.5", dtype=torch.bfloat16, device="cuda", attn_backend="auto")
    vocab = model.config.vocab_size
    rows = [
        {**r, "input_ids": [t % vocab for t in r["input_ids"]]} for r in samples(lengths=(300, 1, 130, 77))
    ]
    res = check_exactness(model, rows, backend="auto")
    print(f"gated delta rule: {res['gated_delta_backend']} ({res['gated_delta_reason']})")
    assert res["gated_delta_backend"] in ("fla", "fla_hybrid"), res["gated_delta_reason"]
    assert res["passed"], res["failures"]
    monkeypatch.setattr(varpack.collate, "PaddingFreeCollator", _Sabotaged)
    assert not check_exactness(model, rows, backend="auto")["passed"]


@pytest.mark.parametrize(
    "extra,expected,exit_code",
    [
        (["--model", "no-such-model"], "no-such-model", 1),
        (["--data", "/no/such/file.jsonl"], "/no/such/file.jsonl", 1),
        (["--attn-backend", "no-such-backend"], "no-such-backend", 2),  # a usage error (argparse)
        (["--device", "cuda"], "CUDA is not available", 1),
    ],
)
def test_cli_check_bad_input_is_a_clear_error(extra, expected, exit_code, capsys, monkeypatch):
    """Bad settings give `varpack check: error: ...` naming what was wrong, not a traceback: exit code 2 for a
    usage error (after the usage line), 1 for one found while running (tests/cli/test_cli_consistency.py)."""
    import torch

    from varpack.cli.main import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["check", "--model", "tiny-qwen3", "--num-samples", "2", *extra]
    if "--model" in extra:
        args = ["check", *extra]
    code = main(args)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert code == exit_code and last.startswith("varpack check: error:") and expected in last, err
    assert err.startswith("usage: varpack check" if exit_code == 2 else "varpack check: error:"), err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--write", "x.md"], "--write has an invalid value: x.md (needs --zoo)"),
        (["--context-parallel-attention", "ring"], "--context-parallel-attention has an invalid value: ring (needs "
         "--context-parallel N, N >= 2)"),
    ],
)  # fmt: skip
def test_cli_check_flag_without_the_flag_it_needs_is_refused(argv, expected, tmp_path, monkeypatch, capsys):
    """``--write`` without ``--zoo`` ran a plain check and wrote nothing; ``--context-parallel-attention ring``
    without ``--context-parallel`` ran one process: both a usage error naming the flag and what it needs, before
    any model is loaded. Their defaults, or each beside what it needs, pass the check."""
    from varpack.cli import check
    from varpack.cli.main import build_parser, main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(check, "_run", lambda *a: pytest.fail("the check ran"))
    assert main(["check", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: varpack check") and err.strip().endswith(f"varpack check: error: {expected}"), err
    assert not (tmp_path / "x.md").exists()
    parse = build_parser().parse_args
    check.refuse_unread_flags(parse(["check"]))
    check.refuse_unread_flags(parse(["check", "--context-parallel-attention", "auto"]))
    check.refuse_unread_flags(parse(["check", "--zoo", "--write", "x.md"]))
    check.refuse_unread_flags(parse(["check", "--context-parallel", "2", "--context-parallel-attention", "ring"]))


@pytest.mark.parametrize("sabotage", [False, True])
def test_cli_check_vl_model_runs_on_images(sabotage, monkeypatch, capsys):
    """`varpack check` on a VL model packs the built-in image chats (whole, with their media and mRoPE
    positions) and passes; with the boundaries dropped it fails."""
    from varpack.cli.main import main

    if sabotage:
        monkeypatch.setattr(varpack.collate, "PaddingFreeCollator", _Sabotaged)
    code = main(["check", "--model", "tiny-qwen3-vl", "--num-samples", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["samples_with_media"] >= 2 and out["num_samples"] == 4
    if sabotage:
        assert code == 1 and out["passed"] is False and out["max_abs_logit_diff"] > 1e-3
    else:
        assert code == 0 and out["passed"] is True and out["max_abs_logit_diff"] < 1e-5


def test_fp32_truth_runs_varpacks_chunked_gated_delta_not_the_checked_kernels(monkeypatch):
    """Where transformers' own forward cannot train (fla installed, its backward refused: the H200 stack), the
    unpacked runs go through varpack's path; the bf16 ones with the checked backend, the fp32 truth with the
    PyTorch chunked path (TF32-free, and no second fla autotuning for fp32)."""
    import varpack.integrations.gated_delta as G

    calls = []
    real_rule = G.gated_delta_rule

    def spy(q, *a, backend, **k):
        calls.append((backend, q.dtype))
        return real_rule(q, *a, backend=backend, **k)

    real_resolve = G.resolve_backend

    def resolve(backend, *a, **k):  # stands in for auto picking a kernel backend (fla_hybrid on the H200)
        return "naive" if backend == "auto" else real_resolve(backend, *a, **k)

    monkeypatch.setattr(G, "gated_delta_rule", spy)
    monkeypatch.setattr(G, "resolve_backend", resolve)
    monkeypatch.setattr(G, "_original_cannot_train", lambda layer, h: True)
    model = load_model("tiny-qwen3.5", vocab_size=VOCAB, attn_backend="reference")
    res = check_exactness(model, samples(lengths=(6, 1, 9)), backend="reference", dtype=torch.bfloat16)
    assert res["passed"], res["failures"]
    assert {b for b, d in calls if d == torch.bfloat16} == {"naive"}  # packed and unpacked: the checked one
    assert {b for b, d in calls if d == torch.float32} == {"chunk"}  # the truth: varpack's chunked path


def test_truth_gated_delta_keeps_naive_and_sets_chunk_otherwise():
    from varpack.check import TRUTH_GATED_DELTA_BACKEND, _truth_gated_delta

    model = load_model("tiny-qwen3.5", vocab_size=VOCAB, attn_backend="reference")
    for requested, expected in (
        ("fla_hybrid", TRUTH_GATED_DELTA_BACKEND),
        ("auto", "chunk"),
        ("naive", "naive"),
    ):
        assert _truth_gated_delta(model, requested) == expected
        layers = [m for m in model.modules() if hasattr(m, "_varpack_gdn_backend")]
        assert layers and {m._varpack_gdn_backend for m in layers} == {expected}


def test_fp32_truth_on_cuda_avoids_transformers_fla_forward(monkeypatch):
    """Where transformers' own forward can train (fla absent, or fla fully usable on a newer Triton), the bf16
    unpacked run is that forward, but the fp32 truth on CUDA must not be (it would be fla's TF32 kernels): it
    runs varpack's chunked path. The device test of the routing is replaced so that this runs on a CPU."""
    import varpack.integrations.gated_delta as G

    calls = []
    real_rule = G.gated_delta_rule

    def spy(q, *a, backend, **k):
        calls.append((backend, q.dtype, q.shape[1]))
        return real_rule(q, *a, backend=backend, **k)

    monkeypatch.setattr(G, "gated_delta_rule", spy)
    monkeypatch.setattr(G, "_original_cannot_train", lambda layer, h: False)
    monkeypatch.setattr(
        G, "_truth_via_varpack", lambda layer, h: bool(getattr(layer, "_varpack_gdn_truth", False))
    )
    model = load_model("tiny-qwen3.5", vocab_size=VOCAB, attn_backend="reference")
    res = check_exactness(model, samples(lengths=(6, 1, 9)), backend="reference", dtype=torch.bfloat16)
    # routing only: on a CPU the unpacked rows here run transformers' PyTorch reference and the packed row
    # varpack's chunked path, a pairing the simulated CUDA stack does not have (there both are fla's kernels)
    assert "logit_err_packed" in res and res["gated_delta_backend"] == "chunk"
    bf16 = [c for c in calls if c[1] == torch.bfloat16]
    assert bf16 and {c[2] for c in bf16} == {16}  # only the packed row: the unpacked ones ran transformers'
    assert {(b, t) for b, d, t in calls if d == torch.float32} == {("chunk", 6), ("chunk", 1), ("chunk", 9)}
    assert not any(getattr(m, "_varpack_gdn_truth", False) for m in model.modules())  # the caller's model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_check_catches_a_backward_only_gate_gradient_leak(monkeypatch, dtype):
    """A leak that leaves logits and loss equal: in the packed run's backward, each token's gate gradient also
    gets 0.1x the summed gate gradient of the later tokens of the row (a reverse cumsum not reset at the
    boundaries). Only the gradients of the gate path (dt_bias, in_proj_a, A_log: parameters with gradients
    1e-5 of the embedding's) can show it, so their tolerance must stay relative to their own scale (a floor
    relative to the model's largest gradient hid exactly this)."""
    import torch.nn.functional as F

    import varpack.integrations.gated_delta as G

    class LeakyIdentity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, cu):
            ctx.cu = cu
            return x.view_as(x)

        @staticmethod
        def backward(ctx, d):
            out = d.clone()
            for i in range(len(ctx.cu) - 2):
                out[:, ctx.cu[i] : ctx.cu[i + 1]] += 0.1 * d[:, ctx.cu[i + 1] :].sum(1, keepdim=True)
            return out, None

    model = load_model("tiny-qwen3.5", vocab_size=VOCAB, attn_backend="reference")
    rows = samples(lengths=(5, 7, 3))
    honest = check_exactness(model, rows, backend="reference", dtype=dtype, gated_delta_backend="chunk")
    assert honest["passed"], honest["failures"]

    state = {"cu": None}
    real_packed, real_softplus = G._packed_forward, F.softplus

    def packed(layer, h, mask, meta):
        cu = [int(x) for x in meta.cu_seqlens_cpu()]
        state["cu"] = cu if len(cu) > 2 else None  # the packed row only; unpacked rows are one sample each
        try:
            return real_packed(layer, h, mask, meta)
        finally:
            state["cu"] = None

    def softplus(x, *a, **k):  # the gate: g = -exp(A_log) * softplus(a + dt_bias)
        y = real_softplus(x, *a, **k)
        return LeakyIdentity.apply(y, state["cu"]) if state["cu"] is not None and y.dim() == 3 else y

    monkeypatch.setattr(G, "_packed_forward", packed)
    monkeypatch.setattr(F, "softplus", softplus)
    leaky = check_exactness(model, rows, backend="reference", dtype=dtype, gated_delta_backend="chunk")
    assert leaky["max_abs_logit_diff"] <= honest["max_abs_logit_diff"] + 2e-2  # the forward is untouched
    assert not leaky["passed"]
    assert any("dt_bias" in f or "in_proj_a" in f for f in leaky["failures"]), leaky["failures"]


@pytest.mark.parametrize("also", [None, "model.embed_tokens.weight", "model.layers.0.linear_attn.in_proj_a.weight"])
def test_low_precision_failure_of_gate_gradients_only_carries_the_note(monkeypatch, capsys, also):
    """A bf16 check whose every failure is a Gated DeltaNet gate parameter's gradient (dt_bias / A_log) keeps
    its FAIL and carries the note naming the float32 run that decides; any other failing gradient (an
    embedding, the gate's own projection) drops the note."""
    from varpack import check
    from varpack.cli.check import _print_table

    model = load_model("tiny-qwen3.5", vocab_size=VOCAB, attn_backend="reference")
    rows = samples(lengths=(5, 7, 3))
    real = check._packed_run
    gate = "model.layers.0.linear_attn.dt_bias"

    def perturbed(*args):
        logits, loss, grads = real(*args)
        for name in (gate, also) if also else (gate,):
            grads[name] = grads[name] + 10 * grads[name].abs().max() + 1.0
        return logits, loss, grads

    monkeypatch.setattr(check, "_packed_run", perturbed)
    res = check_exactness(model, rows, backend="reference", dtype=torch.bfloat16, gated_delta_backend="chunk")
    assert not res["passed"]
    failing = {f.split(":")[0].removeprefix("grad of ") for f in res["failures"]}
    assert gate in failing
    if also is None:
        assert failing == {gate}
        assert "dt_bias / A_log" in res["note"] and "--dtype fp32" in res["note"] and "bfloat16" in res["note"]
        _print_table({**res, "model": "tiny-qwen3.5", "device": "cpu"}, "Qwen3_5ForCausalLM", 1)
        out = capsys.readouterr().out
        assert "FAIL" in out and "note: the FAIL stands, but every failing gradient belongs to a Gated DeltaNet" in out
    else:
        assert also in failing
        assert "note" not in res


def test_gate_parameter_names_are_the_gated_delta_layers_own():
    from varpack.check import _gate_parameter_names

    names = _gate_parameter_names(load_model("tiny-qwen3.5", vocab_size=VOCAB))
    assert names and all(n.rsplit(".", 1)[-1] in ("dt_bias", "A_log") for n in names)
    assert "model.layers.0.linear_attn.A_log" in names
    assert not _gate_parameter_names(load_model("tiny-qwen3", vocab_size=VOCAB))


def test_fla_rule_on_cuda_only_for_float32_on_cuda_with_fla_kernels():
    from varpack.check import _fla_rule_on_cuda

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert _fla_rule_on_cuda(torch.float32, cuda, ("fla_hybrid", "auto")) == "fla_hybrid"
    assert _fla_rule_on_cuda(torch.float32, cuda, ("fla", "forced")) == "fla"
    assert _fla_rule_on_cuda(torch.float32, cuda, ("chunk", "forced")) is None
    assert _fla_rule_on_cuda(torch.bfloat16, cuda, ("fla_hybrid", "auto")) is None
    assert _fla_rule_on_cuda(torch.float32, cpu, ("chunk", "auto")) is None
    assert _fla_rule_on_cuda(torch.float32, cuda, None) is None


@pytest.mark.parametrize("fails", [True, False])
def test_failed_float32_check_on_fla_kernels_carries_the_tf32_note(monkeypatch, fails):
    """Wiring: a float32 check whose rule ran fla's kernels on CUDA (simulated) names TF32 when it fails, and
    says nothing when it passes."""
    from varpack import check

    model = load_model("tiny-qwen3.5", vocab_size=VOCAB, attn_backend="reference")
    real = check._packed_run

    def perturbed(*args):
        logits, loss, grads = real(*args)
        if fails:
            name = "model.layers.0.linear_attn.in_proj_a.weight"
            grads[name] = grads[name] + 1.0
        return logits, loss, grads

    monkeypatch.setattr(check, "_packed_run", perturbed)
    monkeypatch.setattr(check, "_fla_rule_on_cuda", lambda dtype, device, gdn: "fla_hybrid")
    res = check_exactness(model, samples(lengths=(5, 7, 3)), backend="reference", gated_delta_backend="chunk")
    assert res["passed"] is not fails
    if fails:
        assert "TF32" in res["note"] and "--gated-delta-backend chunk" in res["note"]
    else:
        assert "note" not in res


def test_unpacked_run_rows_of_one_sends_the_boundaries_and_matches_the_plain_run(monkeypatch):
    """``rows_of_one``: each sample alone, with its boundary keywords (varpack's kernels), equal in float32 to
    the plain per-sample run through the model's own attention."""
    from varpack import check
    from varpack.collate import PaddingFreeCollator

    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    rows = check._as_sample_list(samples(lengths=(6, 1, 9)))
    seen = []
    real = check._model_inputs

    def spy(batch, device, *, packed):
        seen.append(packed)
        return real(batch, device, packed=packed)

    monkeypatch.setattr(check, "_model_inputs", spy)
    cpu, collate = torch.device("cpu"), PaddingFreeCollator()
    plain = check._unpacked_run(model, collate, rows, cpu, "sdpa")
    assert seen == [False] * 3
    seen.clear()
    ones = check._unpacked_run(model, collate, rows, cpu, model.config._attn_implementation, rows_of_one=True)
    assert seen == [True] * 3
    torch.testing.assert_close(ones[0], plain[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ones[1], plain[1], rtol=1e-5, atol=1e-6)
    for name, g in plain[2].items():
        torch.testing.assert_close(ones[2][name], g, rtol=1e-3, atol=1e-7 + 1e-3 * float(g.abs().max()))
