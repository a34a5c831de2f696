"""Where a varpack SFT step spends its time (issue 7 item 1): torch.profiler of train steps, by category.

Builds the same model, samples and packs as ``benchmarks/train.py`` (Qwen3-0.6B shape, bf16, fused AdamW,
packs of ``--packing-length``), runs ``--warmup`` un-profiled steps, times ``--steps`` steps without the
profiler (the true step time), then profiles ``--steps`` more and attributes every GPU kernel to a category:

====================  ==================================================================================
category              rule (first match wins)
====================  ==================================================================================
optimizer             launched under ``Optimizer.step`` / ``zero_grad`` or by an ``*adam*`` op
attention             kernel name (flash / fmha / attention / flex ...) or launched under an attention op
                      (``varlen_attn``, ``flash_attn``, ``flex_attention``, ``scaled_dot_product``, ...)
embedding             launched under an ``embedding`` op (forward gather, dense backward)
LM head + loss        the launching op (or one of its 3 closest ancestors) has a tensor with a dimension
                      equal to the vocabulary size, or is a cross-entropy / log-softmax / linear-CE op
GEMM                  kernel name (gemm / xmma / cutlass / cublas / nvjet ...) or a matmul op
elementwise / norm    everything else launched by an ATen op (RMSNorm, RoPE, SiLU, casts, adds, copies)
memcpy / memset       copies and fills issued by the runtime
====================  ==================================================================================

Each kernel is attributed once, to the innermost ATen op that launched it (``FunctionEvent.kernels``), with
that op's ancestors (the autograd node for backward kernels) giving the context. ``GPU busy`` is the union of
all kernel intervals; ``host gaps`` = profiled wall time - GPU busy: time the GPU waited for the CPU (Python,
launch overhead, syncs). Shares are of the profiled wall time. The un-profiled step time is printed beside
the profiled one so the profiler's own overhead is visible.

Run::

    python benchmarks/profile_step.py --samples .gpu/samples.npz --config varpack_lce --out runs/profile.json
    python benchmarks/profile_step.py --device cpu --small      # smoke test (CPU op self time instead)
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import train as T  # noqa: E402
from benchmarks._common import load_samples, machine_info, markdown_table, sync, synthetic_samples, write_json  # noqa: E402

CATEGORIES = (
    "attention",
    "GEMM",
    "LM head + loss",
    "optimizer",
    "embedding",
    "elementwise / norm",
    "memcpy / memset",
    "other",
)

_ATTN_KERNEL = re.compile(r"flash|fmha|attention|attn|flex|sdpa|_fwd_kernel|_bwd_kernel", re.I)
_ATTN_OP = re.compile(
    r"varlen|flash_?attn|flex|attention|scaled_dot_product|sdpa|fmha",
    re.I,
)
_GEMM_KERNEL = re.compile(r"gemm|gemv|xmma|cutlass|cublas|nvjet|wgmma|sm90_|sm80_|ampere_|hopper", re.I)
_GEMM_OP = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm)$")
_LOSS_OP = re.compile(
    r"cross_entropy|nll_loss|log_softmax|logsumexp|LinearCrossEntropy|linear_cross_entropy|Liger", re.I
)
_OPT = re.compile(r"^Optimizer\.|zero_grad|adam", re.I)
_COPY_KERNEL = re.compile(r"memcpy|memset", re.I)


_LAUNCH = re.compile(r"^(cuda|cu)(LaunchKernel|LaunchCooperativeKernel|GraphLaunch|Memcpy|Memset)", re.I)


def _by_name(kernel_name: str) -> str:
    """Category from the kernel name alone (no CPU context found)."""
    if _ATTN_KERNEL.search(kernel_name):
        return "attention"
    if _COPY_KERNEL.search(kernel_name):
        return "memcpy / memset"
    if _GEMM_KERNEL.search(kernel_name):
        return "GEMM"
    return "other"


def _chain(evt: Any, depth: int = 64) -> list[Any]:
    out = []
    while evt is not None and len(out) < depth:
        out.append(evt)
        evt = evt.cpu_parent
    return out


def _has_dim(evt: Any, size: int) -> bool:
    for shape in evt.input_shapes or ():
        if isinstance(shape, (list, tuple)) and size in shape:
            return True
    return False


def categorize(kernel_name: str, op: Any, vocab: int) -> str:
    """Category of one kernel launched by the CPU op ``op`` (see the module table)."""
    chain = _chain(op)
    names = [e.name for e in chain]
    if any(_OPT.search(n) for n in names):
        return "optimizer"
    if _ATTN_KERNEL.search(kernel_name) or any(_ATTN_OP.search(n) for n in names):
        return "attention"
    if any("embedding" in n for n in names):
        return "embedding"
    if any(_LOSS_OP.search(n) for n in names) or any(_has_dim(e, vocab) for e in chain[:4]):
        return "LM head + loss"
    if _COPY_KERNEL.search(kernel_name):
        return "memcpy / memset"
    if _GEMM_KERNEL.search(kernel_name) or any(_GEMM_OP.match(n) for n in names[:3]):
        return "GEMM"
    if names and names[0].startswith("aten::"):
        return "elementwise / norm"
    return "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(prof: Any, wall_s: float, vocab: int, device_type: str, steps: int) -> dict[str, Any]:
    """Per-category time (ms per step), GPU busy, host gaps, top kernels."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    per_cat: dict[str, float] = defaultdict(float)
    per_kernel: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    if device_type == "cuda":
        device_events = [e for e in events if e.device_type == DeviceType.CUDA]
        kernel_total = sum(e.time_range.end - e.time_range.start for e in device_events)
        # Preferred attribution: kernel -> its launch call (same CUPTI correlation id) -> the innermost range
        # open on the CPU at launch (an ATen op, an autograd node, or a compiled region for Triton kernels).
        launches = {e.id: e for e in events if e.device_type == DeviceType.CPU and _LAUNCH.search(e.name)}
        attributed = 0.0
        for k in device_events:
            rt = launches.get(k.id)
            op = rt.cpu_parent if rt is not None else None
            dur = k.time_range.end - k.time_range.start
            cat = categorize(k.name, op, vocab) if op is not None else _by_name(k.name)
            attributed += dur if op is not None else 0.0
            per_cat[cat] += dur
            agg = per_kernel[(k.name, cat)]
            agg[0] += dur
            agg[1] += 1
        if kernel_total and attributed < 0.5 * kernel_total:
            # this torch version does not link launches to kernels: use the ops' own kernel lists
            per_cat.clear()
            per_kernel.clear()
            for evt in events:
                if evt.device_type != DeviceType.CPU:
                    continue
                for k in getattr(evt, "kernels", ()):
                    cat = categorize(k.name, evt, vocab)
                    per_cat[cat] += k.duration
                    agg = per_kernel[(k.name, cat)]
                    agg[0] += k.duration
                    agg[1] += 1
            attributed = sum(per_cat.values())
            per_cat["other"] += max(0.0, kernel_total - attributed)
        busy_us = _union_us([(e.time_range.start, e.time_range.end) for e in device_events])
        n_kernels = len(device_events)
        attribution = attributed / kernel_total if kernel_total else 1.0
    else:  # CPU smoke: ATen ops' self CPU time stands in for kernel time
        for evt in events:
            if evt.device_type != DeviceType.CPU or not evt.name.startswith("aten::"):
                continue
            cat = categorize(evt.name, evt, vocab)
            per_cat[cat] += evt.self_cpu_time_total
            agg = per_kernel[(evt.name, cat)]
            agg[0] += evt.self_cpu_time_total
            agg[1] += 1
        busy_us = sum(per_cat.values())
        n_kernels = sum(int(v[1]) for v in per_kernel.values())
        attribution = 1.0
    wall_us = wall_s * 1e6
    rows = {c: per_cat.get(c, 0.0) / steps / 1e3 for c in CATEGORIES}
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:20]
    return {
        "ms_per_step": rows,
        "kernel_sum_ms_per_step": sum(per_cat.values()) / steps / 1e3,
        "busy_ms_per_step": busy_us / steps / 1e3,
        "wall_ms_per_step": wall_us / steps / 1e3,
        "host_gap_ms_per_step": max(0.0, wall_us - busy_us) / steps / 1e3,
        "kernels_per_step": n_kernels / steps,
        "attributed_fraction": attribution,
        "top_kernels": [
            {
                "name": name[:120],
                "category": cat,
                "ms_per_step": v[0] / steps / 1e3,
                "calls_per_step": v[1] / steps,
            }
            for (name, cat), v in top
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None)
    p.add_argument("--samples", default=None)
    p.add_argument(
        "--config", default="varpack", choices=[c for c in T.ALL_CONFIGS if c.startswith("varpack")]
    )
    p.add_argument("--packing-length", type=int, default=8192)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps timed without, then with the profiler")
    p.add_argument("--attn-backend", default="auto")
    p.add_argument("--lce-backend", default="auto")
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", default=None, help="also export a Chrome trace here")
    p.add_argument("--small", action="store_true", help="smoke mode: tiny model, packing 512")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; use --device cpu --small")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    args.pad_batch, args.pad_token_id = 0, 0  # unused by the varpack configs; train.py's helpers read them
    values = dict(T.QWEN3_0_6B)
    if args.small:
        values = dict(T.TINY)
        args.packing_length, args.warmup, args.steps = min(args.packing_length, 512), 1, 2
        args.chunk_size = min(args.chunk_size, 128)
    total_steps = args.warmup + 2 * args.steps
    if args.samples:
        samples = load_samples(args.samples)
        if args.small:
            values["vocab_size"] = T.QWEN3_0_6B["vocab_size"]
    else:
        from benchmarks.attention import DEFAULT_MU, DEFAULT_SIGMA

        samples = synthetic_samples(
            int(total_steps * args.packing_length * 1.3 / 150) + 16,
            vocab=values["vocab_size"],
            mu=DEFAULT_MU,
            sigma=DEFAULT_SIGMA,
            hi=args.packing_length,
            seed=args.seed,
        )
    ds, chosen, info = T.build_workload(samples, args.packing_length, total_steps)
    steps = T.collate_steps(args.config, ds, chosen, args)
    dtype = getattr(torch, args.dtype)
    model = T.build_model(values, device=device, dtype=dtype, attn_implementation="sdpa", seed=args.seed)
    from varpack.integrations.transformers import enable_varpack

    enable_varpack(model, backend=args.attn_backend)
    options = T.apply_step_options(model, args.config)
    loss_fn, loss_note = T.make_loss_fn(args.config, args)
    opt = T.make_optimizer(model, device)
    counts = [T.supervised_count(st) for st in steps]

    def run(i: int) -> None:
        for mb in steps[i]:
            loss = loss_fn(model, T.to_device(mb, device, T.VARPACK_CPU_KEYS), counts[i])
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(args.warmup):
        run(i)
    sync(device)
    t0 = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        run(i)
    sync(device)
    plain_ms = 1e3 * (time.perf_counter() - t0) / args.steps

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        sync(device)
        t0 = time.perf_counter()
        for i in range(args.warmup + args.steps, total_steps):
            run(i)
        sync(device)
        wall = time.perf_counter() - t0
    summary = summarize(prof, wall, values["vocab_size"], device.type, args.steps)
    if args.trace:
        prof.export_chrome_trace(args.trace)

    tokens = (
        sum(T.real_token_count(steps[i]) for i in range(args.warmup + args.steps, total_steps)) / args.steps
    )
    print(
        f"# profile of one {args.config} step, {args.device} {args.dtype}, packing_length {args.packing_length}"
    )
    print(
        f"- loss: {loss_note}; attention: varpack {args.attn_backend}; options: {options or 'none'}; ~{tokens:.0f} tokens/step; {info}"
    )
    print(
        f"- step time without profiler {plain_ms:.1f} ms, with profiler {summary['wall_ms_per_step']:.1f} ms; "
        f"{summary['kernels_per_step']:.0f} {'kernels' if device.type == 'cuda' else 'ATen ops'} per step; "
        f"{100 * summary['attributed_fraction']:.0f}% of kernel time attributed to a CPU context"
    )
    wall_ms = summary["wall_ms_per_step"]
    rows = [[c, ms, f"{100 * ms / wall_ms:.1f}%"] for c, ms in summary["ms_per_step"].items()]
    busy_label = "GPU busy (union of kernels)" if device.type == "cuda" else "ATen self time (sum)"
    rows.append(
        [busy_label, summary["busy_ms_per_step"], f"{100 * summary['busy_ms_per_step'] / wall_ms:.1f}%"]
    )
    rows.append(
        [
            "host gaps (wall - busy)",
            summary["host_gap_ms_per_step"],
            f"{100 * summary['host_gap_ms_per_step'] / wall_ms:.1f}%",
        ]
    )
    rows.append(["step wall (profiled)", wall_ms, "100%"])
    print()
    print(markdown_table(["category", "ms / step", "share of wall"], rows))
    print()
    print(
        markdown_table(
            ["top kernels", "category", "ms / step", "calls / step"],
            [
                [k["name"][:80], k["category"], k["ms_per_step"], k["calls_per_step"]]
                for k in summary["top_kernels"][:12]
            ],
        )
    )
    write_json(
        args.out,
        {
            "machine": machine_info(device),
            "args": vars(args),
            "workload": info,
            "step_ms_without_profiler": plain_ms,
            "tokens_per_step": tokens,
            **summary,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
