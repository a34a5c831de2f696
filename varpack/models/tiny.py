"""Tiny random-init configs of any ``transformers`` model type, built offline from the config class's defaults.

:func:`tiny_config` ``(model_type)`` shrinks the widths of the config class's defaults (hidden 64, 4 / 2 heads of
16, MLP 128, a 256-token vocabulary, 4 experts of which 2 per token, ...) on the config and on every sub-config
(text, vision, audio), keeps every per-layer pattern of the default model at least once (``layer_types``,
NoPE / MoE / hybrid layer lists: the fewest leading layers in which every kind occurs, at least 2) and moves
every special-token id into the small vocabulary. Per-model-type facts that the generic rule cannot guess (a
width that must divide another, a mixer's own sizes) are in :data:`TINY_OVERRIDES`; a family may provide its own
builder (:attr:`varpack.models.ModelFamily.tiny_configs`), which :func:`tiny_config` prefers.

Used by the model zoo (:mod:`varpack.zoo`: every causal-LM model type through the packed == unpacked check) and by
the built-in tiny models of the zoo's families. Size values follow transformers' own model tests
(``tests/models/*/test_modeling_*.py``: hidden 32-64, 2-4 layers, vocabulary 99-256).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "SAMPLE_TOKEN_RANGE",
    "TINY_OVERRIDES",
    "TINY_SIZES",
    "TINY_VOCAB_SIZE",
    "tiny_config",
]

#: embedding rows of every tiny config; sample tokens are drawn from :data:`SAMPLE_TOKEN_RANGE`, and every special
#: token id of the config is moved above it (so a random sample never holds an image or pad token)
TINY_VOCAB_SIZE = 256
SAMPLE_TOKEN_RANGE = (8, 224)

#: config fields set wherever the config (or a sub-config) has them (directly or through ``attribute_map``)
TINY_SIZES: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    # MoE: 4 experts, 2 per token, small experts; routing groups that divide 4 experts
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "dense_intermediate_size": 128,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_local_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    # MLA (DeepSeek-V2/V3, Kimi, MiniCPM3): q/k head dim 16 + 8 = 24, v head dim 16
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    # linear attention (Gated DeltaNet) and SSM widths
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "mamba_d_state": 16,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_chunk_size": 4,
    "state_size": 16,
    # local attention shapes short enough for the samples to cross them
    "sliding_window": 4,
    "attention_chunk_size": 4,
    # encoder-decoder / BERT-style names
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "n_positions": 512,
    "n_ctx": 512,
    # vision / audio towers (built, never fed in a text-only check)
    "image_size": 32,
    "patch_size": 8,
    # partial rotary width inside the head (GPT-J, CodeGen)
    "rotary_dim": 8,
    # Llama 4's dense MLP layers
    "intermediate_size_mlp": 128,
    # per-layer input embeddings (Gemma 3n / 4)
    "vocab_size_per_layer_input": TINY_VOCAB_SIZE,
    "hidden_size_per_layer_input": 8,
}

#: fields set only when the default is an int (``None`` means the feature is off: it stays off)
_ONLY_IF_SET = frozenset(
    {"sliding_window", "attention_chunk_size", "q_lora_rank", "hidden_size_per_layer_input", "rotary_dim"}
)
#: widths set even where the default is None (derived from other fields when not given)
_CORE_SIZES = frozenset(
    {"vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
     "max_position_embeddings", "d_model", "n_routed_experts", "num_experts_per_tok", "n_shared_experts"}
)  # fmt: skip
#: fields never set on a vision / audio sub-config (their own layer counts and widths are shrunk above)
_TEXT_ONLY = frozenset({"vocab_size", "sliding_window", "attention_chunk_size", "max_position_embeddings"})

#: per model type: config fields the generic rule cannot guess (facts of transformers' model tests)
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    # real LFM2 checkpoints interleave short convolutions with attention (transformers' Lfm2ModelTester)
    "lfm2": {"layer_types": ["full_attention", "conv"]},
    # MiniMax-M3's language model has sparse (indexer-selected) attention layers beside full ones
    "minimax_m3_vl_text": {"layer_types": ["full_attention", "minimax_m3_sparse"]},
    # Mamba-2: hidden * expand == num_heads * head_dim
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1},
    # Dory: input, looped (recurrent) and output layers; released configs list attention and MLP blocks apart
    "dory": {
        "num_hidden_layers": 4,
        "n_input_layers": 1,
        "n_recurrent_layers": 2,
        "n_output_layers": 1,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    },
    # the assistant's language model has no per-layer inputs
    "gemma4_assistant": {"text_config": {"model_type": "gemma4_text", "hidden_size_per_layer_input": 0}},
    "gemma4_unified_assistant": {
        "text_config": {"model_type": "gemma4_unified_text", "hidden_size_per_layer_input": 0}
    },
    # Zamba: Mamba layers with a shared attention block every attn_layer_period layers (ZambaModelTester)
    "zamba": {
        "num_hidden_layers": 5,
        "attn_layer_offset": 1,
        "attn_layer_period": 8,
        "num_key_value_heads": 4,
        "n_mamba_heads": 2,
        "mamba_dt_rank": 32,
        "use_mamba_kernels": False,
    },
    # Qwen2-VL / Qwen2.5-VL: mRoPE sections of the tiny head (temporal, height, width halves of 16)
    "qwen2_vl": {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}}},
    "qwen2_5_vl": {
        "text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}}
    },
    # dots.3: the sliding-window layers' head dim is the MLA q/k head dim (16 + 8)
    "dots3_note_text": {"head_dim": 24},
    # LFM2-MoE: dense layers, then MoE ones; attention and short convolutions interleaved
    "lfm2_moe": {"layer_types": ["full_attention", "conv"], "num_dense_layers": 1},
    # OLMo-hybrid: linear-attention (Gated DeltaNet) layers and at least one attention layer
    "olmo_hybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # ZAYA routes each token to one expert
    "zaya": {"num_experts_per_tok": 1},
}

_MAX_LAYERS = 8


def _fields(config: Any) -> dict[str, str]:
    """``{name: stored name}`` of every field of ``config``, the ``attribute_map`` aliases included."""
    names = {k: k for k in config.to_dict()}
    for alias, stored in (getattr(type(config), "attribute_map", {}) or {}).items():
        if stored in names:
            names[alias] = stored
    return names


def _sub_configs(config: Any) -> dict[str, Any]:
    from transformers import PretrainedConfig

    out = {}
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = config.__dict__.get(name)
        if isinstance(sub, PretrainedConfig):
            out[name] = sub
    return out


def _is_text(name: str | None) -> bool:
    return name is None or "text" in name or name in ("decoder", "language_config", "llm_config")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _per_layer_fields(values: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Fields holding one entry per layer: a list of ``num_layers`` entries, or a ``*pattern*`` string of that
    many characters (Nemotron-H's ``M-*`` block pattern)."""
    out = {}
    for name, value in values.items():
        if name.startswith("_") or num_layers < 2:
            continue
        if isinstance(value, (list, tuple)) and len(value) == num_layers:
            out[name] = list(value)
        elif isinstance(value, str) and "pattern" in name and len(value) == num_layers:
            out[name] = value
    return out


