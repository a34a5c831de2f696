"""Per-sample mRoPE position ids with a text plane, for packing Qwen3-VL / Qwen3.5 vision-language models.

Qwen-VL models rotate queries and keys with three position planes (temporal, height, width: "mRoPE",
Qwen2-VL paper, arXiv:2409.12191, section 2.1). Inside an image the height/width planes repeat and jump,
so they cannot mark where one packed sample ends and the next begins. transformers 5.x models of this
family (``Qwen3VLTextModel.forward``, ``Qwen3_5TextModel.forward``) therefore accept ``position_ids`` of
shape ``[4, B, L]``: plane 0 is a plain text position ``0..L-1`` (used for masks and handed to every
decoder layer as ``position_ids``), planes 1..3 are the mRoPE planes that feed the rotary embedding.

varpack computes the mRoPE planes per sample with the model's own rope-index function
(``Qwen3VLModel.get_rope_index`` / ``Qwen3_5Model.get_rope_index``) on that sample alone, prepends the
text plane, and stores the ``[4, L]`` result on the encoded sample as ``position_ids``. The collator
concatenates samples along the last dim into ``[4, 1, T]``; boundaries (``cu_seq_lens_q/k``) come from the
text plane, which restarts at 0 for every sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "NUM_PLANES",
    "TEXT_PLANE",
    "add_mrope_position_ids",
    "mrope_position_ids",
    "rope_index_fn",
    "spatial_merge_size",
    "split_planes",
]

#: planes of a varpack mRoPE ``position_ids`` tensor: text, temporal, height, width
NUM_PLANES = 4
#: index of the text plane (boundaries are read from it)
TEXT_PLANE = 0

_META_CACHE: dict[str, Any] = {}


def _find_rope_owner(model: Any) -> Any | None:
    for candidate in (model, getattr(model, "model", None)):
        if candidate is not None and callable(getattr(candidate, "get_rope_index", None)):
            return candidate
    return None


def rope_index_fn(model_or_config: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The model's own rope-index function (``get_rope_index``) for a model or a config.

    Args:
        model_or_config: a loaded model (``Qwen3VLForConditionalGeneration``, ``Qwen3VLModel``,
            ``Qwen3_5ForConditionalGeneration``, ...) or its ``PreTrainedConfig``. For a config, the base
            model is built once on the ``meta`` device (no weights are allocated) and its bound
            ``get_rope_index`` is returned; the function only does index arithmetic on its inputs' device.

    Returns:
        ``get_rope_index(input_ids [B, L], mm_token_type_ids [B, L], image_grid_thw=None,
        video_grid_thw=None, attention_mask=None) -> (position_ids [3, B, L], deltas [B, 1])``.

    Raises:
        TypeError: the model (or the model a config builds) has no ``get_rope_index``.
    """
    owner = _find_rope_owner(model_or_config)
    if owner is not None:
        return owner.get_rope_index
    from transformers import AutoModel, PreTrainedConfig

    if not isinstance(model_or_config, PreTrainedConfig):
        raise TypeError(
            f"model_or_config must be a model with get_rope_index (or .model.get_rope_index) or a "
            f"transformers config; got {type(model_or_config).__name__}"
        )
    key = f"{type(model_or_config).__name__}:{model_or_config.to_json_string(use_diff=False)}"
    owner = _META_CACHE.get(key)
    if owner is None:
        with torch.device("meta"):
            base = AutoModel.from_config(model_or_config)
        owner = _find_rope_owner(base)
        if owner is None:
            raise TypeError(
                f"{type(base).__name__} (built from {type(model_or_config).__name__}) has no get_rope_index: "
                "not an mRoPE vision-language model"
            )
        _META_CACHE[key] = owner
    return owner.get_rope_index


def spatial_merge_size(model_or_config: Any) -> int:
    """``vision_config.spatial_merge_size`` of a VL model or config (2 for Qwen2-VL..Qwen3.5).

    Raises:
        TypeError: no ``vision_config.spatial_merge_size`` found.
    """
    config = getattr(model_or_config, "config", model_or_config)
    vision = getattr(config, "vision_config", None)
    merge = getattr(vision, "spatial_merge_size", None)
    if merge is None:
        raise TypeError(
            f"{type(config).__name__} has no vision_config.spatial_merge_size: not a Qwen-VL config"
        )
    return int(merge)


def _as_long(x: Any, name: str, sample_id: Any) -> torch.Tensor | None:
    if x is None:
        return None
    t = torch.as_tensor(x)
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise TypeError(f"sample {sample_id}: {name} must hold integers, got dtype {t.dtype}")
    return t.long()


