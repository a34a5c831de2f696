"""``varpack plan``: encode chat data, plan the packs, print what packing would give.

    varpack plan DATA... [--tokenizer DIR|qwen3] [--packing-length N] [--packing-strategy bfd|sequential]
                 [--overflow error|drop|truncate|split] [--seed S] [--report PATH.png] [--save PATH.npz]
                 [--json]

Without DATA the built-in chat set (``varpack.data.builtin.builtin_chats()``) is used. Encoding shows the
``datasets`` progress bar on stderr and is cached (a second run reads the Arrow cache). With ``--json``,
stdout carries exactly one JSON object and nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Any

from varpack.cli._common import check_data_files, int_at_least

__all__ = ["register", "run"]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` sub-command to ``subparsers`` and return its parser."""
    from varpack.plan import DEFAULT_PACKING_LENGTH, OVERFLOW_POLICIES, STRATEGIES, strategies_help

    p = subparsers.add_parser(
        "plan",
        help="encode chat data and plan padding-free packs (samples, tokens, packs, fill)",
        description=(
            "Encode chat data (JSON / JSONL / parquet with a 'messages' column) with a chat template and "
            "plan packs of --packing-length tokens. Prints a table, or one JSON object with --json."
        ),
    )
    p.add_argument(
        "data",
        nargs="*",
        metavar="DATA",
        help="chat data files (JSON/JSONL/parquet); none: the built-in chat set",
    )
    p.add_argument(
        "--tokenizer",
        default="qwen3",
        metavar="DIR|qwen3",
        help="tokenizer directory, or an embedded tokenizer name (default: qwen3)",
    )
    p.add_argument(
        "--packing-length",
        dest="packing_length",
        type=int_at_least(1),
        default=DEFAULT_PACKING_LENGTH,
        metavar="N",
        help="tokens per pack (default: %(default)s)",
    )
    p.add_argument(
        "--packing-strategy",
        dest="packing_strategy",
        choices=STRATEGIES,
        default="bfd",
        help=f"{strategies_help()} (default: %(default)s)",
    )
    p.add_argument(
        "--overflow",
        choices=OVERFLOW_POLICIES,
        default="error",
        help="samples longer than --packing-length (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=int_at_least(0),
        default=0,
        metavar="S",
        help="seed of the per-epoch pack order (default: %(default)s)",
    )
    p.add_argument(
        "--num-proc",
        dest="num_proc",
        type=int_at_least(1),
        default=None,
        metavar="N",
        help="encoding worker processes",
    )
    p.add_argument("--report", metavar="PATH.png", default=None, help="write length / fill histograms")
    p.add_argument("--save", metavar="PATH.npz", default=None, help="save the plan (npz with JSON header)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of a table")
    return p


_EMBEDDED_CACHE: dict[str, Any] = {}


def _has_mm_chats(paths: list[str]) -> bool:
    """True when the files hold image/video chats (needs varpack.encode.multimodal; False without it)."""
    try:
        from varpack.encode.multimodal import has_mm_chats
    except ImportError:
        return False
    return has_mm_chats(list(paths))


def _tokenizer(name_or_dir: str) -> Any:
    """``load_tokenizer``, keeping embedded tokenizers (not directories) for later calls in this process."""
    from varpack.tokenizer import load_tokenizer

    if name_or_dir in ("qwen3", "qwen3.5"):
        if name_or_dir not in _EMBEDDED_CACHE:
            _EMBEDDED_CACHE[name_or_dir] = load_tokenizer(name_or_dir)
        return _EMBEDDED_CACHE[name_or_dir]
    return load_tokenizer(name_or_dir)


def _formats(data: Any) -> dict[str, int]:
    """Rows per data format (``varpack.encode.formats``); a refused row's error names its file and line."""
    from varpack.encode.chat import locate_error
    from varpack.encode.formats import data_formats

    try:
        return data_formats(data)
    except (ValueError, TypeError) as exc:
        located = locate_error(exc, data)
        if located is exc:
            raise
        raise located from exc


def run(args: argparse.Namespace) -> int:
    """Run ``varpack plan``; returns the process exit code (0 ok).

    Raises:
        ValueError / TypeError / OSError: bad data or overlong samples (``varpack.cli.main`` prints them as
            ``varpack plan: error: ...`` and exits 1).
    """
    check_data_files(args.data)  # a missing file is reported before the encoder's imports
    import numpy as np

    from varpack.plan import plan_packs
    from varpack.plan.report import plan_summary, plot_plan_report, summary_table

    t0 = time.perf_counter()
    # with --json, stdout is reserved for the JSON object: anything printed while encoding goes to stderr
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with quiet:
        from varpack.encode import encode_dataset, load_chat_data

        mm_samples = None
        formats = None
        if args.data and _has_mm_chats(args.data):
            # image/video chats: the vision-language encoder expands the placeholders (lengths only)
            from varpack.encode.multimodal import encode_any

            tokenizer = _tokenizer(args.tokenizer)
            mm_samples = encode_any(list(args.data), tokenizer, with_pixels=False, progress=True)
            lengths = np.asarray([int(s["length"]) for s in mm_samples], dtype=np.int64)
        else:
            if args.data:
                data: Any = load_chat_data(list(args.data))  # bad rows fail before the tokenizer loads
            else:
                from varpack.data.builtin import builtin_chats

                data = builtin_chats()
            formats = _formats(data)  # refused formats (preference, text, ...) fail before the tokenizer
            tokenizer = _tokenizer(args.tokenizer)
            encoded = encode_dataset(data, tokenizer, num_proc=args.num_proc, desc="encode")
            lengths = np.asarray(encoded.with_format("numpy")["length"], dtype=np.int64)
    t1 = time.perf_counter()
    plan = plan_packs(
        lengths,
        args.packing_length,
        strategy=args.packing_strategy,
        overflow=args.overflow,
        seed=args.seed,
    )
    t2 = time.perf_counter()
    if mm_samples is not None and plan.pieces:
        from varpack.encode.multimodal import check_plan_cuts

        bad = check_plan_cuts(mm_samples, plan.pieces)
        if bad:
            shown = "; ".join(
                f"piece {b['piece_id']} = sample {b['sample_id']} [{b['start']}, {b['stop']})"
                for b in bad[:20]
            )
            raise ValueError(
                f"{len(bad)} piece(s) of overlong samples would cut through an image or video ({shown}); "
                "choose overflow='drop' or a larger packing_length"
            )
    if args.report:
        plot_plan_report(lengths, plan, args.report)
    if args.save:
        args.save = str(plan.save(args.save))
    context: dict[str, Any] = {
        "data": list(args.data) if args.data else "builtin",
        "tokenizer": args.tokenizer,
        "seed": plan.seed,
        "seconds": {"encode": t1 - t0, "plan": t2 - t1},
    }
    if args.report:
        context["report"] = args.report
    if args.save:
        context["plan_path"] = args.save
    if formats is not None:
        context["formats"] = formats
    summary = plan_summary(plan, lengths, **context)
    if args.json:
        sys.stdout.write(json.dumps(summary) + "\n")
        sys.stdout.flush()
    else:
        from rich.console import Console

        Console().print(summary_table(summary))
    return 0
