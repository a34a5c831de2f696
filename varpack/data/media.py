"""Media facts the encoder needs from a Qwen-VL model family: which image processor, with which patch grid.

The data side (:mod:`varpack.data.multimodal`) encodes image chats with an image processor that matches the
model's vision tower; this module builds it from a model or config duck-typed (its ``vision_config`` and
``model_type``), so that data never imports the model side (:mod:`varpack.integrations.vision` imports it
from here).
"""

from __future__ import annotations

from typing import Any

__all__ = ["image_processor_for"]

# Qwen3-VL / Qwen3.5 image preprocessing (preprocessor_config.json of the released checkpoints):
# patch 16, merge 2, temporal patch 2, mean = std = 0.5, pixels between 64K and 16M.
_QWEN3_VL_IMAGE = {
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "min_pixels": 65536,
    "max_pixels": 16777216,
}


def image_processor_for(
    model_or_config: Any = None,
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> Any:
    """An image processor matching a Qwen-VL vision tower, built offline without torchvision.

    Returns transformers' ``Qwen2VLImageProcessorPil`` (the PIL/numpy backend of the Qwen2-VL..Qwen3.5
    image processor) with the model's ``patch_size``, ``spatial_merge_size`` and ``temporal_patch_size``
    and the Qwen3-VL normalisation (mean = std = 0.5); for a Qwen2-VL / Qwen2.5-VL config, the
    normalisation (CLIP mean/std) and pixel bounds are that class's own defaults (the Qwen2-VL values).
    Each image is resized so that both sides are multiples of ``patch_size * merge_size`` with
    ``min_pixels <= h * w <= max_pixels``; its ``image_grid_thw`` is ``(1, h / patch, w / patch)`` and it
    fills ``h * w / (patch * merge)**2`` LLM slots.

    Args:
        model_or_config: a VL model/config (None: the released Qwen3-VL values, patch 16, merge 2).
        min_pixels / max_pixels: resize bounds in pixels (defaults 65,536 / 16,777,216 as released for
            Qwen3-VL, 3,136 / 1,003,520 for Qwen2-VL / Qwen2.5-VL; tests use small bounds to keep sequences
            short).

    Raises:
        TypeError: the config has no ``vision_config``.
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    params = dict(_QWEN3_VL_IMAGE)
    if model_or_config is not None:
        config = getattr(model_or_config, "config", model_or_config)
        vision = getattr(config, "vision_config", None)
        if vision is None:
            raise TypeError(f"{type(config).__name__} has no vision_config: not a vision-language model")
        if getattr(config, "model_type", None) in ("qwen2_vl", "qwen2_5_vl"):
            own = Qwen2VLImageProcessorPil()
            params.update(
                image_mean=list(own.image_mean),
                image_std=list(own.image_std),
                min_pixels=int(own.size.shortest_edge),
                max_pixels=int(own.size.longest_edge),
            )
        params["patch_size"] = int(vision.patch_size)
        params["merge_size"] = int(vision.spatial_merge_size)
        params["temporal_patch_size"] = int(vision.temporal_patch_size)
    if min_pixels is not None:
        params["min_pixels"] = int(min_pixels)
    if max_pixels is not None:
        params["max_pixels"] = int(max_pixels)
    if params["min_pixels"] > params["max_pixels"]:
        raise ValueError(f"min_pixels={params['min_pixels']} > max_pixels={params['max_pixels']}")
    return Qwen2VLImageProcessorPil(**params)
