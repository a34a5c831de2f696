"""The planner: varpack's global BFD / next-fit against a per-item segment-tree BFD and ``binpacking``, one
thread.

Lengths: the real token lengths of the ../shared/data chat files (chat-templated with the embedded Qwen3
tokenizer, :func:`benchmarks._common.real_lengths_per_file`), drawn with replacement to 1M and 10M samples.
Baselines, measured in the same run:

- ``segment-tree BFD``: best-fit decreasing with one Python step per sample over a segment tree of remaining
  capacities, the approach of TRL's ``pack_dataset(strategy="bfd")`` (``varpack/plan/reference.py``, shared
  with the tests). It breaks ties as varpack does, so its packs must be identical to varpack's (checked: "same
  packs");
- ``binpacking.to_constant_volume`` (the ``binpacking`` library, worst-fit decreasing, O(N x bins)): out of
  reach at 1M, so timed on a stated subset next to varpack on the same subset.

Times are CPU seconds of this process (best of ``--repeat`` for varpack; on a shared machine the fair one-core
figure), wall seconds beside them. Also per data file: BFD packs <= ceil(1.005 x the lower bound).

    python benchmarks/planner.py [--sizes 1000000 10000000] [--packing-length 4096] [--out planner.json]
    python benchmarks/planner.py --small     # stand-in lengths, 20k samples
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    best_cpu_time,
    lengths_for,
    machine_info,
    markdown_table,
    write_json,
)
from varpack.plan import plan_packs  # noqa: E402
from varpack.plan.reference import segment_tree_bfd  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--packing-length", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3, help="varpack timings: best of this many runs")
    ap.add_argument("--tree-max", type=int, default=10_000_000, help="largest N timed with the segment tree")
    ap.add_argument("--binpacking-n", type=int, default=20_000, help="subset size timed with binpacking")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument(
        "--small", action="store_true", help="stand-in lengths, sizes 20,000, binpacking on 2,000"
    )
    ap.add_argument(
        "--out", default=None, help="write the rows, the command, commit and machine as JSON here"
    )
    args = ap.parse_args(argv)
    if args.small:
        args.sizes, args.tree_max, args.binpacking_n, args.repeat = [20_000], 20_000, 2_000, 1
    L = args.packing_length
    per_file, source = lengths_for(args.small, args.data_dir)
    real = np.concatenate(list(per_file.values()))
    print(
        f"{source}; mean {real.mean():.0f}, p50 {np.percentile(real, 50):.0f}, p99 "
        f"{np.percentile(real, 99):.0f}, "
        f"max {real.max()} tokens; packing_length {L}; load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} "
        "CPUs"
    )
    files = []
    for name, lens in per_file.items():
        p = plan_packs(np.minimum(lens, L), L)
        files.append([name, lens.size, p.total_tokens, p.num_packs, p.lower_bound_packs,
                      math.ceil(1.005 * p.lower_bound_packs), f"{p.fill_ratio:.4f}",
                      "yes" if p.num_packs <= math.ceil(1.005 * p.lower_bound_packs) else "NO"])  # fmt: skip
    print("\nbfd packs <= ceil(1.005 x lower bound), per file:")
    print(
        markdown_table(
            ["file", "samples", "tokens", "packs", "lower bound", "ceil(1.005 lb)", "fill", "ok"], files
        )
    )

    pool = real[(real >= 1) & (real <= L)]
    rng, rows = np.random.default_rng(args.seed), []

    def add(items, method, timed, packs, tokens, ref_cpu=None, note=""):
        rows.append(
            {
                "samples": items,
                "method": method,
                "cpu_s": timed[1],
                "wall_s": timed[0],
                "packs": packs,
                "lower_bound": -(-tokens // L),
                "fill": tokens / (packs * L),
                "vs_varpack_bfd": None if ref_cpu is None else timed[1] / ref_cpu,
                "note": note,
            }
        )

    sub = rng.choice(pool, size=args.binpacking_n, replace=True)
    *t_vp, plan = best_cpu_time(lambda: plan_packs(sub, L), args.repeat)
    add(sub.size, "varpack bfd", t_vp, plan.num_packs, plan.total_tokens)
    try:
        import binpacking

        *t_bp, bins = best_cpu_time(lambda: binpacking.to_constant_volume(sub.tolist(), L), 1)
        assert sum(sum(b) for b in bins) == plan.total_tokens and max(sum(b) for b in bins) <= L
        add(sub.size, "binpacking.to_constant_volume", t_bp, len(bins), plan.total_tokens, t_vp[1],
            f"subset of {sub.size:,}: O(N x bins)")  # fmt: skip
    except ImportError:
        print("(binpacking not installed: pip install 'varpack[bench]')")
    for n in args.sizes:
        lengths = rng.choice(pool, size=n, replace=True)
        *t_bfd, plan = best_cpu_time(lambda lengths=lengths: plan_packs(lengths, L), args.repeat)
        add(n, "varpack bfd", t_bfd, plan.num_packs, plan.total_tokens)
        *t_seq, seq = best_cpu_time(
            lambda lengths=lengths: plan_packs(lengths, L, strategy="sequential"), args.repeat
        )
        add(
            n,
            "varpack sequential (next-fit)",
            t_seq,
            seq.num_packs,
            seq.total_tokens,
            t_bfd[1],
            "keeps data order",
        )
        m = min(n, args.tree_max)
        part = lengths[:m].tolist()
        *t_tree, tree = best_cpu_time(lambda part=part: segment_tree_bfd(part, L), 1)
        if m == n:
            same = len(tree) == plan.num_packs and all(
                np.array_equal(plan.pack(i), b) for i, b in enumerate(tree)
            )
            ref, note = t_bfd[1], f"per-sample Python loop; same packs as varpack: {'yes' if same else 'NO'}"
        else:
            ref = best_cpu_time(lambda x=lengths[:m]: plan_packs(x, L), args.repeat)[1]
            note = f"first {m:,} samples only (varpack bfd on them: {ref:.3f} s cpu)"
        add(m, "segment-tree BFD (TRL-like, Python)", t_tree, len(tree), int(lengths[:m].sum()), ref, note)
        del tree, part
    print("\nplanner speed and fill (one thread; lower bound = ceil(tokens / packing_length)):")
    print(
        markdown_table(
            [
                "samples",
                "method",
                "cpu s",
                "wall s",
                "packs",
                "lower bound",
                "fill",
                "cpu time vs varpack bfd",
                "note",
            ],
            [
                [
                    r["samples"],
                    r["method"],
                    f"{r['cpu_s']:.3f}",
                    f"{r['wall_s']:.3f}",
                    r["packs"],
                    r["lower_bound"],
                    f"{r['fill']:.4f}",
                    "1 (ref)" if r["vs_varpack_bfd"] is None else f"{r['vs_varpack_bfd']:.1f}x",
                    r["note"],
                ]
                for r in rows
            ],
        )
    )
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    write_json(args.out, {"machine": machine_info(), "args": vars(args), "lengths": source, "files": files,
                          "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
