"""Dense-attention families: Llama, Qwen3 (``tiny-qwen3``, ``tiny-llama``, ``qwen3-0.6b-shape``) and the other
decoder-only model types with dense feed-forward blocks that the model zoo verified exact (docs/MODELS.md:
Mistral, Qwen2, Gemma 1/2/3, Phi-3, OLMo 2/3, GLM-4, Granite, Cohere2, SmolLM3, StarCoder2, GPT-2, ...).

Every token mixer is (full or sliding-window, softcapped, NoPE, with or without sinks) softmax attention, so varpack attention
(:func:`varpack.integrations.transformers.enable_varpack`) alone keeps packed samples apart; positions are
1-D (``[1, T]``, restarting at 0 for every sample).

Built-in configs (random init, offline): ``tiny-qwen3`` / ``tiny-llama`` (2-3 layers, hidden 64, GQA 4/2
heads, head dim 16: fast on a laptop CPU) and ``qwen3-0.6b-shape`` (the Qwen3-0.6B config values with random
weights, for GPU benchmarks). The vocabulary is the Qwen3 one (151,669 tokens padded to 151,936 as in Qwen3's
configs) unless ``vocab_size`` is given.
"""

from __future__ import annotations

from typing import Any

from varpack.models.registry import ModelFamily

__all__ = ["DENSE", "FAMILIES", "QWEN3_VOCAB_SIZE", "qwen3_special_ids"]

#: Qwen3's embedding rows: the 151,669 tokens of the Qwen3 vocabulary padded to a multiple of 128.
QWEN3_VOCAB_SIZE = 151936
_QWEN3_IDS = {"pad_token_id": 151643, "eos_token_id": 151645, "bos_token_id": None}


def qwen3_special_ids(vocab_size: int) -> dict[str, int | None]:
    """Qwen3's special token ids, or None for ids outside a reduced test vocabulary."""
    return {k: (v if v is not None and v < vocab_size else None) for k, v in _QWEN3_IDS.items()}


def _build(config_cls: Any, overrides: dict[str, Any], **defaults: Any) -> Any:
    """``config_cls(**defaults | overrides)``, refusing override keys the config class does not know."""
    known = set(config_cls().to_dict())
    unknown = sorted(set(overrides) - known - set(defaults))
    if unknown:
        raise ValueError(f"{config_cls.__name__} has no field(s) {unknown} (overrides {overrides})")
    return config_cls(**{**defaults, **overrides})


def _vocab(vocab_size: int | None) -> int:
    return int(vocab_size or QWEN3_VOCAB_SIZE)


def tiny_qwen3_config(vocab_size: int | None = None, **overrides: Any) -> Any:
    """``tiny-qwen3``: ``Qwen3Config`` with 2 layers, hidden 64, 4/2 heads of 16, tied embeddings."""
    from transformers import Qwen3Config

    vocab = _vocab(vocab_size)
    return _build(
        Qwen3Config,
        overrides,
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        **qwen3_special_ids(vocab),
    )


def tiny_llama_config(vocab_size: int | None = None, **overrides: Any) -> Any:
    """``tiny-llama``: ``LlamaConfig`` with 3 layers, hidden 64, 4/2 heads of 16, untied embeddings."""
    from transformers import LlamaConfig

    vocab = _vocab(vocab_size)
    return _build(
        LlamaConfig,
        overrides,
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        tie_word_embeddings=False,
        **qwen3_special_ids(vocab),
    )


def qwen3_0_6b_shape_config(vocab_size: int | None = None, **overrides: Any) -> Any:
    """Qwen/Qwen3-0.6B's config.json values (28 layers, hidden 1024, 16/8 heads of 128, tied embeddings)."""
    from transformers import Qwen3Config

    vocab = _vocab(vocab_size)
    return _build(
        Qwen3Config,
        overrides,
        vocab_size=vocab,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=False,
        **qwen3_special_ids(vocab),
    )


def qwen3_1_7b_shape_config(vocab_size: int | None = None, **overrides: Any) -> Any:
    """Qwen/Qwen3-1.7B's config.json values (28 layers, hidden 2048, MLP 6144, 16/8 heads of 128, tied
    embeddings): the multi-GPU (FSDP2) memory benchmark's shape, random weights."""
    return qwen3_0_6b_shape_config(
        vocab_size, **{"hidden_size": 2048, "intermediate_size": 6144, **overrides}
    )


#: Llama, Qwen3 and every decoder-only model type with dense feed-forward blocks whose token mixers are softmax
#: attention through transformers' attention interface (full, sliding-window, softcapped, NoPE layers, attention
#: sinks) that the model zoo verified exact (docs/MODELS.md); 1-D positions
DENSE = ModelFamily(
    name="dense",
    model_types=(
        "llama", "qwen3",
        "apertus", "apertus1p5_text", "arcee", "biogpt", "bitnet", "codegen", "cohere", "cohere2", "ctrl", "cwm",
        "diffllama", "dory", "ernie4_5", "exaone", "exaone4", "gemma", "gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "glm",
        "glm4",
        "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "granite", "granite_swa", "helium", "hrm_text", "hunyuan_v1_dense",
        "hyperclovax", "internlm3", "iquestcoder", "jais2", "ministral", "ministral3", "mistral",
        "modernbert-decoder", "nanochat", "olmo", "olmo2", "olmo3", "opt", "persimmon", "phi", "phi3", "qwen2",
        "seed_oss", "smollm3", "starcoder2", "vaultgemma",
    ),  # fmt: skip
    mixers="attention",
    vision=False,
    position_ids="1d",
    builtins={
        "tiny-qwen3": tiny_qwen3_config,
        "tiny-llama": tiny_llama_config,
        "qwen3-0.6b-shape": qwen3_0_6b_shape_config,
        "qwen3-1.7b-shape": qwen3_1_7b_shape_config,
    },
)

FAMILIES = (DENSE,)
