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
}

#: fields set only when the default is an int (``None`` means the feature is off: it stays off)
_ONLY_IF_SET = frozenset({"sliding_window", "attention_chunk_size", "q_lora_rank"})
#: fields never set on a vision / audio sub-config (their own layer counts and widths are shrunk above)
_TEXT_ONLY = frozenset({"vocab_size", "sliding_window", "attention_chunk_size", "max_position_embeddings"})

#: per model type: config fields the generic rule cannot guess (facts of transformers' model tests)
TINY_OVERRIDES: dict[str, dict[str, Any]] = {}

_MAX_LAYERS = 8


def _fields(config: Any) -> set[str]:
    names = set(config.to_dict())
    names |= set(getattr(type(config), "attribute_map", {}) or {})
    return names


def _sub_configs(config: Any) -> dict[str, Any]:
    from transformers import PretrainedConfig

    out = {}
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if isinstance(sub, PretrainedConfig):
            out[name] = sub
    return out


def _is_text(name: str | None) -> bool:
    return name is None or "text" in name or name in ("decoder", "language_config", "llm_config")


def _num_layers(config: Any) -> int | None:
    for name in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _per_layer_fields(config: Any, num_layers: int) -> dict[str, Any]:
    """Fields holding one entry per layer (a list or a pattern string of length ``num_layers``)."""
    out = {}
    for name, value in config.to_dict().items():
        if name.startswith("_"):
            continue
        if isinstance(value, (list, tuple, str)) and len(value) == num_layers and num_layers > 1:
            if isinstance(value, str) and " " in value:
                continue
            out[name] = value
    return out


def _layers_needed(per_layer: Mapping[str, Any]) -> int:
    """The fewest leading layers in which every kind of every per-layer field occurs (at least 2)."""
    need = 2
    for value in per_layer.values():
        items = list(value)
        try:
            kinds = {repr(v) for v in items}
        except TypeError:
            continue
        seen: set[str] = set()
        for i, item in enumerate(items):
            seen.add(repr(item))
            if seen == kinds:
                need = max(need, i + 1)
                break
    return min(need, _MAX_LAYERS)


def _cut(value: Any, n: int) -> Any:
    return value[:n] if isinstance(value, str) else list(value)[:n]


def _shrunk_kwargs(config: Any, name: str | None) -> dict[str, Any]:
    fields = _fields(config)
    defaults = config.to_dict()
    kwargs: dict[str, Any] = {}
    for key, value in TINY_SIZES.items():
        if key not in fields:
            continue
        if not _is_text(name) and key in _TEXT_ONLY:
            continue
        current = getattr(config, key, defaults.get(key))
        if key in _ONLY_IF_SET and not isinstance(current, int):
            continue
        if isinstance(current, bool) or (current is not None and not isinstance(current, int)):
            continue  # a field of that name with another meaning (a list, a float, a flag)
        kwargs[key] = value
    return kwargs


def _special_ids(config: Any, vocab: int) -> dict[str, Any]:
    """Every ``*_token_id`` / ``*_token_index`` field moved into ``[SAMPLE_TOKEN_RANGE[1], vocab)``: distinct
    values above the sample tokens, the same old id always to the same new one."""
    remap: dict[int, int] = {}
    spare = iter(range(SAMPLE_TOKEN_RANGE[1], vocab))
    low = {0, 1, 2, 3}

    def move(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int):
            return value
        if value in low:
            return value
        if value not in remap:
            remap[value] = next(spare, vocab - 1)
        return remap[value]

    out = {}
    for key, value in config.to_dict().items():
        if not (key.endswith("_token_id") or key.endswith("_token_index") or key.endswith("_token_ids")):
            continue
        if isinstance(value, list):
            out[key] = [move(v) for v in value]
        elif isinstance(value, int) and not isinstance(value, bool):
            out[key] = move(value)
    return out


def _build(config_cls: Any, kwargs: dict[str, Any]) -> Any:
    return config_cls(**kwargs)


def _generic_tiny(model_type: str) -> Any:
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    default = config_cls()
    overrides = dict(TINY_OVERRIDES.get(model_type, {}))
    kwargs = _shrunk_kwargs(default, None)
    for name, sub in _sub_configs(default).items():
        sub_kwargs = _shrunk_kwargs(sub, name)
        sub_layers = _num_layers(sub)
        if sub_layers is not None:
            key = next(k for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if hasattr(sub, k))
            sub_kwargs[key] = min(sub_layers, 2)
        sub_kwargs.update(overrides.pop(name, {}))
        kwargs[name] = {**sub.to_dict(), **sub_kwargs}
    layers = _num_layers(default)
    if layers is not None:
        per_layer = _per_layer_fields(default, layers)
        need = _layers_needed(per_layer)
        key = next(k for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if hasattr(default, k))
        kwargs[key] = need
        for field_name, value in per_layer.items():
            kwargs[field_name] = _cut(value, need)
    kwargs.update(overrides)
    config = _build(config_cls, kwargs)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", TINY_VOCAB_SIZE) or TINY_VOCAB_SIZE)
    ids = _special_ids(config, vocab)
    if ids:
        for key, value in ids.items():
            setattr(config, key, value)
    if text is not config:
        for key, value in _special_ids(text, vocab).items():
            setattr(text, key, value)
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
        return builder(vocab_size=vocab_size)
    config = _generic_tiny(model_type)
    if vocab_size is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        text.vocab_size = int(vocab_size)
    return config
