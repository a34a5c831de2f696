"""``varpack`` command line: one sub-command per module in ``varpack.cli``.

Each sub-command module defines ``register(subparsers) -> argparse.ArgumentParser`` and
``run(args) -> int``. Building the parsers imports no torch, transformers or datasets (each ``run`` imports
what it needs), so ``varpack --help``, ``varpack <command> --help`` and argument errors are quick.

Flags are matched whole: no parser takes an abbreviation (``allow_abbrev=False``; ``--pack 4096`` is an
unrecognized argument, not a prefix of some ``--packing-*`` flag), so a typo never lands on another flag. An
unrecognized flag is reported with the sub-command's closest flag (``--packing-lenght``: "did you mean
--packing-length?"), each of several. A flag written before the sub-command is refused naming the order that
works (``varpack sft --packing-length 10``); ``varpack --help sft`` is ``sft``'s help; a misspelled command gets its
closest command. Every sub-command takes the underscore spelling of its flags (``--packing_length``, as TRL
and HF scripts write them): rewritten to the hyphen spelling before parsing, only where the sub-command has
that flag.

Exit codes are the same for every sub-command (:mod:`varpack.cli._common`): 2 for a usage error (argparse),
1 for an error found while running (``varpack <command>: error: ...`` on stderr, no traceback), 0 otherwise.
"""

from __future__ import annotations

import argparse
import difflib
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


def _sub_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser | None:
    """The sub-command parser ``argv`` names (its first sub-command word), or ``None``."""
    command = next((a for a in argv if a in SUBCOMMANDS), None)
    for action in parser._actions:  # argparse keeps the sub-parsers here; there is no public accessor
        if isinstance(action, argparse._SubParsersAction) and command is not None:
            return action.choices.get(command)
    return None


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


def hyphen_spellings(argv: list[str], sub: argparse.ArgumentParser | None) -> list[str]:
    """``argv`` with each ``--under_score`` flag (or ``--under_score=value``) that ``sub`` lacks but has as
    ``--under-score`` rewritten to that; everything after ``--`` and every other word unchanged."""
    if sub is None:
        return list(argv)
    known, out = set(_flags(sub)), []
    for i, word in enumerate(argv):
        if word == "--":
            return out + list(argv[i:])
        flag, eq, value = word.partition("=")
        if flag.startswith("--") and "_" in flag and flag not in known and flag.replace("_", "-") in known:
            word = flag.replace("_", "-") + eq + value
        out.append(word)
    return out


def _did_you_mean(extra: list[str], sub: argparse.ArgumentParser) -> str:
    """For each unrecognized flag before any ``--``: the flags of ``sub`` it abbreviates, each setting once
    (``--warmup``: ``--warmup-steps``; ``--pack``: ``one of --packing, --packing-length, ...``), else the
    closest flag (its hyphen spelling):
    `` (did you mean --x?)`` for one, `` (did you mean --x for --y, --z for --w?)`` for several; ``""`` when
    no flag is close."""
    known = set(_flags(sub))
    flags = [f for f in _flags(sub) if not ("_" in f and f.replace("_", "-") in known)]
    # each setting once, by its first flag (--grad-accum, not also its alias --gradient-accumulation-steps)
    dest_of = {f: a.dest for a in sub._actions for f in a.option_strings}
    guesses: list[tuple[str, str]] = []
    for word in extra:
        if word == "--":  # what follows is not a flag of this command
            break
        if word.startswith("-"):
            typed = word.partition("=")[0]
            started: dict[str, str] = {}
            for f in flags if len(typed) > 3 else ():
                if f.startswith(typed):
                    started.setdefault(dest_of[f], f)
            if started:  # an abbreviation (--pack, --warmup): the flags it starts, not the nearest spelling
                names = sorted(started.values())
                guesses.append((names[0] if len(names) == 1 else "one of " + ", ".join(names), typed))
                continue
            close = difflib.get_close_matches(typed, flags, n=1, cutoff=0.75)
            if close:
                guesses.append((close[0], typed))
    if len(guesses) == 1:
        return f" (did you mean {guesses[0][0]}?)"
    if guesses:
        return " (did you mean " + ", ".join(f"{g} for {t}" for g, t in guesses) + "?)"
    return ""


