"""Settings files: ``varpack sft --config run.yaml`` (also ``.json``, and ``varpack demo --config``), and the
resolved settings a saved run writes beside its model (:data:`CONFIG_FILE_NAME`).

A file is a mapping of :class:`varpack.train.config.SFTConfig` field names to values::

    model: tiny-qwen3
    data: [chats.jsonl]          # or one path as a string
    packing_length: 1024
    overflow: split
    max_steps: 30
    lr: 3.0e-3                   # YAML 1.1 reads 3e-3 as a string; both are accepted
    extra_training_args: {max_grad_norm: 0.5}

Keys: the field names, their flag spelling (``packing-length``) or an alias of the field
(``metadata["aliases"]``: ``max_length``, ``learning_rate``, ...; :func:`varpack.train.fields.field_names`);
the always-on switches ``padding_free`` / ``packing`` may be ``true``; ``torch_compile`` takes ``true``, ``false``
or ``auto`` and a plain switch ``true`` or ``false`` (quoted or not, any case). Values are checked as the flags check
them (the same ``cli_type`` checks), then by the dataclass. Paths are read as on the command line, relative to
the working directory. ``.json`` files are read with :mod:`json`, anything else as YAML (PyYAML, a dependency).

This module imports no torch (the ``varpack sft`` parser path reads files through it).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import shlex
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from varpack.train.config import ALWAYS_ON, SFTConfig, literal_choices

__all__ = [
    "CONFIG_FILE_NAME",
    "ConfigFileError",
    "config_mapping",
    "load_config_file",
    "read_config_file",
    "write_config_file",
]

#: File name of the resolved settings that a saved run writes into its ``output_dir``.
CONFIG_FILE_NAME = "varpack_config.yaml"


class ConfigFileError(ValueError):
    """A settings file that cannot be used; the message names the file and, where one is at fault, the key."""


def _read_mapping(path: Path) -> dict[str, Any]:
    shown = repr(os.fspath(path))
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigFileError(f"config file not found: {shown}") from None
    except OSError as exc:
        raise ConfigFileError(f"config file {shown} cannot be read: {exc}") from None
    if path.suffix.lower() == ".json":
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigFileError(f"config file {shown} is not valid JSON: {exc}") from None
    else:
        try:
            import yaml
        except ImportError:  # pragma: no cover - pyyaml is a dependency
            raise ConfigFileError(
                f"config file {shown}: reading YAML needs PyYAML (pip install pyyaml); or use a .json file"
            ) from None
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigFileError(f"config file {shown} is not valid YAML: {exc}") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigFileError(
            f"config file {shown} must hold a mapping of settings (packing_length: 1024, ...), "
            f"got {type(value).__name__}"
        )
    return value


def _check_value(annotation: Any, meta: Mapping[str, Any], value: Any) -> Any:
    """``value`` of field ``name`` as the flag would give it; raises ``ValueError`` with the reason."""
    from varpack._argtypes import parse_auto_bool, parse_bool
    from varpack.train.fields import cli_types, is_auto_bool, strip_optional

    optional = strip_optional(annotation) is not annotation
    annotation = strip_optional(annotation)
    if value is None:
        if optional:
            return None
        raise ValueError("must not be null")
    if is_auto_bool(annotation) or annotation is bool:
        if isinstance(value, bool):
            return value
        parse = parse_auto_bool if annotation is not bool else parse_bool
        if isinstance(value, str):  # quoted "false" / "AUTO" / "0", read as the flag reads them
            try:
                return parse(value)
            except argparse.ArgumentTypeError as exc:
                raise ValueError(str(exc)) from None
        rule = "auto, true or false" if annotation is not bool else "true or false"
        raise ValueError(f"must be {rule}, got {value!r}")
    if literal_choices(annotation) is not None:
        return value  # the dataclass checks it against the choices and names them
    if typing.get_origin(annotation) is tuple:
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ValueError("must be a path or a list of paths")
    if typing.get_origin(annotation) is dict:
        if not isinstance(value, dict):
            raise ValueError("must be a mapping")
        return dict(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ValueError("must be a string")
        return value
    # int / float: the flag's own check on the value's text (a YAML 1.1 "3e-3" string included)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"must be a number, got {type(value).__name__}")
    check = cli_types()[meta["cli_type"]] if "cli_type" in meta else annotation
    try:
        return check(str(value))
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(str(exc)) from None


def read_config_file(path: str | os.PathLike[str], config_cls: type = SFTConfig) -> dict[str, Any]:
    """The settings of a YAML / JSON file, as ``{field name: value}`` (only the fields it sets).

    Args:
        path: the file (``.json``: JSON; anything else: YAML).
        config_cls: the dataclass whose fields the keys name.

    Returns:
        Field name -> value, converted as the flags convert them (a list of paths -> tuple, ``"3e-3"`` -> float).

    Raises:
        ConfigFileError: the file is missing or not a mapping; an unknown key (with the closest setting name);
            two keys for one setting; an always-on switch set to false; a value of the wrong type or range
            (``SFTConfig.<field> has an invalid value: ... (from config file 'PATH')``).
    """
    from varpack.train.fields import field_names

    path = Path(path)
    shown = repr(os.fspath(path))
    raw = _read_mapping(path)
    names = field_names(config_cls)
    always_on = ALWAYS_ON if config_cls is SFTConfig else {}
    hints = typing.get_type_hints(config_cls)
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    out: dict[str, Any] = {}
    key_of: dict[str, str] = {}
    for key, value in raw.items():
        key = str(key)
        switch = key.replace("-", "_")
        if switch in always_on:
            if value is not True:
                raise ConfigFileError(
                    f"{key}: {value!r} in config file {shown}: only true is accepted; {always_on[switch]}"
                )
            continue
        if key not in names:
            close = difflib.get_close_matches(key.replace("-", "_"), list(names), n=1, cutoff=0.6)
            hint = f"; did you mean {names[close[0]]!r}?" if close else ""
            raise ConfigFileError(
                f"unknown setting {key!r} in config file {shown}{hint} (the settings: varpack sft --help)"
            )
        name = names[key]
        if name in key_of:
            raise ConfigFileError(f"config file {shown} sets {name!r} twice: as {key_of[name]!r} and {key!r}")
        key_of[name] = key
        try:
            out[name] = _check_value(hints[name], fields[name].metadata, value)
        except ValueError as exc:
            raise ConfigFileError(
                f"{config_cls.__name__}.{name} has an invalid value: {value!r} ({exc}) (from config file {shown})"
            ) from None
    return out


def load_config_file(path: str | os.PathLike[str], config_cls: type = SFTConfig) -> Any:
    """``config_cls`` from a settings file alone (fields it does not set: the dataclass defaults).

    Raises:
        ConfigFileError: as :func:`read_config_file`, and a value the dataclass refuses (naming the file).
    """
    values = read_config_file(path, config_cls)
    try:
        return config_cls(**values)
    except ValueError as exc:
        raise ConfigFileError(f"{exc} (from config file {os.fspath(path)!r})") from None


def config_mapping(config: Any) -> dict[str, Any]:
    """Every field of ``config`` as a YAML / JSON-ready mapping (tuples as lists), in field order."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def write_config_file(config: Any, path: str | os.PathLike[str]) -> Path:
    """Write every field of ``config`` to ``path`` (``.json``: JSON, else YAML) so that
    ``--config path`` (:func:`load_config_file`) gives ``config`` back. A YAML file starts with a comment line
    ``# varpack: ...; rerun with: varpack sft --config /absolute/path`` (shell-quoted).

    Returns:
        The path written.
    """
    path = Path(path)
    mapping = config_mapping(config)
    if path.suffix.lower() == ".json":
        text = json.dumps(mapping, indent=2) + "\n"
    else:
        import yaml

        rerun = shlex.quote(str(path.resolve()))  # absolute: the line runs from any working directory
        text = (
            f"# varpack: the resolved settings of this run; rerun with: varpack sft --config {rerun}\n"
            + yaml.safe_dump(mapping, sort_keys=False, default_flow_style=False, allow_unicode=True)
        )
    path.write_text(text, encoding="utf-8")
    return path
