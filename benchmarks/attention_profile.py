"""Where one varlen attention call's time goes: device kernels, host path, queued vs synced.

For each backend on one length mix (benchmarks/attention.py's mixes and inputs: T packed tokens, H/Hkv heads,
head dim D, causal, one ``VarlenMeta`` per batch as in training), after warm-up:

* ``kernels``: ``torch.profiler`` over ``--iters`` forward + backward calls, attributed as
  benchmarks/profile_step.py does (:func:`benchmarks._profile_attr.attribute`: device kernels only, the
  GPU-side spans of autograd and ``record_function`` ranges left out; on the CPU the leaf ATen ops stand in);
  per kernel the mean device time per call, and the sum of all kernels per call;
* ``host ms``: host wall time per forward + backward call while the calls are issued without waiting (the
  device catches up after the loop): varpack's dispatch, the backend's Python wrapper and its launches;
* ``queued ms`` / ``synced ms``: ``benchmarks._common.time_fn`` with ``queued=True`` / ``False``
  (benchmarks/attention.py's two timings). ``synced - queued`` is the host path the device idles behind when
  each call is waited for.

Run (GPU)::

    python benchmarks/attention_profile.py --lengths-file .gpu/samples.npz --mix short --heads 16/4 \\
        --backends triton_short,flash_attn_4 --out runs/profile.json
    python benchmarks/attention_profile.py --device cpu --small   # smoke test (triton_short interpreted)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # triton_short on the CPU: decided when triton is imported

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _profile_attr as A  # noqa: E402
from benchmarks._common import (  # noqa: E402
    REAL_MU,
    REAL_SIGMA,
    add_common_args,
    checked_device,
    error_text,
    machine_info,
    markdown_table,
    read_lengths_file,
    sync,
    time_fn,
    write_json,
)
from benchmarks.attention import MIXES, inputs, mix_lengths, parse_heads, varlen_runner  # noqa: E402


def kernel_rows(att: A.Attribution, calls: int) -> list[dict[str, Any]]:
    """Per kernel of :func:`benchmarks._profile_attr.attribute`'s ``top`` (largest first): name, category and
    mean µs per call over ``calls`` profiled calls."""
    return [{"name": name, "category": cat, "us": us / calls} for name, cat, us, _ in att.top]


def host_ms(fn, calls: int, device: torch.device) -> float:
    """Host wall ms per ``fn()`` issued ``calls`` times without waiting (the device synchronised before and
    after, outside the measured span)."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e3
    sync(device)
    return host


def profile_backend(name: str, q, k, v, cu, max_len: int, args, device: torch.device) -> dict[str, Any]:
    runner = varlen_runner(name, q, k, v, cu, max_len, batch_meta=True)
    row: dict[str, Any] = {"backend": name}
    try:
        for _ in range(args.warmup):
            runner.fwd_bwd()
        timed = {"warmup": 1, "iters": args.iters}
        row["queued_ms"] = time_fn(runner.fwd_bwd, device, queued=True, **timed)["ms"]
        row["synced_ms"] = time_fn(runner.fwd_bwd, device, queued=False, **timed)["ms"]
        row["host_ms"] = host_ms(runner.fwd_bwd, args.iters, device)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(args.iters):
                runner.fwd_bwd()
            sync(device)
        # profile_step.py's attribution: GPU-side spans of autograd / record_function ranges are not kernels
        # (torch.profiler reports them with the time of the kernels they enclose: counted once, not twice)
        records = A.events_from_profiler(list(prof.events()), -1, device.type)
        att = A.attribute(records, device="cuda" if device.type == "cuda" else "cpu", top=args.top)
        row["kernels"] = kernel_rows(att, args.iters)
        row["kernel_sum_ms"] = att.kernel_total_us / args.iters / 1e3
    except Exception as exc:  # a backend that cannot run here: reported, never fatal
        row["error"] = error_text(exc)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, small="smoke run: T=256, H=4/2, D=32, 1 iteration")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--mix", default="short", help="short, lognormal, uniform512, uniform2048")
    p.add_argument("--heads", default="16/4", help="one H/Hkv pair")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--backends", default="triton_short,flash_attn_4,torch_varlen")
    p.add_argument("--lengths-file", default=None, help="real lengths for the lognormal mix")
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--top", type=int, default=8, help="kernels listed per backend")
    args = p.parse_args(argv)
    device = checked_device(p, args)
    if args.small:
        args.tokens, args.head_dim, args.heads, args.max_len = 256, 32, "4/2", 128
        args.warmup, args.iters = 1, 1
    try:
        pairs = parse_heads(args.heads)
    except ValueError as exc:
        p.error(str(exc))
    if len(pairs) != 1:
        p.error(f"--heads takes one H/Hkv pair, got {args.heads!r}")
    if args.mix not in MIXES:
        p.error(f"--mix {args.mix!r}: choose one of {', '.join(MIXES)}")
    ((heads, kv_heads),) = pairs
    real = read_lengths_file(args.lengths_file) if args.lengths_file else None
    lengths = mix_lengths(
        args.mix, args.tokens, real=real, mu=REAL_MU, sigma=REAL_SIGMA, max_len=args.max_len, seed=args.seed
    )
    total = sum(lengths)
    q, k, v = inputs(total, heads, kv_heads, args.head_dim, device, getattr(torch, args.dtype), args.seed)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    print(
        f"# attention profile, {args.device} {args.dtype}, mix {args.mix}: T={total} N={len(lengths)} "
        f"max {max(lengths)}, H={heads}/{kv_heads}, D={args.head_dim}, causal, batch meta, fwd+bwd per call"
    )
    rows = [
        profile_backend(name, q, k, v, cu, max(lengths), args, device)
        for name in args.backends.split(",")
        if name
    ]
    nan = float("nan")
    print(
        markdown_table(
            ["backend", "queued ms", "synced ms", "synced - queued", "host ms", "kernel sum ms", "note"],
            [
                [
                    r["backend"],
                    r.get("queued_ms", nan),
                    r.get("synced_ms", nan),
                    r.get("synced_ms", nan) - r.get("queued_ms", nan),
                    r.get("host_ms", nan),
                    r.get("kernel_sum_ms", nan),
                    r.get("error", ""),
                ]
                for r in rows
            ],
        )
    )
    for r in rows:
        if r.get("kernels"):
            print(f"\n{r['backend']}: top kernels, mean µs per fwd+bwd call")
            print(
                markdown_table(
                    ["kernel", "category", "µs"],
                    [[x["name"][:90], x["category"], x["us"]] for x in r["kernels"]],
                )
            )
    write_json(args.out, {"machine": machine_info(device), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
