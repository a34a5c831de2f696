"""Multimodal models packed on text only: the language model of Gemma 3, Llama 4, Mllama, Emu3, Fuyu, Phi-4
multimodal, Moshi and MOSS speech models is softmax attention through transformers' attention interface
(sliding / chunked / NoPE layers, MoE), exact on packed text-only rows (the model zoo, docs/MODELS.md).

Their vision / audio paths are not prepared for packed batches (image tokens attend bidirectionally in Gemma 3,
media features are placed by per-row masks): a packed batch that carries media (``pixel_values``, ...) is refused
by the packing guard of :func:`varpack.integrations.transformers.enable_varpack`. The Qwen-VL families, whose
media varpack does pack, are :mod:`varpack.models.qwen_vl`.
"""

from __future__ import annotations

from varpack.models.registry import ModelFamily

__all__ = ["FAMILIES", "MULTIMODAL_TEXT"]

MULTIMODAL_TEXT = ModelFamily(
    name="multimodal-text",
    model_types=(
        "emu3", "fuyu", "gemma3", "gemma4", "gemma4_unified", "llama4", "mllama", "moshi", "moss_transcribe_diarize", "phi4_multimodal",
    ),  # fmt: skip
    mixers="attention",
    vision=False,
    position_ids="1d",
)

FAMILIES = (MULTIMODAL_TEXT,)
