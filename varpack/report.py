"""PNG report of a packing plan: how long the samples are and how full the packs are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from varpack.plan import PackPlan

__all__ = ["plot_plan_report"]


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

    arr = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if arr.shape[0] != plan.num_samples:
        raise ValueError(
            f"lengths has {arr.shape[0]} entries but the plan was made for {plan.num_samples} samples"
        )
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
