"""Gated delta rule on a packed row: varpack's varlen chunk path vs the per-sequence PyTorch loop vs fla.

    python benchmarks/gated_delta.py                 # GPU: T=32768, H=16, K=V=128, bf16
    python benchmarks/gated_delta.py --small         # CPU smoke test (T=1024, H=2, K=V=32, fp32)
    python benchmarks/gated_delta.py --mixes 64x512 --methods chunk loop --iters 5

Methods (all on the same packed inputs, measured in this one run):

- ``loop`` (the baseline): transformers' PyTorch reference ``torch_chunk_gated_delta_rule``
  (``models/qwen3_next/modeling_qwen3_next.py``, unwrapped from any kernel-hub/fla dispatch) run once per
  sequence of the pack, outputs concatenated: the only exact path for packed rows without fla.
- ``chunk``: :func:`varpack.ops.chunk_gated_delta_rule` (vectorized over all sequences, GEMM-only block
  inverse), eager; ``chunk-solve``: the same with ``torch.linalg.solve_triangular``; ``chunk-compiled``:
  with ``torch.compile(dynamic=True)`` on its hot blocks (compile time reported separately).
- ``fla``: flash-linear-attention's ``chunk_gated_delta_rule`` with ``cu_seqlens`` when importable; its
  backward is timed only if it runs (fla 0.6.0 refuses it on Hopper with Triton < 3.7.1: the reason is
  printed).
- ``fla_hybrid``: :func:`varpack.ops.gated_delta_rule.fla_hybrid_gated_delta_rule` as ``auto`` runs it:
  fla's forward and backward kernels with the refused ``chunk_bwd_dqkwg`` step done by varpack's own Triton
  kernel (``precision="mixed"``: bf16 operands, fp32 accumulation, fla's kernel semantics);
  ``fla_hybrid-torch``: the same step in batched PyTorch (cuBLAS; the earlier default);
  ``fla_hybrid-fp32``: the Triton step with IEEE fp32 dots (``precision="fp32"``); ``fla_hybrid-bf16``: the
  PyTorch step with GEMM outputs rounded to bf16 (``precision="input"``).

Length mixes (T tokens each): ``64x512``, ``16x2048``, ``lognormal``: lognormal(6.5, 1.0) clipped to
[16, 8192] (seed 0; lognormal(4.0, 1.0) with ``--small``), the last sample cut to fill T exactly. Columns: forward ms (no grad), forward+backward
ms, each vs the loop (loop ms / method ms), max |o - o_loop| in the forward, peak memory of fwd+bwd (CUDA).
Issue-8 goal on the H200: chunk forward+backward <= 60 ms for 64x512 (printed as a PASS/FAIL line).
Issue-16 goal: fla_hybrid forward+backward <= 12 ms for 64x512, its forward within 2x of fla's (PASS/FAIL).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
import traceback

import numpy as np
import torch
import torch.nn.functional as F

from varpack.ops.gated_delta_rule import chunk_gated_delta_rule, prepare_chunk_layout

GOAL_MS = 60.0
HYBRID_GOAL_MS = 12.0


def baseline_fn():
    """transformers' pure-PyTorch ``torch_chunk_gated_delta_rule`` (no fla / hub kernel dispatch)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    return inspect.unwrap(m.torch_chunk_gated_delta_rule)


def mix_lengths(name: str, T: int, mu: float = 6.5) -> list[int]:
    if "x" in name:
        n, L = (int(v) for v in name.split("x"))
        if n * L != T:
            raise ValueError(f"mix {name} has {n * L} tokens, expected T={T}")
        return [L] * n
    if name == "lognormal":
        rng = np.random.default_rng(0)
        out: list[int] = []
        hi = max(16, min(8192, T))
        while sum(out) < T:
            out.append(int(np.clip(rng.lognormal(mu, 1.0), 16, hi)))
        out[-1] -= sum(out) - T
        return [x for x in out if x > 0]
    raise ValueError(f"unknown mix {name!r}: use NxL (e.g. 64x512) or lognormal")