def mrope_position_ids(
    input_ids: Sequence[int] | torch.Tensor,
    mm_token_type_ids: Sequence[int] | torch.Tensor,
    *,
    model: Any,
    image_grid_thw: Any = None,
    video_grid_thw: Any = None,
    sample_id: Any = None,
) -> torch.Tensor:
    """Position ids ``[4, L]`` int64 of ONE sample: text plane ``0..L-1`` then the model's 3 mRoPE planes.

    The mRoPE planes are exactly ``rope_index_fn(model)(input_ids[None], mm_token_type_ids[None],
    image_grid_thw, video_grid_thw)[0][:, 0]`` — the model's own function on this sample alone, so a
    packed stream built from these per-sample tensors gives every token the position it has unpacked.

    Args:
        input_ids: ``[L]`` token ids of the sample (placeholders already expanded).
        mm_token_type_ids: ``[L]``: 0 text, 1 image, 2 video (transformers' ``create_mm_token_type_ids``).
        model: model or config, see :func:`rope_index_fn`.
        image_grid_thw: ``[n_images, 3]`` int (t, h, w in patches) of this sample's images, in order.
        video_grid_thw: ``[n_videos, 3]`` int of this sample's videos, in order.
        sample_id: named in errors.

    Returns:
        ``torch.LongTensor [4, L]``; plane 0 is ``arange(L)``.

    Raises:
        ValueError: L == 0, length mismatch, or placeholder count != ``grid.prod() // merge**2`` summed.
        TypeError: non-integer inputs.
    """
    ids = _as_long(input_ids, "input_ids", sample_id)
    types = _as_long(mm_token_type_ids, "mm_token_type_ids", sample_id)
    if ids.ndim != 1 or types.ndim != 1 or ids.numel() != types.numel():
        raise ValueError(
            f"sample {sample_id}: input_ids {tuple(ids.shape)} and mm_token_type_ids {tuple(types.shape)} must be "
            "1-D of the same length"
        )
    length = ids.numel()
    if length == 0:
        raise ValueError(f"sample {sample_id}: empty input_ids")
    image_grid = _as_long(image_grid_thw, "image_grid_thw", sample_id)
    video_grid = _as_long(video_grid_thw, "video_grid_thw", sample_id)
    merge = spatial_merge_size(model)
    for code, name, grid in ((1, "image", image_grid), (2, "video", video_grid)):
        slots = int((types == code).sum())
        if grid is not None and grid.numel() == 0:
            grid = None
        if grid is not None and (grid.ndim != 2 or grid.shape[1] != 3):
            raise ValueError(f"sample {sample_id}: {name}_grid_thw must be [n, 3], got {tuple(grid.shape)}")
        features = 0 if grid is None else int((grid.prod(-1) // merge**2).sum())
        if slots != features:
            raise ValueError(
                f"sample {sample_id}: {slots} {name} placeholder tokens (mm_token_type_ids == {code}) but "
                f"{name}_grid_thw gives {features} features (grid.prod() // {merge}**2)"
            )
    if image_grid is not None and image_grid.numel() == 0:
        image_grid = None
    if video_grid is not None and video_grid.numel() == 0:
        video_grid = None
    fn = rope_index_fn(model)
    with torch.no_grad():
        planes, _ = fn(
            ids[None],
            mm_token_type_ids=types[None],
            image_grid_thw=image_grid,
            video_grid_thw=None if video_grid is None else video_grid.clone(),
        )
    planes = planes[:, 0].to(torch.long)
    text = torch.arange(length, dtype=torch.long)[None]
    return torch.cat([text, planes], dim=0)


def add_mrope_position_ids(sample: dict, model: Any, *, sample_id: Any = None) -> dict:
    """Return ``sample`` with ``position_ids`` (list of 4 int lists, ``[4, L]``) computed by
    :func:`mrope_position_ids` from its ``input_ids``, ``mm_token_type_ids`` (all 0 if absent) and grids.

    Raises:
        ValueError / TypeError: as :func:`mrope_position_ids`.
    """
    ids = sample["input_ids"]
    types = sample.get("mm_token_type_ids")
    if types is None:
        types = [0] * len(ids)
    pos = mrope_position_ids(
        ids,
        types,
        model=model,
        image_grid_thw=sample.get("image_grid_thw"),
        video_grid_thw=sample.get("video_grid_thw"),
        sample_id=sample_id,
    )
    out = dict(sample)
    out["position_ids"] = pos.tolist()
    return out


def split_planes(position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a varpack mRoPE tensor ``[4, B, T]`` (or ``[4, T]``) into ``(text [B, T], mrope [3, B, T])``.

    Raises:
        ValueError: the first dim is not 4.
    """
    if position_ids.shape[0] != NUM_PLANES:
        raise ValueError(
            f"mRoPE position_ids need {NUM_PLANES} planes (text plane first), got shape {tuple(position_ids.shape)}"
        )
    return position_ids[TEXT_PLANE], position_ids[1:]
