"""Gated-delta (linear-attention) text families: Qwen3.5 text, Qwen3.5-MoE text and Qwen3-Next (``tiny-qwen3.5``,
``tiny-qwen3.5-moe``, ``tiny-qwen3-next``, and the benchmark shape ``qwen3.5-hybrid-shape``).

Their decoder mixes Gated DeltaNet layers (a 4-tap causal short convolution and a recurrent gated delta rule,
both reset at every sample boundary by :func:`varpack.integrations.gated_delta.patch_linear_attention`, which
``enable_varpack`` calls) with full-attention layers (varpack attention). Positions are 1-D for the text
models (the Qwen3.5 text config carries an ``mrope_section`` but a text-only forward uses one plane). The VL
Qwen3.5 (``model_type`` ``qwen3_5``) is in :mod:`varpack.models.qwen_vl`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from varpack.models.registry import GATED_DELTA_LAYER_CLASSES, ModelFamily, is_gated_delta_layer

__all__ = [
    "FAMILIES",
    "GATED_DELTA_LAYER_CLASSES",
    "GATED_DELTA_TEXT",
    "TINY_MODELS",
    "is_gated_delta_layer",
    "qwen3_5_hybrid_shape_config",
    "tiny_config",
    "tiny_model",
]

TINY_MODELS = ("tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-next")


def tiny_config(name: str, *, vocab_size: int | None = None, **kw: Any) -> Any:
    """Config of a tiny random-init Qwen3.5 text / Qwen3.5-MoE text / Qwen3-Next model (see :func:`tiny_model`).

    Raises:
        ValueError: an unknown name.
    """
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    qwen3_5 = name in ("tiny-qwen3.5", "tiny-qwen3.5-moe")
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    common: dict[str, Any] = dict(
        vocab_size=vocab_size or (248320 if qwen3_5 else 151936),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=4096,
        use_cache=False,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    if qwen3_5:
        common["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        }
        if name == "tiny-qwen3.5-moe":
            common.pop("intermediate_size")  # every layer's MLP is the mixture of experts
            common.update(moe, **kw)
            return Qwen3_5MoeTextConfig(**common)
        common.update(kw)
        return Qwen3_5TextConfig(**common)
    if name == "tiny-qwen3-next":
        common.update(moe, decoder_sparse_step=1, mlp_only_layers=[])
        common.update(kw)
        return Qwen3NextConfig(**common)
    raise ValueError(f"unknown tiny linear-attention model {name!r}; expected one of {TINY_MODELS}")


def qwen3_5_hybrid_shape_config(vocab_size: int | None = None, **kw: Any) -> Any:
    """``qwen3.5-hybrid-shape``: a benchmark shape, not a released checkpoint's config. Qwen3.5's layer
    pattern (three Gated DeltaNet layers to one full-attention layer, ``Qwen3_5TextConfig``'s default
    ``layer_types``) and head sizes (Gated DeltaNet 16 key / 16 value heads of 128, conv kernel 4; gated full
    attention 8 / 2 heads of 256, partial rotary 0.25) at the Qwen3-0.6B width: hidden 1024, MLP 3072, 24
    layers (18 linear, 6 full), vocabulary 248,320, tied embeddings; random weights (0.71B parameters).
    The gated delta rule of each linear layer is then T x 16 heads x 128 x 128, the shape of
    ``benchmarks/gated_delta.py``."""
    from transformers import Qwen3_5TextConfig

    layers = int(kw.pop("num_hidden_layers", 24))
    common: dict[str, Any] = dict(
        vocab_size=vocab_size or 248320,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        use_cache=False,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    common.update(kw)
    return Qwen3_5TextConfig(**common)


def _causal_lm(config: Any) -> torch.nn.Module:
    """``Qwen3_5ForCausalLM`` / ``Qwen3NextForCausalLM`` of ``config``, else transformers' causal LM of its
    ``model_type`` (``Qwen3_5MoeForCausalLM``) (random init, float32)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3NextForCausalLM

    if config.model_type == "qwen3_next":
        return Qwen3NextForCausalLM(config)
    if config.model_type == "qwen3_5_text":
        return Qwen3_5ForCausalLM(config)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


def tiny_model(
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    vocab_size: int | None = None,
    **kw: Any,
) -> torch.nn.Module:
    """A tiny random-init ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM`` or ``Qwen3NextForCausalLM`` (built
    offline, no hub).

    All mix linear-attention (Gated DeltaNet, grouped value heads: 2 key heads, 4 value heads, conv
    kernel 4) and full-attention layers: ``layer_types = [linear, full, linear, linear]``; Qwen3.5-MoE and
    Qwen3-Next have a small mixture of experts in every layer (4 experts of 32, top 2, a shared expert of 32).
    ``use_cache=False``.

    Args:
        name: ``"tiny-qwen3.5"``, ``"tiny-qwen3.5-moe"`` or ``"tiny-qwen3-next"``.
        dtype: parameter dtype.
        seed: ``torch.manual_seed`` for the initialisation.
        vocab_size: vocabulary size; default the real model's (248320 for Qwen3.5, whose tokenizer
            varpack's ``load_tokenizer("qwen3.5")`` embeds, also for Qwen3.5-MoE; 151936 for Qwen3-Next, Qwen3
            tokenizer), so real
            tokenized text fits. Tests pass a small one.
        **kw: overrides of config fields (e.g. ``num_hidden_layers=6, layer_types=[...]``).

    Returns:
        The model in eval mode, on the CPU.

    Raises:
        ValueError: an unknown name.
    """
    config = tiny_config(name, vocab_size=vocab_size, **kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _causal_lm(config)
    return model.to(dtype).eval()


#: Qwen3.5 text and Qwen3-Next: Gated DeltaNet + full attention, 1-D positions
GATED_DELTA_TEXT = ModelFamily(
    name="gated-delta",
    model_types=("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"),
    mixers="gated_delta",
    vision=False,
    position_ids="1d",
    builtins={
        **{name: partial(tiny_config, name) for name in TINY_MODELS},
        "qwen3.5-hybrid-shape": qwen3_5_hybrid_shape_config,
    },
    builtin_tokenizers={"tiny-qwen3.5": "qwen3.5", "tiny-qwen3.5-moe": "qwen3.5", "qwen3.5-hybrid-shape": "qwen3.5"},
    model_class=_causal_lm,
)

FAMILIES = (GATED_DELTA_TEXT,)
