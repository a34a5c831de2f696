"""transformers integration (varpack.integrations.transformers): enable_varpack's names and idempotence, the
packing guards, refused stateful layers, and no per-layer host reads (CPU) / host syncs (CUDA). The packed ==
unpacked runs of the dense families are in tests/invariant/test_dense.py (their helpers are imported here)."""

from __future__ import annotations

import pytest
import torch

from tests.invariant.test_dense import VOCAB, make_samples, model_inputs
from varpack.collate import PaddingFreeCollator
from varpack.integrations.transformers import (
    PackingGuardError,
    attn_implementation_name,
    enable_varpack,
    is_varpack_attention,
)
from varpack.loss import causal_lm_loss
from varpack.models import load_model
from varpack.schema import BOUNDARY_KEYS


def test_enable_varpack_names_and_idempotence():
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend=None)
    assert model.config._attn_implementation == "sdpa"
    enable_varpack(model)
    assert model.config._attn_implementation == "varpack" == attn_implementation_name("auto")
    enable_varpack(model, backend="reference")
    assert model.config._attn_implementation == "varpack_reference"
    assert attn_implementation_name("flash_attn_4") == "varpack_fa_4"  # no "flash" in the name
    assert attn_implementation_name("sdpa") == "varpack_sdp"  # no "sdpa": transformers' SDPA checks stay off
    assert is_varpack_attention("varpack_reference") and not is_varpack_attention("sdpa")
    # replaced, not stacked: the guard on the base model, the boundary hand-down on the top model
    assert len(model.model._forward_pre_hooks) == 1 == len(model._forward_pre_hooks) == len(model._forward_hooks)
    assert model._varpack_state.original_attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="unknown attention backend"):
        enable_varpack(model, backend="nope")


def test_deepcopy_keeps_the_original_guarded():
    import copy

    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    clone = enable_varpack(copy.deepcopy(model), backend="reference")
    assert len(model.model._forward_pre_hooks) == 1 and len(clone.model._forward_pre_hooks) == 1
    batch = model_inputs(PaddingFreeCollator()([make_samples()]))
    batch["input_ids"] = batch["input_ids"].repeat(2, 1)
    for m in (model, clone):
        with pytest.raises(PackingGuardError):
            m(**batch)


# ------------------------------------------------------------------------------------------------ guards
@pytest.fixture(scope="module")
def qwen():
    return load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")


@pytest.fixture()
def batch():
    return model_inputs(PaddingFreeCollator()([make_samples()]))


def test_guard_missing_boundaries(qwen, batch):
    for key in BOUNDARY_KEYS:  # varpack.schema: every boundary key, varlen_meta included
        batch.pop(key)
    with pytest.raises(PackingGuardError, match="restart inside a row"):
        qwen(**batch)


def test_guard_batch_rows(qwen, batch):
    batch["input_ids"] = batch["input_ids"].repeat(2, 1)
    batch["position_ids"] = batch["position_ids"].repeat(2, 1)
    with pytest.raises(PackingGuardError, match=r"one row \[1, T\]"):
        qwen(**batch)


def test_guard_attention_mask_with_packed(qwen, batch):
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    with pytest.raises(PackingGuardError, match="attention_mask"):
        qwen(**batch)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_guard_cache(qwen, batch):
    from transformers import DynamicCache

    with pytest.raises(PackingGuardError, match="use_cache=True"):
        qwen(**batch, use_cache=True)
    with pytest.raises(PackingGuardError, match="KV cache"):
        qwen(**batch, past_key_values=DynamicCache(config=qwen.config))


def test_guard_use_cache_defaults_off(qwen, batch):
    out = qwen(**batch)
    assert getattr(out, "past_key_values", None) is None and getattr(out, "cache", None) is None


def test_guard_not_varpack_attention(batch):
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    model.set_attn_implementation("sdpa")
    with pytest.raises(PackingGuardError, match="not varpack's"):
        model(**batch)


def test_guard_base_model_call(qwen, batch):
    """Calling the base model directly (as linear-CE losses do) is guarded too."""
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    with pytest.raises(PackingGuardError, match="attention_mask"):
        qwen.model(**batch)


def test_guard_no_position_ids(qwen, batch):
    batch.pop("position_ids")
    with pytest.raises(PackingGuardError, match="without position_ids"):
        qwen(**batch)


