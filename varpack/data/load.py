"""One load-and-encode entry for every caller: ``varpack sft``, ``varpack plan``, ``varpack check``, benchmarks.

Chat data (files of any supported format, or the built-in sets) -> encoded samples, with image/video chats
detected and routed to the vision-language encoder:

* no files: the built-in text chats (:func:`varpack.data.builtin.builtin_chats`), or with ``vl=True`` the
  built-in image-caption chats (:func:`varpack.data.vl_builtin.write_vl_jsonl`, written once under the
  varpack cache);
* files holding at least one image/video chat (:func:`varpack.data.multimodal.has_mm_chats`): every row is
  encoded by :func:`varpack.data.multimodal.encode_any` (placeholders expanded to the patch grid, mRoPE
  positions from ``rope_model``'s own rope function);
* ``streaming=True``: a :class:`varpack.data.stream.ChatStream` (JSONL read line by line, or the built-in
  chats), encoded when it is iterated (``varpack sft --streaming``);
* anything else: :func:`varpack.data.chat.load_chat_data` + :func:`varpack.data.chat.encode_dataset` (any
  format of :mod:`varpack.data.formats`, cached as Arrow).

Whether a model is a vision-language model is the caller's knowledge (``vl``): data never imports the model
side.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["EncodedData", "load_and_encode"]

BUILTIN_TEXT = "built-in chats"
BUILTIN_VL = "built-in image-caption chats"


@dataclass(frozen=True)
class EncodedData:
    """What :func:`load_and_encode` read and encoded.

    Attributes:
        samples: ``datasets.Dataset`` (text chats: ``input_ids``, ``labels``, ``length``, ``sample_id``) or
            ``list[dict]`` (image/video chats, see :func:`varpack.data.multimodal.encode_mm_chat`); sample
            ``i`` is row ``i``.
        multimodal: True when ``samples`` came from the vision-language encoder (a list of dicts).
        paths: the files read, in order (the written JSONL for the built-in image-caption chats; empty for the
            built-in text chats).
        source: ``"built-in chats"``, ``"built-in image-caption chats"`` or the paths joined by ``", "``.
        formats: rows per data format (``{"messages": 120, "sharegpt": 30}``, :func:`varpack.data.formats.
            data_formats`) when asked for with ``formats=True`` on text chats; else None.
    """

    samples: Any
    multimodal: bool
    paths: tuple[str, ...]
    source: str
    formats: dict[str, int] | None = None

    def lengths(self) -> Any:
        """``numpy.int64 [N]`` token length of every sample (what the planner packs)."""
        import numpy as np

        if not hasattr(self.samples, "__len__"):
            raise TypeError("a stream has no lengths before it is read (load_and_encode(..., streaming=True))")
        if hasattr(self.samples, "with_format"):
            return np.asarray(self.samples.with_format("numpy")["length"], dtype=np.int64)
        return np.asarray([s.get("length", len(s["input_ids"])) for s in self.samples], dtype=np.int64)


def _tokenizer(tokenizer: Any) -> Any:
    """A tokenizer, or the result of calling a no-argument loader (anything callable without
    ``apply_chat_template``: a tokenizer object is callable itself)."""
    if callable(tokenizer) and not hasattr(tokenizer, "apply_chat_template"):
        return tokenizer()
    return tokenizer


def _rope_model(rope_model: Any) -> Any:
    """A model / config / None, or the result of calling a no-argument loader (callable without ``config``:
    a model is callable itself and has a ``config``; a config is not callable)."""
    if callable(rope_model) and not hasattr(rope_model, "config"):
        return rope_model()
    return rope_model


def _data_formats(rows: Any) -> dict[str, int]:
    """Rows per data format; a refused row's error names its file and line."""
    from varpack.data.chat import locate_error
    from varpack.data.formats import data_formats

    try:
        return data_formats(rows)
    except (ValueError, TypeError) as exc:
        located = locate_error(exc, rows)
        if located is exc:
            raise
        raise located from exc


