"""Host time of one varpack attention call inside a model layer: what a decoder layer pays besides the kernel.

Argument checks, boundary handling, backend resolution and dispatch, measured on a tiny problem (a 64-token
stream in 8 segments, 2 heads of 16) so that the kernel is small, over many calls after warm-up: the median
over repeats of the calling thread's CPU time per call, one torch thread (robust to other load on a shared
machine).

Backends: ``no_kernel`` (registered here) returns ``q`` at once, so its rows are varpack's host time alone;
``sdpa`` adds the real per-segment kernel loop. Calls:

* ``meta``: ``varlen_attention(q, k, v, meta=meta)`` with the batch's ``VarlenMeta``: how every layer of a
  model calls it (the meta is built and validated once per batch);
* ``tensors``: ``varlen_attention(q, k, v, cu, cu, max, max)``: a direct call, which builds and validates a
  ``VarlenMeta`` per call.

Run it on two checkouts to compare them (the same script measures both)::

    PYTHONPATH=/path/to/other/checkout python benchmarks/attention_host_time.py --label other
    python benchmarks/attention_host_time.py --out host_time.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: another checkout's varpack wins

from benchmarks._common import machine_info, markdown_table, write_json  # noqa: E402


def _time(fn, calls: int, repeats: int) -> float:
    for _ in range(min(50, calls)):
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
    """``(backend, call, seconds of calling-thread CPU time per call)`` for the ``meta`` and ``tensors`` calls
    (module docstring), under ``torch.no_grad``. ``cu``: CPU int32 offsets ``[N+1]``; q / k / v ``(T, H, D)``
    / ``(T, Hkv, D)`` on any device. On a GPU a row is host time only while the kernels are shorter than the
    host work (otherwise launches wait on a full queue): use ``no_kernel`` or a tiny problem."""
    from varpack.attn import varlen_attention
    from varpack.varlen import VarlenMeta

    rows = []
    with torch.no_grad():
        for backend in backends:
            meta = VarlenMeta(cu)
            rows.append(
                (
                    backend,
                    "meta",
                    _time(
                        lambda b=backend, m=meta: varlen_attention(q, k, v, meta=m, backend=b), calls, repeats
                    ),
                )
            )
            rows.append((backend, "tensors", _time(
                lambda b=backend: varlen_attention(q, k, v, cu, cu, max_seqlen, max_seqlen, backend=b),
                calls, repeats)))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--backend", default="sdpa")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--small", action="store_true", help="smoke run: 50 calls, 2 repeats")
    ap.add_argument(
        "--out", default=None, help="write the rows, the command, commit and machine as JSON here"
    )
    args = ap.parse_args(argv)
    if args.small:
        args.calls, args.repeats = 50, 2
    torch.manual_seed(0)
    torch.set_num_threads(1)
    import varpack

    cu = torch.arange(0, 65, 8, dtype=torch.int32)
    q, k, v = (torch.randn(64, 2, 16) for _ in range(3))
    rows = host_time_rows(q, k, v, cu, 8, (register_no_kernel(), args.backend), args.calls, args.repeats)
    print(f"varpack at {varpack.__file__} ({args.label}); backend {args.backend}; torch {torch.__version__}")
    print(
        markdown_table(["backend", "call", "CPU us per call"], [[b, how, sec * 1e6] for b, how, sec in rows])
    )
    write_json(
        args.out,
        {
            "machine": machine_info("cpu"),
            "args": vars(args),
            "rows": [{"backend": b, "call": how, "us": sec * 1e6} for b, how, sec in rows],
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
