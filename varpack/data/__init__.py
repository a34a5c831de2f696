"""Data: the tokenizer, chat and multimodal encoding, data formats, built-in sets and the packed dataset.

:func:`load_and_encode` is the one entry from chat data (files or the built-in sets) to encoded samples.
Data never imports the model side (``varpack.models``, ``varpack.integrations``, ``varpack.train``).
"""

from __future__ import annotations

from varpack.data.load import EncodedData, load_and_encode

__all__ = ["EncodedData", "load_and_encode"]
