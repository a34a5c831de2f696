"""mRoPE helpers: per-sample Qwen-VL position ids with a text plane (see :mod:`varpack.rope.mrope`)."""

from __future__ import annotations

from varpack.rope.mrope import (
    NUM_PLANES,
    SUPPLIED_ARGS,
    TEXT_PLANE,
    add_mrope_position_ids,
    mrope_position_ids,
    rope_args,
    rope_index_fn,
    spatial_merge_size,
    split_planes,
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
