"""Gated delta rule on a packed row: varpack's varlen paths against the per-sequence PyTorch loop and fla.

Methods, all on the same packed inputs, in one run:

- ``loop`` (the baseline): transformers' PyTorch reference ``torch_chunk_gated_delta_rule``
  (``models/qwen3_next/modeling_qwen3_next.py``, unwrapped from any kernel dispatch) once per sequence of the
  pack, outputs concatenated: the only exact path for packed rows without fla;
- ``chunk``: :func:`varpack.ops.chunk_gated_delta_rule` (vectorized over all sequences, GEMM-only block
  inverse), eager; ``chunk-solve``: with ``torch.linalg.solve_triangular``; ``chunk-compiled``:
  ``torch.compile(dynamic=True)`` on its hot blocks (the first call's compile time in the note);
- ``fla``: flash-linear-attention's ``chunk_gated_delta_rule`` with ``cu_seqlens``; its backward is timed only
  where fla runs it (the refusal is in the note);
- ``fla_hybrid``: :func:`varpack.ops.gated_delta_rule.fla_hybrid_gated_delta_rule` as ``auto`` runs it (fla's
  kernels, the step fla refuses done by varpack's Triton kernel, ``precision="mixed"``); ``fla_hybrid-torch``:
  that step in batched PyTorch; ``fla_hybrid-fp32``: the Triton step with IEEE fp32 dots; ``fla_hybrid-bf16``:
  the PyTorch step with GEMM outputs rounded to bf16.

Mixes of T tokens: ``NxL`` (N sequences of L tokens) and ``lognormal`` (lognormal(6.5, 1) clipped to [16,
8192], seed 0; lognormal(4, 1) with ``--small``), the last sequence cut to fill T. Columns: forward ms (no
grad) and forward + backward ms (median after warm-up calls, each call waited for), each as the loop's ms /
the method's, the max |o - o_loop| of the forward, peak memory of forward + backward (CUDA).

    python benchmarks/gated_delta.py --methods loop chunk fla fla_hybrid --out gated_delta.json   # GPU
    python benchmarks/gated_delta.py --small                             # CPU smoke run
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    error_text,
    machine_info,
    markdown_table,
    sync,
    time_fn,
    write_json,
)
from varpack.ops.gated_delta_rule import chunk_gated_delta_rule, prepare_chunk_layout  # noqa: E402

METHODS = ("loop", "chunk", "chunk-solve", "chunk-compiled", "fla", "fla_hybrid", "fla_hybrid-torch",
           "fla_hybrid-fp32", "fla_hybrid-bf16")  # fmt: skip
#: fla_hybrid methods: the replaced backward step's precision, and the implementation that runs it
#: (``DQKWG_IMPL``)
HYBRID_METHODS = {"fla_hybrid": "mixed", "fla_hybrid-torch": "mixed", "fla_hybrid-fp32": "fp32",
                  "fla_hybrid-bf16": "input"}  # fmt: skip
HYBRID_IMPL = {"fla_hybrid-torch": "torch"}


def mix_lengths(name: str, T: int, mu: float = 6.5) -> list[int]:
    """Sequence lengths of a mix, summing to ``T``.

    Raises:
        ValueError: an ``NxL`` mix of other than ``T`` tokens, or an unknown mix."""
    if "x" in name:
        n, L = (int(v) for v in name.split("x"))
        if n * L != T:
            raise ValueError(f"mix {name} has {n * L} tokens, expected T={T}")
        return [L] * n
    if name != "lognormal":
        raise ValueError(f"unknown mix {name!r}: use NxL (e.g. 64x512) or lognormal")
    rng, out = np.random.default_rng(0), []
    while sum(out) < T:
        out.append(int(np.clip(rng.lognormal(mu, 1.0), 16, max(16, min(8192, T)))))
    out[-1] -= sum(out) - T
    return [x for x in out if x > 0]


def make_inputs(T, H, K, V, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen).to(device=device, dtype=dtype)

    q, k, v = r(1, T, H, K), r(1, T, H, K), r(1, T, H, V)
    g = F.logsigmoid(torch.randn(1, T, H, generator=gen) + 3.0).to(device=device, dtype=torch.float32)
    beta = torch.rand(1, T, H, generator=gen).to(device=device, dtype=dtype)
    return q, k, v, g, beta


def build_methods(cu_cpu, device, names):
    """``{name: callable(q, k, v, g, beta) -> o}``, or a string saying why the method cannot run here."""
    methods: dict = {}
    layout = prepare_chunk_layout(cu_cpu, device=device)
    if "loop" in names:
        from transformers.models.qwen3_next import modeling_qwen3_next as m

        base, bounds = (
            inspect.unwrap(m.torch_chunk_gated_delta_rule),
            list(zip(cu_cpu[:-1].tolist(), cu_cpu[1:].tolist())),
        )
        methods["loop"] = lambda q, k, v, g, beta: torch.cat(
            [
                base(
                    q[:, a:b],
                    k[:, a:b],
                    v[:, a:b],
                    g=g[:, a:b],
                    beta=beta[:, a:b],
                    use_qk_l2norm_in_kernel=True,
                )[0]
                for a, b in bounds
            ],
            dim=1,
        )
    for name, kw in (
        ("chunk", {}),
        ("chunk-solve", {"solve": "solve"}),
        ("chunk-compiled", {"compile": True}),
    ):
        methods[name] = lambda q, k, v, g, beta, _kw=kw: chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=cu_cpu, layout=layout, use_qk_l2norm_in_kernel=True, **_kw
        )[0]
    if "fla" in names:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

            cu_dev = cu_cpu.to(device)
            methods["fla"] = (
                "fla needs CUDA"
                if device.type != "cuda"
                else lambda q, k, v, g, beta: fla_rule(
                    q, k, v, g, beta, cu_seqlens=cu_dev, cu_seqlens_cpu=cu_cpu, use_qk_l2norm_in_kernel=True
                )[0]
            )
        except Exception as exc:  # not installed or not importable here
            methods["fla"] = f"fla not importable: {error_text(exc)}"
    if any(n in HYBRID_METHODS for n in names):
        from varpack.ops.gated_delta_rule.fla_hybrid import (
            fla_hybrid_gated_delta_rule,
            load_hybrid,
            prepare_fla_hybrid_boundaries,
        )

        fns, reason = load_hybrid()
        for name, precision in HYBRID_METHODS.items():
            if device.type != "cuda" or fns is None:
                methods[name] = (
                    "fla_hybrid needs CUDA" if device.type != "cuda" else f"fla_hybrid unavailable: {reason}"
                )
                continue
            bnd = prepare_fla_hybrid_boundaries(cu_cpu, device)  # per batch, as the model layers keep it
            methods[name] = lambda q, k, v, g, beta, _p=precision, _b=bnd: fla_hybrid_gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                cu_seqlens=_b.cu_seqlens,
                cu_seqlens_cpu=cu_cpu,
                use_qk_l2norm_in_kernel=True,
                precision=_p,
                boundaries=_b,
            )[0]
    return methods


def _set_dqkwg_impl(name):
    """The backward of ``fla_hybrid`` reads ``DQKWG_IMPL`` when it runs: set it for this method."""
    if name in HYBRID_METHODS:
        from varpack.ops.gated_delta_rule import fla_hybrid as fh

        fh.DQKWG_IMPL = HYBRID_IMPL.get(name, "auto")


def run_mix(mix, args, device, dtype):
    lengths = mix_lengths(mix, args.T, mu=4.0 if args.small else 6.5)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64)
    inputs = make_inputs(args.T, args.H, args.K, args.V, dtype, device)
    methods = build_methods(cu, device, args.methods)
    timing = {"warmup": args.warmup, "iters": args.iters}
    rows, ref = [], None
    for name in args.methods:
        fn = methods.get(name, "not run")
        row = {"mix": mix, "method": name, "n": len(lengths), "note": fn if isinstance(fn, str) else ""}
        rows.append(row)
        if isinstance(fn, str):
            continue
        _set_dqkwg_impl(name)
        try:
            if name == "chunk-compiled":
                t0 = time.perf_counter()
                fn(*[x.detach().clone().requires_grad_() for x in inputs]).float().sum().backward()
                sync(device)
                row["note"] = f"first call (compile) {time.perf_counter() - t0:.1f} s"
            with torch.no_grad():
                o = fn(*inputs).float()
                ref = o if name == "loop" else ref
                if name != "loop" and ref is not None:
                    row["err"] = float((o - ref).abs().max())
                row["fwd"] = time_fn(lambda f=fn: f(*inputs), device, **timing)["ms"]
        except Exception as exc:  # a method that cannot run this mix: reported
            row["note"] = f"forward failed: {error_text(exc)}"
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
            row["fb"] = time_fn(fwd_bwd, device, **timing)["ms"]
            if device.type == "cuda":
                row["mem"] = torch.cuda.max_memory_allocated() / 2**30
        except Exception as exc:  # e.g. fla's refusal of its backward on this stack
            row["note"] = "; ".join(x for x in (row["note"], f"backward failed: {error_text(exc)}") if x)
            if args.verbose:
                traceback.print_exc()
        del leaves
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = next((r for r in rows if r["method"] == "loop"), {})
    for r in rows:
        for key in ("fwd", "fb"):
            r[f"{key}_x"] = base[key] / r[key] if base.get(key) and r.get(key) else None
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="CPU-sized smoke run (T=1024, H=2, K=V=32, fp32)")
    p.add_argument("--device", default=None, help="default: cuda if available (cpu with --small)")
    p.add_argument("--mixes", nargs="+", default=None)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    p.add_argument("--out", default=None, help="write the rows, the command, commit and machine as JSON here")
    args = p.parse_args(argv)
    if args.small:
        args.T, args.H, args.K, args.V, dtype = 1024, 2, 32, 32, torch.float32
        device = torch.device(args.device or "cpu")
        args.mixes = args.mixes or ["16x64", "4x256", "lognormal"]
        args.iters, args.warmup = args.iters or 2, 1 if args.warmup is None else args.warmup
        if device.type == "cpu":  # minutes of CPU compile
            args.methods = [m for m in args.methods if m != "chunk-compiled"]
    else:
        args.T, args.H, args.K, args.V, dtype = 32768, 16, 128, 128, torch.bfloat16
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        args.mixes = args.mixes or ["64x512", "16x2048", "lognormal"]
        args.iters, args.warmup = args.iters or 10, 2 if args.warmup is None else args.warmup
    info = machine_info(device)
    print(
        f"torch {info['torch']}, transformers {info['transformers']}, fla {info['fla']}, triton "
        f"{info['triton']}, "
        f"{info.get('gpu', info.get('cpu'))}; T={args.T} H={args.H} K={args.K} V={args.V} "
        f"{str(dtype).removeprefix('torch.')}, median of {args.iters} after {args.warmup} warm-up calls"
    )
    rows = [row for mix in args.mixes for row in run_mix(mix, args, device, dtype)]
    headers = [
        "mix",
        "N",
        "method",
        "fwd ms",
        "x loop",
        "fwd+bwd ms",
        "x loop",
        "max|o-loop|",
        "peak GiB",
        "note",
    ]
    print(
        markdown_table(
            headers,
            [
                [
                    r["mix"],
                    r["n"],
                    r["method"],
                    r.get("fwd"),
                    r["fwd_x"],
                    r.get("fb"),
                    r["fb_x"],
                    f"{r['err']:.2e}" if "err" in r else "-",
                    r.get("mem"),
                    r["note"],
                ]
                for r in rows
            ],
        )
    )
    write_json(args.out, {"machine": info, "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
