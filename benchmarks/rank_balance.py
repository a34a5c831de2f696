"""Per-rank cost balance of ``varpack sft``'s pack layout (#13) on the real length mix of ../shared/data.

For each (world size, packs per rank per micro-batch) the table gives the cost model's imbalance of one epoch,
sum over micro-batch slots of the slowest rank's cost / sum of the mean rank's cost (1.0: no rank ever waits
at the all-reduce; :func:`varpack.plan.balance.layout_imbalance`), for the balanced layout
(``rank_balance``, the default) and for the baseline measured in the same run: the same packs in the plan's
per-epoch order dealt round-robin (``--no-rank-balance``). Cost = tokens + attention_weight x sum L_i^2 with
the attention weight of the Qwen3-0.6B shape (:func:`varpack.plan.balance.attention_cost_weight`). Also
shown: a lognormal length mix (median ~400 tokens, long tail), the kind of mix where the quadratic term
matters most.

    python benchmarks/rank_balance.py [--packing-length 8192] [--data-dir ../shared/data]

These are cost-model figures (no GPU): the measured per-rank step times on GPUs are for benchmarks/train.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _lengths import real_lengths_per_file  # noqa: E402

from varpack.models import model_config  # noqa: E402
from varpack.plan import plan_packs  # noqa: E402
from varpack.plan.balance import attention_cost_weight, epoch_layout, layout_imbalance, pack_costs  # noqa: E402

LAYOUTS = ((2, 1), (2, 2), (4, 1), (8, 1), (8, 2))


def rows_for(name: str, lengths: np.ndarray, packing_length: int, weight: float, epochs: int) -> list[str]:
    plan = plan_packs(lengths, packing_length, overflow="truncate", seed=0)
    costs = pack_costs(plan, weight)
    out = [
        f"{name}: {lengths.size:,} samples, {plan.num_packs:,} packs of {packing_length:,} tokens, "
        f"pack cost max/min {costs.max() / costs.min():.3f} (attention share of the cost: "
        f"{1 - plan.pack_lengths.sum() / costs.sum():.1%})",
        f"  {'ranks':>5} {'packs/rank':>10} {'slots':>6} {'round-robin':>12} {'balanced':>9} {'ratio':>6}"
        f" {'worst slot (balanced)':>22}",
    ]
    for W, P in LAYOUTS:
        plain, bal, worst, slots = [], [], [], 0
        for epoch in range(epochs):
            kw = dict(world_size=W, packs_per_rank=P, seed=0, epoch=epoch)
            a = layout_imbalance(epoch_layout(plan.pack_order(epoch), costs, balance=False, **kw), costs)
            b = layout_imbalance(epoch_layout(plan.pack_order(epoch), costs, balance=True, **kw), costs)
            plain.append(a["imbalance"])
            bal.append(b["imbalance"])
            worst.append(b["worst_slot"])
            slots = b["slots"]
        out.append(
            f"  {W:>5} {P:>10} {slots:>6} {np.mean(plain):>12.4f} {np.mean(bal):>9.4f} "
            f"{np.mean(plain) / np.mean(bal):>6.3f} {max(worst):>22.3f}"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packing-length", type=int, default=8192)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--epochs", type=int, default=3, help="epochs averaged (each its own order)")
    args = ap.parse_args(argv)
    weight = attention_cost_weight(model_config("qwen3-0.6b-shape"))
    print(f"attention_weight (Qwen3-0.6B shape) = {weight:.4e} per token^2; imbalance = sum of slowest rank / "
          f"sum of mean rank, {args.epochs} epochs averaged")
    per_file = real_lengths_per_file(args.data_dir)
    real = np.concatenate([per_file[k] for k in sorted(per_file)])
    for line in rows_for("../shared/data (all SFT files)", real, args.packing_length, weight, args.epochs):
        print(line)
    rng = np.random.default_rng(0)
    mix = np.clip(rng.lognormal(6.0, 1.0, 20000).astype(np.int64), 1, args.packing_length)
    for line in rows_for("lognormal(6, 1) x 20,000", mix, args.packing_length, weight, args.epochs):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