def _layers_needed(per_layer: Mapping[str, Any]) -> int:
    """The fewest leading layers in which every kind of every per-layer field occurs (at least 2)."""
    need = 2
    for value in per_layer.values():
        items = [repr(v) for v in value]
        kinds = set(items)
        seen: set[str] = set()
        for i, item in enumerate(items):
            seen.add(item)
            if seen == kinds:
                need = max(need, i + 1)
                break
    return min(need, _MAX_LAYERS)


def _per_layer_config(value: Any, layers: int, scale: Mapping[str, float]) -> dict[str, Any]:
    """A ``per_layer_config`` (``{layer index: field overrides}``) cut to the first ``layers`` layers, each
    width scaled as its global field was (a layer twice as wide as the default stays twice as wide)."""
    out = {}
    for index, entry in dict(value).items():
        if int(index) >= layers:
            continue
        out[index] = {
            k: (max(1, round(v * scale[k])) if k in scale and _is_int(v) else v) for k, v in dict(entry).items()
        }
    return out


def _shrunk_kwargs(config: Any, name: str | None, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Constructor keywords of a tiny version of ``config`` (a default config), sub-configs included."""
    fields = _fields(config)
    values = config.to_dict()
    kwargs: dict[str, Any] = {}
    scale: dict[str, float] = {}
    for key, value in TINY_SIZES.items():
        stored = fields.get(key)
        if stored is None or (not _is_text(name) and key in _TEXT_ONLY):
            continue
        current = values.get(stored)
        if key in _ONLY_IF_SET and not _is_int(current):
            continue
        if current is None and key not in _CORE_SIZES:
            continue  # a feature switched off by None (no experts, no shared experts): it stays off
        if current is not None and not _is_int(current):
            continue  # a field of that name with another meaning (a list, a float, a flag)
        kwargs[stored] = value
    if "qk_rope_head_dim" in kwargs and "head_dim" in fields:  # MLA: head_dim is the rotary part
        kwargs[fields["head_dim"]] = kwargs["qk_rope_head_dim"]
    heads, kv_heads = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if heads in kwargs and kv_heads in kwargs and values.get(heads) == values.get(kv_heads):
        kwargs[kv_heads] = kwargs[heads]  # a model that needs as many key/value heads as query heads keeps it
    expand = values.get("mamba_expand", values.get("expand"))
    if _is_int(expand) and "hidden_size" in kwargs:  # Mamba-2 heads: n_heads * d_head == expand * hidden
        for n_key, d_key in (("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim")):
            if n_key in values and d_key in values:
                kwargs[d_key] = 16
                kwargs[n_key] = expand * kwargs["hidden_size"] // 16
        if _is_int(values.get("mamba_d_ssm")):
            kwargs["mamba_d_ssm"] = expand * kwargs["hidden_size"]
    rope = values.get("rope_parameters")
    head_dim = kwargs.get(fields.get("head_dim", ""))
    if head_dim is None and "hidden_size" in kwargs and fields.get("num_attention_heads") in kwargs:
        head_dim = kwargs["hidden_size"] // kwargs[fields["num_attention_heads"]]
    if isinstance(rope, Mapping) and rope.get("mrope_section") and head_dim:
        half = head_dim // 2  # mRoPE sections split the rotary half of a head
        section = [max(1, round(x * half / sum(rope["mrope_section"]))) for x in rope["mrope_section"]]
        section[0] += half - sum(section)
        kwargs["rope_parameters"] = {**rope, "mrope_section": section}
    for key, value in list(kwargs.items()):  # widths' scale, for per-layer overrides of them
        if _is_int(value) and _is_int(values.get(key)) and values[key] > 0:
            scale[key] = value / values[key]
    if "is_decoder" in values and not values.get("is_encoder_decoder") and _is_text(name):
        kwargs["is_decoder"] = True  # BERT-style encoders run as causal LMs (their *ForCausalLM needs it)
    for sub_name, sub in _sub_configs(config).items():
        sub_over = dict(overrides.get(sub_name, {}))
        kwargs[sub_name] = {**sub.to_dict(), **_shrunk_kwargs(sub, sub_name, sub_over)}
    layers_key = fields.get("num_hidden_layers") or next(
        (fields[k] for k in ("num_layers", "n_layers") if k in fields), None
    )
    layers = values.get(layers_key) if layers_key else None
    if _is_int(layers):
        per_layer = _per_layer_fields(values, layers)
        need = _layers_needed(per_layer) if _is_text(name) else min(layers, 2)
        kwargs[layers_key] = need
        own = [v for k, v in overrides.items() if k in per_layer and isinstance(v, (list, str))]
        if layers_key in overrides:  # the layer count given as a fact: the config derives its patterns
            need = overrides[layers_key]
            per_layer = {}
        elif own:  # a per-layer pattern given as a fact: its length is the layer count
            need = len(own[0])
            kwargs[layers_key] = need
        shared = values.get("num_kv_shared_layers")
        if _is_int(shared) and shared > 0:  # layers reusing earlier layers' keys / values: one of each kind
            need = min(2 * need, 2 * _MAX_LAYERS)
            kwargs[layers_key] = need
            kwargs["num_kv_shared_layers"] = need // 2
        for field_name, value in per_layer.items():
            kwargs[field_name] = value[:need]
        if isinstance(values.get("per_layer_config"), Mapping):
            kwargs["per_layer_config"] = _per_layer_config(values["per_layer_config"], need, scale)
    kwargs.update({k: v for k, v in overrides.items() if k not in _sub_configs(config)})
    return kwargs


def _special_ids(config: Any, vocab: int) -> dict[str, Any]:
    """Every ``*_token_id`` / ``*_token_index`` field moved into ``[SAMPLE_TOKEN_RANGE[1], vocab)``: distinct
    values above the sample tokens (ids 0-3 stay: pad / bos / eos), the same old id always to the same new one."""
    remap: dict[int, int] = {}
    spare = iter(range(SAMPLE_TOKEN_RANGE[1], vocab))

    def move(value: Any) -> Any:
        if not _is_int(value) or 0 <= value < 4:
            return value
        if value not in remap:
            remap[value] = next(spare, vocab - 1)
        return remap[value]

    out = {}
    for key, value in config.to_dict().items():
        if not key.endswith(("_token_id", "_token_index", "_token_ids")):
            continue
        if isinstance(value, list):
            out[key] = [move(v) for v in value]
        elif _is_int(value):
            out[key] = move(value)
    return out


def _generic_tiny(model_type: str) -> Any:
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    overrides = TINY_OVERRIDES.get(model_type, {})
    try:
        default = config_cls()
    except (TypeError, ValueError):  # defaults the class itself refuses: start from the overrides' facts
        default = config_cls(**overrides)
    config = config_cls(**_shrunk_kwargs(default, None, overrides))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", None) or TINY_VOCAB_SIZE)
    for cfg in {id(config): config, id(text): text}.values():
        for key, value in _special_ids(cfg, vocab).items():
            setattr(cfg, key, value)
    return config


def tiny_config(model_type: str, *, vocab_size: int | None = None) -> Any:
    """A tiny config of ``model_type`` (a key of ``transformers``' ``CONFIG_MAPPING``), random weights to be
    drawn by the caller.

    Args:
        model_type: e.g. ``"llama"``, ``"gpt_oss"``, ``"deepseek_v3"``.
        vocab_size: embedding rows (default :data:`TINY_VOCAB_SIZE`).

    Returns:
        A ``transformers`` config: the family's own tiny config when its family provides one
        (:attr:`varpack.models.ModelFamily.tiny_configs`), else the config class's defaults shrunk as the module
        docstring says.

    Raises:
        KeyError: ``model_type`` unknown to the installed transformers.
        ValueError / TypeError: the config class refuses the tiny values (its message), e.g. a width that must
            divide another; the zoo records such a model type as refused with that reason.
    """
    from varpack.models.registry import family_for_model_type

    family = family_for_model_type(model_type)
    builder = family.tiny_configs.get(model_type) if family is not None else None
    if builder is not None:
        return builder(vocab_size=vocab_size or TINY_VOCAB_SIZE)
    config = _generic_tiny(model_type)
    if vocab_size is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        text.vocab_size = int(vocab_size)
    return config
