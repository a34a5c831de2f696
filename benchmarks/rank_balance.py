"""Per-rank cost balance of ``varpack sft``'s pack layout on the real length mix (a cost model: no GPU).

For each (ranks, packs per rank per micro-batch): the cost model's imbalance of one epoch, the sum over
micro-batch slots of the slowest rank's cost / the sum of the mean rank's cost (1.0: no rank ever waits at the
all-reduce; :func:`varpack.plan.balance.layout_imbalance`), for the balanced layout (the default) and for the
baseline computed in the same run: the same packs in the plan's per-epoch order dealt round-robin
(``--no-rank-balance``); the mean of ``--epochs`` epochs. Cost = tokens + attention_weight x sum L_i^2, the
weight of the Qwen3-0.6B shape (:func:`varpack.plan.balance.attention_cost_weight`). Also a lognormal(6, 1)
mix, where the quadratic term weighs more. The measured per-rank step times are
benchmarks/rank_step_time.py's.

    python benchmarks/rank_balance.py [--packing-length 8192] [--data-dir ../shared/data] [--out balance.json]
    python benchmarks/rank_balance.py --small          # stand-in lengths, no data needed
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import lengths_for, machine_info, markdown_table, write_json  # noqa: E402
from varpack.models import model_config  # noqa: E402
from varpack.plan import plan_packs  # noqa: E402
from varpack.plan.balance import (  # noqa: E402
    attention_cost_weight,
    epoch_layout,
    layout_imbalance,
    pack_costs,
)

LAYOUTS = ((2, 1), (2, 2), (4, 1), (8, 1), (8, 2))


def rows_for(lengths: np.ndarray, packing_length: int, weight: float, epochs: int) -> tuple[dict, list[dict]]:
    """The mix's facts and one row per layout of :data:`LAYOUTS`."""
    plan = plan_packs(lengths, packing_length, overflow="truncate", seed=0)
    costs = pack_costs(plan, weight)
    facts = {
        "samples": int(lengths.size),
        "packs": plan.num_packs,
        "cost_max_over_min": float(costs.max() / costs.min()),
        "attention_share": float(1 - plan.pack_lengths.sum() / costs.sum()),
    }
    rows = []
    for world, per_rank in LAYOUTS:
        got: dict[bool, list[dict]] = {False: [], True: []}
        for epoch in range(epochs):
            for balance in got:
                layout = epoch_layout(plan.pack_order(epoch), costs, balance=balance, world_size=world,
                                      packs_per_rank=per_rank, seed=0, epoch=epoch)  # fmt: skip
                got[balance].append(layout_imbalance(layout, costs))
        rows.append({"ranks": world, "packs_per_rank": per_rank, "slots": got[True][-1]["slots"],
                     "round_robin": float(np.mean([x["imbalance"] for x in got[False]])),
                     "balanced": float(np.mean([x["imbalance"] for x in got[True]])),
                     "worst_slot_balanced": max(x["worst_slot"] for x in got[True])})  # fmt: skip
    return facts, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packing-length", type=int, default=8192)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--epochs", type=int, default=3, help="epochs averaged (each its own order)")
    ap.add_argument("--small", action="store_true", help="stand-in lengths (no data), 1 epoch")
    ap.add_argument(
        "--out", default=None, help="write the rows, the command, commit and machine as JSON here"
    )
    args = ap.parse_args(argv)
    if args.small:
        args.epochs = 1
    weight = attention_cost_weight(model_config("qwen3-0.6b-shape"))
    per_file, source = lengths_for(args.small, args.data_dir)
    rng = np.random.default_rng(0)
    mixes = {
        source: np.concatenate([per_file[k] for k in sorted(per_file)]),
        "lognormal(6, 1) x 20,000": np.clip(
            rng.lognormal(6.0, 1.0, 20000).astype(np.int64), 1, args.packing_length
        ),
    }
    print(
        f"attention_weight (Qwen3-0.6B shape) = {weight:.4e} per token^2; imbalance = sum of slowest rank / "
        "sum of "
        f"mean rank, {args.epochs} epoch(s) averaged; packing_length {args.packing_length:,}"
    )
    out = {}
    for name, lengths in mixes.items():
        facts, rows = rows_for(lengths, args.packing_length, weight, args.epochs)
        out[name] = {**facts, "rows": rows}
        print(
            f"\n{name}: {facts['samples']:,} samples, {facts['packs']:,} packs, pack cost max/min "
            f"{facts['cost_max_over_min']:.3f}, attention {facts['attention_share']:.1%} of the cost"
        )
        print(
            markdown_table(
                ["ranks x packs/rank", "slots", "round-robin", "balanced", "worst slot (balanced)"],
                [
                    [
                        f"{r['ranks']} x {r['packs_per_rank']}",
                        r["slots"],
                        f"{r['round_robin']:.4f}",
                        f"{r['balanced']:.4f}",
                        f"{r['worst_slot_balanced']:.3f}",
                    ]
                    for r in rows
                ],
            )
        )
    write_json(
        args.out, {"machine": machine_info(), "args": vars(args), "attention_weight": weight, "mixes": out}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
