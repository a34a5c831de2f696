"""The streaming packer: fill of best-fit decreasing over a bounded buffer against the global plan, and its
speed.

Lengths: the real token lengths of the ../shared/data chat files
(:func:`benchmarks._common.real_lengths_per_file`; preference pairs left out), as three streams: ``real, file
order`` (one file after the other: each file its own length mix, the hard case for a buffer), ``real,
shuffled``, and ``--samples`` lengths drawn with replacement.

For each stream and buffer size: packs and fill of :class:`varpack.plan.streaming.StreamingPacker` (lengths
added in one call, then ``finish()``), of the global plan (``plan_packs``, best-fit decreasing over all
samples, the same run) and their ratio; and the packer's speed in samples per CPU second (the planner alone on
precomputed lengths, best of ``--repeat``, one thread).

    python benchmarks/streaming.py [--buffers 100 1000 10000 100000] [--samples 1000000] [--out s.json]
    python benchmarks/streaming.py --small     # stand-in lengths, 20k drawn
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
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
from varpack.plan.streaming import StreamingPacker  # noqa: E402


def stream(lengths: np.ndarray, packing_length: int, buffer: int) -> StreamingPacker:
    p = StreamingPacker(packing_length, buffer_size=buffer, overflow="truncate")
    p.add(lengths)
    p.finish()
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--buffers", type=int, nargs="+", default=[100, 1000, 10_000, 100_000])
    ap.add_argument("--packing-length", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--small", action="store_true", help="stand-in lengths, 20k drawn, buffers 100 and 1,000")
    ap.add_argument(
        "--out", default=None, help="write the rows, the command, commit and machine as JSON here"
    )
    args = ap.parse_args(argv)
    if args.small:
        args.buffers, args.samples, args.repeat = [100, 1000], 20_000, 1
    L = args.packing_length
    per_file, source = lengths_for(args.small, args.data_dir)
    real = np.concatenate(list(per_file.values()))
    rng = np.random.default_rng(0)
    streams = {"real, file order": real, "real, shuffled": real[rng.permutation(real.size)],
               f"{args.samples:,} drawn": rng.choice(real, size=args.samples, replace=True)}  # fmt: skip
    print(f"{source}: mean {real.mean():.0f}, max {real.max()} tokens; packing_length {L}; overflow truncate "
          f"({int((real > L).sum())} overlong)")  # fmt: skip
    rows = []
    for name, lengths in streams.items():
        _, g_cpu, plan = best_cpu_time(lambda x=lengths: plan_packs(x, L, overflow="truncate"), args.repeat)
        for k in args.buffers:
            _, cpu, p = best_cpu_time(lambda x=lengths, k=k: stream(x, L, k), args.repeat)
            rows.append({"stream": name, "buffer": k, "packs": p.num_packs, "global_packs": plan.num_packs,
                         "fill": p.fill_ratio, "global_fill": plan.fill_ratio, "cpu_s": cpu,
                         "samples_per_s": lengths.size / cpu, "global_cpu_s": g_cpu})  # fmt: skip
    print(
        markdown_table(
            [
                "stream",
                "buffer",
                "packs",
                "global packs",
                "fill",
                "global fill",
                "fill / global",
                "cpu s",
                "samples/s",
                "global cpu s",
            ],
            [
                [
                    r["stream"],
                    r["buffer"],
                    r["packs"],
                    r["global_packs"],
                    f"{r['fill']:.4%}",
                    f"{r['global_fill']:.4%}",
                    f"{r['fill'] / r['global_fill']:.4f}",
                    f"{r['cpu_s']:.3f}",
                    f"{r['samples_per_s']:,.0f}",
                    f"{r['global_cpu_s']:.3f}",
                ]
                for r in rows
            ],
        )
    )
    write_json(args.out, {"machine": machine_info(), "args": vars(args), "lengths": source, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
