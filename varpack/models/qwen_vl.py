"""Qwen vision-language families: Qwen2-VL / Qwen3-VL, Qwen2.5-VL, Qwen3.5 (VL) (``tiny-qwen3-vl``,
``tiny-qwen3.5-vl``, ``tiny-qwen2.5-vl``).

Packing a Qwen-VL batch is exact when (a) every image's features land in that image's placeholder slots, (b)
every token keeps the mRoPE position it has unpacked (``position_ids [4, 1, T]``, text plane first, the three
mRoPE planes from the model's own ``get_rope_index`` per sample: :mod:`varpack.rope.mrope`) and (c) attention
and linear-attention layers keep samples apart (``enable_varpack``). The vision tower (``.visual``) attends
per image and is kept away from the text stream's boundaries (:func:`varpack.integrations.vision.prepare_vl_model`,
run by :func:`varpack.models.load_model`).

The families differ in their media fields (Qwen2.5-VL's rope index also reads ``second_per_grid_ts``) and in
their token mixers (Qwen3.5 mixes Gated DeltaNet layers into its language model).
"""

from __future__ import annotations

from typing import Any

import torch

from varpack.models.dense import QWEN3_VOCAB_SIZE
from varpack.models.registry import ModelFamily
from varpack.schema import IMAGE_FIELDS, MM_TOKEN_TYPE_IDS, SECOND_PER_GRID_TS, VIDEO_FIELDS

__all__ = [
    "FAMILIES",
    "QWEN2_5_VL",
    "QWEN3_5_VL",
    "QWEN3_5_VISION_TOKENS",
    "QWEN3_VISION_TOKENS",
    "QWEN3_VOCAB_SIZE",
    "QWEN_VL",
    "TINY_VL_MODELS",
    "qwen3_5_vl_hybrid_shape_config",
    "tiny_config",
    "tiny_model",
]

#: special-token ids of the Qwen2/2.5/3 vocabulary (the embedded ``qwen3`` tokenizer)
QWEN3_VISION_TOKENS = {
    "image_token_id": 151655,  # <|image_pad|>
    "video_token_id": 151656,  # <|video_pad|>
    "vision_start_token_id": 151652,  # <|vision_start|>
    "vision_end_token_id": 151653,  # <|vision_end|>
}

TINY_VL_MODELS = ("tiny-qwen3-vl", "tiny-qwen3.5-vl", "tiny-qwen2.5-vl")

#: special-token ids of the Qwen3.5 vocabulary (the embedded ``qwen3.5`` tokenizer: the same names from 248044)
QWEN3_5_VISION_TOKENS = {
    "image_token_id": 248056,  # <|image_pad|>
    "video_token_id": 248057,  # <|video_pad|>
    "vision_start_token_id": 248053,  # <|vision_start|>
    "vision_end_token_id": 248054,  # <|vision_end|>
}

#: media fields of the Qwen-VL forward and rope index: images, videos, and the per-token media type
_MEDIA = (*IMAGE_FIELDS, *VIDEO_FIELDS, MM_TOKEN_TYPE_IDS)


def _vision_common(patch_size: int, out_hidden: int) -> dict[str, Any]:
    return {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": patch_size,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": out_hidden,
        "num_position_embeddings": 256,
    }


