"""Vision-language models under varpack: media checks, the vision tower kept out of the text boundaries (the
image processor lives in :mod:`varpack.data.media`, the tiny offline configs and the family facts -- is it VL,
where is its vision tower -- in :mod:`varpack.models.qwen_vl` / :mod:`varpack.models.registry`; all imported
here, so the old names keep working).

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

from varpack.models.registry import family_of, is_vl_model
from varpack.schema import BOUNDARY_KEYS, CP_SHARD, IMAGE_FIELDS, MM_TOKEN_TYPE_IDS, VIDEO_FIELDS

__all__ = ["check_media", "install_media_guard", "isolate_vision_tower", "prepare_vl_model"]


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
        shard = kwargs.get(CP_SHARD)
        if shard is not None and getattr(shard, "full_input_ids", None) is not None:
            # a context-parallel shard: the media belong to the whole row, whose input_ids the shard keeps
            whole = {k: v for k, v in kwargs.items() if k != MM_TOKEN_TYPE_IDS}
            check_media({**whole, "input_ids": shard.full_input_ids[None]}, module)
        else:
            check_media(kwargs, module)
        pos = kwargs.get("position_ids")
        if pos is not None and pos.ndim == 3 and pos.shape[0] != 4:
            raise ValueError(
                f"position_ids of shape {tuple(pos.shape)}: a packed vision-language batch needs [4, B, T] with the "
                "text plane first (varpack.rope.mrope); the 3 mRoPE planes alone cannot mark sample boundaries"
            )

    return model.register_forward_pre_hook(_hook, with_kwargs=True)


#: the text stream's boundary kwargs (transformers ``FlashAttentionKwargs`` + varpack's ``seq_idx``):
#: :data:`varpack.schema.BOUNDARY_KEYS`, and a context-parallel shard of it (``cp_shard``)
TEXT_VARLEN_KWARGS = BOUNDARY_KEYS + (CP_SHARD,)


def _vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    return family_of(model).vision_tower(model)  # a family fact: varpack.models.registry.ModelFamily


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
