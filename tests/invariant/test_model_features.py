"""Packed == per-sample steps for the model features the zoo turned on, each with a negative control:

* attention sinks (GPT-OSS's ``s_aux``): exact through the reference and sdpa backends; dropping them (what
  varpack's attention did with unknown keywords) fails;
* multi-head latent attention (DeepSeek-V3, MiniCPM3: value head dim != q/k head dim): exact; one segment over
  the whole row fails;
* chunked attention (Llama 4's ``chunked_attention`` layers, NoPE layers between them): exact; attention over
  whole samples instead of chunks fails; Llama 4's query temperature by row position is refused in rows of at
  least ``floor_scale`` tokens;
* a decoder layer that drops the boundary keywords (StableLM, Nemotron) is refused, not run unpacked.
"""

from __future__ import annotations

import pytest

import varpack.collate
import varpack.integrations.transformers as vt
from tests.test_check import _Sabotaged
from varpack.check import check_exactness
from varpack.integrations.transformers import UnsupportedModelError
from varpack.zoo import build_tiny_model, zoo_samples

SAMPLES = zoo_samples((7, 10, 5, 1))  # a 1-token sample among longer ones


def _exact(model, backend):
    result = check_exactness(model, SAMPLES, backend=backend)
    assert result["passed"], result["failures"][:5]
    return result


# ------------------------------------------------------------------------------------------------ sinks
@pytest.fixture(scope="module")
def gpt_oss():
    model = build_tiny_model("gpt_oss")
    sinks = [p for n, p in model.named_parameters() if n.endswith("sinks")]
    assert len(sinks) == model.config.num_hidden_layers and all(float(s.detach().abs().min()) > 0 for s in sinks)
    return model


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_gpt_oss_sinks_exact(gpt_oss, backend):
    result = _exact(gpt_oss, backend)
    assert result["backend"] == backend


def test_gpt_oss_auto_backend_reports_sinks(gpt_oss):
    result = _exact(gpt_oss, "auto")
    assert result["backend"] == "sdpa"  # sdpa declares sinks on the CPU


def test_gpt_oss_negative_control_sinks_dropped(gpt_oss, monkeypatch):
    import varpack.attn  # the attention function imports varlen_attention from here at call time

    real = varpack.attn.varlen_attention

    def without_sinks(*args, sinks=None, **kwargs):
        return real(*args, **kwargs)

    monkeypatch.setattr(varpack.attn, "varlen_attention", without_sinks)
    result = check_exactness(gpt_oss, SAMPLES, backend="reference")
    assert not result["passed"] and result["max_abs_logit_diff"] > 1e-2


# -------------------------------------------------------------------------------------------------- MLA
@pytest.mark.parametrize("model_type", ["deepseek_v3", "minicpm3"])
def test_mla_exact(model_type):
    model = build_tiny_model(model_type)
    cfg = model.config
    assert cfg.qk_nope_head_dim + cfg.qk_rope_head_dim != cfg.v_head_dim
    for backend in ("reference", "sdpa"):
        _exact(model, backend)


def test_mla_negative_control_boundaries_dropped(monkeypatch):
    model = build_tiny_model("deepseek_v3")
    monkeypatch.setattr(varpack.collate, "PaddingFreeCollator", _Sabotaged)
    result = check_exactness(model, SAMPLES, backend="sdpa")
    assert not result["passed"]


# ------------------------------------------------------------------------------------ chunked attention
@pytest.fixture(scope="module")
def llama4():
    model = build_tiny_model("llama4_text")
    cfg = model.config
    assert "chunked_attention" in cfg.layer_types and 0 in cfg.no_rope_layers  # chunked and NoPE layers
    assert cfg.attention_chunk_size < max(len(s["input_ids"]) for s in SAMPLES)
    return model


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_llama4_chunked_attention_exact(llama4, backend):
    _exact(llama4, backend)


def test_llama4_negative_control_chunks_ignored(llama4, monkeypatch):
    monkeypatch.setattr(vt, "_attention_chunk", lambda module: None)
    result = check_exactness(llama4, SAMPLES, backend="sdpa")
    assert not result["passed"]


def test_llama4_row_position_temperature_refused_in_long_rows(llama4, monkeypatch):
    nope = [m for m in llama4.modules() if getattr(m, "attn_temperature_tuning", False) and not m.use_rope]
    assert nope
    for module in nope:
        monkeypatch.setattr(module, "floor_scale", 8)  # shorter than the packed row of 23 tokens
    with pytest.raises(UnsupportedModelError, match="attn_temperature_tuning") as info:
        check_exactness(llama4, SAMPLES, backend="sdpa")
    assert "floor_scale" in info.value.feature


# ------------------------------------------------------------------------- boundary keywords dropped
@pytest.mark.parametrize("model_type", ["stablelm", "nemotron"])
def test_layer_that_drops_boundary_keywords_is_refused(model_type):
    from varpack.models import ModelFamily, register_family, unregister_family

    model = build_tiny_model(model_type)
    register_family(ModelFamily(name="as-if-verified", model_types=(model.config.model_type,)))
    try:
        with pytest.raises(UnsupportedModelError, match="without the batch's boundary keywords") as info:
            check_exactness(model, SAMPLES, backend="sdpa")
    finally:
        unregister_family("as-if-verified")
    assert info.value.feature.startswith("attention without the boundary keywords")
