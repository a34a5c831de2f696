"""The packing report of a plan: what packing gives (samples, tokens, packs, fill, overflow), as data plus
renderers.

- :func:`plan_summary`: the data, one JSON-ready dict (``varpack plan --json`` prints it).
- :func:`summary_table`: the rich table of ``varpack plan``.
- :func:`summary_text`: the plain-text packing report that ``varpack sft`` / ``varpack demo`` print before
  training (:func:`format_packing_report` builds it straight from a plan).
- :func:`plot_plan_report`: PNG histograms of the sample lengths and the pack fill (``varpack plan --report``).

Importing this module imports numpy only; the renderers import rich / matplotlib when called.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from varpack.plan.plan import PackPlan

__all__ = ["format_packing_report", "plan_summary", "plot_plan_report", "summary_table", "summary_text"]

_ACTION = {"drop": "dropped", "truncate": "truncated", "split": "split"}


def _lengths_of(lengths: Any, plan: PackPlan) -> np.ndarray:
    """``lengths`` as ``[N]`` int64, checked against the plan (ValueError when the count differs)."""
    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if arr.shape[0] != plan.num_samples:
        raise ValueError(
            f"lengths has {arr.shape[0]} entries but the plan was made for {plan.num_samples} samples"
        )
    return arr


def _summary(plan: PackPlan, input_tokens: int, context: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = dict(plan.stats)
    out["input_tokens"] = int(input_tokens)
    out["overflow"] = plan.overflow
    out.update(context)
    return out


def plan_summary(plan: PackPlan, lengths: Any, **context: Any) -> dict[str, Any]:
    """The packing report as data: one JSON-ready dict.

    Args:
        plan: the :class:`~varpack.plan.PackPlan`.
        lengths: ``[N]`` integer sample lengths in tokens, the ones ``plan`` was made from.
        **context: the caller's fields, added after the plan's own, in the given order. The renderers read
            ``data`` (:func:`summary_table`: a list of file names or ``"builtin"``; :func:`summary_text`: a
            label), ``locations`` (``{"sample_id": "FILE:LINE"}``, :func:`varpack.data.chat.locate_samples`:
            where the overlong and left-out samples named come from), and :func:`summary_table` also ``formats``
            (rows per data format) and ``seconds`` (``{"encode": s, "plan": s}``) when present.

    Returns:
        ``plan.stats`` (counts, tokens, fill, overflow counts, fingerprint; see
        :attr:`~varpack.plan.PackPlan.stats`), then ``input_tokens`` (tokens of all samples before packing,
        ``sum(lengths)``), ``overflow`` (the plan's full overflow report, ids included), then ``context``.

    Raises:
        ValueError: if ``lengths`` does not have ``plan.num_samples`` entries.
    """
    return _summary(plan, int(_lengths_of(lengths, plan).sum()), context)


def _overflow_line(ov: dict[str, Any], *, split: str) -> str:
    """``"3 overlong (dropped), 1 empty, 42 tokens dropped"``; ``split`` formats the split case's pieces."""
    if ov.get("overlong_group_ids"):  # a plan with groups (preference pairs): overlong as units
        gids = ov["overlong_group_ids"]
        noun = ov.get("group_noun", "group")
        shown = ", ".join(str(g) for g in gids[:10]) + (", ..." if len(gids) > 10 else "")
        over = (
            f"{len(gids):,} overlong {noun}(s) of {len(ov['overlong_ids']):,} samples "
            f"({_ACTION.get(ov['policy'], ov['policy'])}; {noun} ids {shown})"
        )
    elif ov["overlong_ids"]:
        over = f"{len(ov['overlong_ids']):,} overlong ({_ACTION.get(ov['policy'], ov['policy'])}"
        over += split.format(ov["num_pieces"]) if ov["policy"] == "split" else ")"
        if ov.get("split_targets_at_cuts"):
            over += (
                f", {ov['split_targets_at_cuts']:,} supervised tokens at the cuts not trained (a piece's first "
                "token has no token before it)"
            )
    else:
        over = "none overlong"
    return over + f", {len(ov['empty_ids']):,} empty, {ov['tokens_dropped']:,} tokens dropped"


def _at(where: dict[str, str], sample_id: int) -> str:
    """``" (FILE:LINE)"`` of a sample in a summary's ``locations``, or ``""``."""
    at = where.get(str(sample_id))
    return f" ({at})" if at else ""


def _overlong_line(summary: dict[str, Any]) -> str | None:
    """``"sample 2: 412 tokens (chats.jsonl:4), sample 9: 5,000 tokens (...) and 3 more"``: the first 10 overlong
    samples, with their ``locations`` when the summary has them; None when none is overlong (or for a plan with
    groups, whose overflow line names the groups)."""
    ov = summary["overflow"]
    ids = ov.get("overlong_ids") or []
    if not ids or ov.get("overlong_group_ids"):
        return None
    where = summary.get("locations") or {}
    lengths = ov.get("overlong_lengths") or []
    named = [
        f"sample {i}" + (f": {lengths[k]:,} tokens" if k < len(lengths) else "") + _at(where, i)
        for k, i in enumerate(ids[:10])
    ]
    more = len(ids) - len(named)
    return ", ".join(named) + (f" and {more:,} more" if more else "")


def _unsupervised_line(ov: dict[str, Any], where: dict[str, str] | None = None) -> str | None:
    """``"1 sample, 2 pieces left out (no supervised token): sample 3, sample 5 [0, 64), ..."`` or None; each
    named with its place in ``where`` (a summary's ``locations``) when known."""
    ids = ov.get("unsupervised_ids") or []
    pieces = ov.get("unsupervised_pieces") or []
    if not ids and not pieces:
        return None
    where = where or {}
    named = [f"sample {i}{_at(where, i)}" for i in ids[:10]]
    named += [f"sample {s} [{a}, {b}){_at(where, s)}" for s, a, b in pieces[: 10 - len(named)]]
    more = len(ids) + len(pieces) - len(named)
    counts = [f"{len(ids):,} sample(s)" if ids else "", f"{len(pieces):,} piece(s)" if pieces else ""]
    return (
        f"{', '.join(c for c in counts if c)} left out, no supervised token (they would train nothing): "
        f"{', '.join(named)}{f' and {more:,} more' if more else ''}"
    )


def _format_label(formats: dict[str, int]) -> str:
    """``messages``, ``sharegpt (converted)`` or ``messages 120, alpaca 30 (converted)``."""
    if len(formats) == 1:
        fmt = next(iter(formats))
        return fmt if fmt == "messages" else f"{fmt} (converted)"
    return ", ".join(f"{f} {n:,}" + ("" if f == "messages" else " (converted)") for f, n in formats.items())


def _strategy_label(summary: dict[str, Any]) -> str:
    """``bfd``, or for a streaming packer's summary ``bfd over a buffer of 10,000 samples``."""
    if "buffer_size" in summary:
        return f"{summary['strategy']} over a buffer of {summary['buffer_size']:,} samples"
    return str(summary["strategy"])


def _stream_line(summary: dict[str, Any]) -> str | None:
    """For a streaming summary: the final partial packs, or how many items wait in the buffer."""
    if "buffer_size" not in summary:
        return None
    if summary["finished"]:
        return (
            f"end of stream: {summary['final_packs']:,} final pack(s) of {summary['final_tokens']:,} tokens "
            "emitted (nothing left in the buffer)"
        )
    return f"{summary['buffered']:,} item(s) in the buffer, not packed yet"


def summary_table(summary: dict[str, Any]) -> Any:
    """The ``varpack plan`` table of a :func:`plan_summary` (a ``rich.table.Table``; print it with
    ``rich.console.Console().print``). Rows: data, pairs (when ``preference_pairs`` is given: ``varpack plan
    --objective dpo``), format (when ``formats`` is given), samples, tokens, packs, lower bound, fill, overflow,
    overlong (the first 10 overlong samples: id, tokens and, with ``locations``, ``FILE:LINE``), no loss (samples
    left out for want of a supervised token), time (when ``seconds`` is given)."""
    from rich.table import Table

    ov = summary["overflow"]
    over = _overflow_line(ov, split=", {:,} pieces)")
    data = summary["data"]
    table = Table(
        title=(
            f"varpack plan: {_strategy_label(summary)}, packing_length={summary['packing_length']:,}, "
            f"overflow={ov['policy']}"
        ),
        show_header=True,
    )
    table.add_column("quantity")
    table.add_column("value", justify="right")
    pairs = summary.get("preference_pairs")
    builtin = "built-in pairs" if pairs is not None else "built-in chats"
    table.add_row("data", builtin if data == "builtin" else ", ".join(data))
    if pairs is not None:
        table.add_row("pairs", f"{pairs:,} preference pairs, each in one pack")
    if summary.get("formats"):
        table.add_row("format", _format_label(summary["formats"]))
    table.add_row("samples", f"{summary['num_samples']:,}")
    table.add_row("tokens (input)", f"{summary['input_tokens']:,}")
    table.add_row("tokens (packed)", f"{summary['total_tokens']:,}")
    table.add_row("packs", f"{summary['num_packs']:,}")
    table.add_row("lower bound", f"{summary['lower_bound_packs']:,}")
    table.add_row("fill", f"{summary['fill_ratio']:.4%}")
    table.add_row("overflow", over)
    overlong = _overlong_line(summary)
    if overlong:
        table.add_row("overlong", overlong)
    unsup = _unsupervised_line(ov, summary.get("locations"))
    if unsup:
        table.add_row("no loss", unsup)
    stream = _stream_line(summary)
    if stream:
        table.add_row("stream", stream)
    if "seconds" in summary:
        sec = summary["seconds"]
        table.add_row("time", f"encode {sec['encode']:.2f} s, plan {sec['plan']:.3f} s")
    return table


def summary_text(summary: dict[str, Any]) -> str:
    """The packing report printed before training, from a :func:`plan_summary` whose ``data`` is a label.

    Args:
        summary: from :func:`plan_summary` (or :meth:`varpack.plan.streaming.StreamingPacker.summary`).

    Returns:
        Lines ``packing report (...)``, data, samples, packs, tokens, fill, overflow[, overlong: the first 10
        overlong samples by id, tokens and, with ``locations``, ``FILE:LINE``][, no loss: the samples and pieces
        left out for want of a supervised token, the first 10 by sample id and token range][, stream].
    """
    ov = summary["overflow"]
    over = _overflow_line(ov, split=" into {:,} pieces)")
    lines = [
        f"packing report ({_strategy_label(summary)}, packing_length={summary['packing_length']:,}, "
        f"overflow={ov['policy']})",
        f"  data      {summary['data']}",
        f"  samples   {summary['num_samples']:,} ({summary['input_tokens']:,} tokens)",
        f"  packs     {summary['num_packs']:,} (lower bound {summary['lower_bound_packs']:,})",
        f"  tokens    {summary['total_tokens']:,} packed",
        f"  fill      {summary['fill_ratio']:.2%}",
        f"  overflow  {over}",
    ]
    overlong = _overlong_line(summary)
    if overlong:
        lines.append(f"  overlong  {overlong}")
    unsup = _unsupervised_line(ov, summary.get("locations"))
    if unsup:
        lines.append(f"  no loss   {unsup}")
    stream = _stream_line(summary)
    if stream:
        lines.append(f"  stream    {stream}")
    return "\n".join(lines)


def format_packing_report(plan: PackPlan, *, data: str, input_tokens: int) -> str:
    """:func:`summary_text` of ``plan`` when only the input token count is at hand (not the lengths).

    Args:
        plan: the :class:`~varpack.plan.PackPlan`.
        data: label of the data source (file names, ``"built-in chats"``).
        input_tokens: tokens of all samples before packing.
    """
    return summary_text(_summary(plan, input_tokens, {"data": data}))


def plot_plan_report(lengths: Any, plan: PackPlan, path: str | Path, *, title: str | None = None) -> Path:
    """Write a PNG with two histograms: sample lengths (tokens) and pack fill (tokens / packing_length).

    Uses matplotlib's Agg canvas directly (no display, no change of the global backend).

    Args:
        lengths: ``[N]`` integer sample lengths in tokens, the ones ``plan`` was made from.
        plan: the :class:`~varpack.plan.PackPlan`.
        path: output file (PNG); parent folders are created.
        title: optional figure title (defaults to the strategy and packing_length).

    Returns:
        The path written.

    Raises:
        ValueError: if ``lengths`` does not have ``plan.num_samples`` entries.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    arr = _lengths_of(lengths, plan)
    L = plan.packing_length
    stats = plan.stats
    fig = Figure(figsize=(11, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)

    bins = min(80, max(10, int(np.sqrt(max(arr.size, 1)))))
    if arr.size:
        ax1.hist(arr, bins=bins, color="#4c72b0")
    ax1.axvline(L, color="#c44e52", linestyle="--", label=f"packing_length = {L}")
    n_over = stats["num_overlong"]
    ax1.set_title(f"sample lengths\nN = {arr.size:,}, overlong = {n_over:,}, empty = {stats['num_empty']:,}")
    ax1.set_xlabel("tokens per sample")
    ax1.set_ylabel("samples")
    ax1.legend(loc="upper right")

    fill = plan.pack_lengths / L if plan.num_packs else np.zeros(0)
    if fill.size:
        ax2.hist(fill, bins=np.linspace(0.0, 1.0, 51), color="#55a868", log=True)
    ax2.set_xlim(0.0, 1.0)
    ax2.set_title(
        f"pack fill\npacks = {plan.num_packs:,}, lower bound = {plan.lower_bound_packs:,}, "
        f"fill = {plan.fill_ratio:.2%}"
    )
    ax2.set_xlabel("tokens in pack / packing_length")
    ax2.set_ylabel("packs (log scale)")
    fig.suptitle(title or f"varpack plan: strategy={plan.strategy}, packing_length={L}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
