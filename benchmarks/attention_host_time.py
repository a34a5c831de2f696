"""Host time of one varpack attention call inside a model layer (issue 12: before / after the boundary object).

What a decoder layer pays on the host per attention call, besides the kernel: argument checks, boundary
handling, backend resolution. Measured on a tiny problem (a 64-token stream in 8 segments, 2 heads of 16) so
that the kernel itself is small, over many calls, after warm-up (median of repeats, one torch thread, CPU time
of the calling thread: robust to other load on a shared machine).

The ``no_kernel`` backend (registered by this script) returns ``q`` at once: its rows are varpack's host time
alone (argument checks, boundary handling, backend resolution, dispatch). The ``sdpa`` rows add the real
per-segment kernel loop.

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
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        best.append((time.thread_time() - t0) / calls)
    return statistics.median(best)


def register_no_kernel() -> str:
    """Register (once) the ``no_kernel`` backend: everything varpack does around a kernel, and no kernel (it
    returns ``q``). Any device, fp32 / bf16 / fp16. Returns its name."""
    from varpack.attn import registry
    from varpack.attn._base import Backend, Capabilities

    class NoKernel(Backend):
        name = "no_kernel"
        capabilities = Capabilities(
            devices=frozenset({"*"}), dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16})
        )

        def _probe(self):
            return True, "benchmark"

        def forward(self, q, k, v, *args, **kwargs):
            return q

    registry.BACKENDS.setdefault("no_kernel", NoKernel())
    return "no_kernel"


def host_time_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_seqlen: int,
    backends: tuple[str, ...],
    calls: int,
    repeats: int,
) -> list[tuple[str, str, float]]:
    """``(backend, call, seconds of calling-thread CPU time per call)`` for the ``tensors`` and ``meta`` call
    forms (module docstring), under ``torch.no_grad``. ``cu``: CPU int32 offsets ``[N+1]``; q/k/v
    ``(T, H, D)`` / ``(T, Hkv, D)`` on any device. On a GPU a row is host time only while the kernels are
    shorter than the host work (otherwise launches wait on a full queue): use ``no_kernel`` or a tiny problem."""
    from varpack.attn import varlen_attention

    rows = []
    with torch.no_grad():
        for backend in backends:
            rows.append((backend, "tensors", _time(
                lambda b=backend: varlen_attention(q, k, v, cu, cu, max_seqlen, max_seqlen, backend=b),
                calls, repeats,
            )))  # fmt: skip
            try:
                from varpack.varlen import VarlenMeta
            except ImportError:
                continue
            meta = VarlenMeta(cu)
            rows.append((backend, "meta", _time(
                lambda b=backend, m=meta: varlen_attention(q, k, v, meta=m, backend=b), calls, repeats
            )))  # fmt: skip
    return rows


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

    lengths = [8] * 8
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(sum(lengths), 2, 16) for _ in range(3))
    rows = host_time_rows(q, k, v, cu, 8, (register_no_kernel(), args.backend), args.calls, args.repeats)
    print(f"varpack at {varpack.__file__} ({args.label}); backend {args.backend}; torch {torch.__version__}")
    print("| backend | call | CPU us per call |")
    print("|---|---|---|")
    for backend, name, sec in rows:
        print(f"| {backend} | {name} | {sec * 1e6:.1f} |")


if __name__ == "__main__":
    main()
