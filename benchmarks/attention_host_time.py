"""Host time of one varpack attention call inside a model layer (issue 12: before / after the boundary object).

What a decoder layer pays on the host per attention call, besides the kernel: argument checks, boundary
handling, backend resolution. Measured on a tiny problem (a 64-token stream in 8 segments, 2 heads of 16) so
that the kernel itself is small, over many calls, after warm-up (median of repeats, one thread). The same
per-segment SDPA calls without varpack are timed as the floor; the difference is varpack's host overhead.

Rows:
* ``tensors``: ``varlen_attention(q, k, v, cu, cu, max, max)`` with the same CPU ``cu_seqlens`` tensor in every
  call (how the old code was called by every layer: it kept per-batch boundary info in a module-level cache
  keyed by tensor identity);
* ``meta``: ``varlen_attention(q, k, v, meta=meta)`` with the batch's ``VarlenMeta`` (how every layer calls it
  now); only where this checkout has ``varpack.varlen.VarlenMeta``.

Run it on two checkouts to compare (the baseline is measured by the same script)::

    PYTHONPATH=/path/to/old/checkout python benchmarks/attention_host_time.py --label before
    PYTHONPATH=$PWD python benchmarks/attention_host_time.py --label after
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _time(fn, calls: int, repeats: int) -> float:
    for _ in range(50):
        fn()
    best = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best.append((time.perf_counter() - t0) / calls)
    return statistics.median(best)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--backend", default="sdpa")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    import varpack
    from varpack.attn import varlen_attention

    lengths = [8] * 8
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(sum(lengths), 2, 16) for _ in range(3))
    rows = []
    with torch.no_grad():
        rows.append(("tensors", _time(lambda: varlen_attention(q, k, v, cu, cu, 8, 8, backend=args.backend),
                                      args.calls, args.repeats)))  # fmt: skip
        try:
            from varpack.varlen import VarlenMeta
        except ImportError:
            VarlenMeta = None
        if VarlenMeta is not None:
            meta = VarlenMeta(cu)
            rows.append(("meta", _time(lambda: varlen_attention(q, k, v, meta=meta, backend=args.backend),
                                       args.calls, args.repeats)))  # fmt: skip
        # the kernel alone (the same per-segment SDPA calls, no varpack code): the floor
        segs = [(a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]

        def kernel_only():
            for a, b in segs:
                torch.nn.functional.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True
                )

        floor = _time(kernel_only, args.calls, args.repeats)
    print(f"varpack at {varpack.__file__} ({args.label}); backend {args.backend}; torch {torch.__version__}")
    print(f"| call | us per call | host overhead over the kernel loop ({floor * 1e6:.1f} us) |")
    print("|---|---|---|")
    for name, sec in rows:
        print(f"| {name} | {sec * 1e6:.1f} | {(sec - floor) * 1e6:.1f} us |")


if __name__ == "__main__":
    main()