def tiny_config(name: str, *, vocab_size: int | None = None) -> Any:
    """Tiny random-init config of a Qwen vision-language model, built offline.

    The special-token ids are those of the embedded Qwen3 vocabulary (:data:`QWEN3_VISION_TOKENS`), so the
    tiny models read what ``varpack.data.tokenizer.load_tokenizer("qwen3")`` and
    :func:`varpack.data.multimodal.encode_mm_chat` produce.

    Args:
        name: ``"tiny-qwen3-vl"`` (``Qwen3VLConfig``: 2 full-attention layers, DeepStack at vision layer 1),
            ``"tiny-qwen3.5-vl"`` (``Qwen3_5Config``: one ``linear_attention`` (gated delta) and one
            ``full_attention`` layer) or ``"tiny-qwen2.5-vl"`` (``Qwen2_5_VLConfig``: 2 full-attention layers,
            patch 14, windowed vision attention, ``tokens_per_second = 2`` as released: video frames are timed
            by ``second_per_grid_ts``).
        vocab_size: defaults to 151936 (Qwen3); must exceed the largest special-token id (151656).

    Raises:
        ValueError: unknown name or a vocab_size too small for the special tokens.
    """
    vocab = QWEN3_VOCAB_SIZE if vocab_size is None else int(vocab_size)
    needed = max(QWEN3_VISION_TOKENS.values()) + 1
    if vocab < needed:
        raise ValueError(f"vocab_size={vocab} is too small: the vision special tokens need at least {needed}")
    if name == "tiny-qwen3-vl":
        from transformers import Qwen3VLConfig

        text = {
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            # 8 rotary frequencies split temporal/height/width, interleaved as in Qwen3-VL
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": False,
        }
        vision = _vision_common(16, 64) | {"deepstack_visual_indexes": [1]}
        return Qwen3VLConfig(text_config=text, vision_config=vision, **QWEN3_VISION_TOKENS)
    if name == "tiny-qwen3.5-vl":
        from transformers import Qwen3_5Config

        text = {
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "max_position_embeddings": 4096,
            # partial rotary 0.5 of head_dim 32 -> 8 frequencies, split as in Qwen3.5
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
            "tie_word_embeddings": False,
        }
        vision = _vision_common(16, 64)
        return Qwen3_5Config(text_config=text, vision_config=vision, **QWEN3_VISION_TOKENS)
    if name == "tiny-qwen2.5-vl":
        from transformers import Qwen2_5_VLConfig

        text = {
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            # head_dim 16 -> 8 rotary frequencies split temporal/height/width 2:3:3 as in Qwen2.5-VL
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            "tie_word_embeddings": False,
        }
        vision = {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 64,
            "tokens_per_second": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
        }
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **QWEN3_VISION_TOKENS)
    raise ValueError(f"unknown tiny vision-language model {name!r}; known: {', '.join(TINY_VL_MODELS)}")


def qwen3_5_vl_hybrid_shape_config(vocab_size: int | None = None, **overrides: Any) -> Any:
    """``qwen3.5-vl-hybrid-shape``: a benchmark shape, not a released checkpoint's config. The language model is
    ``qwen3.5-hybrid-shape`` (:func:`varpack.models.gated_delta.qwen3_5_hybrid_shape_config`: 24 layers, 18
    Gated DeltaNet and 6 gated full attention, hidden 1024, vocabulary 248,320) with Qwen3.5's interleaved mRoPE
    (64 rotary dimensions of head dim 256 split temporal / height / width as ``mrope_section = [11, 11, 10]``);
    the vision tower is ``transformers.Qwen3_5VisionConfig``'s default (27 layers of width 1152, MLP 4304, 16
    heads, patch 16, 2x2 spatial merge) projected to width 1024. Random weights, about 1.13B parameters (0.41B
    of them the tower). Special tokens of the Qwen3.5 vocabulary (:data:`QWEN3_5_VISION_TOKENS`), read by the
    embedded ``qwen3.5`` tokenizer.

    Args:
        vocab_size: embedding rows (default 248,320); must exceed the vision special tokens' ids.
        **overrides: language-model config fields (e.g. ``num_hidden_layers=4``), and ``vision_config``: a dict
            of vision config fields (e.g. ``{"depth": 1}``) merged over the default tower.

    Raises:
        ValueError: a vocab_size too small for the special tokens.
    """
    from transformers import Qwen3_5Config, Qwen3_5VisionConfig

    from varpack.models.gated_delta import qwen3_5_hybrid_shape_config

    vocab = 248320 if vocab_size is None else int(vocab_size)
    needed = max(QWEN3_5_VISION_TOKENS.values()) + 1
    if vocab < needed:
        raise ValueError(f"vocab_size={vocab} is too small: the vision special tokens need at least {needed}")
    vision_overrides = dict(overrides.pop("vision_config", None) or {})
    text = qwen3_5_hybrid_shape_config(vocab, **overrides).to_dict()
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[11, 11, 10], mrope_interleaved=True)
    text["tie_word_embeddings"] = True
    vision = Qwen3_5VisionConfig(out_hidden_size=text["hidden_size"], **vision_overrides).to_dict()
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True, **QWEN3_5_VISION_TOKENS)


