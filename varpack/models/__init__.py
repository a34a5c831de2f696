"""Model families and model loading.

* :mod:`varpack.models.registry`: :class:`ModelFamily` (one family's facts and hooks), :func:`family_of`,
  :func:`register_family`, :func:`builtin_names`.
* one file per family: :mod:`varpack.models.dense` (Llama, Qwen3), :mod:`varpack.models.gated_delta`
  (Qwen3.5 text, Qwen3-Next), :mod:`varpack.models.qwen_vl` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 VL);
  a new family is one file plus one line in :data:`varpack.models.registry.FAMILY_MODULES`.
* :mod:`varpack.models.load`: :func:`load_model`, :func:`load_tokenizer_for`, model sources (built-in names,
  model directories, GGUF).

``from varpack.models import load_model, model_config, BUILTIN_MODELS, ...`` works as it did when this was
one module. :data:`BUILTIN_MODELS` is read live (families registered later add their names).
"""

from __future__ import annotations

from typing import Any

from varpack.models.dense import QWEN3_VOCAB_SIZE
from varpack.models.load import (
    GGUF_PACKAGES,
    find_gguf,
    load_model,
    load_tokenizer_for,
    model_config,
    resolve_model_source,
)
from varpack.models.registry import (
    GENERIC,
    ModelFamily,
    builtin_family,
    builtin_names,
    families,
    family_of,
    is_vl_model,
    register_family,
    unregister_family,
)

__all__ = [
    "BUILTIN_MODELS",
    "GENERIC",
    "GGUF_PACKAGES",
    "QWEN3_VOCAB_SIZE",
    "ModelFamily",
    "builtin_family",
    "builtin_names",
    "families",
    "family_of",
    "find_gguf",
    "is_vl_model",
    "load_model",
    "load_tokenizer_for",
    "model_config",
    "register_family",
    "resolve_model_source",
    "unregister_family",
]


def __getattr__(name: str) -> Any:
    if name == "BUILTIN_MODELS":  # every built-in model name (random init), of the families registered now
        return builtin_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
