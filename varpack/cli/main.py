"""``varpack`` command line: one sub-command per module in ``varpack.cli``.

Each sub-command module defines ``register(subparsers) -> argparse.ArgumentParser`` and
``run(args) -> int``. Building the parsers imports no torch, transformers or datasets (each ``run`` imports
what it needs), so ``varpack --help``, ``varpack <command> --help`` and argument errors are quick.

Flags are matched whole: no parser takes an abbreviation (``allow_abbrev=False``; ``--pack 4096`` is an
unrecognized argument, not a prefix of some ``--packing-*`` flag), so a typo never lands on another flag.

Exit codes are the same for every sub-command (:mod:`varpack.cli._common`): 2 for a usage error (argparse),
1 for an error found while running (``varpack <command>: error: ...`` on stderr, no traceback), 0 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from varpack.cli._common import DATA_ERRORS, UsageError, flag_wording

# name -> module implementing it
SUBCOMMANDS = {
    "plan": "varpack.cli.plan",
    "sft": "varpack.cli.sft",
    "check": "varpack.cli.check",
    "demo": "varpack.cli.demo",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="varpack",
        description="Padding-free sequence packing for LLM fine-tuning (packed step == unpacked step).",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        mod = importlib.import_module(module)
        p = mod.register(sub)
        p.allow_abbrev = False  # every sub-command: a flag is matched whole, never by a prefix
        p.set_defaults(_run=mod.run, _parser=p)
    return parser


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    return code if isinstance(code, int) else (0 if code is None else 1)


def main(argv: list[str] | None = None) -> int:
    """Run ``varpack`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code (argparse's own exits,
    ``--help`` and usage errors, included) instead of raising ``SystemExit``."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # reported by the sub-command's parser: its usage line and `varpack <command>: error:`
            getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:
        return _exit_code(exc)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    sub: argparse.ArgumentParser = args._parser
    try:
        return int(args._run(args) or 0)
    except UsageError as exc:
        try:
            sub.error(flag_wording(str(exc), sub) if getattr(exc, "flag_wording", True) else str(exc))
        except SystemExit as stop:
            return _exit_code(stop)
        raise AssertionError("argparse's error() returned") from exc  # pragma: no cover
    except DATA_ERRORS as exc:
        print(f"{sub.prog}: error: {flag_wording(str(exc), sub)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
