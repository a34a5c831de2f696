"""Does the gated delta rule compute a sample differently when it shares a packed row? The same inputs go through a
backend once as one packed row (``cu_seqlens`` of every sample) and once as one call per sample; each output and
gradient (o, dq, dk, dv, dg, dbeta) of every sample is compared between the two, and both against the float32
truth (varpack's PyTorch chunked rule).

A backend whose kernels work per sample and per chunk (``fla_hybrid``) gives the same bits either way. ``chunk``
vectorizes its sequences, so its dg differs at rounding level (about 1e-7 of its scale in float32 on the CPU,
8e-5 in bf16 on an H200). A leak shows as a difference of the order of the values themselves (a row without its
boundaries: ``tests/benchmarks/test_gated_delta_packed_bits.py``).

Also printed, per trial, the error of a gate-parameter-like reduction: ``sum_t dg[t, h] * w[t, h]`` per head (as
a Gated DeltaNet's ``dt_bias`` / ``A_log`` gradient sums ``dg`` over every token), packed and per sample::

    python -m benchmarks.gated_delta_packed_bits --backend fla_hybrid      # CUDA (fla installed)
    python -m benchmarks.gated_delta_packed_bits --backend chunk --device cpu --dims 2 4 16 16

The shape defaults to Qwen3.5's linear-attention heads (Hk = H = 16, K = V = 128) and the lengths of the
``varpack check`` VL sample set (308, 63, 177, 46 tokens).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["main"]

NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def _inputs(lengths, dims, seed):
    Hk, H, K, V = dims
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)

    def r(*s):
        return torch.randn(*s, generator=gen)

    q, k, v = r(1, T, Hk, K), r(1, T, Hk, K), r(1, T, H, V)
    g = F.logsigmoid(r(1, T, H) + 2.0)
    beta = torch.rand(1, T, H, generator=gen)
    do = r(1, T, H, V)
    return [q, k, v, g, beta], do


def _call(backend, ins, do, cu, device):
    from varpack.ops import gated_delta_rule

    leaves = [x.detach().clone().requires_grad_() for x in ins]
    kw = {"cu_seqlens": cu.to(device)}
    if backend == "fla_hybrid":
        kw["cu_seqlens_cpu"] = cu
    o, _ = gated_delta_rule(*leaves, backend=backend, use_qk_l2norm_in_kernel=True, **kw)
    (o.float() * do.to(o.device).float()).sum().backward()
    return [o.detach().float().cpu()] + [x.grad.float().cpu() for x in leaves]


def trial(backend, lengths, dims, seed, device, dtype):
    ins, do = _inputs(lengths, dims, seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    low = [x.to(device=device, dtype=dtype) for x in ins]
    packed = _call(backend, low, do.to(device=device, dtype=dtype), cu, device)
    parts = []
    for i, n in enumerate(lengths):
        a, b = int(cu[i]), int(cu[i + 1])
        sl = [x[:, a:b] for x in low]
        parts.append(_call(backend, sl, do[:, a:b].to(device=device, dtype=dtype), torch.tensor([0, n]), device))
    single = [torch.cat([p[j] for p in parts], dim=1) for j in range(len(NAMES))]
    truth = _call("chunk", [x.float().cpu() for x in low], do.to(dtype).float(), cu, "cpu")
    out = {"seed": seed}
    for name, p, s, t in zip(NAMES, packed, single, truth):
        scale = float(t.abs().max())
        out[name] = {
            "packed_vs_per_sample": float((p - s).abs().max()) / scale,
            "packed_err": float((p - t).abs().max()) / scale,
            "per_sample_err": float((s - t).abs().max()) / scale,
        }
    w = torch.rand(truth[4].shape, generator=torch.Generator().manual_seed(seed + 1))  # a sigmoid-like weight
    red = lambda dg: (dg * w).sum(dim=(0, 1))  # noqa: E731   per head, like dt_bias's gradient
    rt = red(truth[4])
    out["gate_sum"] = {
        "packed_err": float((red(packed[4]) - rt).abs().max()) / float(rt.abs().max()),
        "per_sample_err": float((red(single[4]) - rt).abs().max()) / float(rt.abs().max()),
    }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from varpack.ops.gated_delta_rule import BACKENDS

    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--backend", default="fla_hybrid" if cuda else "chunk", choices=BACKENDS,
        help="gated delta rule backend under test (default: fla_hybrid with CUDA, else chunk)",
    )  # fmt: skip
    p.add_argument("--device", default="cuda" if cuda else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the inputs' dtype")
    p.add_argument(
        "--dims", type=int, nargs=4, default=[16, 16, 128, 128], metavar=("Hk", "H", "K", "V"),
        help="q/k heads, v heads (a multiple of Hk), q/k head dim, v head dim (default: Qwen3.5's)",
    )  # fmt: skip
    p.add_argument(
        "--lengths", type=int, nargs="+", default=[308, 63, 177, 46],
        help="the samples' token counts, each >= 1 (default: the varpack check VL sample set's)",
    )  # fmt: skip
    p.add_argument("--trials", type=int, default=8, help="random input sets (default: %(default)s)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not cuda:
        p.error("--device cuda but CUDA is not available here")
    if args.backend in ("fla", "fla_hybrid") and args.device != "cuda":
        p.error(f"--backend {args.backend} runs on CUDA only (--device {args.device}); try --backend chunk")
    if min(args.lengths) < 1:
        p.error(f"--lengths must each be >= 1 (a sample of no token has nothing to compare), got {args.lengths}")
    if args.trials < 1 or min(args.dims) < 1:
        p.error(f"--trials and --dims must be >= 1, got {args.trials} and {args.dims}")
    if args.dims[1] % args.dims[0]:
        p.error(f"--dims: the v heads H={args.dims[1]} must be a multiple of the q/k heads Hk={args.dims[0]}")
    dtype = getattr(torch, args.dtype)
    rows = [trial(args.backend, args.lengths, args.dims, s, args.device, dtype) for s in range(args.trials)]
    print(f"{args.backend} {args.dtype} on {args.device}, dims {args.dims}, lengths {args.lengths}, {args.trials} trials")
    print("max over trials of max|x| error / max|truth|:")
    print("| tensor | packed vs per sample | packed vs fp32 truth | per sample vs fp32 truth |")
    print("|---|---|---|---|")
    for name in NAMES:
        vals = [max(r[name][k] for r in rows) for k in ("packed_vs_per_sample", "packed_err", "per_sample_err")]
        print(f"| {name} | " + " | ".join(f"{v:.3g}" for v in vals) + " |")
    ratios = sorted(r["gate_sum"]["packed_err"] / max(r["gate_sum"]["per_sample_err"], 1e-30) for r in rows)
    print("gate-parameter-like sum, error / max|truth| per trial (packed, per sample):")
    for r in rows:
        print(f"  seed {r['seed']}: {r['gate_sum']['packed_err']:.3g} {r['gate_sum']['per_sample_err']:.3g}")
    print(f"  ratio packed / per sample: median {ratios[len(ratios) // 2]:.3g}, max {ratios[-1]:.3g}")
    print("RESULT " + json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