def make_inputs(T, H, K, V, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen).to(device=device, dtype=dtype)

    q, k, v = r(1, T, H, K), r(1, T, H, K), r(1, T, H, V)
    g = F.logsigmoid(torch.randn(1, T, H, generator=gen) + 3.0).to(device=device, dtype=torch.float32)
    beta = torch.rand(1, T, H, generator=gen).to(device=device, dtype=dtype)
    return q, k, v, g, beta


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device, iters, warmup):
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def build_methods(cu_cpu, lengths, device, names):
    """name -> callable(q, k, v, g, beta) -> o, or a string saying why it cannot run."""
    methods = {}
    layout = prepare_chunk_layout(cu_cpu, device=device)
    if "loop" in names:
        base = baseline_fn()
        bounds = list(zip(cu_cpu[:-1].tolist(), cu_cpu[1:].tolist()))

        def loop(q, k, v, g, beta):
            outs = [
                base(
                    q[:, a:b],
                    k[:, a:b],
                    v[:, a:b],
                    g=g[:, a:b],
                    beta=beta[:, a:b],
                    use_qk_l2norm_in_kernel=True,
                )[0]
                for a, b in bounds
            ]
            return torch.cat(outs, dim=1)

        methods["loop"] = loop
    for name, kw in (
        ("chunk", {}),
        ("chunk-solve", {"solve": "solve"}),
        ("chunk-compiled", {"compile": True}),
    ):
        if name in names:
            methods[name] = lambda q, k, v, g, beta, _kw=kw: chunk_gated_delta_rule(
                q, k, v, g, beta, cu_seqlens=cu_cpu, layout=layout, use_qk_l2norm_in_kernel=True, **_kw
            )[0]
    if "fla" in names:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

            cu_dev = cu_cpu.to(device)

            def fla(q, k, v, g, beta):
                return fla_rule(
                    q, k, v, g, beta, cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu, use_qk_l2norm_in_kernel=True
                )[0]

            methods["fla"] = fla if device.type == "cuda" else "fla needs CUDA"
        except Exception as exc:  # noqa: BLE001
            methods["fla"] = f"fla not importable: {type(exc).__name__}: {exc}"
    for name, precision in HYBRID_METHODS.items():
        if name not in names:
            continue
        from varpack.ops.gated_delta_rule.fla_hybrid import (
            fla_hybrid_gated_delta_rule,
            load_hybrid,
            prepare_fla_hybrid_boundaries,
        )

        fns, reason = load_hybrid()
        if device.type != "cuda":
            methods[name] = "fla_hybrid needs CUDA"
        elif fns is None:
            methods[name] = f"fla_hybrid unavailable: {reason}"
        else:
            bnd = prepare_fla_hybrid_boundaries(cu_cpu, device)  # per batch, as the model layers keep it
            methods[name] = lambda q, k, v, g, beta, _p=precision, _cu=bnd.cu_seqlens, _b=bnd: (
                fla_hybrid_gated_delta_rule(
                    q,
                    k,
                    v,
                    g,
                    beta,
                    cu_seqlens=_cu,
                    cu_seqlens_cpu=cu_cpu,
                    use_qk_l2norm_in_kernel=True,
                    precision=_p,
                    boundaries=_b,
                )[0]
            )
    return methods


#: fla_hybrid methods: the backward step's precision, and which implementation runs it (DQKWG_IMPL)
HYBRID_METHODS = {
    "fla_hybrid": "mixed",
    "fla_hybrid-torch": "mixed",
    "fla_hybrid-fp32": "fp32",
    "fla_hybrid-bf16": "input",
}
HYBRID_IMPL = {"fla_hybrid-torch": "torch"}


def _set_dqkwg_impl(name):
    """The backward of ``fla_hybrid`` reads ``DQKWG_IMPL`` when it runs: set it for this method."""
    if name in HYBRID_METHODS:
        from varpack.ops.gated_delta_rule import fla_hybrid as fh

        fh.DQKWG_IMPL = HYBRID_IMPL.get(name, "auto")


def run_mix(mix, args, device, dtype):
    lengths = mix_lengths(mix, args.T, mu=4.0 if args.small else 6.5)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)
    inputs = make_inputs(args.T, args.H, args.K, args.V, dtype, device)
    methods = build_methods(cu, lengths, device, args.methods)
    rows = []
    ref = None
    for name in args.methods:
        fn = methods.get(name)
        row = {
            "mix": mix,
            "method": name,
            "n": len(lengths),
            "fwd": None,
            "fb": None,
            "err": None,
            "mem": None,
            "note": "",
        }
        rows.append(row)
        if isinstance(fn, str) or fn is None:
            row["note"] = fn or "not run"
            continue
        _set_dqkwg_impl(name)
        try:
            if name == "chunk-compiled":
                t0 = time.perf_counter()
                with torch.no_grad():
                    fn(*inputs)
                leaves = [x.detach().clone().requires_grad_() for x in inputs]
                fn(*leaves).float().sum().backward()
                sync(device)
                row["note"] = f"first call (compile) {time.perf_counter() - t0:.1f} s"
            with torch.no_grad():
                o = fn(*inputs)
                if name == "loop":
                    ref = o.float()
                elif ref is not None:
                    row["err"] = float((o.float() - ref).abs().max())
                row["fwd"] = timeit(lambda f=fn: f(*inputs), device, args.iters, args.warmup)
            del o
        except Exception as exc:  # noqa: BLE001
            row["note"] = f"forward failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            if args.verbose:
                traceback.print_exc()
            continue
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        do = torch.randn(1, args.T, args.H, args.V, device=device, dtype=dtype)

        def fwd_bwd(f=fn, leaves=leaves, do=do):
            for x in leaves:
                x.grad = None
            (f(*leaves) * do).sum().backward()

        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            row["fb"] = timeit(fwd_bwd, device, args.iters, args.warmup)
            if device.type == "cuda":
                row["mem"] = torch.cuda.max_memory_allocated() / 2**30
        except Exception as exc:  # noqa: BLE001  e.g. fla's refusal of its backward
            msg = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            row["note"] = (
                row["note"] + "; " if row["note"] else ""
            ) + f"backward failed: {type(exc).__name__}: {msg}"
            if args.verbose:
                traceback.print_exc()
        del leaves
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = next((r for r in rows if r["method"] == "loop"), None)
    for r in rows:
        r["fwd_x"] = base["fwd"] / r["fwd"] if base and base["fwd"] and r["fwd"] else None
        r["fb_x"] = base["fb"] / r["fb"] if base and base["fb"] and r["fb"] else None
    return rows


