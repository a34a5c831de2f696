"""Vision-language models under varpack: tiny offline configs, media checks (the image processor lives in
:mod:`varpack.data.media`, imported here).

Packing a Qwen3-VL / Qwen3.5 batch is exact when (a) every image's features land in that image's
placeholder slots, (b) every token keeps the mRoPE position it has unpacked (``varpack.rope.mrope``) and
(c) attention and linear-attention layers keep samples apart (``enable_varpack``). For (a) the model
scatters the concatenated image features, in order, into the ``<|image_pad|>`` slots of the flat stream
(``inputs_embeds.masked_scatter`` in ``Qwen3VLModel.forward``), so the collator must concatenate
``pixel_values`` / ``image_grid_thw`` (and the video tensors) along dim 0 in pack order — the same order
the placeholders appear in. The vision tower itself is per image (its attention uses ``cu_seqlens`` from
``image_grid_thw``), so concatenating images of different samples is exact.

:func:`check_media` verifies slots == features before a forward; :func:`install_media_guard` runs it as a
forward pre-hook so a bad batch fails with both counts instead of inside ``masked_scatter``.
"""

from __future__ import annotations

from typing import Any

import torch

from varpack.data.media import image_processor_for
from varpack.schema import BOUNDARY_KEYS, IMAGE_FIELDS, VIDEO_FIELDS

