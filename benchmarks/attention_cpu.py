"""CPU attention backends ``sdpa`` / ``reference``: segments cut by one ``torch.split`` vs a slice per
segment.

Both backends loop over the segments of ``cu_seqlens``. Slicing ``q[cu[n]:cu[n+1]]`` (and k, v) per segment is
the obvious loop, but each slice's backward adds a zero-filled gradient of the whole tensor: O(N * T) for N
segments. The backends take the segments from one ``torch.split`` per tensor
(``varpack.attn.reference.split_segments``), whose backward is one concatenation. Measured in the same run, on
the same inputs, per layout (N segments x L tokens):

* ``slice``: the per-segment slicing loops (below: ``_slice_reference`` / ``_slice_sdpa``, with the backends'
  helpers ``segment_attention`` / ``segment_mask`` / ``read_offsets``), the baseline;
* ``split``: ``varpack.attn.BACKENDS[name].forward`` (the backend itself, without ``varlen_attention``'s
  checks).

``fwd`` under ``torch.no_grad()``, ``fwd+bwd`` = forward + ``backward(dout)`` into leaf q / k / v. Each
configuration runs once untimed first, and there the outputs and dq / dk / dv of the two are compared (``0``:
bit-identical). Then ``--iters`` rounds, the two alternating inside each round (load drift on a shared machine
hits both), median ms (``time.perf_counter``); the ratio of the medians and of the minima (the least disturbed
runs).

    python benchmarks/attention_cpu.py --threads 1 --iters 5 --out attention_cpu.json   # 512x8, 64x64, 8x512
    python benchmarks/attention_cpu.py --small                                          # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    add_common_args,
    checked_device,
    machine_info,
    markdown_table,
    write_json,
)
from varpack.attn import BACKENDS  # noqa: E402
from varpack.attn.reference import read_offsets, segment_attention, segment_mask  # noqa: E402

# ----------------------------------------------------------------------------------------------------------
# the baseline: the per-segment slicing loops
# ----------------------------------------------------------------------------------------------------------


def _slice_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal, window_size, softmax_scale, softcap):
    cu_q, cu_k = read_offsets(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    outs = [
        segment_attention(
            q[cu_q[n] : cu_q[n + 1]],
            k[cu_k[n] : cu_k[n + 1]],
            v[cu_k[n] : cu_k[n + 1]],
            causal=causal,
            window_size=window_size,
            scale=softmax_scale,
            softcap=softcap,
            compute_dtype=compute_dtype,
        )
        for n in range(len(cu_q) - 1)
        if cu_q[n + 1] > cu_q[n]
    ]
    if not outs:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    return torch.cat(outs, dim=0)


def _slice_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal, window_size, softmax_scale, softcap):
    cu_q, cu_k = read_offsets(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
    left, right = window_size
    windowed = left >= 0 or (right >= 0 and not causal)
    gqa = q.shape[1] != k.shape[1]
    outs: list[torch.Tensor] = []
    for n in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        if qe == qs:
            continue
        if qe - qs != ke - ks:
            outs.append(
                segment_attention(
                    q[qs:qe],
                    k[ks:ke],
                    v[ks:ke],
                    causal=causal,
                    window_size=window_size,
                    scale=softmax_scale,
                    softcap=softcap,
                    compute_dtype=torch.promote_types(q.dtype, torch.float32),
                )
            )
            continue
        mask = None
        if windowed:
            mask = segment_mask(qe - qs, ke - ks, causal=causal, window_size=window_size, device=q.device)
        out = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1),
            k[ks:ke].transpose(0, 1),
            v[ks:ke].transpose(0, 1),
            attn_mask=mask,
            is_causal=causal and not windowed,
            scale=softmax_scale,
            enable_gqa=gqa,
        )
        outs.append(out.transpose(0, 1))
    if not outs:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    return torch.cat(outs, dim=0)


SLICE = {"reference": _slice_reference, "sdpa": _slice_sdpa}


def _split(name: str):
    backend = BACKENDS[name]

    def call(q, k, v, cu_q, cu_k, **kw):
        return backend.forward(q, k, v, cu_q, cu_k, 0, 0, **kw)  # max_seqlen: unused by the loop backends

    return call


# ----------------------------------------------------------------------------------------------------------
# measurement
# ----------------------------------------------------------------------------------------------------------


def _runs(fn, q, k, v, dout, cu, kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            return fn(q, k, v, cu, cu, **kw)

    def fwd_bwd():
        fn(*leaves, cu, cu, **kw).backward(dout)
        grads = [t.grad for t in leaves]
        for t in leaves:
            t.grad = None
        return grads

    return fwd, fwd_bwd


def run_layout(n: int, length: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows of one layout (N segments of L tokens): per backend and pass, slice vs split."""
    total, (heads, kv_heads) = n * length, args.heads
    g = torch.Generator().manual_seed(args.seed)
    q, k, v, dout = (torch.randn(total, h, args.head_dim, generator=g).to(getattr(torch, args.dtype))
                     for h in (heads, kv_heads, kv_heads, heads))  # fmt: skip
    cu = torch.arange(0, total + 1, length, dtype=torch.int32)
    kw = dict(causal=True, window_size=(-1, -1), softmax_scale=args.head_dim**-0.5, softcap=0.0)
    rows = []
    for name in args.backends:
        (s_fwd, s_fb), (n_fwd, n_fb) = (
            _runs(SLICE[name], q, k, v, dout, cu, kw),
            _runs(_split(name), q, k, v, dout, cu, kw),
        )
        d_out = float((s_fwd().float() - n_fwd().float()).abs().max())  # the untimed first runs
        d_grad = max(float((a.float() - b.float()).abs().max()) for a, b in zip(s_fb(), n_fb()))
        for mode, fns in (("fwd", (s_fwd, n_fwd)), ("fwd+bwd", (s_fb, n_fb))):
            times: tuple[list[float], list[float]] = ([], [])
            for _ in range(args.iters):
                for fn, acc in zip(fns, times):
                    t0 = time.perf_counter()
                    fn()
                    acc.append((time.perf_counter() - t0) * 1e3)
            rows.append({
                "backend": name, "N": n, "L": length, "T": total, "mode": mode,
                "slice_ms": statistics.median(times[0]), "split_ms": statistics.median(times[1]),
                "slice_ms_all": times[0], "split_ms_all": times[1],
                "speedup": statistics.median(times[0]) / statistics.median(times[1]),
                "speedup_min": min(times[0]) / min(times[1]),
                "max_abs_diff_out": d_out, "max_abs_diff_grad": d_grad if mode == "fwd+bwd" else None,
            })  # fmt: skip
            print(
                f"  {name} {n}x{length} {mode}: slice {rows[-1]['slice_ms']:.1f} ms, split "
                f"{rows[-1]['split_ms']:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    headers = ["backend", "segments x tokens", "pass", "slice ms", "split ms", "slice / split",
               "slice / split of the minima", "max abs diff out", "max abs diff dq,dk,dv"]  # fmt: skip
    body = [
        [
            r["backend"],
            f"{r['N']}x{r['L']}",
            r["mode"],
            r["slice_ms"],
            r["split_ms"],
            f"{r['speedup']:.2f}x",
            f"{r['speedup_min']:.2f}x",
            f"{r['max_abs_diff_out']:.1e}",
            "-" if r["max_abs_diff_grad"] is None else f"{r['max_abs_diff_grad']:.1e}",
        ]
        for r in rows
    ]
    return markdown_table(headers, body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, device="cpu", small="smoke run: layouts 64x8,8x64, 1 round")
    p.add_argument("--layouts", default="512x8,64x64,8x512", help="comma-separated NxL (N segments of L)")
    p.add_argument("--backends", default="sdpa,reference")
    p.add_argument("--heads", default="8/2", help="H/Hkv")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=3, help="timed rounds per configuration (after one untimed)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = p.parse_args(argv)
    checked_device(p, args)
    if args.device != "cpu":
        p.error("--device: the per-segment loop backends are measured on the CPU")
    h, _, kv = args.heads.partition("/")
    args.heads = (int(h), int(kv or h))
    args.backends = [b for b in args.backends.split(",") if b]
    for b in args.backends:
        if b not in SLICE:
            p.error(f"--backends: {b!r} is not a per-segment loop backend (choose from {sorted(SLICE)})")
    if args.small:
        args.layouts, args.iters = "64x8,8x64", 1
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"# CPU attention loops: slice per segment vs one split; H/Hkv {args.heads[0]}/{args.heads[1]}, "
        f"D {args.head_dim}, {args.dtype}, causal, {torch.get_num_threads()} threads, median of {args.iters} "
        "after 1 untimed"
    )
    layouts = [tuple(int(x) for x in part.split("x")) for part in args.layouts.split(",")]
    rows = [row for n, length in layouts for row in run_layout(n, length, args)]
    print(f"\n{table(rows)}")
    write_json(args.out, {"machine": machine_info("cpu"), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