def fmt(v, spec):
    width = int(spec.split(".")[0]) if spec[0].isdigit() else 0
    return "-".rjust(width) if v is None else format(v, spec)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="CPU-sized smoke test (T=1024, H=2, K=V=32, fp32)")
    p.add_argument("--device", default=None, help="default: cuda if available (cpu with --small)")
    p.add_argument("--mixes", nargs="+", default=None)
    p.add_argument(
        "--methods",
        nargs="+",
        default=[
            "loop",
            "chunk",
            "chunk-solve",
            "chunk-compiled",
            "fla",
            "fla_hybrid",
            "fla_hybrid-torch",
            "fla_hybrid-fp32",
            "fla_hybrid-bf16",
        ],
    )
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = p.parse_args(argv)

    if args.small:
        args.T, args.H, args.K, args.V = 1024, 2, 32, 32
        dtype = torch.float32
        device = torch.device(args.device or "cpu")
        args.mixes = args.mixes or ["16x64", "4x256", "lognormal"]
        args.iters, args.warmup = args.iters or 2, args.warmup if args.warmup is not None else 1
        if "chunk-compiled" in args.methods and device.type == "cpu":
            args.methods = [m for m in args.methods if m != "chunk-compiled"]  # minutes of CPU compile
    else:
        args.T, args.H, args.K, args.V = 32768, 16, 128, 128
        dtype = torch.bfloat16
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        args.mixes = args.mixes or ["64x512", "16x2048", "lognormal"]
        args.iters, args.warmup = args.iters or 10, args.warmup if args.warmup is not None else 2
        if device.type != "cuda":
            print("note: full-size run without CUDA; use --small for a CPU smoke test", file=sys.stderr)

    import transformers

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )
    try:
        import fla
        import triton

        print(f"fla {getattr(fla, '__version__', '?')}, triton {triton.__version__}")
    except Exception:  # noqa: BLE001
        print("fla: not installed")
    print(
        f"T={args.T} H={args.H} K={args.K} V={args.V} dtype={str(dtype).replace('torch.', '')}, "
        f"median of {args.iters} (warm-up {args.warmup}); ratios = loop ms / method ms"
    )

    all_rows = []
    for mix in args.mixes:
        all_rows += run_mix(mix, args, device, dtype)

    head = (
        f"{'mix':<10} {'N':>4} {'method':<15} {'fwd ms':>9} {'x loop':>7} {'fwd+bwd ms':>11} {'x loop':>7} "
        f"{'max|o-loop|':>11} {'peak GiB':>8}  note"
    )
    print()
    print(head)
    print("-" * len(head))
    for r in all_rows:
        print(
            f"{r['mix']:<10} {r['n']:>4} {r['method']:<15} {fmt(r['fwd'], '9.2f')} {fmt(r['fwd_x'], '7.1f')} "
            f"{fmt(r['fb'], '11.2f')} {fmt(r['fb_x'], '7.1f')} {fmt(r['err'], '11.2e')} {fmt(r['mem'], '8.2f')}  "
            f"{r['note']}"
        )
    if not args.small and device.type == "cuda":
        for method in ("chunk", "chunk-compiled"):
            r = next((x for x in all_rows if x["mix"] == "64x512" and x["method"] == method), None)
            if r and r["fb"] is not None:
                verdict = "PASS" if r["fb"] <= GOAL_MS else "FAIL"
                print(
                    f"\nissue-8 goal (64x512 fwd+bwd <= {GOAL_MS:.0f} ms), {method}: {r['fb']:.1f} ms -> {verdict}"
                    + (f" ({r['fb_x']:.1f}x the per-sequence loop)" if r["fb_x"] else "")
                )
        fla = next((x for x in all_rows if x["mix"] == "64x512" and x["method"] == "fla"), None)
        for method in HYBRID_METHODS:
            r = next((x for x in all_rows if x["mix"] == "64x512" and x["method"] == method), None)
            if r is None:
                continue
            if r["fb"] is None:
                print(f"\nissue-16 goal, {method}: not measured ({r['note']})")
                continue
            verdict = "PASS" if r["fb"] <= HYBRID_GOAL_MS else "FAIL"
            line = f"\nissue-16 goal (64x512 fwd+bwd <= {HYBRID_GOAL_MS:.0f} ms), {method}: {r['fb']:.2f} ms -> {verdict}"
            if fla and fla["fwd"] and r["fwd"]:
                ratio = r["fwd"] / fla["fwd"]
                line += f"; forward {r['fwd']:.2f} ms = {ratio:.2f}x fla's -> {'PASS' if ratio <= 2 else 'FAIL'} (<= 2x)"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
