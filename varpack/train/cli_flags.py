"""Command-line flags generated from a config dataclass (``varpack sft`` / ``varpack demo`` from
:class:`varpack.train.config.SFTConfig`), and the way back.

One flag per field, so no setting is unreachable from the command line:

* name: ``--`` + the field name with ``_`` -> ``-`` (``packing_length`` -> ``--packing-length``), ``dest`` the
  field name;
* ``Literal[...]`` -> ``choices`` (with a ``metadata["cli_type"]``, also that type: other spellings mapped onto
  the choices, ``--dtype bf16`` -> ``bfloat16``); ``bool`` -> ``--flag`` / ``--no-flag`` (``argparse.BooleanOptionalAction``);
  :data:`varpack.train.config.AutoBool` (``bool | Literal["auto"]``) -> ``--flag [auto|true|false]`` (no
  value: on) and ``--no-flag`` (off, hidden from ``--help``; :func:`varpack._argtypes.parse_auto_bool`);
  ``tuple[str, ...]`` -> ``nargs="+"``; ``int`` / ``float`` / ``str`` (also ``X | None``) -> that type, or the
  stricter check named by the field's ``metadata["cli_type"]`` (:data:`CLI_TYPES`);
* help text and metavar from the field's metadata (see :mod:`varpack.train.config`).

Other spellings, each a hidden flag (``help=SUPPRESS``) writing to the same ``dest``, so ``--help`` keeps one
entry per setting: the underscore spelling of every flag (``--packing_length``, ``--no_bf16``; TRL / HF /
ms-swift write flags so), the field's ``metadata["aliases"]`` in both spellings (``--max_length``,
``--learning_rate``; named in the flag's help), and the always-on switches of
:data:`varpack.train.config.ALWAYS_ON` (``--padding_free [true]`` is a no-op, ``false`` is refused).

``--config FILE`` (YAML / JSON, :mod:`varpack.train.config_file`) gives the settings from a file; a flag
given on the command line overrides the file's value. Each flag records that it was given in the parsed
namespace (``_explicit_fields``), which is how :func:`config_from_args` tells a flag given as its default
value from a flag not given. Two spellings of one setting on the command line (``--max_seq_length 512
--max-length 1024``, ``--lr`` and ``--learning_rate``) are a usage error, as in a ``--config`` file: the later one
would win unseen; one spelling given twice keeps argparse's rule (the later value; a list flag adds to its list),
and both sides of a switch (``--bf16`` / ``--no-bf16``) are one spelling.

:func:`config_from_args` is the inverse, :func:`config_to_argv` gives the flags that rebuild a config. This
module imports no torch (the parsers of :mod:`varpack.cli` use it; tests/cli/test_cli_consistency.py checks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import types
import typing
from typing import Any

from varpack._argtypes import parse_auto_bool, parse_bool
from varpack.train.config import ALWAYS_ON, DEPENDENT_SETTINGS, SFTConfig, literal_choices
from varpack.train.config_file import ConfigFileError, read_config_file
from varpack.train.fields import cli_types, field_names, flag_name, is_auto_bool, strip_optional

__all__ = [
    "EXPLICIT_FIELDS",
    "GIVEN_AS",
    "add_config_arguments",
    "config_defaults",
    "config_from_args",
    "config_to_argv",
]

#: Namespace attribute: the set of ``dest`` names whose flag was given on the command line.
EXPLICIT_FIELDS = "_explicit_fields"


#: Namespace attribute: ``dest`` -> the spelling of the flag that gave it (:func:`_spelling`).
GIVEN_AS = "_given_as"


def _spelling(option_string: str) -> str:
    """A flag's spelling, one for both sides of a switch: ``--no-bf16`` -> ``--bf16``, ``--no_bf16`` ->
    ``--bf16``, ``--max_length`` -> ``--max_length``."""
    for off in ("--no-", "--no_"):
        if option_string.startswith(off):
            return "--" + option_string[len(off) :]
    return option_string


def _mark_given(
    namespace: argparse.Namespace, dest: str, action: argparse.Action | None = None, option_string: Any = None
) -> None:
    """Record that ``dest`` was given, and refuse a second spelling of it (``--max-length 512
    --max_seq_length 1024``: the later one would silently win; a ``--config`` file is refused alike).

    Raises:
        argparse.ArgumentError: ``--packing-length given twice: as --max_seq_length and --max-length``.
    """
    given = getattr(namespace, EXPLICIT_FIELDS, None)
    if given is None:
        given = set()
        setattr(namespace, EXPLICIT_FIELDS, given)
    given.add(dest)
    if not option_string:
        return
    spelled = getattr(namespace, GIVEN_AS, None)
    if spelled is None:
        spelled = {}
        setattr(namespace, GIVEN_AS, spelled)
    first = spelled.setdefault(dest, _spelling(option_string))
    if first != _spelling(option_string):
        raise argparse.ArgumentError(
            action, f"{flag_name(dest)} given twice: as {first} and {option_string}; give it once"
        )


class _Store(argparse.Action):
    """``store`` that records that the flag was given (argparse's own store action is private)."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None):
        setattr(namespace, self.dest, values)
        _mark_given(namespace, self.dest, self, option_string)


class _Extend(_Store):
    """A list flag (``nargs="+"``) given twice adds to its list: ``--data a.jsonl --data b.jsonl`` names both
    files, as ``--data a.jsonl b.jsonl`` does; its first use replaces the default."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None):
        if self.dest in (getattr(namespace, EXPLICIT_FIELDS, None) or ()):
            values = [*getattr(namespace, self.dest), *values]
        super().__call__(parser, namespace, values, option_string)


class _Switch(argparse.BooleanOptionalAction):
    """``--flag`` / ``--no-flag`` that records that it was given; an underscore flag gets ``--no_flag``."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, **kw)
        self.option_strings = [
            "--no_" + s[5:] if s.startswith("--no-") and "_" in s else s for s in self.option_strings
        ]

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None):
        if option_string in self.option_strings:
            setattr(namespace, self.dest, not option_string.startswith(("--no-", "--no_")))
            _mark_given(namespace, self.dest, self, option_string)


