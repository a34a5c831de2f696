"""Model types varpack refuses for a feature its run-time checks do not detect by themselves (the model zoo found
them; docs/MODELS.md). Each record names the feature; :func:`varpack.integrations.transformers.enable_varpack`
raises it before the model runs.
"""

from __future__ import annotations

from varpack.models.registry import ModelFamily

__all__ = ["BYTE_LATENT", "FAMILIES"]

#: Byte Latent Transformer: byte-level encoder / decoder around a patch-level transformer, joined by
#: cross-attention between the byte and patch streams whose masks follow the row's patches, not the samples
BYTE_LATENT = ModelFamily(
    name="byte-latent",
    model_types=("blt",),
    mixers="attention",
    refused="byte patches joined by cross-attention between byte and patch streams (BltCrossAttention)",
)

FAMILIES = (BYTE_LATENT,)
