"""Encode vision-language chats: images by path, expanded placeholders, per-sample mRoPE.

A multimodal chat is a list of messages whose ``content`` is a string or a list of parts in the Hugging
Face / Qwen chat style::

    [{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                  {"type": "text", "text": "What is this?"}]},
     {"role": "assistant", "content": "A cat."}]

Each image part is rendered as Qwen-VL does (``<|vision_start|><|image_pad|><|vision_end|>``), the chat is
tokenized and supervised by :func:`varpack.data.chat.encode_chat` (assistant-only labels, the same template
as text chats), then the single ``<|image_pad|>`` of image ``i`` is expanded to
``image_grid_thw[i].prod() // merge_size**2`` copies — the slots the model's ``masked_scatter`` fills with
that image's merged features (transformers ``Qwen3VLProcessor.replace_image_token``). Labels are -100
over the whole span ``<|vision_start|> ... <|vision_end|>``; ``mm_token_type_ids`` is 1 on image slots,
2 on video slots, 0 elsewhere (what ``Qwen3VLModel.get_rope_index`` / ``Qwen3_5Model.get_rope_index``
read). Videos are expanded by the processor's own video step; Qwen2.5-VL's ``second_per_grid_ts`` (seconds
per temporal grid) is kept on the sample as a media field, for its rope function. ``length`` is the final LLM
token length, which is what the planner packs.

Cuts (overflow ``truncate`` / ``split``) must never fall inside a span: :func:`image_spans`,
:func:`legal_cut`, :func:`validate_cut`, :func:`nearest_legal_cut`, :func:`slice_mm_sample` and
:func:`check_plan_cuts` make that checkable and enforceable.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from varpack.data.jsonfile import read_rows, require_file
from varpack.schema import FLAT_TOKEN_FIELDS, IGNORE_INDEX, IMAGE_FIELDS, VIDEO_FIELDS

__all__ = [
    "VISION_TOKENS",
    "check_plan_cuts",
    "encode_any",
    "encode_mm_chat",
    "encode_mm_dataset",
    "has_mm_chats",
    "image_spans",
    "is_mm_chat",
    "legal_cut",
    "load_mm_rows",
    "nearest_legal_cut",
    "slice_mm_sample",
    "validate_cut",
]

#: special tokens of the Qwen-VL chat format (same strings in the Qwen3 and Qwen3.5 vocabularies)
VISION_TOKENS = {
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
    "image_pad": "<|image_pad|>",
    "video_pad": "<|video_pad|>",
}

_MEDIA_TYPES = ("image", "video")
_PART_TYPES = ("text", "image", "video")
_IMAGE_KEYS = ("image", "path", "url")
_VIDEO_KEYS = ("video", "path", "url")


# --------------------------------------------------------------------------------------------- parsing
def _part_type(part: Any, where: str) -> str:
    if isinstance(part, str):
        return "text"
    if not isinstance(part, dict):
        raise TypeError(f"{where}: a content part must be a dict or str, got {type(part).__name__}")
    kind = part.get("type")
    if kind is None:  # tolerate {"image": ...} / {"text": ...} without "type"
        present = [k for k in _PART_TYPES if k in part]
        if len(present) == 1:
            return present[0]
    if kind not in _PART_TYPES:
        raise ValueError(
            f"{where}: unknown content part type {kind!r} (keys {sorted(part)}); expected one of {list(_PART_TYPES)}"
        )
    return kind


def _media_ref(part: dict, kind: str, where: str) -> Any:
    keys = _IMAGE_KEYS if kind == "image" else _VIDEO_KEYS
    for key in keys:
        if part.get(key) is not None:
            return part[key]
    raise ValueError(f"{where}: {kind} part has none of the keys {list(keys)} (got keys {sorted(part)})")


def is_mm_chat(row_or_messages: Any) -> bool:
    """True if any message's content is a list holding an image or video part.

    Accepts a row ``{"messages": [...]}`` or the message list itself. Text-only chats (string contents, or
    lists of text parts only) return False. This is the test a CLI uses to route rows to
    :func:`encode_mm_chat` instead of :func:`varpack.data.chat.encode_chat`.
    """
    messages = row_or_messages.get("messages") if isinstance(row_or_messages, dict) else row_or_messages
    if not isinstance(messages, (list, tuple)):
        return False
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, (list, tuple)):
            for part in content:
                if isinstance(part, dict) and (
                    part.get("type") in _MEDIA_TYPES
                    or (part.get("type") is None and ("image" in part or "video" in part))
                ):
                    return True
    return False


def has_mm_chats(data: Any) -> bool:
    """True if ``data`` (JSON / JSONL path(s), or rows) holds at least one image/video chat.

    Paths with other suffixes (parquet, dataset folders, ...) return False without being read, so a CLI can
    call this first and keep its text loader for everything else.

    Raises:
        ValueError: a ``.json`` / ``.jsonl`` file that does not parse (file and line named).
    """
    if isinstance(data, (str, os.PathLike)):
        data = [data]
    if isinstance(data, (list, tuple)) and data and all(isinstance(d, (str, os.PathLike)) for d in data):
        paths = [p for p in data if Path(p).suffix in (".json", ".jsonl") and Path(p).is_file()]
        return bool(paths) and any(is_mm_chat(row) for row, _ in load_mm_rows(paths))
    return any(is_mm_chat(row) for row in data)


def _flatten_messages(messages: Any, sample_id: Any) -> tuple[list[dict], list[tuple[str, Any, str]]]:
    """Messages with list contents -> string contents with one pad per media item; media refs in order."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(
            f"sample {sample_id}: messages must be a non-empty list, got {type(messages).__name__}"
        )
    literal = tuple(VISION_TOKENS.values())
    out: list[dict] = []
    media: list[tuple[str, Any, str]] = []
    for m_idx, msg in enumerate(messages):
        where_msg = f"sample {sample_id}: messages[{m_idx}]"
        if not isinstance(msg, dict):
            raise TypeError(f"{where_msg}: a message must be a dict, got {type(msg).__name__}")
        content = msg.get("content")
        new = dict(msg)
        if isinstance(content, (list, tuple)):
            pieces: list[str] = []
            for p_idx, part in enumerate(content):
                where = f"{where_msg}.content[{p_idx}]"
                kind = _part_type(part, where)
                if kind == "text":
                    text = part if isinstance(part, str) else part.get("text")
                    if not isinstance(text, str):
                        raise TypeError(f"{where}: text part needs a str 'text', got {type(text).__name__}")
                    pieces.append(text)
                else:
                    media.append((kind, _media_ref(part, kind, where), where))
                    pad = VISION_TOKENS["image_pad" if kind == "image" else "video_pad"]
                    pieces.append(VISION_TOKENS["vision_start"] + pad + VISION_TOKENS["vision_end"])
            new["content"] = "".join(pieces)
            for p_idx, part in enumerate(content):
                text = (
                    part if isinstance(part, str) else (part.get("text") if isinstance(part, dict) else None)
                )
                if isinstance(text, str) and any(tok in text for tok in literal):
                    bad = [tok for tok in literal if tok in text]
                    raise ValueError(
                        f"{where_msg}.content[{p_idx}]: text contains the reserved vision token(s) {bad}; "
                        "placeholders are inserted from image/video parts only"
                    )
        elif isinstance(content, str):
            bad = [tok for tok in literal if tok in content]
            if bad:
                raise ValueError(
                    f"{where_msg}.content: text contains the reserved vision token(s) {bad}; "
                    "placeholders are inserted from image/video parts only"
                )
        out.append(new)
    return out, media


