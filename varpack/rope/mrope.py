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

Every input the rope function reads is supplied or refused, never dropped: a function that takes an
argument varpack cannot give it (Qwen2.5-Omni's ``use_audio_in_video``, MiniCPM-V's ``target_sizes``, ...)
is refused by :func:`rope_index_fn`, and Qwen2.5-VL's ``second_per_grid_ts`` (seconds per temporal grid of
each video, from ``Qwen2_5_VLProcessor``; frame ``k`` gets temporal position ``start + int(k *
tokens_per_second * second_per_grid_ts)``) travels with the sample as a media field and is handed to the
function per sample. The media layout is checked before the call (one run of ``mm_token_type_ids`` per
image; per video one run, or one run per frame for models that separate frames by timestamp text), and a
failure of the function is re-raised naming the sample.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from varpack.schema import (
    ATTENTION_MASK,
    IMAGE_GRID_THW,
    INPUT_IDS,
    MM_TOKEN_TYPE_IDS,
    SECOND_PER_GRID_TS,
    VIDEO_GRID_THW,
)

__all__ = [
    "NUM_PLANES",
    "SUPPLIED_ARGS",
    "TEXT_PLANE",
    "add_mrope_position_ids",
    "mrope_position_ids",
    "rope_args",
    "rope_index_fn",
    "spatial_merge_size",
    "split_planes",
]

#: planes of a varpack mRoPE ``position_ids`` tensor: text, temporal, height, width
NUM_PLANES = 4
#: index of the text plane (boundaries are read from it)
TEXT_PLANE = 0

_META_CACHE: dict[str, Any] = {}
_PARAMS_CACHE: dict[Any, frozenset[str]] = {}

#: rope-function arguments varpack supplies (``attention_mask`` is left at None: a sample has no padding)
SUPPLIED_ARGS = (
    INPUT_IDS,
    MM_TOKEN_TYPE_IDS,
    IMAGE_GRID_THW,
    VIDEO_GRID_THW,
    SECOND_PER_GRID_TS,
    ATTENTION_MASK,
)
_REQUIRED_ARGS = (INPUT_IDS, MM_TOKEN_TYPE_IDS, IMAGE_GRID_THW)


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def rope_args(fn: Callable[..., Any]) -> frozenset[str]:
    """Named parameters of a rope-index function, checked against what varpack can supply.

    Args:
        fn: a model's ``get_rope_index`` (bound method).

    Returns:
        the parameter names (``**kwargs`` excluded), a subset of :data:`SUPPLIED_ARGS`.

    Raises:
        TypeError: the function takes an argument varpack does not supply (its positions would silently
            differ from the model's: Qwen2.5-Omni's ``use_audio_in_video`` / ``audio_seqlens``, GLM-Image's
            ``images_per_sample``, MiniCPM-V 4.7's ``target_sizes``, ...) or lacks ``input_ids``,
            ``mm_token_type_ids`` or ``image_grid_thw``. The message names the function and the arguments.
    """
    key = getattr(fn, "__func__", fn)
    cached = _PARAMS_CACHE.get(key)
    if cached is not None:
        return cached
    params = inspect.signature(fn).parameters.values()
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = [n for n in names if n not in SUPPLIED_ARGS]
    missing = [n for n in _REQUIRED_ARGS if n not in names]
    if unknown or missing:
        problems = []
        if unknown:
            problems.append(f"takes {unknown}, which varpack does not supply")
        if missing:
            problems.append(f"has no parameter {missing}")
        raise TypeError(
            f"{_fn_name(fn)}{inspect.signature(fn)} {' and '.join(problems)}: varpack cannot compute this "
            f"model's positions per sample exactly, so it refuses the model (supported arguments: "
            f"{list(SUPPLIED_ARGS)})"
        )
    cached = _PARAMS_CACHE[key] = frozenset(names)
    return cached


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
        video_grid_thw=None, [second_per_grid_ts=None,] attention_mask=None) -> (position_ids [3, B, L],
        deltas [B, 1])``.

    Raises:
        TypeError: the model (or the model a config builds) has no ``get_rope_index``, or its
            ``get_rope_index`` takes arguments varpack does not supply (:func:`rope_args`).
    """
    owner = _find_rope_owner(model_or_config)
    if owner is not None:
        rope_args(owner.get_rope_index)
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
        rope_args(owner.get_rope_index)
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


def _runs(types: torch.Tensor, code: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of every maximal run of ``types == code``, in order."""
    edge = torch.zeros(1, dtype=torch.bool)
    mask = torch.cat([edge, types == code, edge])
    flips = torch.nonzero(mask[1:] != mask[:-1]).flatten().tolist()
    return list(zip(flips[::2], flips[1::2]))