class _SwitchOff(argparse.Action):
    """``--no_flag`` alone (the underscore spelling of ``--no-flag`` for a flag without ``_``)."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None):
        setattr(namespace, self.dest, False)
        _mark_given(namespace, self.dest, self, option_string)


class _AutoSwitch(_Store):
    """``--flag [auto|true|false]`` of a :data:`varpack.train.config.AutoBool` field: no value means ``true``."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", const=True, type=parse_auto_bool, **kw)


class _AlwaysOn(argparse.Action):
    """``--padding_free [BOOL]``: ``true`` (or nothing) changes nothing, ``false`` is a usage error."""

    def __init__(self, option_strings: list[str], dest: str, reason: str = "", **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", const="true", **kw)
        self.reason = reason

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None):
        try:
            on = parse_bool(values)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        if not on:
            raise argparse.ArgumentError(self, f"cannot be false: {self.reason}")


def config_defaults(config_cls: type = SFTConfig) -> dict[str, Any]:
    """The field defaults of ``config_cls``, read without instantiating it (``default_factory`` ones called)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def add_config_arguments(
    parser: argparse.ArgumentParser,
    config_cls: type = SFTConfig,
    *,
    defaults: dict[str, Any] | None = None,
    always_on: dict[str, str] | None = None,
    config_file: bool = True,
) -> None:
    """Add one flag per field of the dataclass ``config_cls`` to ``parser`` (rules in the module docstring),
    the hidden other spellings, and ``--config FILE``.

    Args:
        parser: the sub-command's parser.
        config_cls: a dataclass whose fields carry ``metadata["help"]``.
        defaults: parser defaults that differ from the field defaults (``varpack demo``'s).
        always_on: switch name -> why ``false`` is refused (default: :data:`varpack.train.config.ALWAYS_ON`
            for :class:`SFTConfig`, else none).
        config_file: add ``--config FILE``.

    Raises:
        TypeError: a field whose annotation has no flag rule, or an unknown ``metadata["cli_type"]``.
    """
    hints = typing.get_type_hints(config_cls)
    d = {**config_defaults(config_cls), **(defaults or {})}
    types = cli_types()
    names = field_names(config_cls)
    if config_file:
        parser.add_argument(
            "--config",
            metavar="FILE",
            default=None,
            help="YAML or JSON file of settings (keys: the flag names, e.g. packing_length: 2048); flags given "
            "on the command line override it",
        )
    for f in dataclasses.fields(config_cls):
        meta = f.metadata
        text = meta.get("help")
        if callable(text):
            text = text(d)
        aliases = meta.get("aliases", ())
        if aliases and text:
            text += " (also " + ", ".join("--" + a for a in aliases) + ")"
        flag, default = flag_name(f.name), d.get(f.name)
        # the other spellings: --packing_length, and the aliases --max_length / --max-length, ...
        hidden = ["--" + n for n, name in names.items() if name == f.name and "--" + n != flag]
        annotation = strip_optional(hints[f.name])
        choices = literal_choices(annotation)
        kw: dict[str, Any] = {"dest": f.name}
        if "metavar" in meta:
            kw["metavar"] = meta["metavar"]
        if annotation is bool:
            kw.pop("metavar", None)
            action = parser.add_argument(flag, action=_Switch, default=default, help=text, **kw)
            action.help = text  # BooleanOptionalAction appends "(default: ...)", which --help does not show
            for other in hidden:
                parser.add_argument(other, action=_Switch, default=default, help=argparse.SUPPRESS, **kw)
            if "_" not in f.name:  # --no_bf16 (--use_liger_kernel's --no_use_liger_kernel comes with it)
                parser.add_argument(
                    "--no_" + f.name, action=_SwitchOff, default=default, help=argparse.SUPPRESS, **kw
                )
            continue
        if is_auto_bool(annotation):
            kw.setdefault("metavar", "auto|true|false")
            parser.add_argument(flag, action=_AutoSwitch, default=default, help=text, **kw)
            for other in hidden:
                parser.add_argument(other, action=_AutoSwitch, default=default, help=argparse.SUPPRESS, **kw)
            kw.pop("metavar")
            for off in dict.fromkeys(["--no-" + flag[2:], "--no_" + f.name]):  # --no-torch-compile: false
                parser.add_argument(off, action=_SwitchOff, default=default, help=argparse.SUPPRESS, **kw)
            continue
        if "cli_type" in meta and meta["cli_type"] not in types:
            raise TypeError(f"{config_cls.__name__}.{f.name}: unknown cli_type {meta['cli_type']!r}")
        if choices is not None:
            kw["choices"] = choices
            if "cli_type" in meta:  # other spellings mapped onto the choices (dtype: bf16 -> bfloat16)
                kw["type"] = types[meta["cli_type"]]
        elif typing.get_origin(annotation) is tuple:
            kw["nargs"] = "+"
            default = list(default) or None
        elif "cli_type" in meta:
            kw["type"] = types[meta["cli_type"]]
        elif annotation in (int, float, str):
            kw["type"] = annotation
        else:
            raise TypeError(f"{config_cls.__name__}.{f.name}: no flag rule for the annotation {annotation!r}")
        if isinstance(default, dict) and not default:
            default = None  # an empty mapping: the field's own default_factory
        store = _Extend if kw.get("nargs") == "+" else _Store
        parser.add_argument(flag, action=store, default=default, help=text, **kw)
        for other in hidden:
            parser.add_argument(other, action=store, default=default, help=argparse.SUPPRESS, **kw)
    if always_on is None:
        always_on = ALWAYS_ON if config_cls is SFTConfig else {}
    if parser.epilog is None:
        parser.epilog = "Every flag also takes its underscore spelling (--packing_length, --no_bf16)" + (
            "; " + " / ".join("--" + n for n in always_on) + " true are accepted (always on in varpack)"
            if always_on
            else ""
        )
    for name, reason in always_on.items():
        parser.add_argument(
            *dict.fromkeys(["--" + name, "--" + name.replace("_", "-")]),
            action=_AlwaysOn,
            reason=reason,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            metavar="BOOL",
            help=argparse.SUPPRESS,
        )


def config_from_args(args: argparse.Namespace, config_cls: type = SFTConfig) -> Any:
    """``config_cls`` from the flags :func:`add_config_arguments` added (absent / ``None`` for a ``data``-like
    or mapping field: the field default), over the settings of ``args.config`` when a file was given: a flag
    given on the command line wins, a flag not given takes the file's value, else the parser default.

    Raises:
        ValueError: a value the dataclass refuses (``SFTConfig.<field> has an invalid value: ...``).
        varpack.train.config_file.ConfigFileError: a bad ``--config`` file, or a value from it refused (the
            message names the setting and the file).
    """
    kw: dict[str, Any] = {}
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        annotation = strip_optional(hints[f.name])
        if typing.get_origin(annotation) is tuple:
            value = tuple(value or ())
        elif typing.get_origin(annotation) is dict and value is None:
            continue
        kw[f.name] = value
    path = getattr(args, "config", None)
    if not path:
        return config_cls(**kw)

    given = getattr(args, EXPLICIT_FIELDS, set())
    file_values = read_config_file(path, config_cls)
    from_file = {k: v for k, v in file_values.items() if k not in given}
    _drop_settings_turned_off(config_cls, kw, file_values, from_file)
    try:
        return config_cls(**{**kw, **from_file})
    except ValueError as exc:
        m = re.match(rf"{config_cls.__name__}\.(\w+) ", str(exc))
        if m and m.group(1) in from_file:
            raise ConfigFileError(f"{exc} (from config file {str(path)!r})") from None
        raise


def _drop_settings_turned_off(
    config_cls: type, kw: dict[str, Any], file_values: dict[str, Any], from_file: dict[str, Any]
) -> None:
    """Remove from ``from_file`` the file's values of settings read only with another one
    (:data:`varpack.train.config.DEPENDENT_SETTINGS`) that the command line turned off: ``--no-lora`` over a
    saved LoRA config drops its ``lora_r``, ``--objective sft`` over a DPO config its ``beta``. With the file's
    own value of that other setting the file is consistent; without it they are read nowhere, by the user's
    choice on the command line. A file that sets them without their setting is still refused."""
    if not (isinstance(config_cls, type) and issubclass(config_cls, SFTConfig)):
        return
    as_file = types.SimpleNamespace(**{**kw, **file_values})
    as_run = types.SimpleNamespace(**{**kw, **from_file})
    for name, (_needed, on) in DEPENDENT_SETTINGS.items():
        if name in from_file and on(as_file) and not on(as_run):
            del from_file[name]


def config_to_argv(config: Any) -> list[str]:
    """The flags that :func:`config_from_args` turns back into ``config`` (every field, defaults included)."""
    argv: list[str] = []
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value, flag = getattr(config, f.name), flag_name(f.name)
        annotation = strip_optional(hints[f.name])
        if annotation is bool:
            argv.append(flag if value else "--no-" + flag[2:])
        elif is_auto_bool(annotation):
            argv += [flag, "auto"] if value == "auto" else [flag if value else "--no-" + flag[2:]]
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
