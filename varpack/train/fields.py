"""The vocabulary of a config dataclass's fields, shared by its command-line flags
(:mod:`varpack.train.cli_flags`) and its config files (:mod:`varpack.train.config_file`): every accepted name of a
field, the flag spelling, the value checks named by ``metadata["cli_type"]``, and the annotation kinds
(``X | None``, :data:`varpack.train.config.AutoBool`). Imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from collections.abc import Callable
from types import NoneType, UnionType
from typing import Any

from varpack.train.config import SFTConfig, literal_choices

__all__ = ["CLI_TYPES", "cli_types", "field_names", "flag_name", "is_auto_bool", "json_object", "strip_optional"]


def is_auto_bool(annotation: Any) -> bool:
    """Whether a field annotation is :data:`varpack.train.config.AutoBool` (``bool | Literal["auto"]``)."""
    if typing.get_origin(annotation) not in (typing.Union, UnionType):
        return False
    args = typing.get_args(annotation)
    return len(args) == 2 and bool in args and any(literal_choices(a) == ("auto",) for a in args)


def json_object(text: str) -> dict[str, Any]:
    """``argparse`` type: a JSON object (``'{"max_grad_norm": 0.5}'``); the error names the value given."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def cli_types() -> dict[str, Callable[[str], Any]]:
    from varpack._argtypes import dtype_spelling, float_above, int_at_least, max_steps_type

    return {
        "dtype": dtype_spelling(short=False),
        "int>=0": int_at_least(0),
        "int>=1": int_at_least(1),
        "int>=2": int_at_least(2),
        "float>0": float_above(0),
        "max_steps": max_steps_type,
        "json_object": json_object,
    }


#: ``metadata["cli_type"]`` names -> the argparse value checks (the same as ``varpack plan``'s flags); ``dtype``:
#: ``bf16`` / ``fp16`` / ``fp32`` -> torch's names, for the field's ``choices`` (as ``varpack check --dtype``).
CLI_TYPES: tuple[str, ...] = ("dtype", "int>=0", "int>=1", "int>=2", "float>0", "max_steps", "json_object")


def flag_name(field_name: str) -> str:
    """``packing_length`` -> ``--packing-length``."""
    return "--" + field_name.replace("_", "-")


def field_names(config_cls: type = SFTConfig) -> dict[str, str]:
    """Every accepted name of every field -> the field name: the field name, its ``-`` spelling and its
    ``metadata["aliases"]`` in both spellings (``max_length`` / ``max-length`` -> ``packing_length``); the
    keys of a ``--config`` file and, with ``--``, the flags."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(config_cls):
        for name in (f.name, *f.metadata.get("aliases", ())):
            for spelling in (name, name.replace("_", "-")):
                if out.setdefault(spelling, f.name) != f.name:
                    raise TypeError(f"{config_cls.__name__}: {spelling!r} names two fields")
    return out


def strip_optional(annotation: Any) -> Any:
    """``int | None`` -> ``int``; anything else unchanged."""
    if typing.get_origin(annotation) in (typing.Union, UnionType):
        args = [a for a in typing.get_args(annotation) if a is not NoneType]
        if len(args) == 1:
            return args[0]
    return annotation
