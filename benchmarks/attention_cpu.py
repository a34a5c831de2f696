"""CPU attention backends ``sdpa`` / ``reference``: segments cut by one ``torch.split`` vs a slice per segment.

Issue 11 item 6. Both backends loop over the segments of ``cu_seqlens``. Before the fix they sliced
``q[cu[n]:cu[n+1]]`` (and k, v) per segment; each slice's backward allocates and adds a zero-filled gradient
of the whole tensor, so the backward cost O(N * T) for N segments. They now take the segments from one
``torch.split`` per tensor (``varpack.attn.reference.split_segments``), whose backward is one concatenation.

Measured in the same run, on the same inputs, for each segment layout (N segments x L tokens, T = N * L):

* ``old``: the loops as they were before the fix (copied below, with the arguments the backends pass:
  ``_old_reference`` / ``_old_sdpa``; same helpers ``segment_attention`` / ``segment_mask`` / ``read_offsets``);
* ``new``: ``varpack.attn.BACKENDS[name].forward`` (the backend itself, without ``varlen_attention``'s
  validation, like the old loop);

``fwd`` under ``torch.no_grad()``, ``fwd+bwd`` = forward + ``backward(dout)`` into leaf q/k/v. Every
configuration runs once untimed first (old and new), and there the outputs and dq/dk/dv of old and new are
compared (``max abs diff``; ``0`` = bit-identical). Timing: ``--iters`` rounds, old and new alternating inside each
round (so load drift on a shared machine hits both), median milliseconds (``time.perf_counter``); the
ratio of medians and the ratio of minima (the least disturbed run of each, on a loaded machine).

Run::

    python benchmarks/attention_cpu.py                        # 512x8, 64x64, 8x512; H/Hkv 8/2, D 64, fp32
    python benchmarks/attention_cpu.py --threads 1            # steadier on a shared machine
    python benchmarks/attention_cpu.py --layouts 256x16 --iters 5 --out runs/attention_cpu.json
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

from benchmarks._common import machine_info, markdown_table, write_json  # noqa: E402
from varpack.attn import BACKENDS  # noqa: E402
from varpack.attn.reference import read_offsets, segment_attention, segment_mask  # noqa: E402

# ----------------------------------------------------------------------------------------------------------
# the baseline: the per-segment slicing loops before the fix (varpack 6b00ad4, attn/reference.py, attn/sdpa.py)
# ----------------------------------------------------------------------------------------------------------


def _old_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal, window_size, softmax_scale, softcap):
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


def _old_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal, window_size, softmax_scale, softcap):
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


OLD = {"reference": _old_reference, "sdpa": _old_sdpa}


def _new(name: str):
    backend = BACKENDS[name]

    def call(q, k, v, cu_q, cu_k, **kw):
        return backend.forward(q, k, v, cu_q, cu_k, 0, 0, **kw)  # max_seqlen: unused by the loop backends

    return call


# ----------------------------------------------------------------------------------------------------------
# measurement
# ----------------------------------------------------------------------------------------------------------


def parse_layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        n, _, length = part.partition("x")
        out.append((int(n), int(length)))
    return out


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
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(args.seed)
    total = n * length
    heads, kv_heads = args.heads
    q = torch.randn(total, heads, args.head_dim, generator=g).to(dtype)
    k = torch.randn(total, kv_heads, args.head_dim, generator=g).to(dtype)
    v = torch.randn(total, kv_heads, args.head_dim, generator=g).to(dtype)
    dout = torch.randn(total, heads, args.head_dim, generator=g).to(dtype)
    cu = torch.arange(0, total + 1, length, dtype=torch.int32)
    kw = dict(causal=True, window_size=(-1, -1), softmax_scale=args.head_dim**-0.5, softcap=0.0)
    rows = []
    for name in args.backends:
        old_fwd, old_fb = _runs(OLD[name], q, k, v, dout, cu, kw)
        new_fwd, new_fb = _runs(_new(name), q, k, v, dout, cu, kw)
        # untimed first run of every configuration; the correctness figures come from it
        out_old, out_new = old_fwd(), new_fwd()
        g_old, g_new = old_fb(), new_fb()
        d_out = float((out_old.float() - out_new.float()).abs().max())
        d_grad = max(float((a.float() - b.float()).abs().max()) for a, b in zip(g_old, g_new))
        for mode, (old, new) in (("fwd", (old_fwd, new_fwd)), ("fwd+bwd", (old_fb, new_fb))):
            t_old, t_new = [], []
            for _ in range(args.iters):
                for fn, acc in ((old, t_old), (new, t_new)):
                    t0 = time.perf_counter()
                    fn()
                    acc.append((time.perf_counter() - t0) * 1e3)
            row = {
                "backend": name,
                "N": n,
                "L": length,
                "T": total,
                "mode": mode,
                "old_ms": statistics.median(t_old),
                "new_ms": statistics.median(t_new),
                "old_ms_all": t_old,
                "new_ms_all": t_new,
                "max_abs_diff_out": d_out,
                "max_abs_diff_grad": d_grad if mode == "fwd+bwd" else None,
            }
            row["speedup"] = row["old_ms"] / row["new_ms"]
            row["speedup_min"] = min(t_old) / min(t_new)
            rows.append(row)
            print(
                f"  {name} {n}x{length} {mode}: old {row['old_ms']:.1f} ms, new {row['new_ms']:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    headers = ["backend", "segments x tokens", "pass", "old ms (slice/segment)", "new ms (split)", "old/new"]
    headers += ["old/new of the minima"]
    headers += ["max abs diff out", "max abs diff dq,dk,dv"]
    out = []
    for r in rows:
        dg = r["max_abs_diff_grad"]
        out.append(
            [
                r["backend"],
                f"{r['N']}x{r['L']}",
                r["mode"],
                r["old_ms"],
                r["new_ms"],
                f"{r['speedup']:.2f}x",
                f"{r['speedup_min']:.2f}x",
                f"{r['max_abs_diff_out']:.1e}",
                "-" if dg is None else f"{dg:.1e}",
            ]
        )
    return markdown_table(headers, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="512x8,64x64,8x512", help="comma-separated NxL (N segments of L)")
    p.add_argument("--backends", default="sdpa,reference")
    p.add_argument("--heads", default="8/2", help="H/Hkv")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--iters", type=int, default=3, help="timed rounds per configuration (after one untimed)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    h, _, kv = args.heads.partition("/")
    args.heads = (int(h), int(kv or h))
    args.backends = [b for b in args.backends.split(",") if b]
    for b in args.backends:
        if b not in OLD:
            p.error(f"--backends: {b!r} is not a per-segment loop backend (choose from {sorted(OLD)})")
    if args.threads:
        torch.set_num_threads(args.threads)

    print(
        f"# CPU attention loops: slice per segment (old) vs one split (new); H/Hkv {args.heads[0]}/"
        f"{args.heads[1]}, D {args.head_dim}, {args.dtype}, causal, {torch.get_num_threads()} threads, "
        f"median of {args.iters} after 1 untimed"
    )
    rows = []
    for n, length in parse_layouts(args.layouts):
        rows.extend(run_layout(n, length, args))
    print()
    print(table(rows))
    write_json(args.out, {"machine": machine_info("cpu"), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
