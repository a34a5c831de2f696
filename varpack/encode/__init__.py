"""Moved: chat encoding lives in :mod:`varpack.data` (``data/chat.py``, ``data/formats.py``,
``data/multimodal.py``); this old import path re-exports it for users' code (README:
``from varpack.encode import load_chat_data, encode_dataset``), and ``varpack.encode.chat`` / ``.formats`` /
``.multimodal`` are the moved modules themselves."""

from __future__ import annotations

from varpack.data.chat import (
    IGNORE_INDEX,
    KNOWN_ROLES,
    encode_chat,
    encode_dataset,
    load_chat_data,
    tokenizer_fingerprint,
    validate_messages,
)
from varpack.data.formats import SUPPORTED_FORMATS, data_formats, detect_format, row_to_messages

__all__ = [
    "IGNORE_INDEX",
    "KNOWN_ROLES",
    "SUPPORTED_FORMATS",
    "data_formats",
    "detect_format",
    "encode_chat",
    "encode_dataset",
    "load_chat_data",
    "row_to_messages",
    "tokenizer_fingerprint",
    "validate_messages",
]