def _token_id(tokenizer: Any, token: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == getattr(tokenizer, "unk_token_id", None) or isinstance(tid, list):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} has no single token for {token!r} (got {tid!r})"
        )
    return int(tid)


def _open_image(ref: Any, image_root: str | os.PathLike | None, where: str) -> Any:
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref
    if not isinstance(ref, (str, os.PathLike)):
        raise TypeError(f"{where}: image must be a path or a PIL.Image, got {type(ref).__name__}")
    ref = str(ref)
    if ref.startswith("file://"):
        ref = ref[len("file://") :]
    if "://" in ref:
        raise ValueError(f"{where}: image {ref!r} is a URL; only local paths are supported")
    path = Path(ref)
    if not path.is_absolute() and image_root is not None:
        path = Path(image_root) / path
    if not path.is_file():
        raise ValueError(f"{where}: image file not found: {str(path)!r}")
    try:
        image = Image.open(path)
    except Exception as exc:  # PIL raises UnidentifiedImageError / OSError
        raise ValueError(f"{where}: cannot read image {str(path)!r}: {exc}") from exc
    return image


def _merge_size(image_processor: Any, where: str) -> int:
    merge = getattr(image_processor, "merge_size", None)
    if merge is None:
        raise TypeError(
            f"{where}: image processor {type(image_processor).__name__} has no merge_size; use a Qwen-VL image "
            "processor (varpack.data.media.image_processor_for)"
        )
    return int(merge)