def _flags_before_command(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Refuse a flag written before the sub-command (``varpack --packing-length 10 sft``), or with no
    sub-command at all: argparse would take its value for the command name ("invalid choice: '10'").

    Raises:
        SystemExit: through ``parser.error`` (exit code 2): the command line with the flag moved after the
            command where the command has that flag; else that the command has no such flag (with the closest
            one); with no command, the commands there are.
    """
    command = next((i for i, a in enumerate(argv) if a in SUBCOMMANDS), None)
    before = argv if command is None else argv[:command]
    if "--" in before:
        return
    if command is None and argv and not argv[0].startswith("-"):  # a misspelled command
        close = difflib.get_close_matches(argv[0].lower(), list(SUBCOMMANDS), n=1, cutoff=0.6)
        guess = f" (did you mean {close[0]}?)" if close else ""
        parser.error(f"unknown command {argv[0]!r}{guess}; the commands: {', '.join(SUBCOMMANDS)}")
    early = [a for a in before if a.startswith("-") and a not in ("-h", "--help")]
    if not early:
        if command is not None and before:  # varpack --help sft: the command's help
            _sub_parser(parser, argv).print_help()
            parser.exit(0)
        return
    if command is None:
        parser.error(
            f"{early[0]} needs a command before it: varpack COMMAND {early[0]} ... (COMMAND: {', '.join(SUBCOMMANDS)})"
        )
    name, sub = argv[command], _sub_parser(parser, argv)
    flag = early[0].partition("=")[0]
    if sub is not None and flag not in _flags(sub) and flag.replace("_", "-") not in _flags(sub):
        parser.error(f"{early[0]} comes before the command {name!r}, and {name} has no {flag} flag{_did_you_mean([flag], sub)}")
    moved = " ".join([name, *argv[:command], *argv[command + 1 :]][:6])
    parser.error(
        f"{early[0]} comes before the command {name!r}: a command's flags go after its name "
        f"(varpack {moved}{' ...' if len(argv) > 6 else ''})"
    )


def _more_positionals(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """``extra`` less the words that belong to a sub-command's list positional (``varpack plan``'s ``DATA``
    paths): argparse takes such a list in one run, so paths on both sides of a flag (``varpack plan a.jsonl
    --json b.jsonl``) left the later ones unrecognized. Those words are appended to the list, in order; words
    after ``--`` and flags stay in ``extra`` (still an error)."""
    sub = getattr(args, "_parser", None)
    if sub is None or not extra:
        return extra
    lists = [a.dest for a in sub._actions if not a.option_strings and a.nargs in ("*", "+")]
    if len(lists) != 1 or "--" in extra:
        return extra
    words = [w for w in extra if not w.startswith("-")]
    if not words:
        return extra
    getattr(args, lists[0]).extend(words)
    return [w for w in extra if w.startswith("-")]


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    return code if isinstance(code, int) else (0 if code is None else 1)


def main(argv: list[str] | None = None) -> int:
    """Run ``varpack`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code (argparse's own exits,
    ``--help`` and usage errors, included) instead of raising ``SystemExit``."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = hyphen_spellings(argv, _sub_parser(parser, argv))
    try:
        _flags_before_command(parser, argv)
        args, extra = parser.parse_known_args(argv)
        extra = _more_positionals(args, extra)
        if extra:  # reported by the sub-command's parser: its usage line and `varpack <command>: error:`
            sub = getattr(args, "_parser", parser)
            sub.error(f"unrecognized arguments: {' '.join(extra)}{_did_you_mean(extra, sub)}")
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
