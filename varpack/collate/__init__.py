"""Padding-free flattening: packs of samples -> one token row with its boundary metadata."""

from __future__ import annotations

from varpack.collate.padding_free import IGNORED_FIELDS, MEDIA_FIELDS, TOKEN_FIELDS, PaddingFreeCollator

__all__ = ["IGNORED_FIELDS", "MEDIA_FIELDS", "TOKEN_FIELDS", "PaddingFreeCollator"]
