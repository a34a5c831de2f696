"""``varpack`` command line: one sub-command per module in ``varpack.cli``.

Each sub-command module defines ``register(subparsers) -> argparse.ArgumentParser`` and
``run(args) -> int``. Modules are imported only when listed here, so ``varpack --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

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
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS.values():
        mod = importlib.import_module(module)
        p = mod.register(sub)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
