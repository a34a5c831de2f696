"""What every ``varpack`` sub-command shares: argument types, the exit-code convention, error wording.

Exit codes (all sub-commands): 0 success; 2 usage error (a bad flag or flag value, reported by ``argparse``
with the sub-command's usage line); 1 an error found while running (a missing or bad data file, an unknown
model, overlong samples, no CUDA for ``--device cuda``; and ``varpack check`` FAIL), reported as one line
``varpack <command>: error: <message>`` on stderr, without a traceback.

This module imports nothing heavy (no torch, transformers or datasets): the parsers are built from it, and
``varpack --help`` and argument errors answer in well under a second.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

from varpack._argtypes import DTYPE_SPELLINGS, dtype_spelling, float_above, int_at_least, max_steps_type

__all__ = [
    "ATTN_BACKENDS",
    "DATA_ERRORS",
    "DTYPE_SPELLINGS",
    "GATED_DELTA_BACKENDS",
    "UsageError",
    "check_data_files",
    "dtype_spelling",
    "flag_wording",
    "float_above",
    "int_at_least",
    "max_steps_type",
]

#: ``--attn-backend`` values: ``auto`` and the names of :data:`varpack.attn.BACKENDS` (kept here because
#: importing :mod:`varpack.attn` imports torch; tests/cli/test_cli_consistency.py checks that they agree).
ATTN_BACKENDS: tuple[str, ...] = (
    "auto",
    "reference",
    "sdpa",
    "torch_varlen",
    "flex",
    "flash_attn",
    "flash_attn_3",
    "flash_attn_4",
    "triton_short",
)

#: ``--gated-delta-backend`` values: ``auto`` and the names of
#: :data:`varpack.ops.gated_delta_rule.dispatch.BACKENDS` (kept here because that module imports torch;
#: tests/cli/test_cli_consistency.py checks that they agree).
GATED_DELTA_BACKENDS: tuple[str, ...] = ("auto", "fla", "fla_hybrid", "chunk", "chunk_compiled", "naive")

#: Exceptions that a sub-command's run reports as ``varpack <command>: error: ...`` with exit code 1.
DATA_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, OSError)


class UsageError(ValueError):
    """A flag value (or combination) that is wrong whatever the data: exit code 2 with the usage line.

    ``flag_wording = False``: print the message as it is (a ``--config`` file's error names the file's keys).
    """

    flag_wording: bool = True


def check_data_files(paths: Sequence[str] | None) -> None:
    """Refuse a ``--data`` / ``DATA`` path that is not a file before anything heavy is imported
    (:func:`varpack.data.jsonfile.require_file`, the check of every data reader).

    Raises:
        FileNotFoundError: ``chat data file not found: 'PATH'``.
        IsADirectoryError: ``chat data path 'DIR' is a directory, not a file: give the data files in it (e.g.
            DIR/*.jsonl; ...)``.
    """
    from varpack.data.jsonfile import require_file

    for p in paths or ():
        require_file(p)


def _long_flag(action: argparse.Action) -> str:
    """The flag named after the setting (``--use-liger-kernel``, not ``--no-use-liger-kernel`` of a
    ``--flag/--no-flag`` pair), else the longest option string."""
    named = "--" + action.dest.replace("_", "-")
    return named if named in action.option_strings else max(action.option_strings, key=len)


def flag_wording(message: str, parser: argparse.ArgumentParser) -> str:
    """Reword a library error for the command line: a setting named as its Python argument becomes the
    sub-command's flag (``overflow='drop'`` -> ``--overflow drop``, ``packing_length=256`` ->
    ``--packing-length 256``, ``SFTConfig.packing_length`` / ``use_liger_kernel`` / ``SFTConfig.beta`` ->
    ``--packing-length`` / ``--use-liger-kernel`` / ``--beta``). Only names that are flags of ``parser`` are
    changed; a bare name (without ``SFTConfig.``) is changed only when it has an underscore (``model`` or
    ``seed`` in prose stay as they are). A setting followed by its own flag in parentheses
    (``torch_compile (--torch-compile; ...)``) names the flag once (``--torch-compile (...)``); a setting
    written as flag then field (``--packs-per-step 2 (packs_per_step=2)``, :func:`varpack.train.config.setting_text`)
    stays as it is.
    """
    for action in parser._actions:  # argparse keeps its actions here; there is no public accessor
        if (
            not action.option_strings
            or action.dest in (argparse.SUPPRESS, "help")
            or action.help == argparse.SUPPRESS
        ):
            continue
        flag, dest = _long_flag(action), re.escape(action.dest)
        if action.nargs != 0:  # takes a value: name=value -> --flag value
            message = re.sub(
                rf"(?<![\w.-])(?:SFTConfig\.)?{dest}=('[^']*'|\"[^\"]*\"|[^\s,;)]+)",
                lambda m, flag=flag: (
                    m.group(0)  # "--flag value (name=value)": the field beside its flag stays
                    if re.search(rf"{re.escape(flag)}(?: \S+)? \($", m.string[: m.start()])
                    else f"{flag} {m.group(1).strip(chr(39) + chr(34))}"
                ),
                message,
            )
        # a field named as SFTConfig.<name> is the setting whatever its name (SFTConfig.beta -> --beta)
        prefix = r"(?:SFTConfig\.)?" if "_" in action.dest else r"SFTConfig\."
        message = re.sub(rf"(?<![\w.-]){prefix}{dest}(?![\w=])", flag, message)
        if "_" in action.dest:
            # "setting (--flag; more)" became "--flag (--flag; more)": name the flag once
            f = re.escape(flag)
            message = re.sub(rf"{f} \({f}\)", flag, message)
            message = re.sub(rf"{f} \({f}; ", f"{flag} (", message)
    return message