# --------------------------------------------------------------------------------------------- encode
def encode_mm_chat(
    messages: Any,
    tokenizer: Any,
    image_processor: Any = None,
    *,
    sample_id: Any,
    image_root: str | os.PathLike | None = None,
    video_processor: Any = None,
    rope_model: Any = None,
    with_pixels: bool = True,
) -> dict:
    """Encode one multimodal chat into a packable sample with expanded image placeholders.

    Args:
        messages: list of ``{"role", "content"}``; content is a str or a list of parts
            ``{"type": "text", "text": str}`` / ``{"type": "image", "image": PATH | PIL.Image}`` /
            ``{"type": "video", "video": PATH}`` (``"path"`` / ``"url"`` accepted for the media key; local
            files only). Other message keys are passed to the text encoder unchanged.
        tokenizer: the text tokenizer (e.g. ``varpack.data.tokenizer.load_tokenizer("qwen3")``); must hold the
            Qwen-VL special tokens ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``.
        image_processor: a Qwen-VL image processor (``image_processor_for(model)``); run once per sample on
            all its images (each keeps its own resolution and ``image_grid_thw``). May be None for text-only
            chats.
        sample_id: the sample's index (named in every error).
        image_root: directory that relative media paths are resolved against.
        video_processor: a full Qwen-VL processor (e.g. ``Qwen3VLProcessor``, ``Qwen2_5_VLProcessor``: has
            ``.video_processor`` and ``replace_video_token``); its own video step runs (frame timestamps for
            Qwen3-VL, ``second_per_grid_ts`` for Qwen2.5-VL); video parts without one raise ``ValueError``
            naming the sample.
        rope_model: a VL model or config; when given, ``position_ids`` ``[4, L]`` (text plane + the model's own
            mRoPE planes, :func:`varpack.rope.mrope.mrope_position_ids`) is added.
        with_pixels: False computes only lengths (image headers are read, pixels are not decoded); no media
            tensors or positions are returned. For planning large image sets.

    Returns:
        dict with ``input_ids`` list[int] (L), ``labels`` list[int] (L, -100 except assistant text; -100 on
        every vision span), ``mm_token_type_ids`` list[int] (L), ``length`` int (L), any other token-aligned
        field of the text encoder expanded alike, and when the chat has media: ``pixel_values``
        ``torch.float32 [patches, C * temporal_patch * patch**2]`` and ``image_grid_thw``
        ``torch.int64 [n_images, 3]`` (videos: ``pixel_values_videos``, ``video_grid_thw`` and, when the
        processor makes it (Qwen2.5-VL), ``second_per_grid_ts`` float ``[n_videos]``, seconds per temporal
        grid); plus ``position_ids`` when ``rope_model`` is given.

    Raises:
        ValueError: bad structure, unknown part type, missing/unreadable image file, reserved vision tokens in
            text, a video without a video processor, media without an image processor, or a template that
            does not keep the placeholders — each message names the sample, message and part.
        TypeError: wrong value types (non-dict message, non-str text, processor without ``merge_size``).
    """
    from varpack.data.chat import encode_chat

    flat, media = _flatten_messages(messages, sample_id)
    images = [(ref, where) for kind, ref, where in media if kind == "image"]
    videos = [(ref, where) for kind, ref, where in media if kind == "video"]
    if videos and video_processor is None:
        raise ValueError(
            f"{videos[0][1]}: video part but no video processor was given (sample {sample_id}); pass "
            "video_processor=<a Qwen-VL processor with a video processor> (Qwen3-VL's needs torchvision)"
        )
    if images and image_processor is None:
        raise ValueError(f"{images[0][1]}: image part but no image processor was given (sample {sample_id})")

    enc = encode_chat(flat, tokenizer, sample_id=sample_id)
    ids = list(enc["input_ids"])
    ids_len = len(ids)
    vs, ve = (
        _token_id(tokenizer, VISION_TOKENS["vision_start"]),
        _token_id(tokenizer, VISION_TOKENS["vision_end"]),
    )
    ipad, vpad = (
        _token_id(tokenizer, VISION_TOKENS["image_pad"]),
        _token_id(tokenizer, VISION_TOKENS["video_pad"]),
    )

    # placeholders as they appear after templating: one pad per media part, wrapped in start/end
    pad_positions = [i for i, t in enumerate(ids) if t in (ipad, vpad)]
    pad_kinds = ["image" if ids[i] == ipad else "video" for i in pad_positions]
    if pad_kinds != [kind for kind, _, _ in media]:
        raise ValueError(
            f"sample {sample_id}: the chat template kept {pad_kinds.count('image')} image / {pad_kinds.count('video')} "
            f"video placeholders in order {pad_kinds} but the messages hold {[k for k, _, _ in media]}; the "
            "tokenizer's chat template must render string contents verbatim"
        )
    for pos, (_, _, where) in zip(pad_positions, media):
        if pos == 0 or pos + 1 >= ids_len or ids[pos - 1] != vs or ids[pos + 1] != ve:
            raise ValueError(
                f"{where}: placeholder at token {pos} is not wrapped in <|vision_start|>/<|vision_end|>"
            )

    out: dict[str, Any] = {}
    replacements: list[list[int]] = []
    if images:
        where0 = images[0][1]
        merge = _merge_size(image_processor, where0)
        opened = [_open_image(ref, image_root, where) for ref, where in images]
        if with_pixels:
            try:
                rgb = [im.convert("RGB") for im in opened]
            except Exception as exc:
                raise ValueError(f"sample {sample_id}: cannot decode an image: {exc}") from exc
            processed = image_processor(images=rgb, return_tensors="pt")
            grid = torch.as_tensor(processed["image_grid_thw"], dtype=torch.long).reshape(-1, 3)
            pixels = torch.as_tensor(processed["pixel_values"], dtype=torch.float32)
            if grid.shape[0] != len(images):
                raise ValueError(
                    f"sample {sample_id}: image processor returned {grid.shape[0]} grids for {len(images)} images"
                )
            counts = (grid.prod(-1) // merge**2).tolist()
            out["pixel_values"] = pixels
            out["image_grid_thw"] = grid
        else:
            counts = []
            for im in opened:
                width, height = im.size
                patches = image_processor.get_number_of_image_patches(height, width, {})
                counts.append(int(patches) // merge**2)
        image_iter = iter(counts)
    if videos:
        vid_proc = getattr(video_processor, "video_processor", None)
        if vid_proc is None or not callable(getattr(video_processor, "replace_video_token", None)):
            raise TypeError(
                f"{videos[0][1]}: video_processor must be a full Qwen-VL processor (with .video_processor and "
                f".replace_video_token), got {type(video_processor).__name__}"
            )
        refs = []
        for ref, where in videos:
            if isinstance(ref, (str, os.PathLike)):
                path = Path(str(ref))
                if not path.is_absolute() and image_root is not None:
                    path = Path(image_root) / path
                if not path.is_file():
                    raise ValueError(f"{where}: video file not found: {str(path)!r}")
                ref = str(path)
            refs.append(ref)
        vout, video_strings = _process_videos(video_processor, vid_proc, refs, sample_id)
        video_iter = iter(tokenizer(video_strings, add_special_tokens=False)["input_ids"])
        if with_pixels:
            out["pixel_values_videos"] = torch.as_tensor(vout["pixel_values_videos"], dtype=torch.float32)
            out["video_grid_thw"] = torch.as_tensor(vout["video_grid_thw"], dtype=torch.long).reshape(-1, 3)
            if vout.get("second_per_grid_ts") is not None:
                out["second_per_grid_ts"] = vout["second_per_grid_ts"]
    for kind in pad_kinds:
        replacements.append([ipad] * next(image_iter) if kind == "image" else list(next(video_iter)))

    # expand: every token-aligned field is rebuilt around the replaced pads
    aligned = {k: list(v) for k, v in enc.items() if k != "length" and _is_aligned(v, ids_len)}
    new: dict[str, list] = {k: [] for k in aligned}
    mm_types: list[int] = []
    spans: list[tuple[int, int]] = []
    prev = 0
    for pos, rep in zip(pad_positions, replacements):
        for k, vals in aligned.items():
            new[k].extend(vals[prev:pos])
        mm_types.extend([0] * (pos - prev))
        start_new = len(mm_types)
        for k, vals in aligned.items():
            if k == "input_ids":
                new[k].extend(rep)
            else:
                new[k].extend([vals[pos]] * len(rep))
        mm_types.extend(1 if t == ipad else 2 if t == vpad else 0 for t in rep)
        spans.append((start_new - 1, start_new + len(rep) + 1))  # include vision_start / vision_end
        prev = pos + 1
    for k, vals in aligned.items():
        new[k].extend(vals[prev:])
    mm_types.extend([0] * (ids_len - prev))
    labels = new.get("labels")
    if labels is None:
        raise ValueError(f"sample {sample_id}: the text encoder returned no labels")
    for s, e in spans:
        labels[s:e] = [IGNORE_INDEX] * (e - s)
        if "loss_scale" in new:
            new["loss_scale"][s:e] = [0.0] * (e - s)
    # keep any non-aligned scalar extras of the text encoder, then ours
    for k, v in enc.items():
        if k not in aligned and k != "length":
            out.setdefault(k, v)
    out.update(new)
    out["mm_token_type_ids"] = mm_types
    out["length"] = len(new["input_ids"])
    if rope_model is not None and with_pixels:
        from varpack.rope.mrope import add_mrope_position_ids

        out = add_mrope_position_ids(out, rope_model, sample_id=sample_id)
    return out


def _process_videos(processor: Any, vid_proc: Any, refs: list, sample_id: Any) -> tuple[Any, list[str]]:
    """Run the processor's own video step: (tensors, one placeholder string per video).

    ``ProcessorMixin._process_videos`` (transformers 5.24 has it) is what ``processor(text=..., videos=...)``
    runs: the video processor, ``replace_video_token`` per video and model extras — Qwen2.5-VL adds
    ``second_per_grid_ts`` (``temporal_patch_size / sampled_fps`` per video) there. Without it, the video
    processor and ``replace_video_token`` are called directly, and a processor that lists
    ``second_per_grid_ts`` among its outputs but did not produce it is refused (the model would time the
    frames at its 1.0 s default). ``second_per_grid_ts`` is returned as ``BatchFeature`` makes it for the
    model (a float32 tensor ``[n_videos]`` for a list of floats).
    """
    from transformers import BatchFeature

    try:
        if callable(getattr(processor, "_process_videos", None)):
            vout, strings = processor._process_videos(refs, return_metadata=True, return_tensors="pt")
        else:
            vout = vid_proc(videos=refs, return_metadata=True, return_tensors="pt")
            strings = [processor.replace_video_token(vout, i) for i in range(len(refs))]
    except Exception as exc:  # decoding / processing errors of the library, named by sample
        raise ValueError(
            f"sample {sample_id}: the video processor failed on {refs}: {type(exc).__name__}: {exc}"
        ) from exc
    if len(strings) != len(refs):
        raise ValueError(
            f"sample {sample_id}: the video processor returned {len(strings)} placeholders for {len(refs)} videos"
        )
    seconds = vout.get("second_per_grid_ts")
    if seconds is None and "second_per_grid_ts" in getattr(processor, "model_input_names", ()):
        raise ValueError(
            f"sample {sample_id}: {type(processor).__name__} lists second_per_grid_ts among its outputs but "
            "produced none for these videos (this transformers version has no ProcessorMixin._process_videos); "
            "the model would time the frames at 1.0 s per grid, so the sample is refused"
        )
    if seconds is not None:
        seconds = BatchFeature({"s": seconds}, tensor_type="pt")["s"].reshape(-1)
        vout = dict(vout, second_per_grid_ts=seconds)
    return vout, list(strings)


def _is_aligned(value: Any, length: int) -> bool:
    return isinstance(value, (list, tuple, np.ndarray, torch.Tensor)) and len(value) == length


def load_mm_rows(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[tuple[dict, str]]:
    """Read JSON Lines (or a JSON list) of chat rows, keeping each row's directory (for relative image paths).

    Plain ``json`` is used on purpose (:func:`varpack.data.jsonfile.read_rows`): rows mixing string and list
    contents do not fit one Arrow schema.

    Returns:
        ``[(row, directory_of_its_file), ...]`` in file order.

    Raises:
        FileNotFoundError / IsADirectoryError: a path that is not a file.
        ValueError / TypeError: a line that is not UTF-8 text or not JSON (file, line and sample named), a
            row of no supported format or a bad field (sample, field, file and line named; see
            :mod:`varpack.data.formats`).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    rows: list[tuple[dict, str]] = []
    for p in paths:
        require_file(p)
        path = Path(p)
        base = str(path.parent.resolve())
        # one reader for every data file: lines split on '\n' only (U+2028 inside a JSON string is part of
        # its row, ../shared/data/gsm8k.jsonl line 2382), UTF-8 and JSON errors named by file, line and sample
        for row, where in read_rows(path, first_sample=len(rows)):
            rows.append((_check_row(row, len(rows), where), base))
    return rows


def _check_row(row: Any, sample_id: int, where: str | None = None) -> dict:
    """A row ``{"messages": [...]}`` (a bare message list is wrapped); rows of the other formats of
    :mod:`varpack.data.formats` (ShareGPT, Alpaca, TRL prompt-completion) become ``{"messages": ...}``.
    Errors name the sample and field, and ``where`` (``FILE:LINE``) when given."""
    from varpack.data.formats import row_to_messages

    if isinstance(row, list):
        return {"messages": row}
    try:
        if not isinstance(row, dict):
            raise ValueError(
                f"sample {sample_id}: a row must be a JSON object (e.g. {{'messages': [...]}}) or a message "
                f"list, got {type(row).__name__}"
            )
        messages, fmt = row_to_messages(row, sample_id)
    except (ValueError, TypeError) as exc:
        if where is None:
            raise
        raise type(exc)(f"{where}: {exc}") from exc
    if fmt == "messages":
        return row if messages is row["messages"] else {**row, "messages": messages}
    return {"messages": messages}


def _rows_with_roots(
    data: Any, image_root: str | os.PathLike | None
) -> list[tuple[dict, str | os.PathLike | None]]:
    if isinstance(data, (str, os.PathLike)) or (
        isinstance(data, (list, tuple)) and data and all(isinstance(d, (str, os.PathLike)) for d in data)
    ):
        return [(row, image_root if image_root is not None else base) for row, base in load_mm_rows(data)]
    return [(_check_row(row, i), image_root) for i, row in enumerate(data)]


def encode_mm_dataset(
    data: Any,
    tokenizer: Any,
    image_processor: Any = None,
    *,
    image_root: str | os.PathLike | None = None,
    video_processor: Any = None,
    rope_model: Any = None,
    with_pixels: bool = True,
    progress: bool = False,
) -> list[dict]:
    """Encode a list / JSONL of (multimodal or text) chats with :func:`encode_mm_chat`.

    Args:
        data: path(s) to ``.jsonl`` / ``.json`` files (relative media paths resolve against each file's
            directory unless ``image_root`` is given), or an iterable of rows ``{"messages": [...]}`` (or
            bare message lists, or a ``datasets.Dataset``).
        tokenizer, image_processor, video_processor, rope_model, with_pixels: as :func:`encode_mm_chat`.
        image_root: overrides the media directory for every row.
        progress: show a tqdm bar.

    Returns:
        list of encoded samples; ``sample_id`` is the row index (``samples[i]`` is row ``i``); text-only rows
        get ``mm_token_type_ids`` of zeros (and 4-plane ``position_ids`` with ``rope_model``) so that they pack
        with image rows.

    Raises:
        ValueError / TypeError: as :func:`encode_mm_chat` for the first bad row (its index named).
    """
    return _encode_rows(
        _rows_with_roots(data, image_root),
        tokenizer,
        image_processor,
        video_processor=video_processor,
        rope_model=rope_model,
        with_pixels=with_pixels,
        progress=progress,
    )


def _encode_rows(
    rows: list[tuple[dict, Any]],
    tokenizer: Any,
    image_processor: Any,
    *,
    video_processor: Any,
    rope_model: Any,
    with_pixels: bool,
    progress: bool,
) -> list[dict]:
    it: Iterable = enumerate(rows)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, total=len(rows), desc="encode (vision-language)")
    return [
        encode_mm_chat(
            row["messages"],
            tokenizer,
            image_processor,
            sample_id=i,
            image_root=root,
            video_processor=video_processor,
            rope_model=rope_model,
            with_pixels=with_pixels,
        )
        for i, (row, root) in it
    ]


def encode_any(
    data: Any,
    tokenizer: Any,
    *,
    image_processor: Any = None,
    rope_model: Any = None,
    image_root: str | os.PathLike | None = None,
    video_processor: Any = None,
    with_pixels: bool = True,
    progress: bool = False,
) -> Any:
    """Dispatch text vs image chats: the entry point for ``varpack plan`` / ``varpack sft``.

    If any row holds an image/video part (:func:`is_mm_chat`), every row is encoded with
    :func:`encode_mm_dataset` (text rows too, so all samples carry ``mm_token_type_ids`` and, with
    ``rope_model``, ``[4, L]`` ``position_ids``); the image processor defaults to
    ``image_processor_for(rope_model)`` (Qwen3-VL values when ``rope_model`` is None). Otherwise the rows go
    to :func:`varpack.data.chat.encode_dataset` unchanged.

    Args:
        data: path(s) to JSON/JSONL chat files, or rows ``{"messages": [...]}``.
        tokenizer: text tokenizer.
        image_processor / rope_model / image_root / video_processor / with_pixels: see :func:`encode_mm_chat`.
        progress: progress bar for the multimodal path.

    Returns:
        ``list[dict]`` (multimodal path) or the ``datasets.Dataset`` of ``encode_dataset`` (text path).

    Raises:
        ValueError / TypeError: as the chosen encoder.
    """
    rows = _rows_with_roots(data, image_root)
    if not any(is_mm_chat(row) for row, _ in rows):
        from varpack.data.chat import encode_dataset

        return encode_dataset([row for row, _ in rows], tokenizer)
    if image_processor is None:
        from varpack.data.media import image_processor_for

        image_processor = image_processor_for(rope_model)
    return _encode_rows(
        rows,
        tokenizer,
        image_processor,
        video_processor=video_processor,
        rope_model=rope_model,
        with_pixels=with_pixels,
        progress=progress,
    )


# --------------------------------------------------------------------------------------------- cuts
def _grids(sample: dict, key: str) -> torch.Tensor | None:
    grid = sample.get(key)
    if grid is None:
        return None
    grid = torch.as_tensor(grid, dtype=torch.long).reshape(-1, 3)
    return grid if grid.shape[0] else None


def _runs(types: np.ndarray, code: int) -> list[tuple[int, int]]:
    mask = np.concatenate([[False], types == code, [False]])
    edges = np.flatnonzero(mask[1:] != mask[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def image_spans(sample: dict) -> list[dict]:
    """Token spans that a cut must not fall inside: one per image / video, in stream order.

    An image span is ``[start, stop)`` from its ``<|vision_start|>`` to its ``<|vision_end|>`` inclusive (the
    run of ``mm_token_type_ids == 1`` plus one token each side). A Qwen3-VL video is one span from its first
    frame's ``<|vision_start|>`` to its last frame's ``<|vision_end|>`` (frames grouped by
    ``video_grid_thw[:, 0]``).

    Returns:
        ``[{"kind": "image"|"video", "index": i, "start": s, "stop": e}, ...]`` sorted by start.

    Raises:
        ValueError: the sample has no ``mm_token_type_ids`` but has media, or runs do not match the grids.
    """
    types = sample.get("mm_token_type_ids")
    if types is None:
        if _grids(sample, "image_grid_thw") is not None or _grids(sample, "video_grid_thw") is not None:
            raise ValueError(
                "sample has media tensors but no mm_token_type_ids; encode it with encode_mm_chat"
            )
        return []
    types = np.asarray(types)
    spans: list[dict] = []
    for i, (a, b) in enumerate(_runs(types, 1)):
        spans.append({"kind": "image", "index": i, "start": max(a - 1, 0), "stop": min(b + 1, len(types))})
    frames = _runs(types, 2)
    if frames:
        vgrid = _grids(sample, "video_grid_thw")
        if vgrid is not None and int(vgrid[:, 0].sum()) == len(frames):
            per_video = vgrid[:, 0].tolist()
        elif vgrid is not None and vgrid.shape[0] == len(frames):
            per_video = [1] * len(frames)
        else:
            raise ValueError(
                f"{len(frames)} video token runs do not match video_grid_thw "
                f"{None if vgrid is None else vgrid.tolist()}"
            )
        k = 0
        for i, n in enumerate(per_video):
            group = frames[k : k + n]
            k += n
            spans.append(
                {
                    "kind": "video",
                    "index": i,
                    "start": max(group[0][0] - 1, 0),
                    "stop": min(group[-1][1] + 1, len(types)),
                }
            )
    spans.sort(key=lambda s: s["start"])
    return spans


def legal_cut(sample: dict, pos: int, *, spans: list[dict] | None = None) -> bool:
    """True if cutting the token stream before token ``pos`` (0 <= pos <= L) splits no media span."""
    spans = image_spans(sample) if spans is None else spans
    return not any(s["start"] < pos < s["stop"] for s in spans)


def nearest_legal_cut(sample: dict, pos: int) -> int:
    """The largest legal cut ``<= pos`` (a span that ``pos`` falls inside is moved wholly past the cut).

    For ``truncate`` overflow: keep ``[0, nearest_legal_cut(sample, packing_length))``. Returns 0 when the first
    span starts at 0 and contains ``pos``.
    """
    for s in image_spans(sample):
        if s["start"] < pos < s["stop"]:
            return s["start"]
    return pos


def validate_cut(sample: dict, start: int, stop: int, *, sample_id: Any = None) -> dict:
    """Check that the piece ``[start, stop)`` of ``sample`` does not cut through an image/video span.

    Args:
        sample: an encoded sample (``mm_token_type_ids`` and grids as :func:`encode_mm_chat` makes them).
        start, stop: token range of the piece, ``0 <= start < stop <= length``.
        sample_id: named in the error / report.

    Returns:
        report ``{"sample_id", "start", "stop", "images": [indices inside], "videos": [indices inside]}``.

    Raises:
        ValueError: out-of-range piece, or a cut (start or stop) strictly inside a span — the message names the
            sample, the cut, the span and the nearest legal cuts either side.
    """
    length = int(sample.get("length", len(sample["input_ids"])))
    if not (0 <= start < stop <= length):
        raise ValueError(
            f"sample {sample_id}: piece [{start}, {stop}) is not within [0, {length}] or is empty"
        )
    spans = image_spans(sample)
    for cut in (start, stop):
        for s in spans:
            if s["start"] < cut < s["stop"]:
                raise ValueError(
                    f"sample {sample_id}: cut at token {cut} of piece [{start}, {stop}) falls inside {s['kind']} "
                    f"{s['index']} (tokens [{s['start']}, {s['stop']})); legal cuts nearby: {s['start']} or "
                    f"{s['stop']}. Reject or drop this sample, or cut at a span edge."
                )
    inside = [s for s in spans if start <= s["start"] and s["stop"] <= stop]
    return {
        "sample_id": sample_id,
        "start": start,
        "stop": stop,
        "images": [s["index"] for s in inside if s["kind"] == "image"],
        "videos": [s["index"] for s in inside if s["kind"] == "video"],
    }


def _patch_offsets(grid: torch.Tensor) -> list[int]:
    return [0, *torch.cumsum(grid.prod(-1), 0).tolist()]


def slice_mm_sample(sample: dict, start: int, stop: int, *, sample_id: Any = None) -> dict:
    """The piece ``[start, stop)`` of a multimodal sample, with its media and positions, after
    :func:`validate_cut`.

    Token-aligned fields are sliced; ``labels[0]`` of the piece is set to -100 (every sample's first label is
    ignored); ``pixel_values`` / ``image_grid_thw`` (and video tensors with their ``second_per_grid_ts``) keep
    only the media whose spans lie in the piece, in order; ``position_ids [4, L]`` keeps its mRoPE planes as
    in the whole sample and restarts the text plane at 0 (so boundaries stay correct); ``length`` is
    ``stop - start``.

    Raises:
        ValueError: as :func:`validate_cut`.
    """
    report = validate_cut(sample, start, stop, sample_id=sample_id)
    out = dict(sample)
    for key in FLAT_TOKEN_FIELDS:  # 1-D per-token fields; position_ids [P, L] below
        if key in sample and sample[key] is not None:
            out[key] = list(sample[key][start:stop])
    if "labels" in out and out["labels"]:
        out["labels"][0] = IGNORE_INDEX
    if sample.get("position_ids") is not None:
        pos = torch.as_tensor(sample["position_ids"], dtype=torch.long)[:, start:stop].clone()
        pos[0] = torch.arange(stop - start)
        out["position_ids"] = pos.tolist()
    for _kind, pix_key, grid_key, chosen in (
        ("image", *IMAGE_FIELDS, report["images"]),
        ("video", *VIDEO_FIELDS, report["videos"]),
    ):
        grid = _grids(sample, grid_key)
        if grid is None:
            continue
        offsets = _patch_offsets(grid)
        pixels = torch.as_tensor(sample[pix_key])
        if chosen:
            out[grid_key] = grid[chosen].clone()
            out[pix_key] = torch.cat([pixels[offsets[i] : offsets[i + 1]] for i in chosen], 0)
        else:
            out.pop(grid_key, None)
            out.pop(pix_key, None)
        if grid_key == "video_grid_thw" and sample.get("second_per_grid_ts") is not None:
            seconds = torch.as_tensor(sample["second_per_grid_ts"]).reshape(-1)
            if seconds.numel() != grid.shape[0]:
                raise ValueError(
                    f"sample {sample_id}: second_per_grid_ts has {seconds.numel()} entries for "
                    f"{grid.shape[0]} videos"
                )
            if chosen:
                out["second_per_grid_ts"] = seconds[chosen].clone()
            else:
                out.pop("second_per_grid_ts", None)
    out["length"] = stop - start
    return out


def check_plan_cuts(samples: Sequence[dict], pieces: dict[int, tuple[int, int, int]]) -> list[dict]:
    """Every planner piece that cuts through an image/video span.

    Args:
        samples: encoded samples, indexed by sample id.
        pieces: ``PackPlan.pieces`` (piece id -> ``(sample_id, start, stop)``).

    Returns:
        one dict per illegal piece: ``{"piece_id", "sample_id", "start", "stop", "error"}`` (empty: all legal).
        Callers reject the plan (or drop those samples and re-plan) when it is non-empty.
    """
    bad: list[dict] = []
    for piece_id, (sid, start, stop) in sorted(pieces.items()):
        sample = samples[int(sid)]
        if sample.get("mm_token_type_ids") is None:
            continue
        try:
            validate_cut(sample, int(start), int(stop), sample_id=int(sid))
        except ValueError as exc:
            bad.append(
                {
                    "piece_id": int(piece_id),
                    "sample_id": int(sid),
                    "start": int(start),
                    "stop": int(stop),
                    "error": str(exc),
                }
            )
    return bad