def test_guard_bad_boundaries(qwen, batch):
    t = batch["input_ids"].shape[1]
    meta = batch.pop("varlen_meta")
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 4, t - 1], dtype=torch.int32)
    with pytest.raises(PackingGuardError, match=f"T={t}"):
        qwen(**batch)
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, t], dtype=torch.int32)
    batch["max_length_q"] = batch["max_length_k"] = 3
    with pytest.raises(PackingGuardError, match="max_length"):
        qwen(**batch)
    # the collator's meta beside boundaries that are not its own: refused, never a silent winner
    batch["varlen_meta"] = meta
    with pytest.raises(PackingGuardError, match="disagrees with varlen_meta"):
        qwen(**batch)


def test_guard_tensor_max_length_on_cpu_is_converted(qwen, batch):
    ref = qwen(**batch).logits
    batch["max_length_q"] = torch.tensor(batch["max_length_q"])
    batch["max_length_k"] = torch.tensor(batch["max_length_k"])
    torch.testing.assert_close(qwen(**batch).logits, ref)


def test_guard_padding_mask_unpacked(qwen):
    ids = torch.randint(0, VOCAB, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    with pytest.raises(PackingGuardError, match="padding"):
        qwen(input_ids=ids, attention_mask=mask)
    qwen(input_ids=ids, attention_mask=torch.ones_like(ids))  # no padding: fine


def test_guard_dropout():
    model = load_model(
        "tiny-qwen3", vocab_size=VOCAB, attn_backend="reference", config_overrides={"attention_dropout": 0.1}
    )
    model.train()
    with pytest.raises(ValueError, match=r"dropout.*set config.attention_dropout = 0.0"):
        model(input_ids=torch.randint(0, VOCAB, (1, 4)))


def test_attention_dropout_named_by_the_configs_own_key():
    """GPT-2 keeps its attention dropout in ``attn_pdrop``: the refusal at the forward and the one before
    training name that key, not ``attention_dropout``; a config without attention dropout passes (control)."""
    import transformers

    from varpack.integrations.transformers import (
        attention_dropout_settings,
        enable_varpack,
        refuse_attention_dropout,
    )

    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    enable_varpack(model, backend="reference")
    assert attention_dropout_settings(model) == {"attn_pdrop": 0.1}
    with pytest.raises(ValueError, match=r"varpack sft: .*GPT2Config sets attn_pdrop=0.1: set it to 0.0"):
        refuse_attention_dropout(model, "varpack sft")
    model.train()
    with pytest.raises(ValueError, match=r"from GPT2Attention\); set config.attn_pdrop = 0.0"):
        model(input_ids=torch.randint(0, VOCAB, (1, 4)))
    model.eval()
    model(input_ids=torch.randint(0, VOCAB, (1, 4)))  # no dropout outside training
    model.config.attn_pdrop = 0.0
    assert attention_dropout_settings(model) == {}
    refuse_attention_dropout(model, "varpack sft")
    bert = transformers.BertConfig()
    assert attention_dropout_settings(bert) == {"attention_probs_dropout_prob": 0.1}


def test_guard_positional_arguments(qwen, batch):
    """input_ids / attention_mask / position_ids passed positionally are checked too."""
    ids, pos = batch.pop("input_ids"), batch.pop("position_ids")
    with pytest.raises(PackingGuardError, match="attention_mask"):
        qwen(ids, torch.ones_like(ids), pos, **batch)


def test_top_model_dropping_the_boundaries_is_refused():
    """A *ForCausalLM whose forward calls its base model without the boundary kwargs (and positions) must not
    run the pack as one sequence: the guard on the base model sees the top model's packed call and refuses."""
    import types

    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")

    def drops_kwargs(self, input_ids=None, **kwargs):  # named arguments only, as Mamba2ForCausalLM
        return self.lm_head(self.model(input_ids=input_ids).last_hidden_state)

    model.forward = types.MethodType(drops_kwargs, model)
    batch = PaddingFreeCollator()([make_samples()])
    with pytest.raises(PackingGuardError, match="boundaries and position_ids its top model did not pass on"):
        model(**model_inputs(batch))
    ids = torch.tensor([make_samples()[0]["input_ids"]])
    assert model(input_ids=ids).shape == (1, ids.shape[1], VOCAB)  # an unpacked call is not affected


def test_unknown_stateful_layers_refused():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    model = Qwen3ForCausalLM(config)
    model.config.layer_types = ["mamba"]
    with pytest.raises(PackingGuardError, match="mamba"):
        enable_varpack(model)


# ------------------------------------------------------------------------------------- host reads
class _Watched(torch.Tensor):
    """cu_seqlens that record every value read (item/tolist/int/bool/index) made through them."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in ("item", "tolist", "__int__", "__bool__", "__index__", "__float__", "numpy", "__len__"):
            cls.reads.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


def _count_reads(num_layers, monkeypatch):
    import varpack.attn

    real = varpack.attn.varlen_attention
    seen = []

    def spy(q, k, v, *args, meta=None, **kw):
        seen.append((meta, type(meta.max_seqlen_q)))
        return real(q, k, v, *args, meta=meta, **kw)

    monkeypatch.setattr(varpack.attn, "varlen_attention", spy)
    model = load_model(
        "tiny-qwen3",
        vocab_size=VOCAB,
        attn_backend="reference",
        config_overrides={"num_hidden_layers": num_layers},
    )
    batch = model_inputs(PaddingFreeCollator()([make_samples()]))
    batch.pop("varlen_meta")  # built by the guard from the watched kwargs, once per forward
    cu = batch["cu_seq_lens_q"].as_subclass(_Watched)
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu
    _Watched.reads = []
    from torch.utils._python_dispatch import TorchDispatchMode

    class Scalars(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                Scalars.count += 1
            return func(*args, **(kwargs or {}))

    with Scalars():
        model(**batch).logits.sum().backward()
    # one boundary object, built from these very offsets, reaches every layer
    assert len(seen) == num_layers and all(m is seen[0][0] for m, _ in seen)
    assert seen[0][0].cu_seqlens_q is cu
    assert all(t is int for _, t in seen)
    return len(_Watched.reads), Scalars.count


def test_no_per_layer_host_reads(monkeypatch):
    """Boundaries are read at most once per forward (the CPU check in the pre-hook), never per layer, and no
    tensor is turned into a Python scalar by the integration (aten._local_scalar_dense)."""
    reads_2, scalars_2 = _count_reads(2, monkeypatch)
    reads_4, scalars_4 = _count_reads(4, monkeypatch)
    assert reads_2 == reads_4 <= 1
    assert scalars_2 == scalars_4 == 0


def _cuda_batch(model, seed):
    batch = PaddingFreeCollator()([make_samples(seed=seed)])
    labels, seq_idx = batch["labels"].cuda(), batch["seq_idx"].cuda()
    inputs = {  # boundaries stay on the CPU (as varpack.train keeps them): copied once per batch
        k: (v.cuda() if isinstance(v, torch.Tensor) and not k.startswith("cu_seq_lens") else v)
        for k, v in model_inputs(batch).items()
    }
    return inputs, labels, seq_idx


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "flex", "torch_varlen"])
def test_gpu_no_sync_per_layer(backend):
    """On CUDA, with a fresh batch (new boundary tensors): every decoder layer after the first runs its
    forward under sync-debug mode "error" (the first layer may do the once-per-batch boundary copy), and the
    whole forward + loss + backward step triggers at most one host sync."""
    import warnings

    from varpack.attn import available_backends

    ok, why = available_backends("cuda", torch.bfloat16).get(backend, (True, ""))
    if backend != "auto" and not ok:
        pytest.skip(f"{backend}: {why}")
    # one model per process, as in training: earlier tests compiled FlexAttention for many head dims,
    # dtypes and score mods; past dynamo's recompile limit it runs eagerly (math attention, host syncs)
    torch.compiler.reset()
    model = load_model(
        "tiny-qwen3", vocab_size=VOCAB, attn_backend=backend, device="cuda", dtype=torch.bfloat16,
        config_overrides={"num_hidden_layers": 4},
    ).train()  # fmt: skip  (bf16: torch_varlen refuses fp32, and training runs in bf16 on GPUs)

    def step(seed):
        inputs, labels, seq_idx = _cuda_batch(model, seed)
        torch.cuda.synchronize()
        logits = model(**inputs).logits
        causal_lm_loss(logits, labels, seq_idx=seq_idx).backward()

    step(0)  # warm-up: kernel compilation, caches
    torch.cuda.synchronize()

    def strict(module, args, kwargs):
        torch.cuda.set_sync_debug_mode("error")

    def relaxed(module, args, kwargs, output):
        torch.cuda.set_sync_debug_mode("default")

    handles = []
    for layer in model.model.layers[1:]:
        handles.append(layer.register_forward_pre_hook(strict, with_kwargs=True))
        handles.append(layer.register_forward_hook(relaxed, with_kwargs=True))
    try:
        step(1)  # raises RuntimeError on a host sync inside layers 1..3
    finally:
        torch.cuda.set_sync_debug_mode("default")
        for h in handles:
            h.remove()
    torch.cuda.synchronize()
    inputs, labels, seq_idx = _cuda_batch(model, 2)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            logits = model(**inputs).logits
            causal_lm_loss(logits, labels, seq_idx=seq_idx).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) <= 1, syncs


# ------------------------------------------------------------------------------- attention keywords
def _attention_call(**kwargs):
    """One call of varpack's attention function on a 2-sample packed stream (T = 5, H = 2, D = 8)."""
    from varpack.integrations.transformers import varpack_attention_forward
    from varpack.varlen.meta import VarlenMeta

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    meta = VarlenMeta(torch.tensor([0, 2, 5], dtype=torch.int32), total_q=5, total_k=5)
    module = torch.nn.Module()
    module.is_causal = True
    return varpack_attention_forward(module, q, k, v, None, backend="reference", varlen_meta=meta, **kwargs)


def test_attention_refuses_unimplemented_keywords_before_computing(monkeypatch):
    import varpack.attn
    from varpack.integrations.transformers import UnsupportedModelError

    calls = []
    monkeypatch.setattr(varpack.attn, "varlen_attention", lambda *a, **k: calls.append(1))
    for kwargs, name in (
        ({"position_bias": torch.zeros(1, 2, 5, 5)}, "position_bias"),
        ({"some_new_feature": 1.0}, "some_new_feature"),
        ({"output_attentions": True}, "output_attentions"),
    ):
        with pytest.raises(UnsupportedModelError, match=name) as info:
            _attention_call(**kwargs)
        assert name in info.value.feature
    assert calls == []  # refused before the attention kernel ran


def test_attention_accepts_neutral_keywords_and_none_values():
    base, _ = _attention_call()
    out, _ = _attention_call(
        position_ids=torch.arange(5)[None], use_cache=False, output_attentions=False, s_aux=None, seq_idx=None
    )
    torch.testing.assert_close(out, base, rtol=0, atol=0)



# ------------------------------------------------------------------------- models varpack has not verified
def _llama_like(model_type: str, attention_class=None):
    """A tiny Llama whose config claims ``model_type`` (no family covers it), optionally with its attention
    modules replaced by ``attention_class``."""
    from varpack.models.tiny import tiny_config
    from varpack.zoo import build_tiny_model

    model = build_tiny_model("llama")
    model.config.model_type = model_type
    if attention_class is not None:
        for layer in model.model.layers:
            layer.self_attn.__class__ = attention_class
    assert tiny_config("llama").model_type == "llama"
    return model


def test_generic_model_of_verified_layers_runs_and_unknown_layers_are_refused():
    from transformers.models.llama.modeling_llama import LlamaAttention

    from varpack.check import check_exactness
    from varpack.integrations.transformers import UnsupportedModelError
    from varpack.zoo import zoo_samples

    model = _llama_like("my_llama_finetune")  # Llama's own classes under another name: recognised
    assert check_exactness(model, zoo_samples())["passed"]

    class MyAttention(LlamaAttention):  # a custom layer varpack has never checked
        pass

    custom = _llama_like("my_custom_llama", MyAttention)
    with pytest.raises(UnsupportedModelError, match="MyAttention") as info:
        enable_varpack(custom)
    assert info.value.feature.startswith("unverified model type my_custom_llama")
    assert custom.config._attn_implementation != "varpack"  # refused before the switch


def test_refused_family_and_encoder_decoder_are_refused_by_name():
    from varpack.integrations.transformers import UnsupportedModelError
    from varpack.zoo import build_tiny_model

    with pytest.raises(UnsupportedModelError, match="encoder-decoder") as info:
        enable_varpack(build_tiny_model("bart"))
    assert not info.value.applicable
    mamba = build_tiny_model("mamba")
    with pytest.raises(UnsupportedModelError, match="MambaMixer|MambaBlock") as info:
        enable_varpack(mamba)
    assert info.value.feature.startswith("stateful sequence mixer")


def test_moe_capacity_limit_refused():
    from varpack.integrations.transformers import UnsupportedModelError
    from varpack.zoo import build_tiny_model

    model = build_tiny_model("mixtral")
    enable_varpack(model)  # per-token routing: accepted
    model.config.capacity_factor = 1.25  # an expert capacity: which tokens overflow depends on the batch
    with pytest.raises(UnsupportedModelError, match="capacity") as info:
        enable_varpack(model)
    assert info.value.feature == "MoE routing with an expert capacity (capacity_factor)"


def test_media_in_a_packed_batch_refused_for_a_text_only_family():
    from varpack.integrations.transformers import UnsupportedModelError
    from varpack.zoo import build_tiny_model, zoo_samples

    model = build_tiny_model("gemma3")
    enable_varpack(model, backend="reference")
    batch = model_inputs(PaddingFreeCollator()([zoo_samples()]))
    model(**batch)  # text only: runs
    batch["pixel_values"] = torch.zeros(1, 3, 32, 32)
    with pytest.raises(UnsupportedModelError, match="pixel_values"):
        model(**batch)
