"""Launch-configuration sweep of the ``triton_short`` attention kernels: each kernel alone, every candidate
config.

For each length mix (benchmarks/attention.py's: ``short``, ``lognormal`` = real lengths with
``--lengths-file``, ``uniform2048``), T packed tokens, H/Hkv heads, head dim D, bf16, causal: the per-batch
tile tables are built once (as with a batch ``VarlenMeta``), then each kernel is timed alone for every
``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of :data:`FWD_GRID`, :data:`DKDV_GRID` and :data:`DQ_GRID`, with
the mask-free tiles on and off (``--mask-free both``;
:attr:`varpack.attn.triton_short.TritonShortConfig.mask_free`): one untimed call (the compile; a config that
fails to compile or launch is reported and skipped), then ``--iters`` timed calls
(:func:`benchmarks._common.time_fn`, ``--timing queued`` by default). ``--time-budget`` seconds bound the
sweep.

Printed (and ``--out`` JSON): per mix every config's time (mask-free on / off), the forward's useful TFLOP/s,
the tile work that matters over the work computed (``useful/computed``), the share of mask-free tile
iterations; per mix and kernel the mask-free gain; the best config per kernel and mix with its estimated
fwd+bwd TFLOP/s (``3.5 x`` forward FLOPs over the three kernels' times) and its
``VARPACK_TRITON_SHORT_CONFIG`` JSON; ``overall``: per kernel the config with the smallest summed slowdown
over the mixes (the candidate for ``BLOCKS``); and the errors of each chosen config through
``triton_short_attention`` (out / dq / dk / dv) against ``torch_varlen`` beside the defaults' and beside
torch_varlen's own error against the fp32 reference. Kernel times move by up to 10% between runs: a pick is
confirmed by a same-run bake-off (``benchmarks/attention.py --ts-variant``), not by this sweep alone.

    python benchmarks/attention_tune.py --lengths-file .gpu/samples.npz --out tune.json
    python benchmarks/attention_tune.py --device cpu --small   # smoke run under TRITON_INTERPRET=1, seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    # Triton runs on the CPU only interpreted, decided when triton is imported (torch may import it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    REAL_MU,
    REAL_SIGMA,
    Budget,
    machine_info,
    markdown_table,
    read_lengths_file,
    sync,
    time_fn,
    write_json,
)
from benchmarks.attention import causal_fwd_flops, inputs, mix_lengths, parse_heads  # noqa: E402

Config = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)

#: forward candidates (query tile BLOCK_M, key tile BLOCK_N); all fit Hopper's 227 KiB of shared memory at
#: D <= 128 in bf16 by the usual estimate ((BLOCK_M + 2 * stages * BLOCK_N) * D * 2 bytes), the largest near
#: it.
FWD_GRID: tuple[Config, ...] = (
    (64, 64, 4, 2),  # BLOCKS at D = 64
    (64, 64, 4, 3),
    (32, 32, 4, 2),
    (32, 32, 2, 2),  # short documents: 32x32 tiles waste least (useful/computed 0.49 vs 0.31 at 64x64)
    (32, 64, 4, 2),
    (64, 32, 4, 2),  # BLOCKS at D = 128
    (64, 128, 4, 2),
    (128, 32, 4, 2),
    (128, 64, 4, 2),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    # packed GQA (rows = tokens x group, PACK_GQA_MIN_GROUP): 64 rows are 16 tokens at G = 4
    (64, 32, 4, 3),
    (64, 16, 4, 2),
    (128, 32, 8, 2),
    # around (64, 32, 4, 2)
    (64, 32, 4, 1),
    (64, 32, 8, 2),
    (64, 32, 2, 2),
)
#: dK/dV candidates (key tile BLOCK_N owned by a program, query tile BLOCK_M looped over).
DKDV_GRID: tuple[Config, ...] = (
    (32, 64, 4, 1),  # BLOCKS at D = 64
    (32, 64, 4, 2),  # BLOCKS at D = 128
    (16, 64, 4, 2),
    (16, 32, 2, 2),
    (32, 32, 4, 2),
    (64, 64, 4, 2),
    (64, 64, 8, 2),
    (32, 128, 4, 2),
    (32, 128, 8, 2),
    (64, 128, 8, 2),
    # packed GQA: the looped query tile of BLOCK_M rows is BLOCK_M / G tokens
    (64, 64, 4, 1),
    (64, 32, 4, 1),
    (32, 64, 8, 1),
    # around (32, 64, 4, 2)
    (32, 64, 4, 3),
    (32, 64, 2, 2),
    (64, 64, 4, 3),
)
#: dQ candidates (query tile BLOCK_M owned by a program, key tile BLOCK_N looped over).
DQ_GRID: tuple[Config, ...] = (
    (64, 32, 4, 1),  # BLOCKS at D = 64
    (64, 32, 4, 2),
    (32, 32, 4, 2),
    (32, 32, 2, 2),
    (64, 64, 4, 2),
    (128, 32, 4, 2),
    (128, 32, 8, 2),
    (128, 64, 8, 2),
    (128, 32, 4, 3),
    # packed GQA
    (64, 16, 4, 2),  # BLOCKS at D = 128
    (64, 64, 4, 1),
    # around (64, 16, 4, 2) (short) and (64, 64, 4, 2) (real lengths)
    (64, 16, 4, 1),
    (64, 16, 4, 3),
    (64, 64, 4, 3),
    (64, 128, 4, 2),
    (64, 64, 8, 2),
    (128, 64, 4, 2),
)
#: --small (CPU interpreter smoke): tiny tiles, two per kernel
SMALL_GRIDS: dict[str, tuple[Config, ...]] = {
    "fwd": ((16, 16, 4, 1), (32, 16, 4, 1)),
    "bwd_dkdv": ((16, 16, 4, 1), (16, 32, 4, 1)),
    "bwd_dq": ((16, 16, 4, 1), (32, 16, 4, 1)),
}
KINDS = ("fwd", "bwd_dkdv", "bwd_dq")
MASK_FREE_CHOICES = {"both": (True, False), "on": (True,), "off": (False,)}


def mf_name(mask_free: bool) -> str:
    return "on" if mask_free else "off"


def grids(small: bool) -> dict[str, tuple[Config, ...]]:
    if small:
        return SMALL_GRIDS
    return {"fwd": FWD_GRID, "bwd_dkdv": DKDV_GRID, "bwd_dq": DQ_GRID}


def cfg_name(cfg: Config) -> str:
    return "m{}n{}w{}s{}".format(*cfg)


class MixState:
    """One mix's inputs, tables and forward results (built once, outside any timing), and its rows."""

    def __init__(self, mix: str, lengths: list[int], heads: int, kv_heads: int, args) -> None:
        from varpack.attn import triton_short as ts

        self.ts, self.mix, self.lengths, self.heads, self.kv_heads = ts, mix, lengths, heads, kv_heads
        self.device = device = torch.device(args.device)
        total, d = sum(lengths), args.head_dim
        self.total, self.d = total, d
        dtype = getattr(torch, args.dtype)
        self.q, self.k, self.v, self.dout = inputs(
            total, heads, kv_heads, d, device, dtype, args.seed, dout=True
        )
        self.cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
        self.scale, self.window = d**-0.5, (-1, 0)
        self.flops = causal_fwd_flops(lengths, heads, d)
        t0 = time.perf_counter()
        self.tables = ts.TritonShortTables.build(
            self.cu, self.cu, total, total, causal=True, window_size=self.window
        )
        sync(device)
        self.table_ms = (time.perf_counter() - t0) * 1e3
        with torch.no_grad():
            self.out, self.lse = ts._forward(
                self.q, self.k, self.v, self.tables, True, self.window, self.scale, ts.TritonShortConfig()
            )
            self.delta = ts._backward_delta(self.dout, self.out, self.lse)
            self.delta_ms = time_fn(
                lambda: ts._backward_delta(self.dout, self.out, self.lse), device, warmup=1, iters=args.iters
            )["ms"]
        self.useful = float(sum(n * (n + 1) // 2 for n in lengths))  # causal score elements that matter
        self.rows: list[dict[str, Any]] = []

    def launcher(self, kind: str, cfg: Config, mask_free: bool = True):
        ts, config = self.ts, self.ts.TritonShortConfig(**{kind: cfg}, mask_free=mask_free)
        q, k, v, dout, lse, delta, tables = (
            self.q,
            self.k,
            self.v,
            self.dout,
            self.lse,
            self.delta,
            self.tables,
        )
        w, sc = self.window, self.scale
        if kind == "fwd":
            return lambda: ts._forward(q, k, v, tables, True, w, sc, config)
        if kind == "bwd_dkdv":
            return lambda: ts._backward_dkdv(dout, q, k, v, lse, delta, tables, True, w, sc, config)
        out = self.out if config.delta_in_dq else None  # delta computed in the dQ kernel (the same values)
        return lambda: ts._backward_dq(dout, q, k, v, lse, delta, tables, True, w, sc, config, out=out)

    def work_efficiency(self, kind: str, cfg: Config) -> float:
        """Useful causal score elements / score elements the kernel computes (tiles visited x tile area)."""
        bm, bn = cfg[0], cfg[1]
        lo, hi = self.tables.key_tiles(bn) if kind == "bwd_dkdv" else self.tables.query_tiles(bm)
        step = bm if kind == "bwd_dkdv" else bn
        n_iter = torch.where(hi > lo, (hi - lo + step - 1) // step, 0).sum().item()
        return self.useful / max(1.0, float(n_iter) * bm * bn)

    def mask_free_share(self, kind: str, cfg: Config) -> float:
        """Share of the kernel's tile iterations that run mask-free (whole tiles inside one visible band)."""
        bm, bn = cfg[0], cfg[1]
        if kind == "bwd_dkdv":
            (lo, hi), (flo, fhi), step = self.tables.key_tiles(bn), self.tables.key_tiles_full(bn, bm), bm
        else:
            (lo, hi), (flo, fhi), step = self.tables.query_tiles(bm), self.tables.query_tiles_full(bm, bn), bn
        n_iter = torch.where(hi > lo, (hi - lo + step - 1) // step, 0).sum().item()
        return float(((fhi - flo) // step).sum().item()) / max(1.0, float(n_iter))


def time_config(
    st: MixState, kind: str, cfg: Config, mask_free: bool, args, budget: Budget
) -> dict[str, Any]:
    """One row: ``cfg`` of kernel ``kind`` with ``mask_free`` on one mix (untimed first call, then ``--iters``
    timed)."""
    row: dict[str, Any] = {
        "mix": st.mix,
        "kernel": kind,
        "config": list(cfg),
        "name": cfg_name(cfg),
        "mask_free": mask_free,
    }
    row["work_eff"] = st.work_efficiency(kind, cfg)
    row["mask_free_share"] = st.mask_free_share(kind, cfg)
    if budget.left() <= 0:
        row["skipped"] = "time budget spent"
        return row
    fn = st.launcher(kind, cfg, mask_free)
    try:
        with torch.no_grad():
            t1 = time.perf_counter()
            fn()  # untimed: compiles (once per config; the other mixes reuse it)
            sync(st.device)
            row["first_call_s"] = time.perf_counter() - t1
            queued = args.timing == "queued"
            row["ms"] = time_fn(fn, st.device, warmup=1, iters=args.iters, queued=queued)["ms"]
    except Exception as exc:  # out of shared memory / registers, or a compile error: reported
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if st.device.type == "cuda":
            torch.cuda.synchronize()
    if kind == "fwd" and "ms" in row:
        row["tflops"] = st.flops / row["ms"] / 1e9
    return row


def _best_rows(rows: list[dict[str, Any]], mask_free: bool) -> dict[str, dict[str, Any]]:
    """Per kernel, the fastest timed row with this ``mask_free`` setting."""
    best = {}
    for kind in KINDS:
        timed = [r for r in rows if r["kernel"] == kind and r["mask_free"] == mask_free and "ms" in r]
        if timed:
            best[kind] = min(timed, key=lambda r: r["ms"])
    return best


def _best_total(rows: list[dict[str, Any]], mask_free: bool) -> float:
    """Sum over the three kernels of the best time at ``mask_free`` (inf if a kernel has none)."""
    best = _best_rows(rows, mask_free)
    return sum(r["ms"] for r in best.values()) if len(best) == len(KINDS) else float("inf")


def mask_free_gains(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kernel: best mask-free time vs best masked-only time over the grid, and the gain at the config that
    is best mask-free (masked-only ms / mask-free ms; > 1: the split pays)."""
    gains: dict[str, Any] = {}
    on, off = _best_rows(rows, True), _best_rows(rows, False)
    for kind in KINDS:
        if kind in on and kind in off:
            same = next(
                (
                    r
                    for r in rows
                    if r["kernel"] == kind
                    and not r["mask_free"]
                    and r["config"] == on[kind]["config"]
                    and "ms" in r
                ),
                None,
            )
            gains[kind] = {
                "best_on": on[kind]["name"],
                "best_on_ms": on[kind]["ms"],
                "best_off": off[kind]["name"],
                "best_off_ms": off[kind]["ms"],
                "gain_best": off[kind]["ms"] / on[kind]["ms"],
                "gain_same_config": same["ms"] / on[kind]["ms"] if same else None,
                "mask_free_share": on[kind]["mask_free_share"],
            }
    return gains


def _default_config(st: MixState, kind: str, small: bool) -> Config:
    """The config a run without an override launches for ``kind`` at this head dim, group and mean document
    length: ``BLOCKS``' (``BLOCKS_UNPACKED``' where the kernel runs without PackGQA; the first of the small
    grid under ``--small``, whose tiles ``BLOCKS`` does not use)."""
    if small:
        return grids(small)[kind][0]
    ts, group = st.ts, st.heads // st.kv_heads
    return ts._launch_blocks(ts.TritonShortConfig(), kind, st.d, group, st.total / len(st.lengths))[0]


def finish(st: MixState, small: bool, mf_values: tuple[bool, ...]) -> dict[str, Any]:
    """The mix's record: its rows, the mask-free gains, the best config of each kernel (at the ``mask_free``
    setting with the smaller summed best time), the estimated fwd+bwd TFLOP/s."""
    mask_free = min(mf_values, key=lambda mf: _best_total(st.rows, mf))
    best: dict[str, Any] = {}
    for kind, b in _best_rows(st.rows, mask_free).items():
        default = next(
            (
                r
                for r in st.rows
                if r["kernel"] == kind
                and r["mask_free"] == mask_free
                and tuple(r["config"]) == _default_config(st, kind, small)
                and "ms" in r
            ),
            None,
        )
        best[kind] = {
            "config": b["config"],
            "ms": b["ms"],
            "default_ms": default["ms"] if default else None,
        }
    record: dict[str, Any] = {
        "mix": st.mix,
        "H": st.heads,
        "Hkv": st.kv_heads,
        "D": st.d,
        "T": st.total,
        "N": len(st.lengths),
        "mean_len": st.total / len(st.lengths),
        "max_len": max(st.lengths),
        "useful_fwd_gflop": st.flops / 1e9,
        "tables_ms": st.table_ms,
        "delta_ms": st.delta_ms,
        "rows": st.rows,
        "mask_free": mask_free,
        "mask_free_gain": mask_free_gains(st.rows),
        "best": best,
    }
    if len(best) == len(KINDS):
        fwd_ms = best["fwd"]["ms"]
        # delta's own pass only without delta_in_dq (TritonShortConfig's default computes it in the dQ kernel)
        delta_ms = 0.0 if st.ts.TritonShortConfig().delta_in_dq else st.delta_ms
        bwd_ms = delta_ms + best["bwd_dkdv"]["ms"] + best["bwd_dq"]["ms"]
        record["best_fwd_tflops"] = st.flops / fwd_ms / 1e9
        record["best_fwd_bwd_tflops_est"] = 3.5 * st.flops / (fwd_ms + bwd_ms) / 1e9
        record["best_env"] = st.ts.TritonShortConfig(
            **{k: tuple(best[k]["config"]) for k in KINDS}, mask_free=mask_free
        ).to_json()
    record["_tensors"] = (st.q, st.k, st.v, st.dout, st.cu, st.lengths)
    return record


def overall_mask_free(records: list[dict[str, Any]], mf_values: tuple[bool, ...]) -> bool:
    """The ``mask_free`` setting with the smaller sum over mixes of the three kernels' best times."""
    return min(mf_values, key=lambda mf: sum(_best_total(rec["rows"], mf) for rec in records))


def overall(records: list[dict[str, Any]], small: bool, mask_free: bool = True) -> dict[str, Config]:
    """Per kernel, the config that ran on every mix with the smallest sum over mixes of ``ms / best ms`` (rows
    and bests at ``mask_free``)."""
    pick: dict[str, Config] = {}
    for kind in KINDS:
        scores: dict[Config, float] = {}
        for cfg in grids(small)[kind]:
            total = 0.0
            for rec in records:
                rows = [r for r in rec["rows"] if r["mask_free"] == mask_free]
                row = next(
                    (r for r in rows if r["kernel"] == kind and tuple(r["config"]) == cfg and "ms" in r),
                    None,
                )
                best = _best_rows(rows, mask_free).get(kind)
                if row is None or best is None:
                    total = float("inf")
                    break
                total += row["ms"] / best["ms"]
            scores[cfg] = total
        finite = {c: s for c, s in scores.items() if s != float("inf")}
        if finite:
            pick[kind] = min(finite, key=finite.get)
    return pick


def check(record: dict[str, Any], configs: dict[str, Any], args) -> dict[str, Any]:
    """Max |difference| of out / dq / dk / dv through ``triton_short_attention`` with each config vs the
    comparison backend (torch_varlen, else reference), and of the comparison backend vs fp32 reference on the
    first ``--check-docs`` documents."""
    from varpack.attn import available_backends, reference_varlen_attention, varlen_attention
    from varpack.attn import triton_short as ts

    q, k, v, dout, cu, lengths = record["_tensors"]
    device = q.device
    max_len = max(lengths)
    avail = available_backends(device, q.dtype)
    other = "torch_varlen" if avail.get("torch_varlen", (False,))[0] else "reference"

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        return [out.detach(), *torch.autograd.grad(out, leaves, dout)]

    result: dict[str, Any] = {"compared_with": other}
    want = grads(
        lambda a, b, c: varlen_attention(a, b, c, cu, cu, max_len, max_len, causal=True, backend=other)
    )
    for label, cfg in configs.items():
        try:
            got = grads(lambda a, b, c, cfg=cfg: ts.triton_short_attention(a, b, c, cu, cu, config=cfg)[0])
            result[label] = {
                n: float((g.float() - w.float()).abs().max())
                for n, g, w in zip(("out", "dq", "dk", "dv"), got, want)
            }
        except Exception as exc:  # reported, never fatal
            result[label] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    # scale of bf16 error: the comparison backend vs fp32 reference on the first documents
    n = min(args.check_docs, len(lengths))
    end = int(sum(lengths[:n]))
    sub = [t[:end] for t in (q, k, v, dout)]
    cu_sub = cu[: n + 1]
    ml = max(lengths[:n])
    leaves = [t.detach().float().requires_grad_() for t in sub[:3]]
    truth_out = reference_varlen_attention(*leaves, cu_sub, cu_sub, causal=True)
    truth = [truth_out.detach(), *torch.autograd.grad(truth_out, leaves, sub[3].float())]
    leaves = [t.detach().clone().requires_grad_() for t in sub[:3]]
    oth = varlen_attention(*leaves, cu_sub, cu_sub, ml, ml, causal=True, backend=other)
    oth_all = [oth.detach(), *torch.autograd.grad(oth, leaves, sub[3])]
    result[f"{other}_vs_fp32_first_{n}_docs"] = {
        name: float((g.float() - t).abs().max())
        for name, g, t in zip(("out", "dq", "dk", "dv"), oth_all, truth)
    }
    return result


def print_mix(rec: dict[str, Any]) -> None:
    print(
        f"\n## {rec['mix']}: T={rec['T']} N={rec['N']} mean {rec['mean_len']:.0f} max {rec['max_len']} "
        f"H={rec['H']}/{rec['Hkv']} D={rec['D']}; tables {rec['tables_ms']:.2f} ms (built once), "
        f"delta {rec['delta_ms']:.3f} ms"
    )
    body = []
    nan = float("nan")
    for r in rec["rows"]:
        note = r.get("error") or r.get("skipped") or ""
        off = next(
            (
                o
                for o in rec["rows"]
                if r["mask_free"]
                and not o["mask_free"]
                and o["kernel"] == r["kernel"]
                and o["config"] == r["config"]
                and "ms" in o
            ),
            None,
        )
        gain = off["ms"] / r["ms"] if off and "ms" in r else nan
        body.append(
            [
                r["kernel"],
                r["name"],
                mf_name(r["mask_free"]),
                r.get("ms", nan),
                gain,
                r.get("tflops", nan),
                r.get("work_eff", nan),
                r.get("mask_free_share", nan),
                r.get("first_call_s", nan),
                note,
            ]
        )
    headers = [
        "kernel",
        "config",
        "mask_free",
        "ms",
        "mf gain",
        "fwd TFLOP/s",
        "useful/computed",
        "mask-free iters",
        "first call s",
        "note",
    ]
    print(markdown_table(headers, body))
    for kind, g in rec["mask_free_gain"].items():
        same = f"; at {g['best_on']} {g['gain_same_config']:.2f}x" if g["gain_same_config"] else ""
        print(
            f"- mask-free gain {kind}: best on {g['best_on']} {g['best_on_ms']:.3f} ms vs best off "
            f"{g['best_off']} {g['best_off_ms']:.3f} ms = {g['gain_best']:.2f}x{same} "
            f"({g['mask_free_share']:.0%} of its tile iterations mask-free)"
        )
    print(f"- best below with mask_free {mf_name(rec['mask_free'])}")
    for kind, b in rec["best"].items():
        gain = f" ({b['default_ms'] / b['ms']:.2f}x the default)" if b["default_ms"] else ""
        print(f"- best {kind}: {cfg_name(tuple(b['config']))} {b['ms']:.3f} ms{gain}")
    if "best_env" in rec:
        print(
            f"- best fwd {rec['best_fwd_tflops']:.1f} TFLOP/s, fwd+bwd (sum of kernels) "
            f"{rec['best_fwd_bwd_tflops_est']:.1f} TFLOP/s; VARPACK_TRITON_SHORT_CONFIG='{rec['best_env']}'"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, or cpu (Triton's interpreter: use with --small)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--mixes", default="short,lognormal,uniform2048")
    p.add_argument("--heads", default="16/4", help="H/Hkv (one pair: the sweep runs on the first)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument(
        "--lengths-file", default=None, help="real lengths for the lognormal mix (.gpu/samples.npz)"
    )
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--timing",
        choices=("queued", "synced"),
        default="queued",
        help="queued (default): calls issued back to back, each between its own CUDA events (the kernel's "
        "GPU time, as benchmarks/attention.py's table); synced: the host waits for each call",
    )
    p.add_argument(
        "--time-budget", type=float, default=200.0, help="seconds for the sweep (then skip the rest)"
    )
    p.add_argument("--check-docs", type=int, default=64, help="documents of the fp32 baseline check")
    p.add_argument(
        "--mask-free",
        choices=sorted(MASK_FREE_CHOICES),
        default="both",
        help="time every config with the mask-free tiles on and off (both), or one setting",
    )
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--small", action="store_true", help="smoke mode: T=256, H=4/2, D=32, tiny tiles, 1 iteration"
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; use --device cpu --small for a smoke run (Triton interpreted)")
    if args.small:
        args.tokens, args.head_dim, args.heads, args.iters, args.check_docs = 256, 32, "4/2", 1, 4
        args.max_len = min(args.max_len, 128)
        args.mixes = ",".join(
            m if not m.startswith("uniform") else "uniform64" for m in args.mixes.split(",")
        )
    from varpack.attn import BACKENDS
    from varpack.attn import triton_short as ts

    ok, reason = BACKENDS["triton_short"].supports_platform(device, getattr(torch, args.dtype))
    if not ok:
        p.error(f"triton_short cannot run on {device}: {reason}")
    heads, kv_heads = parse_heads(args.heads)[0]
    mf_values = MASK_FREE_CHOICES[args.mask_free]
    real = read_lengths_file(args.lengths_file) if args.lengths_file else None
    budget = Budget(args.time_budget)
    print(
        f"# triton_short config sweep, {args.device} {args.dtype}, T={args.tokens}, H={heads}/{kv_heads}, "
        f"D={args.head_dim}, causal; mask_free {'/'.join(mf_name(m) for m in mf_values)}; "
        f"budget {args.time_budget:.0f} s; BLOCKS default {ts.BLOCKS}"
    )
    states = []
    for mix in [m for m in args.mixes.split(",") if m]:
        lengths = mix_lengths(
            mix, args.tokens, real=real, mu=REAL_MU, sigma=REAL_SIGMA, max_len=args.max_len, seed=args.seed
        )
        states.append(MixState(mix, lengths, heads, kv_heads, args))
    # config-major: each config compiles once and is timed on every mix, so a spent budget cuts the grids'
    # tails evenly across the mixes
    for kind, grid in grids(args.small).items():
        for cfg in grid:
            for mask_free in mf_values:
                for st in states:
                    st.rows.append(time_config(st, kind, cfg, mask_free, args, budget))
        partial = [
            {k: v for k, v in finish(st, args.small, mf_values).items() if k != "_tensors"} for st in states
        ]
        write_json(
            args.out, {"machine": machine_info(device), "args": vars(args), "records": partial}
        )  # if killed
        print(f"  swept {kind}; {budget.left():.0f} s of the budget left", file=sys.stderr, flush=True)
    records = [finish(st, args.small, mf_values) for st in states]
    for rec in records:
        print_mix(rec)
    overall_mf = overall_mask_free(records, mf_values)
    pick = overall(records, args.small, overall_mf)
    overall_env = ts.TritonShortConfig(**pick, mask_free=overall_mf).to_json() if pick else None
    print("\n## mask-free gain per kernel (best masked-only ms / best mask-free ms; >1: the split pays)")
    gain_rows = [
        [rec["mix"], kind, g["gain_best"], g["gain_same_config"] or float("nan"), g["mask_free_share"]]
        for rec in records
        for kind, g in rec["mask_free_gain"].items()
    ]
    if gain_rows:
        print(
            markdown_table(
                ["mix", "kernel", "gain (bests)", "gain (same config)", "mask-free iters"], gain_rows
            )
        )
    print(f"\n## overall (smallest summed slowdown over the mixes): {overall_env}")
    if not args.no_check:
        for rec in records:
            configs: dict[str, Any] = {"default": ts.TritonShortConfig(mask_free=mf_values[0])}
            if len(mf_values) > 1:
                configs["default_mask_free_off"] = ts.TritonShortConfig(mask_free=False)
            if "best_env" in rec:
                configs["best_of_mix"] = ts.TritonShortConfig.from_json(rec["best_env"])
            if pick:
                configs["overall"] = ts.TritonShortConfig(**pick, mask_free=overall_mf)
            rec["check"] = check(rec, configs, args)
            print(f"- check {rec['mix']}: {rec['check']}")
            sync(device)
    for rec in records:
        rec.pop("_tensors", None)
    print(
        "\nDecide: paste 'overall' (or per-mix bests, if one mix dominates the workload) into BLOCKS of "
        "varpack/attn/triton_short.py; errors vs the comparison backend should match the default's."
    )
    write_json(
        args.out,
        {
            "machine": machine_info(device),
            "args": vars(args),
            "grids": {k: [list(c) for c in g] for k, g in grids(args.small).items()},
            "records": records,
            "overall": {k: list(v) for k, v in pick.items()},
            "overall_mask_free": overall_mf,
            "overall_env": overall_env,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
