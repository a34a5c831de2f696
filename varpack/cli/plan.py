"""``varpack plan``: encode chat data, plan the packs, print what packing would give.

    varpack plan DATA... (or --data PATH...) [--objective sft|dpo] [--tokenizer DIR|qwen3] [--packing-length N]
                 [--packing-strategy bfd|sequential] [--overflow error|drop|truncate|split] [--seed S]
                 [--report PATH.png] [--save PATH.npz] [--json]

Without DATA the built-in chat set (``varpack.data.builtin.builtin_chats()``) is used, with ``--objective dpo``
the built-in preference pairs. ``--objective dpo`` reads preference data ``{prompt, chosen, rejected}`` and
plans it as ``varpack sft --objective dpo`` does: each pair's two sequences in one pack (overlong pairs follow
``--overflow`` error / drop as units); the report names the pairs. Encoding shows the ``datasets`` progress bar
on stderr and is cached (a second run reads the Arrow cache). With ``--json``, stdout carries exactly one JSON
object and nothing else (with ``--objective dpo`` also ``objective`` and ``preference_pairs``).
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
        "--data",
        nargs="+",
        action="extend",  # --data a --data b: both
        default=None,
        dest="data_option",
        metavar="PATH",
        help="the same files as DATA, written as varpack sft and varpack check take them",
    )
    p.add_argument(
        "--objective",
        choices=("sft", "dpo"),
        default="sft",
        help=(
            "sft: chat data; dpo: preference pairs {prompt, chosen, rejected}, each pair in one pack, as "
            "'varpack sft --objective dpo' plans them (default: %(default)s)"
        ),
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


def _tokenizer(name_or_dir: str) -> Any:
    """``load_tokenizer``, keeping embedded tokenizers (not directories) for later calls in this process."""
    from varpack.data.tokenizer import load_tokenizer

    if name_or_dir in ("qwen3", "qwen3.5"):
        if name_or_dir not in _EMBEDDED_CACHE:
            _EMBEDDED_CACHE[name_or_dir] = load_tokenizer(name_or_dir)
        return _EMBEDDED_CACHE[name_or_dir]
    return load_tokenizer(name_or_dir)


def run(args: argparse.Namespace) -> int:
    """Run ``varpack plan``; returns the process exit code (0 ok).

    Raises:
        ValueError / TypeError / OSError: bad data or overlong samples (``varpack.cli.main`` prints them as
            ``varpack plan: error: ...`` and exits 1).
    """
    args.data = [*args.data, *(args.data_option or ())]  # DATA and --data name the same files
    check_data_files(args.data)  # a missing file is reported before the encoder's imports

    from varpack.plan import plan_packs
    from varpack.plan.report import plan_summary, plot_plan_report, summary_table

    t0 = time.perf_counter()
    # with --json, stdout is reserved for the JSON object: anything printed while encoding goes to stderr
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    dpo = args.objective == "dpo"
    groups = pairs = None
    with quiet:
        if dpo:  # as varpack sft --objective dpo: pair k -> samples 2k (chosen), 2k + 1 (rejected)
            import numpy as np

            from varpack.data.preference import encode_pairs, load_pairs, pair_groups

            encoded = encode_pairs(load_pairs(args.data or None), _tokenizer(args.tokenizer))
            lengths = np.asarray([s["length"] for s in encoded], dtype=np.int64)
            groups, pairs = pair_groups(len(encoded)), len(encoded) // 2
            mm_samples = formats = None
        else:
            from varpack.data import load_and_encode

            # image/video chats are encoded for their lengths only (placeholders expanded, pixels not decoded);
            # bad rows and refused formats (preference, text, ...) fail before the tokenizer loads
            data = load_and_encode(
                args.data,
                lambda: _tokenizer(args.tokenizer),
                with_pixels=False,
                num_proc=args.num_proc,
                progress=True,
                formats=True,
            )
            lengths = data.lengths()
            mm_samples = data.samples if data.multimodal else None
            formats = data.formats
    t1 = time.perf_counter()
    from varpack.data.chat import locate_samples
    from varpack.data.dataset import supervised_ranges

    paths = () if dpo else data.paths  # (preference pairs: two samples per row)

    def locate(ids: Any) -> dict[int, str]:
        return locate_samples(paths, ids)

    plan = plan_packs(
        lengths,
        args.packing_length,
        strategy=args.packing_strategy,
        overflow=args.overflow,
        seed=args.seed,
        # what `varpack sft` leaves out, reported by id (not with pairs: a pair is packed or dropped whole)
        supervised=None if dpo else supervised_ranges(data.samples),
        groups=groups,
        group_noun="pair",
        locate=locate if paths else None,  # an overlong sample named with its FILE:LINE
    )
    t2 = time.perf_counter()
    if mm_samples is not None and plan.pieces:
        from varpack.data.multimodal import check_plan_cuts

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
    ov = plan.overflow
    named = ov["overlong_ids"] + ov["unsupervised_ids"] + [s for s, _, _ in ov["unsupervised_pieces"]]
    if paths and named:  # where the overlong and left-out samples come from
        context["locations"] = {str(i): w for i, w in sorted(locate(named).items())}
    if dpo:
        context.update(objective="dpo", preference_pairs=pairs)
    summary = plan_summary(plan, lengths, **context)
    if args.json:
        sys.stdout.write(json.dumps(summary) + "\n")
        sys.stdout.flush()
    else:
        from rich.console import Console

        Console().print(summary_table(summary))
    return 0
