"""Launch-configuration sweep of varpack's own kernels in the Gated DeltaNet step: the dq/dk kernel of
``fla_hybrid`` (:func:`varpack.ops.gated_delta_rule.fla_hybrid.chunk_bwd_dqkwg_triton`,
:data:`~varpack.ops.gated_delta_rule.fla_hybrid.DQKWG_TRITON_LAUNCH`) and the Triton short convolution split into
q, k, v (:func:`varpack.ops.short_conv.short_conv_triton_split` and its backward,
:data:`varpack.ops.short_conv.SHORT_CONV_TRITON_LAUNCH`).

The workload is one static-shape row of ``varpack sft``'s hybrid step: ``--packing-length`` tokens packed best-fit
decreasing from the real lengths of ``--lengths-file`` (the fullest pack), padded to ``--tokens`` (the static
``T``; the pad as one sequence, as ``VarlenMeta.cu_seqlens_linear`` gives the rule) and, for the rule, a chunk
table of ``--table-rows`` rows (``StaticShape.linear_chunks``; rows past the pack's chunks have length 0).
Heads ``H`` of head dim ``K = V`` (Qwen3.5: 16 x 128), the convolution over ``3 * H * K`` channels of width
``--width``, bf16. Every config: one untimed call (the compile; a config that fails is reported and skipped),
then ``--iters`` calls issued back to back (:func:`benchmarks._common.time_fn` ``queued``: the GPU time); its
outputs are compared with the default config's (largest difference over each tensor's largest magnitude).

    python benchmarks/hybrid_kernels_tune.py --lengths-file .gpu/samples.npz --out tune.json          # GPU
    python benchmarks/hybrid_kernels_tune.py --device cpu --small    # smoke run under TRITON_INTERPRET=1

Decide: a config enters the launch tables above only when it is faster on this sweep and its differences stay at
the default's rounding (bf16 products, fp32 sums in another order); the step's figure confirms it.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import Any

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # decided when triton is imported

import numpy as np

from benchmarks._common import machine_info, markdown_table, read_lengths_file, sync, time_fn, write_json

#: candidate launches per kernel: (name, grid of each key); ``--small`` keeps two values of each
DQKWG_GRID = {"block_k": (64, 128), "block_v": (32, 64, 128), "num_warps": (4, 8), "num_stages": (1, 2, 3)}
CONV_FWD_GRID = {"block_t": (8, 16, 32), "block_d": (128, 256, 512), "num_warps": (4, 8)}
CONV_BWD_GRID = {
    "streams": (2, 4, 8),
    "rows": (32, 64),
    "block_d": (64, 128, 256),
    "prefetch": (2,),
    "num_warps": (4, 8),
}
#: ``--small`` (head dim 32): launches whose blocks differ there (the full grid's are capped to 32 alike)
SMALL_GRIDS = {"dqkwg": {"block_k": (16, 32), "block_v": (16, 32), "num_warps": (4,), "num_stages": (2,)}}
KERNELS = ("dqkwg", "conv_fwd", "conv_bwd")
#: what the sweep runs without ``--kernels``: the forward convolution is not among the step's costly kernels
DEFAULT_KERNELS = ("dqkwg", "conv_bwd")


def configs(grid: dict[str, tuple], small: bool, kind: str = "") -> list[dict[str, int]]:
    grid = SMALL_GRIDS.get(kind, grid) if small else grid
    keys = list(grid)
    values = [grid[k][:2] if small else grid[k] for k in keys]
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def pack_lengths(args: argparse.Namespace) -> list[int]:
    """The fullest BFD pack of the real lengths (or of lognormal lengths without a file), then the pad segment
    up to ``--tokens``."""
    from varpack.plan import plan_packs

    if args.lengths_file:
        lengths = read_lengths_file(args.lengths_file)
    else:
        rng = np.random.default_rng(0)
        lengths = np.clip(rng.lognormal(5.0, 0.9, 4 * args.packing_length // 100), 8, args.packing_length)
    lengths = np.asarray([int(n) for n in lengths if 0 < n <= args.packing_length], np.int64)
    plan = plan_packs(lengths, args.packing_length, strategy="bfd")
    fill = [int(lengths[np.asarray(p)].sum()) for p in plan.packs]
    best = plan.packs[int(np.argmax(fill))]
    out = [int(lengths[i]) for i in best]
    if args.tokens > sum(out):
        out.append(args.tokens - sum(out))
    return out


def rel_diff(a, b) -> float:
    a, b = a.float(), b.float()
    scale = float(b.abs().max()) or 1.0
    return float((a - b).abs().max()) / scale if a.shape == b.shape else float("inf")


def dqkwg_case(lengths: list[int], args, device, dtype):
    import torch

    from varpack.ops.gated_delta_rule import fla_hybrid as fh

    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    plan = fh.dqkwg_plan(cu, fh.FLA_CHUNK_SIZE, device=device)
    start, clen = plan.chunk_start.cpu(), plan.chunk_len.cpu()
    NT = int(start.numel())
    rows = max(NT, args.table_rows or NT)
    if rows > NT:  # a fixed-size table (a device plan): rows past the chunks have no token
        pad = rows - NT
        start = torch.cat([start, start.new_zeros(pad)])
        clen = torch.cat([clen, clen.new_zeros(pad)])
    plan = fh.DqkwgPlan(
        total_tokens=int(cu[-1]), num_chunks=rows, groups=(), chunk_start=start.to(device), chunk_len=clen.to(device)
    )
    T, H, K = int(cu[-1]), args.heads, args.head_dim
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(device=device, dtype=dtype)

    q, k = rnd(1, T, H, K, s=K**-0.5), rnd(1, T, H, K, s=K**-0.5)
    v_new, do, dv = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H, K)
    g = -torch.rand(T, H, generator=gen) * 0.1  # per-token log2 decay, summed within each chunk
    for s, n in zip(start.tolist(), clen.tolist()):
        if n:
            g[s : s + n] = g[s : s + n].cumsum(0)
    g = g.unsqueeze(0).to(device)
    h, dh = rnd(1, rows, H, K, K, s=0.1), rnd(1, rows, H, K, K, s=0.1)

    def run(launch):
        return fh.chunk_bwd_dqkwg_triton(
            q, k, v_new, g, h, dh, dv, do, K**-0.5, cu.to(device), plan=plan, launch=launch
        )

    return run, fh.DQKWG_TRITON_LAUNCH, {"T": T, "chunks": NT, "table_rows": rows}


def conv_cases(lengths: list[int], args, device, dtype):
    import importlib

    import torch

    sc = importlib.import_module("varpack.ops.short_conv")

    T, C = sum(lengths), args.heads * args.head_dim
    split = [C, C, C]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, T, 3 * C, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(3 * C, args.width, generator=gen) * 0.3).to(device=device, dtype=dtype)
    seq = np.repeat(np.arange(len(lengths)), lengths)
    seq_idx = torch.tensor(seq, dtype=torch.int32, device=device).unsqueeze(0)
    dys = [torch.randn(1, T, C, generator=gen).to(device=device, dtype=dtype) for _ in split]

    def fwd(launch):
        return sc.short_conv_triton_split(x, w, None, seq_idx, "silu", split, launch=launch)

    def bwd(launch):
        return sc.short_conv_triton_split_backward(dys, x, w, None, seq_idx, "silu", split, launch=launch)

    return {
        "conv_fwd": (fwd, sc.SHORT_CONV_TRITON_LAUNCH["fwd"]),
        "conv_bwd": (bwd, sc.SHORT_CONV_TRITON_LAUNCH["bwd"]),
    }, {"T": T, "channels": 3 * C, "width": args.width}


def sweep(kind: str, run, default: dict, grid: dict, args, device) -> dict[str, Any]:
    ref = run(None)
    sync(device)
    base = time_fn(lambda: run(None), device, warmup=1, iters=args.iters, queued=True)["ms"]
    rows = []
    for cfg in configs(grid, args.small, kind)[: args.max_configs or None]:
        try:
            out = run(cfg)
            sync(device)
            t = time_fn(lambda cfg=cfg: run(cfg), device, warmup=1, iters=args.iters, queued=True)["ms"]
        except Exception as e:  # noqa: BLE001 -- a config that does not compile or launch is reported
            rows.append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            continue
        diff = max(rel_diff(a, b) for a, b in zip(out, ref) if a is not None and b is not None)
        rows.append({"config": cfg, "ms": t, "speedup": base / t, "max_rel_diff_vs_default": diff})
    ok = [r for r in rows if "ms" in r]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    print(f"\n## {kind}: default {default} {base:.4f} ms")
    ok.sort(key=lambda r: r["ms"])
    print(
        markdown_table(
            ["config", "ms", "vs default", "max rel diff"],
            [[r["config"], r["ms"], r["speedup"], r["max_rel_diff_vs_default"]] for r in ok[: args.show]],
        )
    )
    for r in rows:
        if "error" in r:
            print(f"- {r['config']}: {r['error']}")
    return {"default": default, "default_ms": base, "best": best, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths-file", default=None, help="samples.npz / lengths file (default: lognormal lengths)")
    p.add_argument("--packing-length", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=8384, help="static T (>= --packing-length)")
    p.add_argument("--table-rows", type=int, default=246, help="chunk table rows of the rule (0: the chunks)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--kernels", default=",".join(DEFAULT_KERNELS), help=f"some of {', '.join(KERNELS)}")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--max-configs", type=int, default=0, help="the first N configs of each grid (0: all)")
    p.add_argument("--show", type=int, default=8, help="fastest configs printed per kernel")
    p.add_argument("--small", action="store_true", help="tiny shapes and two values per key (CPU smoke run)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    device = torch.device(args.device)
    if args.small:
        args.packing_length, args.tokens, args.table_rows = 256, 288, 12
        args.heads, args.head_dim, args.iters = 2, 32, 1
    kinds = [k for k in args.kernels.split(",") if k]
    unknown = sorted(set(kinds) - set(KERNELS))
    if unknown:
        p.error(f"unknown kernels {unknown}; choose from {list(KERNELS)}")
    dtype = torch.bfloat16
    lengths = pack_lengths(args)
    print(f"# hybrid kernel sweep, {device} bf16, one pack of {len(lengths)} segments, T={sum(lengths)}")
    records: dict[str, Any] = {}
    if "dqkwg" in kinds:
        run, default, info = dqkwg_case(lengths, args, device, dtype)
        records["dqkwg"] = {**info, **sweep("dqkwg", run, default, DQKWG_GRID, args, device)}
    conv_kinds = [k for k in kinds if k.startswith("conv")]
    if conv_kinds:
        cases, info = conv_cases(lengths, args, device, dtype)
        grids = {"conv_fwd": CONV_FWD_GRID, "conv_bwd": CONV_BWD_GRID}
        for kind in conv_kinds:
            run, default = cases[kind]
            records[kind] = {**info, **sweep(kind, run, default, grids[kind], args, device)}
    write_json(args.out, {"machine": machine_info(device), "args": vars(args), "records": records})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
