"""Encoding: chat samples -> ``input_ids``, ``labels``, ``length`` (see :mod:`varpack.encode.chat`)."""

from __future__ import annotations

from varpack.encode.chat import (
    IGNORE_INDEX,
    KNOWN_ROLES,
    encode_chat,
    encode_dataset,
    load_chat_data,
    tokenizer_fingerprint,
    validate_messages,
)
from varpack.encode.formats import SUPPORTED_FORMATS, data_formats, detect_format, row_to_messages

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
