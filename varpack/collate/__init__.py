"""Padding-free flattening: packs of samples -> one token row with its boundary metadata (optionally of a fixed
:class:`StaticShape`, for CUDA graphs); :func:`shard_batch`: one rank's share of the row under context parallelism."""

from __future__ import annotations

from varpack.collate.context_parallel import shard_batch
from varpack.collate.padding_free import IGNORED_FIELDS, MEDIA_FIELDS, TOKEN_FIELDS, PaddingFreeCollator
from varpack.collate.static import StaticShape

__all__ = ["IGNORED_FIELDS", "MEDIA_FIELDS", "TOKEN_FIELDS", "PaddingFreeCollator", "StaticShape", "shard_batch"]
