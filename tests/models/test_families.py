"""varpack.models' family registry: every built-in name loads through its family, each family's facts agree
with the model itself (its gated-delta layers are the ones patch_linear_attention patches, its vision tower is
the model's, its rope-index function is the model's own get_rope_index, its media fields cover what that
function reads), and a family registered with one call is seen by family_of / load_model and packs exactly
(check_exactness; negative control: the same check fails when the boundaries are dropped)."""

from __future__ import annotations

import types

import pytest
import torch

import varpack.collate
import varpack.models
from tests.test_check import _Sabotaged, samples
from varpack.check import check_exactness
from varpack.models import (
    GENERIC,
    ModelFamily,
    builtin_names,
    family_of,
    is_vl_model,
    load_model,
    load_tokenizer_for,
    model_config,
    register_family,
    resolve_model_source,
    unregister_family,
)
from varpack.rope import rope_args
from varpack.schema import MEDIA_FIELDS, MM_TOKEN_TYPE_IDS

VOCAB = 512


def _load(name: str):
    """The built-in model through load_model (varpack attention on, gated-delta layers patched, VL prepared);
    small vocabulary where the family allows it; the full-size shapes (qwen3-0.6b-shape, qwen3-1.7b-shape; qwen3.5-hybrid-shape) cut to
    2 of their 28 layers (4 of 24 for the hybrid, one of them full attention)."""
    kw: dict = {} if "vl" in name else {"vocab_size": VOCAB}
    if name.endswith("-shape"):  # full-size benchmark shapes: a few layers (the hybrid keeps one full-attention)
        kw["config_overrides"] = {"num_hidden_layers": 4 if "hybrid" in name else 2}
        if "vl" in name:  # and one layer of the vision tower
            kw["config_overrides"]["vision_config"] = {"depth": 1}
    return load_model(name, attn_backend="reference", **kw)


@pytest.mark.parametrize("name", builtin_names())
def test_builtin_loads_through_its_family_and_facts_agree(name):
    family = family_of(name)
    assert name in family.builtins and resolve_model_source(name) == ("builtin", name)
    model = _load(name)
    assert family_of(model) is family and family_of(model.config) is family and family.covers(model)
    assert family_of(model_config(name)) is family
    text = family.text_config(model)
    assert len(family.decoder_layers(model)) == text.num_hidden_layers

    # token mixers: the family's recurrent mixers (Gated DeltaNet, Mamba-2) are exactly the ones enable_varpack
    # patched, one per layer whose type holds one
    linear = family.linear_layers(model)
    marks = ("_varpack_gdn_original_forward", "_varpack_ssd_original_forward")
    patched = [m for m in model.modules() if any(k in m.__dict__ for k in marks)]
    assert [id(m) for m in linear] == [id(m) for m in patched]
    assert len(linear) == model._varpack_state.linear_layers_patched
    assert (len(linear) > 0) == (family.mixers in ("gated_delta", "mamba2"))
    layer_types = getattr(text, "layer_types", None) or []
    assert len(linear) == sum(t in ("linear_attention", "hybrid") for t in layer_types)

    # vision: is_vl, the tower, the mRoPE rope index and the media fields it reads
    assert is_vl_model(model) == family.is_vl(model) == bool(family.vision)
    if family.vision:
        assert family.vision_tower(model) is model.model.visual
        assert getattr(model, "_varpack_vl_handles", None)  # prepared: tower isolated, media guarded
        assert family.position_layout(model) == "mrope"
        fn = family.rope_index(model)
        assert fn == model.model.get_rope_index
        media_args = set(rope_args(fn)) & (set(MEDIA_FIELDS) | {MM_TOKEN_TYPE_IDS})
        assert media_args <= set(family.media_fields), (media_args, family.media_fields)
        assert family.rope_index(model.config)(**_rope_inputs()) is not None  # built from the config too
    else:
        assert family.position_layout(model) == "1d" and family.media_fields == ()
        assert not getattr(model, "_varpack_vl_handles", None)
        with pytest.raises(TypeError, match="no vision tower"):
            family.vision_tower(model)
        with pytest.raises(TypeError, match="1-D position_ids"):
            family.rope_index(model)


def _rope_inputs():
    ids = torch.tensor([[1, 2, 3]])
    return {"input_ids": ids, "mm_token_type_ids": torch.zeros_like(ids)}


