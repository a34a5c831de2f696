"""Mixed precision (``--bf16``: float32 master weights under ``torch.autocast``): a Qwen3 layer hands attention q
and k in float32 (its RMSNorm's float32 weight promotes the bf16 projection) and v in bf16. varpack attention
runs them in the autocast dtype, as transformers' own SDPA path does, so the packed row equals each sample run
alone through the model's SDPA attention under the same autocast; the negative control drops the boundaries.
The trainer's linear-CE path (it runs the base model itself, past accelerate's autocast around model.forward)
runs under autocast too: the attention sees bf16 and the loss equals the logits path's."""

from __future__ import annotations

import pytest
import torch

from tests.invariant.test_dense import VOCAB, make_samples, max_grad_diff, packed_run, unpacked_run
from varpack.integrations.transformers import autocast_qkv
from varpack.models import load_model


def test_autocast_qkv_casts_only_under_autocast():
    q, k = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    v = torch.randn(4, 2, 8, dtype=torch.bfloat16)
    assert [t.dtype for t in autocast_qkv(q, k, v)] == [torch.float32, torch.float32, torch.bfloat16]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = autocast_qkv(q, k, v)
    assert [t.dtype for t in out] == [torch.bfloat16] * 3
    torch.testing.assert_close(out[0], q.to(torch.bfloat16), rtol=0, atol=0)
    assert out[2] is v  # already in the dtype: not copied


def _under_autocast(fn, *args, **kw):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return fn(*args, **kw)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_packed_equals_unpacked_under_autocast(backend):
    torch.manual_seed(0)
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend=backend)  # float32 weights
    assert next(model.parameters()).dtype == torch.float32
    samples = make_samples()
    # before: TypeError "q, k, v must share one dtype, got torch.float32, torch.float32, torch.bfloat16"
    logits_p, loss_p, grads_p = _under_autocast(packed_run, model, samples)
    logits_u, loss_u, grads_u = _under_autocast(unpacked_run, model, samples, "sdpa")
    assert logits_p.dtype == logits_u.dtype == torch.bfloat16  # the LM head ran in bf16: autocast was on
    logit_diff = (logits_p.float() - logits_u.float()).abs().max().item()
    grad_diff = max_grad_diff(grads_p, grads_u)
    assert logit_diff <= 2e-2, logit_diff  # bf16 rounding of different GEMM shapes
    torch.testing.assert_close(loss_p, loss_u, rtol=2e-3, atol=2e-3)
    assert grad_diff <= 2e-2, grad_diff
    # negative control: one segment over the row
    logits_s, _, grads_s = _under_autocast(packed_run, model, samples, sabotage=True)
    assert (logits_s.float() - logits_u.float()).abs().max().item() > 10 * max(logit_diff, 1e-2)
    assert max_grad_diff(grads_s, grads_u) > 5 * max(grad_diff, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "flash_attn_4", "triton_short"])
def test_gpu_packed_equals_unpacked_under_autocast(backend):
    """The CUDA form of the test above (``varpack sft --bf16`` on a GPU): float32 weights, CUDA autocast in
    bf16, a varlen kernel that takes only 16-bit inputs (q and k arrive in float32 from Qwen3's RMSNorm)."""
    from varpack.attn import available_backends

    if backend != "auto" and not available_backends("cuda", torch.bfloat16).get(backend, (False,))[0]:
        pytest.skip(f"{backend} not available here")
    torch.manual_seed(0)
    # head_dim 64: FA4's backward on sm90 is verified for D >= 64 only (tiny-qwen3 has 16)
    model = load_model(
        "tiny-qwen3", vocab_size=VOCAB, attn_backend=backend, config_overrides={"head_dim": 64}
    )
    model = model.cuda()
    assert model.config.head_dim == 64
    samples = make_samples()

    def run(fn, *args, **kw):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fn(*args, **kw, device="cuda")

    logits_p, loss_p, grads_p = run(packed_run, model, samples)
    logits_u, loss_u, grads_u = run(unpacked_run, model, samples, "sdpa")
    assert logits_p.dtype == logits_u.dtype == torch.bfloat16
    logit_diff = (logits_p.float() - logits_u.float()).abs().max().item()
    grad_diff = max_grad_diff(grads_p, grads_u)
    assert logit_diff <= 2e-2, logit_diff
    torch.testing.assert_close(loss_p, loss_u, rtol=2e-3, atol=2e-3)
    assert grad_diff <= 2e-2, grad_diff
    logits_s, _, grads_s = run(packed_run, model, samples, sabotage=True)
    assert (logits_s.float() - logits_u.float()).abs().max().item() > 10 * max(logit_diff, 1e-2)
    assert max_grad_diff(grads_s, grads_u) > 5 * max(grad_diff, 1e-2)


def test_sft_bf16_linear_ce_runs_under_autocast(monkeypatch, tmp_path):
    """varpack sft --bf16 on the chunked linear CE: the attention's inputs are bf16 (that path trained in float32
    before) and the first step's loss equals the --loss-impl logits run's (the path accelerate's autocast reaches;
    it raised the dtype TypeError before)."""
    import varpack.attn.interface as interface
    from tests.train.test_cli_sft import VOCAB as SFT_VOCAB
    from tests.train.test_cli_sft import _Tok, synthetic_samples
    from varpack.train import SFTConfig, run_sft

    seen = []
    real = interface.prepare_call

    def spy(q, k, v, *args, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, *args, **kw)

    monkeypatch.setattr(interface, "prepare_call", spy)
    losses = {}
    for impl in ("linear_ce", "logits"):
        seen.clear()
        torch.manual_seed(0)
        model = load_model("tiny-qwen3", vocab_size=SFT_VOCAB, attn_backend="sdpa")
        cfg = SFTConfig(
            model="tiny-qwen3", output_dir=str(tmp_path / impl), packing_length=32, attn_backend="sdpa",
            save=False, logging_steps=1, max_steps=1, bf16=True, loss_impl=impl, torch_compile=False,
            extra_training_args={"optim": "sgd", "max_grad_norm": 0.0, "use_cpu": True},
        )  # fmt: skip
        run = run_sft(
            cfg, print_fn=lambda *_: None, model=model, tokenizer=_Tok(), encoded=synthetic_samples(n=24)
        )
        assert seen and set(seen) == {(torch.bfloat16,) * 3}, (impl, set(seen))
        assert run.trainer.loss_impl_used.startswith("linear") == (impl == "linear_ce"), (
            run.trainer.loss_impl_used
        )
        losses[impl] = run.history[0]["loss"]
    assert losses["linear_ce"] == pytest.approx(losses["logits"], rel=5e-3), losses
