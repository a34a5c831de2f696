"""Multi-head latent attention families (DeepSeek-V2/V3, Kimi K2 (``deepseek_v3``), MiniCPM3, GLM-4-MoE-Lite,
LongCat-Flash, ...): queries and keys of head dim ``qk_nope_head_dim + qk_rope_head_dim``, values of
``v_head_dim`` (``Dv != D``), mostly with MoE feed-forward blocks (per-token routing: see
:mod:`varpack.models.moe`).

varpack attention takes the value head dim as it comes (``varlen_attention``: v ``[T, Hkv, Dv]``); the backends
that run ``Dv != D`` declare it (:attr:`varpack.attn.Capabilities.distinct_v_head_dim`: reference, sdpa, flex;
FlashAttention-4 only as its ``(192, 128)`` shape on sm100), the others are skipped by ``auto`` with that reason.

Built-in config (random init, offline; Qwen3 vocabulary unless ``vocab_size`` is given): ``tiny-deepseek-v3``
(2 layers, the first dense, the second MoE with 4 routed experts (top 2) and a shared one; MLA with q/k head dim
96 + 32 = 128 and value head dim 64: power-of-two head dims that FlexAttention compiles on a GPU).
"""

from __future__ import annotations

from typing import Any

from varpack.models.dense import QWEN3_VOCAB_SIZE, _build, qwen3_special_ids
from varpack.models.registry import ModelFamily

__all__ = ["FAMILIES", "MLA", "tiny_deepseek_v3_config"]


def tiny_deepseek_v3_config(vocab_size: int | None = None, **overrides: Any) -> Any:
    """``tiny-deepseek-v3``: ``DeepseekV3Config`` with 2 layers (dense, then MoE), hidden 256, 4 heads, q/k head
    dim 128 (96 without + 32 with RoPE), value head dim 64, KV rank 64, q rank 96, 4 routed experts of 128
    (top 2) and 1 shared."""
    from transformers import DeepseekV3Config

    vocab = int(vocab_size or QWEN3_VOCAB_SIZE)
    return _build(
        DeepseekV3Config,
        overrides,
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=64,
        q_lora_rank=96,
        qk_nope_head_dim=96,
        qk_rope_head_dim=32,
        head_dim=32,
        v_head_dim=64,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        **qwen3_special_ids(vocab),
    )


#: MLA decoders the model zoo verified exact (docs/MODELS.md)
MLA = ModelFamily(
    name="mla",
    model_types=(
        "axk1", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash", "minicpm3", "sarvam_mla", "youtu",
    ),  # fmt: skip
    mixers="attention",
    vision=False,
    position_ids="1d",
    builtins={"tiny-deepseek-v3": tiny_deepseek_v3_config},
)

FAMILIES = (MLA,)