def test_decoder_layers_and_builtin_names_come_from_the_families():
    import varpack.integrations.kernels as kernels

    model = load_model("tiny-llama", vocab_size=VOCAB, attn_backend=None)
    assert kernels.decoder_layers(model) == family_of(model).decoder_layers(model)
    assert set(varpack.models.BUILTIN_MODELS) == set(builtin_names())


def test_unknown_model_type_falls_back_to_generic():
    cfg = _tiny_qwen2()  # Qwen2's layers under a model_type no family covers
    assert family_of(cfg) is GENERIC
    with pytest.raises(ValueError, match="model_type 'toy_qwen2'"):
        family_of(cfg, strict=True)
    with pytest.raises(ValueError, match="unknown built-in model 'tiny-gpt'"):
        family_of("tiny-gpt")
    # the generic family reads the facts off the model, as varpack did before the registry
    duck_vl = types.SimpleNamespace(model_type="some_vl", vision_config=object(), image_token_id=7)
    assert is_vl_model(duck_vl) and GENERIC.position_layout(duck_vl) == "mrope"
    assert not is_vl_model(cfg) and GENERIC.position_layout(cfg) == "1d"


def test_register_refuses_collisions():
    dense = family_of("tiny-qwen3")
    with pytest.raises(ValueError, match="already registered"):
        register_family(dense)
    clash = ModelFamily(name="other", model_types=("qwen3",))
    with pytest.raises(ValueError, match="'qwen3' of family 'other' is already covered by family 'dense'"):
        register_family(clash)
    clash = ModelFamily(name="other", model_types=(), builtins={"tiny-llama": model_config})
    with pytest.raises(ValueError, match="'tiny-llama' of family 'other' already belongs to family 'dense'"):
        register_family(clash)
    assert "other" not in {f.name for f in varpack.models.families()}
    with pytest.raises(ValueError, match="mixers"):
        ModelFamily(name="bad", model_types=(), mixers="mamba")


# ------------------------------------------------------------------------------- a family added by one call
def _toy_config_class():
    from transformers import Qwen2Config

    class ToyQwen2Config(Qwen2Config):
        model_type = "toy_qwen2"

    return ToyQwen2Config


def _build_toy(config):
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM._from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def _tiny_qwen2(vocab_size=None, **overrides):
    return _toy_config_class()(
        **{
            "vocab_size": vocab_size or VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            **overrides,
        }
    )


@pytest.fixture
def toy_family():
    family = register_family(
        ModelFamily(
            name="toy-qwen2",
            model_types=("toy_qwen2",),
            builtins={"tiny-qwen2": _tiny_qwen2},
            model_class=_build_toy,
        )
    )
    yield family
    unregister_family("toy-qwen2")


def test_registered_family_is_seen_and_packs_exactly(toy_family, monkeypatch):
    assert "tiny-qwen2" in builtin_names() and "tiny-qwen2" in varpack.models.BUILTIN_MODELS
    model = load_model("tiny-qwen2", attn_backend="reference", seed=5)
    assert (
        type(model).__name__ == "Qwen2ForCausalLM"
        and model.config._attn_implementation == "varpack_reference"
    )
    assert family_of(model) is toy_family and family_of(model.config, strict=True) is toy_family
    assert len(toy_family.decoder_layers(model)) == 2 and toy_family.linear_layers(model) == []
    assert load_tokenizer_for("tiny-qwen2").convert_tokens_to_ids("<|im_end|>") == 151645
    res = check_exactness(model, samples(), backend="reference")
    assert res["passed"], res["failures"]
    monkeypatch.setattr(varpack.collate, "PaddingFreeCollator", _Sabotaged)  # negative control
    bad = check_exactness(model, samples(), backend="reference")
    assert not bad["passed"] and bad["max_abs_logit_diff"] > 1e-3


def test_unregistered_family_is_gone(toy_family):
    cfg = _tiny_qwen2()
    assert family_of(cfg) is toy_family
    unregister_family("toy-qwen2")
    try:
        assert family_of(cfg) is GENERIC and "tiny-qwen2" not in builtin_names()
        with pytest.raises(ValueError, match="neither a built-in name"):
            load_model("tiny-qwen2")
    finally:
        register_family(toy_family)  # the fixture unregisters it
