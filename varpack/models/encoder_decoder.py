"""Decoders of encoder-decoder models (BART, mBART, Marian, Pegasus, PLBart, Blenderbot, BigBird-Pegasus, MVP,
ProphetNet, TrOCR, Whisper): their ``*ForCausalLM`` runs the decoder alone, but the models are trained with an
encoder whose states the decoder attends to, and their learned positions count from the row start rather than
from ``position_ids``. Packing does not apply: :func:`varpack.integrations.transformers.enable_varpack` refuses
them (``not applicable``), as it refuses any model whose config says ``is_encoder_decoder``.
"""

from __future__ import annotations

from varpack.models.registry import ModelFamily

__all__ = ["ENCODER_DECODER", "FAMILIES"]

ENCODER_DECODER = ModelFamily(
    name="encoder-decoder",
    model_types=(
        "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus", "plbart",
        "prophetnet", "trocr", "whisper",
    ),  # fmt: skip
    mixers="attention",
    vision=False,
    position_ids="1d",
    not_applicable="decoder of an encoder-decoder model (cross-attention to an encoder; positions from the row start)",
)

FAMILIES = (ENCODER_DECODER,)
