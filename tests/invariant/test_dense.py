"""transformers integration: packed (varpack attention, one row) == each sample alone (the model's own
attention), for logits, loss and every parameter's gradient, for the dense families (Llama, Qwen3, a Gemma2-style
model with softcap and sliding window); the negative control drops the boundaries and must fail. The guards and
host-read checks of the same integration are in tests/integrations/test_transformers.py."""

from __future__ import annotations

import pytest
import torch

from tests._exact import LOGITS_RTOL, LOSS_RTOL, assert_differs, assert_exact
from varpack.collate import PaddingFreeCollator
from varpack.integrations.transformers import enable_varpack
from varpack.loss import causal_lm_loss
from varpack.models import load_model

VOCAB = 512
LENGTHS = (5, 1, 7, 3)  # odd lengths, a 1-token sample


def make_samples(lengths=LENGTHS, vocab=VOCAB, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, vocab, (n,), generator=g)
        labels = ids.clone()
        labels[: max(1, n // 3)] = -100  # a prompt part; labels[0] == -100 always
        samples.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "sample_id": i})
    return samples


def model_inputs(batch):
    return {k: v for k, v in batch.items() if k not in ("labels", "sample_ids", "loss_scale")}


def packed_run(model, samples, *, sabotage=False, device=None):
    """Forward + backward of the packed row; returns (logits [T, V], loss, grads). ``device``: where the
    token tensors go (the boundaries stay on the CPU, as the trainer keeps them)."""
    batch = PaddingFreeCollator()([samples])
    if sabotage:  # one segment spanning the whole row: the boundaries are gone
        t = batch["input_ids"].shape[1]
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, t], dtype=torch.int32)
        batch["max_length_q"] = batch["max_length_k"] = t
        batch.pop("varlen_meta")  # the collator's meta would disagree with the replaced boundaries
    if device is not None:
        batch = {
            k: v.to(device) if isinstance(v, torch.Tensor) and not k.startswith("cu_seq_lens") else v
            for k, v in batch.items()
        }
    model.zero_grad(set_to_none=True)
    logits = model(**model_inputs(batch)).logits
    loss = causal_lm_loss(logits, batch["labels"], seq_idx=batch["seq_idx"])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits[0].detach(), loss.detach(), grads


def unpacked_run(model, samples, attn="sdpa", device=None):
    """Each sample alone through the model's own attention; loss = token mean over all samples."""
    current = model.config._attn_implementation
    model.set_attn_implementation(attn)
    try:
        model.zero_grad(set_to_none=True)
        n_sup = sum(sum(x != -100 for x in s["labels"][1:]) for s in samples)
        logits_all, total = [], 0.0
        for s in samples:
            ids = torch.tensor([s["input_ids"]], device=device)
            labels = torch.tensor([s["labels"]], device=device)
            logits = model(input_ids=ids).logits
            loss_sum = causal_lm_loss(logits, labels, num_items_in_batch=1)  # per-sample sum
            total = total + loss_sum
            logits_all.append(logits[0].detach())
        loss = total / n_sup
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return torch.cat(logits_all), loss.detach(), grads
    finally:
        model.set_attn_implementation(current)


def max_grad_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)


def gemma2_model():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=3,
        attn_logit_softcapping=5.0,
        query_pre_attn_scalar=16,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return enable_varpack(Gemma2ForCausalLM(config).eval())


MODELS = {
    "tiny-qwen3": (lambda: load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference"), "sdpa"),
    "tiny-llama": (lambda: load_model("tiny-llama", vocab_size=VOCAB, attn_backend="reference"), "sdpa"),
    # sliding window on every layer (window 3 < the longest sample), through the same path
    "tiny-qwen3-sliding": (
        lambda: load_model(
            "tiny-qwen3",
            vocab_size=VOCAB,
            attn_backend="reference",
            config_overrides={"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0},
        ),
        "sdpa",
    ),
    # Gemma-style: tanh soft-capping + alternating sliding window; its own attention is eager
    "gemma2": (gemma2_model, "eager"),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_and_ref(request):
    build, ref_attn = MODELS[request.param]
    return build(), ref_attn


def test_packed_equals_unpacked(model_and_ref):
    model, ref_attn = model_and_ref
    samples = make_samples()
    logits_p, loss_p, grads_p = packed_run(model, samples)
    logits_u, loss_u, grads_u = unpacked_run(model, samples, ref_attn)
    assert logits_p.shape == logits_u.shape == (sum(LENGTHS), VOCAB)
    assert_exact(logits_p, logits_u, rtol=LOGITS_RTOL, what="logits")
    assert_exact(loss_p, loss_u, rtol=LOSS_RTOL, what="loss")
    assert len(grads_p) == len(list(model.parameters()))  # every parameter got a gradient
    assert_exact(grads_p, grads_u)


def test_negative_control_without_boundaries(model_and_ref):
    """The same comparison with the boundaries dropped (one segment over the row) must fail clearly."""
    model, ref_attn = model_and_ref
    samples = make_samples()
    logits_p, loss_p, grads_p = packed_run(model, samples, sabotage=True)
    logits_u, loss_u, grads_u = unpacked_run(model, samples, ref_attn)
    assert_differs(logits_p, logits_u, rtol=LOGITS_RTOL, what="logits")
    assert_differs(grads_p, grads_u)


def test_gradient_checkpointing_keeps_exactness():
    """Layers recomputed in backward see the same boundary kwargs: grads still equal the unpacked ones."""
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    samples = make_samples()
    _, _, grads_u = unpacked_run(model, samples)
    model.gradient_checkpointing_enable()
    model.train()
    _, _, grads_p = packed_run(model, samples)
    assert_exact(grads_p, grads_u)
    _, _, grads_bad = packed_run(model, samples, sabotage=True)
    assert_differs(grads_bad, grads_u)


def test_unpacked_path_matches_native_attention():
    """Without boundary kwargs varpack attention is an ordinary causal model (rows = sequences, B > 1)."""
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    ids = torch.randint(0, VOCAB, (3, 9))
    with torch.no_grad():
        out_vp = model(input_ids=ids).logits
        model.set_attn_implementation("sdpa")
        out_sdpa = model(input_ids=ids).logits
    assert (out_vp - out_sdpa).abs().max().item() <= 1e-5


def test_generate_matches_native_attention():
    """Decoding with a KV cache (1 query vs L keys: bottom-right causal alignment) equals sdpa."""
    model = load_model("tiny-llama", vocab_size=VOCAB, attn_backend="reference")
    prompt = torch.randint(0, VOCAB, (1, 6))
    kw = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    out_vp = model.generate(prompt, **kw)
    model.set_attn_implementation("sdpa")
    out_sdpa = model.generate(prompt, **kw)
    assert torch.equal(out_vp, out_sdpa)
