"""``argparse`` value types shared by the CLI parsers (:mod:`varpack.cli`) and the flags generated from
:class:`varpack.train.config.SFTConfig` (:mod:`varpack.train.cli_flags`).

Bottom floor: imports only the standard library, so both sides read it without an upward import and
``varpack --help`` stays free of torch.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = [
    "DTYPE_SPELLINGS",
    "dtype_spelling",
    "float_above",
    "int_at_least",
    "max_steps_type",
    "parse_auto_bool",
    "parse_bool",
]

#: ``--dtype``'s two spellings of each floating dtype: short (``varpack check``'s) -> torch's (``varpack sft``'s,
#: :data:`varpack.train.config.DTypeName`). Both commands accept both.
DTYPE_SPELLINGS: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def parse_bool(text: str) -> bool:
    """``true`` / ``false`` (also ``1`` / ``0``, ``yes`` / ``no``, ``y`` / ``n``, ``t`` / ``f``, any case), as HF's
    ``string_to_bool``: the one reading of a switch written as text, by a flag (``--flag BOOL``), a ``--config``
    file (a quoted value) and :class:`varpack.train.config.SFTConfig` (a string given for a ``bool`` field).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    low = text.strip().lower()
    if low in ("true", "1", "yes", "y", "t"):
        return True
    if low in ("false", "0", "no", "n", "f"):
        return False
    raise argparse.ArgumentTypeError(f"must be true or false, got {text!r}")


def parse_auto_bool(text: str) -> bool | str:
    """``auto`` (any case) -> ``"auto"``, else :func:`parse_bool`: the value of an
    :data:`varpack.train.config.AutoBool` switch (``torch_compile``), read so by the flag, a ``--config`` file
    and ``SFTConfig``.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return parse_bool(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be auto, true or false, got {text!r}") from None


def int_at_least(minimum: int) -> Callable[[str], int]:
    """``argparse`` type: an integer ``>= minimum`` (the error names the value given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"int_at_least_{minimum}"
    return parse


def float_above(minimum: float) -> Callable[[str], float]:
    """``argparse`` type: a finite number ``> minimum``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > minimum):
            raise argparse.ArgumentTypeError(f"must be a finite number > {minimum:g}, got {text!r}")
        return value

    parse.__name__ = f"float_above_{minimum:g}"
    return parse


def max_steps_type(text: str) -> int:
    """``argparse`` type of ``--max-steps``: ``-1`` (run ``--epochs``) or an integer ``>= 1``."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value != -1 and value < 1:
        raise argparse.ArgumentTypeError(f"must be -1 (run --epochs) or an integer >= 1, got {text!r}")
    return value


def dtype_spelling(short: bool) -> Callable[[str], str]:
    """``argparse`` type of ``--dtype``: either spelling of :data:`DTYPE_SPELLINGS` (any case) -> the command's
    own, the short one (``bf16``) when ``short`` else torch's (``bfloat16``). Anything else is returned as given,
    so that the flag's ``choices`` refuse it with argparse's own error listing the command's spellings."""
    to_short = {long: s for s, long in DTYPE_SPELLINGS.items()}

    def parse(text: str) -> str:
        low = text.strip().lower()
        if low in DTYPE_SPELLINGS or low in to_short:
            return to_short.get(low, low) if short else DTYPE_SPELLINGS.get(low, low)
        return text

    parse.__name__ = "dtype_short" if short else "dtype_torch"
    return parse