__all__ = [
    "QWEN3_VISION_TOKENS",
    "TINY_VL_MODELS",
    "check_media",
    "image_processor_for",
    "install_media_guard",
    "is_vl_model",
    "isolate_vision_tower",
    "prepare_vl_model",
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
#: Qwen3 vocab size as configured in Qwen3 / Qwen3-VL checkpoints (151,669 used ids, padded)
QWEN3_VOCAB_SIZE = 151936

TINY_VL_MODELS = ("tiny-qwen3-vl", "tiny-qwen3.5-vl", "tiny-qwen2.5-vl")

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
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen3_5ForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
    )

    config = tiny_config(name, vocab_size=vocab_size)
    config._attn_implementation = attn_implementation
    for sub in ("text_config", "vision_config"):
        getattr(config, sub)._attn_implementation = attn_implementation
    cls = {
        "tiny-qwen3-vl": Qwen3VLForConditionalGeneration,
        "tiny-qwen3.5-vl": Qwen3_5ForConditionalGeneration,
        "tiny-qwen2.5-vl": Qwen2_5_VLForConditionalGeneration,
    }[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.to(dtype).eval()


def is_vl_model(model_or_config: Any) -> bool:
    """True for a model/config with a ``vision_config`` and an ``image_token_id`` (Qwen-VL family)."""
    config = getattr(model_or_config, "config", model_or_config)
    return (
        getattr(config, "vision_config", None) is not None
        and getattr(config, "image_token_id", None) is not None
    )


def _count(x: Any) -> int:
    return 0 if x is None else int(torch.as_tensor(x).sum())


def check_media(batch: dict, model_or_config: Any) -> dict[str, int]:
    """Check that a (packed) batch's placeholder slots match its media features, before the forward.

    For images: ``(input_ids == image_token_id).sum() == (image_grid_thw.prod(-1) // merge**2).sum()``
    and ``pixel_values.shape[0] == image_grid_thw.prod(-1).sum()``; the same for videos
    (``video_token_id``, ``pixel_values_videos``, ``video_grid_thw``). When ``mm_token_type_ids`` is
    present it must be 1 exactly on image slots and 2 on video slots (the model's rope index reads it).
    ``second_per_grid_ts`` (Qwen2.5-VL), when present, has one entry per row of ``video_grid_thw``.

    Args:
        batch: dict with ``input_ids [B, T]`` and optional media tensors.
        model_or_config: VL model or config (token ids, ``spatial_merge_size``).

    Returns:
        ``{"image_slots", "image_features", "video_slots", "video_features"}``.

    Raises:
        ValueError: slots != features (both counts given), pixel rows != grid patches,
            ``mm_token_type_ids`` disagreeing with the placeholder tokens, or a ``second_per_grid_ts`` count
            that is not the video count.
    """
    config = getattr(model_or_config, "config", model_or_config)
    merge = int(config.vision_config.spatial_merge_size)
    input_ids = torch.as_tensor(batch["input_ids"])
    report: dict[str, int] = {}
    for kind, token_id, pix_key, grid_key, code in (
        ("image", config.image_token_id, *IMAGE_FIELDS, 1),
        ("video", config.video_token_id, *VIDEO_FIELDS, 2),
    ):
        slots = int((input_ids == token_id).sum())
        grid = batch.get(grid_key)
        pixels = batch.get(pix_key)
        if grid is not None:
            grid = torch.as_tensor(grid).long()
            if grid.ndim != 2 or grid.shape[-1] != 3:
                raise ValueError(f"{grid_key} must be [n, 3], got {tuple(grid.shape)}")
        features = 0 if grid is None else int((grid.prod(-1) // merge**2).sum())
        if (pixels is None) != (grid is None):
            raise ValueError(
                f"{pix_key} and {grid_key} must be given together; got "
                f"{pix_key}={'None' if pixels is None else tuple(pixels.shape)}, "
                f"{grid_key}={'None' if grid is None else tuple(grid.shape)}"
            )
        if slots != features:
            raise ValueError(
                f"{kind} slots != features: input_ids hold {slots} {kind} placeholder tokens (id {token_id}) but "
                f"{grid_key} gives {features} {kind} features (grid.prod() // {merge}**2)"
            )
        if pixels is not None:
            patches = int(grid.prod(-1).sum())
            if pixels.shape[0] != patches:
                raise ValueError(
                    f"{pix_key} has {pixels.shape[0]} rows but {grid_key} describes {patches} patches; media "
                    "tensors must be concatenated along dim 0 in pack order"
                )
        mm = batch.get("mm_token_type_ids")
        if mm is not None:
            typed = int((torch.as_tensor(mm) == code).sum())
            both = int(((torch.as_tensor(mm) == code) & (input_ids == token_id)).sum())
            if typed != slots or both != slots:
                raise ValueError(
                    f"mm_token_type_ids marks {typed} tokens as {kind} ({code}) but input_ids hold {slots} {kind} "
                    f"placeholders ({both} agree)"
                )
        report[f"{kind}_slots"] = slots
        report[f"{kind}_features"] = features
    seconds = batch.get("second_per_grid_ts")
    if seconds is not None:
        videos = batch.get("video_grid_thw")
        n_videos = 0 if videos is None else int(torch.as_tensor(videos).reshape(-1, 3).shape[0])
        n_seconds = int(torch.as_tensor(seconds).numel())
        if n_seconds != n_videos:
            raise ValueError(
                f"second_per_grid_ts has {n_seconds} entries but video_grid_thw has {n_videos} videos; "
                "concatenate both in pack order, one entry per video"
            )
    return report


def install_media_guard(model: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
    """Register a forward pre-hook on ``model`` that runs :func:`check_media` on every call with
    ``input_ids`` in its keyword arguments, and checks that 3-D ``position_ids`` carry the text plane
    (``[4, B, T]``): a packed VL batch with only the 3 mRoPE planes gives the model no per-sample text
    positions, so masks/boundaries could not be derived from it.

    Returns:
        the hook handle (``.remove()`` to uninstall).

    Raises (at forward time):
        ValueError: as :func:`check_media`, or 3-plane ``position_ids`` on a packed (B == 1) batch whose
            ``image_grid_thw``/``video_grid_thw`` is given.
    """
    if not is_vl_model(model):
        raise TypeError(f"{type(model).__name__} is not a Qwen-VL model (no vision_config / image_token_id)")

    def _hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("input_ids") is None:
            return
        check_media(kwargs, module)
        pos = kwargs.get("position_ids")
        if pos is not None and pos.ndim == 3 and pos.shape[0] != 4:
            raise ValueError(
                f"position_ids of shape {tuple(pos.shape)}: a packed vision-language batch needs [4, B, T] with the "
                "text plane first (varpack.rope.mrope); the 3 mRoPE planes alone cannot mark sample boundaries"
            )

    return model.register_forward_pre_hook(_hook, with_kwargs=True)


#: the text stream's boundary kwargs (transformers ``FlashAttentionKwargs`` + varpack's ``seq_idx``):
#: :data:`varpack.schema.BOUNDARY_KEYS`
TEXT_VARLEN_KWARGS = BOUNDARY_KEYS


def _vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    for owner in (model, getattr(model, "model", None)):
        visual = getattr(owner, "visual", None) if owner is not None else None
        if isinstance(visual, torch.nn.Module):
            return visual
    raise TypeError(f"{type(model).__name__} has no vision tower (.visual or .model.visual)")


def isolate_vision_tower(model: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
    """Keep the packed text stream's boundary kwargs out of the vision tower.

    ``Qwen3VLModel.forward`` / ``Qwen3_5Model.forward`` pass their ``**kwargs`` on to
    ``get_image_features`` and so to every vision attention layer. transformers 5.24 drops the text varlen
    kwargs there (``accepts_precomputed_kwargs``); 5.17 does not, so a vision layer would receive the text
    stream's ``cu_seq_lens_q`` (a different token count) next to its own per-image ``cu_seqlens``. This
    forward pre-hook on the vision tower removes :data:`TEXT_VARLEN_KWARGS` from its call, on every version;
    the tower then attends within each image (its own ``cu_seqlens`` from ``image_grid_thw``).

    Returns:
        the hook handle.

    Raises:
        TypeError: no vision tower found.
    """
    visual = _vision_tower(model)

    def _hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not any(k in kwargs for k in TEXT_VARLEN_KWARGS):
            return None
        return args, {k: v for k, v in kwargs.items() if k not in TEXT_VARLEN_KWARGS}

    return visual.register_forward_pre_hook(_hook, with_kwargs=True)


def prepare_vl_model(model: torch.nn.Module, *, media_guard: bool = True) -> torch.nn.Module:
    """Make a Qwen-VL model ready for packed batches (call after or before ``enable_varpack``).

    Installs :func:`isolate_vision_tower` and (``media_guard``) :func:`install_media_guard`. Idempotent: the
    previous hooks of this function are removed first. Handles are kept in ``model._varpack_vl_handles``.

    Returns:
        the same model.

    Raises:
        TypeError: not a Qwen-VL model.
    """
    if not is_vl_model(model):
        raise TypeError(f"{type(model).__name__} is not a Qwen-VL model (no vision_config / image_token_id)")
    for handle in getattr(model, "_varpack_vl_handles", ()):
        handle.remove()
    handles = [isolate_vision_tower(model)]
    if media_guard:
        handles.append(install_media_guard(model))
    model._varpack_vl_handles = handles
    return model
