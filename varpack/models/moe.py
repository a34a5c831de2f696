"""Mixture-of-experts families: softmax attention (full, sliding, chunked; with or without attention sinks) and
MoE feed-forward blocks with token-choice routing (Qwen2/3-MoE, Mixtral, OLMoE, GPT-OSS, GLM-4-MoE, Llama 4, ...).

Token-choice routing picks each token's experts from that token's hidden state alone, so a packed row routes
every token as its sample alone would: logits, loss and gradients are exact (the model zoo checks each model
type, docs/MODELS.md). What is *not* per token is the router's auxiliary load-balancing loss
(``output_router_logits=True``): it averages expert fractions and router probabilities over a batch's tokens.
Its exact counterpart for a packed row is the same samples as a padded batch with the padding excluded by the
attention mask (transformers' ``load_balancing_loss_func(..., attention_mask)``), not the mean of per-sample
losses; tests/models/test_moe.py checks that equality and that a padded batch without the mask differs. Routing
with an expert capacity (tokens over it dropped) depends on the other samples of the batch: refused by name by
:func:`varpack.integrations.transformers.enable_varpack` (``CAPACITY_LIMIT_FIELDS``).

Built-in configs (random init, offline; Qwen3 vocabulary unless ``vocab_size`` is given), sized for a GPU check
through FlashAttention-4 (head dim 64, the smallest head dim whose FA4 backward is verified on sm90):
``tiny-qwen3-moe`` (Qwen3-MoE, 2 layers, 4 experts, top 2) and ``tiny-gpt-oss`` (GPT-OSS: attention sinks,
sliding and full layers, 4 experts, top 2).
"""

from __future__ import annotations

from typing import Any

from varpack.models.dense import QWEN3_VOCAB_SIZE, _build, qwen3_special_ids
from varpack.models.registry import ModelFamily

__all__ = ["FAMILIES", "MOE", "tiny_gpt_oss_config", "tiny_qwen3_moe_config"]


def tiny_qwen3_moe_config(vocab_size: int | None = None, **overrides: Any) -> Any:
    """``tiny-qwen3-moe``: ``Qwen3MoeConfig`` with 2 layers, hidden 256, 4 / 2 heads of 64, 4 experts of 128, 2
    per token, every layer MoE."""
    from transformers import Qwen3MoeConfig

    vocab = int(vocab_size or QWEN3_VOCAB_SIZE)
    return _build(
        Qwen3MoeConfig,
        overrides,
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        **qwen3_special_ids(vocab),
    )


def tiny_gpt_oss_config(vocab_size: int | None = None, **overrides: Any) -> Any:
    """``tiny-gpt-oss``: ``GptOssConfig`` with 2 layers (sliding window 32, then full attention), hidden 256,
    4 / 2 heads of 64 with learned attention sinks, 4 experts of 128, 2 per token."""
    from transformers import GptOssConfig

    vocab = int(vocab_size or QWEN3_VOCAB_SIZE)
    return _build(
        GptOssConfig,
        overrides,
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=128,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        **qwen3_special_ids(vocab),
    )


#: MoE decoders whose attention is varpack attention (sinks included) and whose routing is per token; the
#: model types the model zoo verified exact (docs/MODELS.md)
MOE = ModelFamily(
    name="moe",
    model_types=(
        "afmoe", "aria_text", "beam", "cohere2_moe", "dots1", "ergo", "ernie4_5_moe", "exaone_moe", "flex_olmo", "flint",
        "glm4_moe", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "jetmoe", "kolibri1",
        "laguna", "lara_mini", "llama4_text", "mellum", "mimo_v2_flash", "minicpm5_moe", "minimax_m2", "mixtral", "olmoe",
        "param2moe", "phimoe", "qwen2_moe", "qwen3_moe", "sarvam_moe", "solar_open",
    ),  # fmt: skip
    mixers="attention",
    vision=False,
    position_ids="1d",
    builtins={"tiny-qwen3-moe": tiny_qwen3_moe_config, "tiny-gpt-oss": tiny_gpt_oss_config},
)

FAMILIES = (MOE,)