def _conditional_generation(config: Any, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """The ``*ForConditionalGeneration`` model of a Qwen-VL config (random init, float32), with
    ``attn_implementation`` set on the config and its text / vision sub-configs."""
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
        Qwen3_5ForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
    )

    classes = {
        "qwen2_vl": Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": Qwen3VLForConditionalGeneration,
        "qwen3_5": Qwen3_5ForConditionalGeneration,
    }
    cls = classes.get(config.model_type)
    if cls is None:
        raise ValueError(
            f"no tiny-model class for a Qwen-VL config of model_type {config.model_type!r}; known: {sorted(classes)}"
        )
    config._attn_implementation = attn_implementation
    for sub in ("text_config", "vision_config"):
        getattr(config, sub)._attn_implementation = attn_implementation
    return cls(config)


def tiny_model(
    name: str,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    vocab_size: int | None = None,
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    """Tiny random-init ``Qwen3VLForConditionalGeneration`` / ``Qwen3_5ForConditionalGeneration`` /
    ``Qwen2_5_VLForConditionalGeneration``.

    Weights are drawn under ``torch.manual_seed(seed)`` (the global RNG state is restored afterwards), so
    the same (name, seed) gives the same model. The model is in eval mode (no dropout) — call ``.train()``
    to train.

    Args:
        name: see :func:`tiny_config`.
        dtype: parameter dtype.
        seed: init seed.
        vocab_size: see :func:`tiny_config`.
        attn_implementation: initial attention implementation (``enable_varpack`` switches it).

    Raises:
        ValueError: unknown name.
    """
    config = tiny_config(name, vocab_size=vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _conditional_generation(config, attn_implementation)
    return model.to(dtype).eval()


def _builder(name: str):
    def build(vocab_size: int | None = None, **overrides: Any) -> Any:
        if overrides:
            raise ValueError(f"built-in model {name!r} takes no config overrides (got {sorted(overrides)})")
        return tiny_config(name, vocab_size=vocab_size)

    build.__name__ = build.__qualname__ = f"tiny_config[{name}]"
    build.__doc__ = f"Config of {name!r} (:func:`varpack.models.qwen_vl.tiny_config`); no overrides."
    return build


#: Qwen2-VL and Qwen3-VL (dense and MoE): dense attention, mRoPE, images and videos
QWEN_VL = ModelFamily(
    name="qwen-vl",
    model_types=(
        "qwen2_vl",
        "qwen2_vl_text",
        "qwen3_vl",
        "qwen3_vl_text",
        "qwen3_vl_moe",
        "qwen3_vl_moe_text",
    ),
    mixers="attention",
    vision=True,
    position_ids="mrope",
    media_fields=_MEDIA,
    builtins={"tiny-qwen3-vl": _builder("tiny-qwen3-vl")},
    model_class=_conditional_generation,
)

#: Qwen2.5-VL: as :data:`QWEN_VL`, video frames timed by ``second_per_grid_ts``
QWEN2_5_VL = ModelFamily(
    name="qwen2.5-vl",
    model_types=("qwen2_5_vl", "qwen2_5_vl_text"),
    mixers="attention",
    vision=True,
    position_ids="mrope",
    media_fields=(*_MEDIA, SECOND_PER_GRID_TS),
    builtins={"tiny-qwen2.5-vl": _builder("tiny-qwen2.5-vl")},
    model_class=_conditional_generation,
)

#: Qwen3.5 (vision-language; dense and MoE): Gated DeltaNet + full attention in the language model, mRoPE
QWEN3_5_VL = ModelFamily(
    name="qwen3.5-vl",
    model_types=("qwen3_5", "qwen3_5_moe"),
    mixers="gated_delta",
    vision=True,
    position_ids="mrope",
    media_fields=_MEDIA,
    builtins={
        "tiny-qwen3.5-vl": _builder("tiny-qwen3.5-vl"),
        "qwen3.5-vl-hybrid-shape": qwen3_5_vl_hybrid_shape_config,
    },
    builtin_tokenizers={"qwen3.5-vl-hybrid-shape": "qwen3.5"},
    model_class=_conditional_generation,
)

FAMILIES = (QWEN_VL, QWEN3_5_VL, QWEN2_5_VL)