def _check_image_runs(types: torch.Tensor, grid: torch.Tensor | None, merge: int, sample_id: Any) -> None:
    runs = _runs(types, 1)
    expected = [] if grid is None else (grid.prod(-1) // merge**2).tolist()
    got = [b - a for a, b in runs]
    if got == expected:
        return
    if len(got) != len(expected):
        raise ValueError(
            f"sample {sample_id}: image tokens (mm_token_type_ids == 1) form {len(got)} runs {got} at tokens "
            f"{[a for a, _ in runs]} but image_grid_thw has {len(expected)} images of {expected} tokens: every "
            "image must be one run, with text (its <|vision_start|>/<|vision_end|>) between images"
        )
    i = next(k for k, (g, e) in enumerate(zip(got, expected)) if g != e)
    raise ValueError(
        f"sample {sample_id}: image {i} is a run of {got[i]} tokens at token {runs[i][0]} but image_grid_thw[{i}] "
        f"= {grid[i].tolist()} gives {expected[i]} (grid.prod() // {merge}**2)"
    )


def _video_layout(
    types: torch.Tensor, grid: torch.Tensor | None, merge: int, sample_id: Any
) -> tuple[str, list]:
    """``("video" | "frame" | "none", runs)``: whether the video tokens form one run per video (Qwen2-VL,
    Qwen2.5-VL) or one run per frame (Qwen3-VL, Qwen3.5, GLM-4V: frames separated by timestamp text)."""
    runs = _runs(types, 2)
    if grid is None:
        return "none", runs
    got = [b - a for a, b in runs]
    per_video = (grid.prod(-1) // merge**2).tolist()
    per_frame = [int(h * w) // merge**2 for t, h, w in grid.tolist() for _ in range(int(t))]
    if got == per_video:
        return "video", runs
    if got == per_frame:
        return "frame", runs
    raise ValueError(
        f"sample {sample_id}: video tokens (mm_token_type_ids == 2) form runs of {got} tokens at tokens "
        f"{[a for a, _ in runs]}, which is neither one run per video {per_video} nor one run per frame "
        f"{per_frame} (video_grid_thw = {grid.tolist()}, merge {merge})"
    )


def _rope_failure(
    exc: Exception, fn: Any, layout: str, runs: list, grid: torch.Tensor | None, sample_id: Any
) -> ValueError:
    """A ValueError naming the sample and, where the layout explains the failure, why."""
    name = _fn_name(fn)
    cause = f"({type(exc).__name__} from the model's function{f': {exc}' if str(exc) else ''})"
    frames = [] if grid is None else grid[:, 0].tolist()
    if layout == "video" and any(t > 1 for t in frames):
        i = next(k for k, t in enumerate(frames) if t > 1)
        return ValueError(
            f"sample {sample_id}: video {i} ({frames[i]} frames, video_grid_thw[{i}] = {grid[i].tolist()}) is one run "
            f"of {runs[i][1] - runs[i][0]} video tokens at token {runs[i][0]}, with no text between its frames, but "
            f"{name} takes each frame as its own run, frames separated by their timestamp text "
            "('<0.0 seconds><|vision_start|>...<|vision_end|><1.0 seconds><|vision_start|>...'; the model's "
            f"processor writes it with replace_video_token) {cause}"
        )
    if layout == "frame" and any(t > 1 for t in frames):
        return ValueError(
            f"sample {sample_id}: the video frames are separate runs of video tokens (at tokens "
            f"{[a for a, _ in runs]}), but {name} takes each video as ONE run with no text between its frames "
            f"(video_grid_thw = {grid.tolist()}) {cause}"
        )
    return ValueError(f"sample {sample_id}: {name} cannot compute this sample's positions {cause}")


def _seconds(
    value: Any, video_grid: torch.Tensor | None, params: frozenset[str], fn: Any, sample_id: Any
) -> torch.Tensor | None:
    """The sample's ``second_per_grid_ts`` as the rope function gets it, or None; refuses what it ignores."""
    seconds = None if value is None else torch.as_tensor(value)
    if seconds is not None and seconds.numel() == 0 and video_grid is None:
        seconds = None
    name = _fn_name(fn)
    if "second_per_grid_ts" not in params:
        if seconds is not None:
            raise ValueError(
                f"sample {sample_id}: second_per_grid_ts {seconds.tolist()} given but {name} takes no "
                "second_per_grid_ts (this model does not time video frames by it); it would be ignored, so it is "
                "refused: drop the field or use the model whose processor produced it"
            )
        return None
    if video_grid is None:
        if seconds is not None:
            raise ValueError(
                f"sample {sample_id}: second_per_grid_ts {seconds.tolist()} given but the sample has no video"
            )
        return None
    n = video_grid.shape[0]
    if seconds is None:
        raise ValueError(
            f"sample {sample_id}: {name} spaces video frames by second_per_grid_ts (seconds per temporal grid, "
            f"one float per video, from the model's processor, e.g. Qwen2_5_VLProcessor) but the sample has {n} "
            "video(s) and no second_per_grid_ts; without it the model assumes 1.0 s per grid, which is right "
            "for one video sampling rate only, so it is refused"
        )
    if seconds.dtype == torch.bool or seconds.is_complex() or seconds.ndim != 1 or seconds.numel() != n:
        raise ValueError(
            f"sample {sample_id}: second_per_grid_ts must be 1-D real numbers, one per video ({n}), got "
            f"{seconds.tolist()} (shape {tuple(seconds.shape)}, dtype {seconds.dtype})"
        )
    if not (torch.isfinite(seconds.double()).all() and (seconds > 0).all()):
        raise ValueError(
            f"sample {sample_id}: second_per_grid_ts must be finite and > 0 (seconds per temporal grid), got "
            f"{seconds.tolist()}"
        )
    return seconds


def mrope_position_ids(
    input_ids: Sequence[int] | torch.Tensor,
    mm_token_type_ids: Sequence[int] | torch.Tensor,
    *,
    model: Any,
    image_grid_thw: Any = None,
    video_grid_thw: Any = None,
    second_per_grid_ts: Any = None,
    sample_id: Any = None,
) -> torch.Tensor:
    """Position ids ``[4, L]`` int64 of ONE sample: text plane ``0..L-1`` then the model's 3 mRoPE planes.

    The mRoPE planes are exactly ``rope_index_fn(model)(input_ids[None], mm_token_type_ids[None],
    image_grid_thw, video_grid_thw[, second_per_grid_ts])[0][:, 0]`` — the model's own function on this
    sample alone, so a packed stream built from these per-sample tensors gives every token the position it has
    unpacked.

    Args:
        input_ids: ``[L]`` token ids of the sample (placeholders already expanded).
        mm_token_type_ids: ``[L]``: 0 text, 1 image, 2 video (transformers' ``create_mm_token_type_ids``).
        model: model or config, see :func:`rope_index_fn`.
        image_grid_thw: ``[n_images, 3]`` int (t, h, w in patches) of this sample's images, in order.
        video_grid_thw: ``[n_videos, 3]`` int of this sample's videos, in order.
        second_per_grid_ts: ``[n_videos]`` float, seconds per temporal grid of each video (Qwen2.5-VL:
            ``Qwen2_5_VLProcessor`` output, ``temporal_patch_size / sampled_fps``). Required when the model's
            function takes it and the sample has videos; refused when the function does not take it. Passed to
            the function as given (``torch.as_tensor``: a list of floats becomes float32, as the processor's
            ``BatchFeature`` makes it).
        sample_id: named in errors.

    Returns:
        ``torch.LongTensor [4, L]``; plane 0 is ``arange(L)``.

    Raises:
        ValueError: L == 0, length mismatch, placeholder count != ``grid.prod() // merge**2`` summed, media
            runs that do not match the grids (two images with no text between them, a video split other than
            per video or per frame), a video layout the model's function rejects (e.g. Qwen3-VL frames with no
            timestamp text between them), a missing / ignored / malformed ``second_per_grid_ts``, or any
            other failure of the model's function — each message names the sample and says why.
        TypeError: non-integer inputs, or a rope function that takes arguments varpack does not supply
            (:func:`rope_args`).
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
    _check_image_runs(types, image_grid, merge, sample_id)
    layout, video_runs = _video_layout(types, video_grid, merge, sample_id)
    fn = rope_index_fn(model)
    params = rope_args(fn)
    kwargs: dict[str, Any] = {"mm_token_type_ids": types[None], "image_grid_thw": image_grid}
    if video_grid is not None:
        if "video_grid_thw" not in params:
            raise ValueError(
                f"sample {sample_id}: the sample has videos but {_fn_name(fn)} takes no video_grid_thw "
                "(this model has no video positions)"
            )
        kwargs["video_grid_thw"] = video_grid.clone()
    seconds = _seconds(second_per_grid_ts, video_grid, params, fn, sample_id)
    if seconds is not None:
        kwargs["second_per_grid_ts"] = seconds
    try:
        with torch.no_grad():
            planes, _ = fn(ids[None], **kwargs)
    except Exception as exc:  # the model's own function: torch RuntimeError, StopIteration, IndexError, ...
        raise _rope_failure(exc, fn, layout, video_runs, video_grid, sample_id) from exc
    planes = planes[:, 0].to(torch.long)
    text = torch.arange(length, dtype=torch.long)[None]
    return torch.cat([text, planes], dim=0)


def add_mrope_position_ids(sample: dict, model: Any, *, sample_id: Any = None) -> dict:
    """Return ``sample`` with ``position_ids`` (list of 4 int lists, ``[4, L]``) computed by
    :func:`mrope_position_ids` from its ``input_ids``, ``mm_token_type_ids`` (all 0 if absent), grids and
    ``second_per_grid_ts``.

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
        second_per_grid_ts=sample.get("second_per_grid_ts"),
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
