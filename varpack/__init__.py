"""varpack: padding-free sequence packing for LLM fine-tuning, exact by construction.

Public names are imported lazily so that ``import varpack`` stays cheap (no torch/transformers import until
a name that needs them is used).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "plan_packs": "varpack.plan",
    "PackPlan": "varpack.plan",
    "PackedDataset": "varpack.data.dataset",
    "PaddingFreeCollator": "varpack.collate",
    "cu_seqlens_from_position_ids": "varpack.varlen",
    "cu_seqlens_from_lengths": "varpack.varlen",
    "cu_seqlens_from_segment_ids": "varpack.varlen",
    "seq_idx_from_cu_seqlens": "varpack.varlen",
    "validate_cu_seqlens": "varpack.varlen",
    "varlen_attention": "varpack.attn",
    "available_backends": "varpack.attn",
    "resolve_backend": "varpack.attn",
    "load_tokenizer": "varpack.data.tokenizer",
    "load_chat_data": "varpack.data.chat",
    "encode_chat": "varpack.data.chat",
    "encode_dataset": "varpack.data.chat",
    "builtin_chats": "varpack.data.builtin",
    "enable_varpack": "varpack.integrations.transformers",
    "causal_lm_loss": "varpack.loss",
    "linear_cross_entropy": "varpack.ops.linear_ce",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'varpack' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