def load_and_encode(
    data: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None,
    tokenizer: Any,
    *,
    vl: bool = False,
    rope_model: Any = None,
    with_pixels: bool = True,
    num_proc: int | None = None,
    progress: bool = False,
    formats: bool = False,
    desc: str = "encode",
    streaming: bool = False,
) -> EncodedData:
    """Load chat data and encode it with ``tokenizer``: the one data entry of the CLI and the benchmarks.

    Args:
        data: path(s) of chat files (JSON / JSONL / parquet, any format of :mod:`varpack.data.formats`, or
            JSON / JSONL image/video chats); None or empty: the built-in chats.
        tokenizer: a Hugging Face tokenizer with a chat template, or a function of no arguments returning one
            (called once the rows are read and, with ``formats``, their formats checked: a bad row is
            reported before a slow tokenizer load).
        vl: without ``data``, use the built-in image-caption chats instead of the text chats (the caller says
            whether its model is a vision-language model).
        rope_model: for image/video chats, the VL model or config whose own mRoPE function gives each
            sample's ``position_ids [4, L]`` and whose vision config picks the image processor
            (:func:`varpack.data.media.image_processor_for`; None: no positions, Qwen3-VL image values); or a
            function of no arguments returning it, called only when image/video chats are found.
        with_pixels: False: image chats get lengths only (pixels not decoded), for planning.
        num_proc: ``Dataset.map`` worker processes for text chats (None: this process).
        progress: tqdm bar while encoding image/video chats (text chats always show the ``datasets`` bar).
        formats: count rows per data format (text chats), checked before the tokenizer is loaded.
        desc: label of the ``datasets`` progress bar (text chats).
        streaming: read nothing now: ``samples`` is a :class:`varpack.data.stream.ChatStream` over the JSONL
            files (read line by line when iterated) or the built-in text chats, encoded on the fly by
            :class:`varpack.data.stream.StreamingPackedDataset` (text chats only).

    Returns:
        :class:`EncodedData` (``samples``, ``multimodal``, ``paths``, ``source``, ``formats``).

    Raises:
        FileNotFoundError: a path does not exist.
        IsADirectoryError: a path is a directory (give its files).
        ValueError / TypeError: unreadable file, unknown file type, a row of no supported format or with a
            bad field (the sample, field and ``FILE:LINE`` named), a missing image — as
            :func:`varpack.data.chat.encode_dataset` and :func:`varpack.data.multimodal.encode_any`.
    """
    from varpack.data.multimodal import has_mm_chats

    paths = [data] if isinstance(data, (str, os.PathLike)) else list(data or [])
    source = ", ".join(os.fspath(p) for p in paths)
    if streaming:  # the streaming source: rows read and encoded when the stream is iterated
        from varpack.data.stream import ChatStream

        if vl or (paths and has_mm_chats(paths)):
            raise ValueError(
                "streaming reads text chats; image/video chats are encoded with the full dataset at hand "
                "(leave streaming off)"
            )
        if paths:
            return EncodedData(ChatStream(paths), False, tuple(os.fspath(p) for p in paths), source)
        from varpack.data.builtin import builtin_chats

        return EncodedData(ChatStream(builtin_chats(), label=BUILTIN_TEXT), False, (), BUILTIN_TEXT)
    if not paths and vl:
        from varpack.data.tokenizer import varpack_cache_root
        from varpack.data.vl_builtin import write_vl_jsonl

        paths = [write_vl_jsonl(varpack_cache_root() / "data" / "vl_builtin.jsonl")]
        source = BUILTIN_VL
    if paths and has_mm_chats(paths):
        # image/video chats: placeholders expanded to the model's patch grid, mRoPE positions per sample
        from varpack.data.multimodal import encode_any

        tok = _tokenizer(tokenizer)
        samples = encode_any(
            paths, tok, rope_model=_rope_model(rope_model), with_pixels=with_pixels, progress=progress
        )
        return EncodedData(samples, True, tuple(os.fspath(p) for p in paths), source)
    from varpack.data.chat import encode_dataset, load_chat_data

    if paths:
        rows: Any = load_chat_data(paths)  # bad rows fail before the tokenizer loads
    else:
        from varpack.data.builtin import builtin_chats

        rows = builtin_chats()
        source = BUILTIN_TEXT
    counts = _data_formats(rows) if formats else None  # refused formats fail before the tokenizer loads
    samples = encode_dataset(rows, _tokenizer(tokenizer), num_proc=num_proc, desc=desc)
    return EncodedData(samples, False, tuple(os.fspath(p) for p in paths), source, counts)
