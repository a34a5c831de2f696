"""Command-line flags generated from a config dataclass (``varpack sft`` / ``varpack demo`` from
:class:`varpack.train.config.SFTConfig`), and the way back.

One flag per field, so no setting is unreachable from the command line:

* name: ``--`` + the field name with ``_`` -> ``-`` (``packing_length`` -> ``--packing-length``), ``dest`` the
  field name;
* ``Literal[...]`` -> ``choices``; ``bool`` -> ``--flag`` / ``--no-flag`` (``argparse.BooleanOptionalAction``);
  ``tuple[str, ...]`` -> ``nargs="+"``; ``int`` / ``float`` / ``str`` (also ``X | None``) -> that type, or the
  stricter check named by the field's ``metadata["cli_type"]`` (:data:`CLI_TYPES`);
* help text and metavar from the field's metadata (see :mod:`varpack.train.config`).

:func:`config_from_args` is the inverse, :func:`config_to_argv` gives the flags that rebuild a config. This
module imports no torch (the parsers of :mod:`varpack.cli` use it; tests/cli/test_cli_consistency.py checks).
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

__all__ = [
    "CLI_TYPES",
    "add_config_arguments",
    "config_defaults",
    "config_from_args",
    "config_to_argv",
    "flag_name",
    "json_object",
]


def json_object(text: str) -> dict[str, Any]:
    """``argparse`` type: a JSON object (``'{"max_grad_norm": 0.5}'``); the error names the value given."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _cli_types() -> dict[str, Callable[[str], Any]]:
    from varpack.cli._common import float_above, int_at_least, max_steps_type

    return {
        "int>=0": int_at_least(0),
        "int>=1": int_at_least(1),
        "float>0": float_above(0),
        "max_steps": max_steps_type,
        "json_object": json_object,
    }


#: ``metadata["cli_type"]`` names -> the argparse value checks (the same as ``varpack plan``'s flags).
CLI_TYPES: tuple[str, ...] = ("int>=0", "int>=1", "float>0", "max_steps", "json_object")


def flag_name(field_name: str) -> str:
    """``packing_length`` -> ``--packing-length``."""
    return "--" + field_name.replace("_", "-")


def config_defaults(config_cls: type = SFTConfig) -> dict[str, Any]:
    """The field defaults of ``config_cls``, read without instantiating it (``default_factory`` ones called)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _strip_optional(annotation: Any) -> Any:
    """``int | None`` -> ``int``; anything else unchanged."""
    if typing.get_origin(annotation) in (typing.Union, UnionType):
        args = [a for a in typing.get_args(annotation) if a is not NoneType]
        if len(args) == 1:
            return args[0]
    return annotation


def add_config_arguments(
    parser: argparse.ArgumentParser,
    config_cls: type = SFTConfig,
    *,
    defaults: dict[str, Any] | None = None,
) -> None:
    """Add one flag per field of the dataclass ``config_cls`` to ``parser`` (rules in the module docstring).

    Args:
        parser: the sub-command's parser.
        config_cls: a dataclass whose fields carry ``metadata["help"]``.
        defaults: parser defaults that differ from the field defaults (``varpack demo``'s).

    Raises:
        TypeError: a field whose annotation has no flag rule, or an unknown ``metadata["cli_type"]``.
    """
    hints = typing.get_type_hints(config_cls)
    d = {**config_defaults(config_cls), **(defaults or {})}
    types = _cli_types()
    for f in dataclasses.fields(config_cls):
        meta = f.metadata
        text = meta.get("help")
        if callable(text):
            text = text(d)
        flag, default = flag_name(f.name), d.get(f.name)
        annotation = _strip_optional(hints[f.name])
        choices = literal_choices(annotation)
        kw: dict[str, Any] = {"dest": f.name, "help": text}
        if "metavar" in meta:
            kw["metavar"] = meta["metavar"]
        if annotation is bool:
            kw.pop("metavar", None)
            action = parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, **kw)
            action.help = text  # BooleanOptionalAction appends "(default: ...)", which --help does not show
            continue
        if choices is not None:
            parser.add_argument(flag, choices=choices, default=default, **kw)
            continue
        if typing.get_origin(annotation) is tuple:
            parser.add_argument(flag, nargs="+", default=list(default) or None, **kw)
            continue
        if "cli_type" in meta:
            if meta["cli_type"] not in types:
                raise TypeError(f"{config_cls.__name__}.{f.name}: unknown cli_type {meta['cli_type']!r}")
            value_type = types[meta["cli_type"]]
        elif annotation in (int, float, str):
            value_type = annotation
        else:
            raise TypeError(f"{config_cls.__name__}.{f.name}: no flag rule for the annotation {annotation!r}")
        if isinstance(default, dict) and not default:
            default = None  # an empty mapping: the field's own default_factory
        parser.add_argument(flag, type=value_type, default=default, **kw)


def config_from_args(args: argparse.Namespace, config_cls: type = SFTConfig) -> Any:
    """``config_cls`` from the flags :func:`add_config_arguments` added (absent / ``None`` for a ``data``-like
    or mapping field: the field default).

    Raises:
        ValueError: a value the dataclass refuses (``SFTConfig.<field> has an invalid value: ...``).
    """
    kw: dict[str, Any] = {}
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        annotation = _strip_optional(hints[f.name])
        if typing.get_origin(annotation) is tuple:
            value = tuple(value or ())
        elif typing.get_origin(annotation) is dict and value is None:
            continue
        kw[f.name] = value
    return config_cls(**kw)


def config_to_argv(config: Any) -> list[str]:
    """The flags that :func:`config_from_args` turns back into ``config`` (every field, defaults included)."""
    argv: list[str] = []
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value, flag = getattr(config, f.name), flag_name(f.name)
        annotation = _strip_optional(hints[f.name])
        if annotation is bool:
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is None:
            continue
        elif typing.get_origin(annotation) is tuple:
            if value:
                argv += [flag, *map(str, value)]
        elif typing.get_origin(annotation) is dict:
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv
