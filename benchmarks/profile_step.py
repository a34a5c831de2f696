"""Where a varpack SFT step spends its time: ``torch.profiler`` of train steps, every device kernel in one
category.

The model, samples and packs of benchmarks/train.py (Qwen3-0.6B shape, bf16, AdamW fused or ``--optimizer
compiled``, ``--static-empty-pads`` as there, ``--steps`` packs of
``--packing-length``; ``--config`` one of its varpack rows). Steady state: every pack is first run once
untimed (every compile, autotune and FA4 kernel compile of its shapes happens there), then ``--warmup`` more
untimed steps; the packs are then timed without the profiler (the true step time) and run once more under
``torch.profiler``. Every device kernel of the profiled pass is attributed to one category
(:mod:`benchmarks._profile_attr`):

====================  ==================================================================================
category              rule (first match wins)
====================  ==================================================================================
optimizer             launched under ``Optimizer.step`` / ``zero_grad``, or an ``*adam*`` op / kernel
attention             kernel name (flash / fmha / attention / attn / flex ...) or an attention op launched it
embedding             launched under an ``embedding`` op / Triton range (forward gather, dense backward)
LM head + loss        one of the 4 innermost launching ops has a vocabulary-sized dimension, or a
                      cross-entropy / log-softmax / linear-CE / Liger kernel or op
memcpy / memset       the runtime's copies and fills
GEMM                  kernel name (gemm / xmma / cutlass / cublas / nvjet / Inductor ``triton_tem_`` ...) or a
                      matmul op among the 3 innermost launching ops
elementwise / norm    Inductor's fused Triton kernels (norms, RoPE, SiLU, casts, adds), the rest of ATen's
other                 the rest (listed in the top kernels when it matters)
====================  ==================================================================================

Device kernels only: the GPU-side spans of ``record_function`` ranges (``## Call CompiledFxGraph ##``,
``ProfilerStep#``) enclose kernels and are excluded (counted, they would count their kernels twice). The table
adds up: kernel time total = the sum of the categories; busy = the union of kernel intervals; host gaps =
profiled wall time - GPU busy (the GPU waiting for the CPU). A check line says so, and the script exits 1
(after ``--out``) when it does not add up or kernels of one stream overlap
(:func:`benchmarks._profile_attr.check`). Then where the device idles between its kernels
(:func:`benchmarks._profile_attr.device_gaps`): gaps under 10 us (mostly launch latency between queued kernels)
summed, longer ones (mostly the device waiting for the host) summed and grouped by the work that ends them; and
the top elementwise / norm kernels. Last line: the host time of one varpack attention call at the step's
shapes (benchmarks/attention_host_time.py), paid once per layer.

    python benchmarks/profile_step.py --samples .gpu/samples.npz --config varpack_lce_compile --out p.json
    python benchmarks/profile_step.py --device cpu --small      # smoke run (CPU op time instead of kernels)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _profile_attr as A  # noqa: E402
from benchmarks import train as T  # noqa: E402
from benchmarks._common import (  # noqa: E402
    OPTIMIZER_IMPLS,
    add_common_args,
    build_model,
    checked_device,
    fullest_packs,
    machine_info,
    make_optimizer,
    markdown_table,
    samples_for,
    sync,
    write_json,
)


def summarize(prof: Any, wall_s: float, vocab: int, device_type: str, steps: int) -> dict[str, Any]:
    """The table's figures per step (:func:`benchmarks._profile_attr.per_step`) and the check's problems."""
    records = A.events_from_profiler(list(prof.events()), vocab, device_type)
    att = A.attribute(records, device="cuda" if device_type == "cuda" else "cpu")
    out = A.per_step(att, steps, wall_s * 1e6)
    out["check_problems"] = A.check(att)
    return out


def print_gaps_and_categories(summary: dict[str, Any], categories: tuple[str, ...] = ("elementwise / norm",)) -> None:
    """The device's idle time between kernels (short gaps: back-to-back launches; long gaps: waiting for the
    host, by the work that ends them) and the top kernels of ``categories``."""
    print()
    print(
        f"device idle between its first and last kernel: {summary['short_gap_ms_per_step']:.2f} ms/step in "
        f"{summary['short_gaps_per_step']:.0f} gaps under {A.LONG_GAP_US:.0f} us (mostly launch latency between "
        f"queued kernels); {summary['long_gap_ms_per_step']:.2f} ms/step in {summary['long_gaps_per_step']:.0f} "
        "longer gaps (mostly the device waiting for the host), the largest by the work that ends them:"
    )
    if summary["long_gaps"]:
        print()
        print(markdown_table(
            ["long gaps before", "ms / step", "gaps / step"],
            [[g["before"], g["ms_per_step"], g["gaps_per_step"]] for g in summary["long_gaps"][:10]],
        ))  # fmt: skip
    for cat in categories:
        rows = summary["top_kernels_by_category"].get(cat)
        if rows:
            print()
            print(markdown_table(
                [f"top {cat} kernels", "ms / step", "calls / step"],
                [[k["name"][:100], k["ms_per_step"], k["calls_per_step"]] for k in rows],
            ))  # fmt: skip


def attention_host_time(
    model: Any, mb: dict[str, Any], device: Any, dtype: Any, backend: str, calls: int
) -> dict:
    """Host time of one varpack attention call at this step's shapes (benchmarks/attention_host_time.py):
    ``no_kernel`` backend (varpack's own work around the kernel: checks, boundaries, backend resolution,
    dispatch), one layer's q/k/v ``[T, H, D]`` / ``[T, Hkv, D]`` and the first micro-batch's cu_seqlens."""
    from benchmarks.attention_host_time import host_time_rows, register_no_kernel

    cfg = model.config
    cu = mb["cu_seq_lens_q"].to(torch.int32)
    t = int(cu[-1])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q = torch.randn(t, cfg.num_attention_heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(t, cfg.num_key_value_heads, head_dim, device=device, dtype=dtype)
    max_seqlen = int((cu[1:] - cu[:-1]).max())
    rows = host_time_rows(q, k, k, cu, max_seqlen, (register_no_kernel(),), calls, 5)
    return {f"{b} ({how})": sec * 1e6 for b, how, sec in rows} | {
        "tokens": t,
        "segments": int(cu.numel() - 1),
        "layers": cfg.num_hidden_layers,
        "note": f"us per call, calling-thread CPU time; backend of the step: {backend}",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, small="smoke run: tiny-qwen3, packing 512, 2 packs")
    p.add_argument("--samples", default=None)
    p.add_argument("--model", default="qwen3-0.6b-shape")
    p.add_argument(
        "--config", default="varpack", choices=[c for c in T.ALL_CONFIGS if c.startswith("varpack")]
    )
    p.add_argument("--packing-length", type=int, default=8192)
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed steps after the untimed pass over the packs"
    )
    p.add_argument(
        "--steps", type=int, default=3, help="packs; each run untimed, timed without, then with the profiler"
    )
    p.add_argument("--attn-backend", default="auto")
    p.add_argument("--lce-backend", default="auto")
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument(
        "--lm-head-rows", choices=("supervised", "all"), default="supervised",
        help="varpack_lce* configs: the LM head on the supervised rows only (varpack sft) or on every row",
    )  # fmt: skip
    p.add_argument(
        "--static-empty-pads", choices=("auto", "on", "off"), default="auto",
        help="static configs: zero-length pad segments (benchmarks/train.py's option)",
    )  # fmt: skip
    p.add_argument("--optimizer", choices=OPTIMIZER_IMPLS, default="fused", help="AdamW's implementation")
    T.add_graphs_inductor_options(p)
    p.add_argument("--attn-host-calls", type=int, default=200, help="0: skip the attention host-time row")
    p.add_argument("--trace", default=None, help="also export a Chrome trace here")
    args = p.parse_args(argv)
    device = checked_device(p, args)
    args.pad_batch, args.pad_token_id = 0, 0  # unused by the varpack configs; train.py's helpers read them
    # the static configs' shape: train.py's defaults
    args.static_multiple_of, args.static_segments = 64, None
    vocab = None
    if args.small:
        args.model, vocab = "tiny-qwen3", None if args.samples else 1024
        args.packing_length, args.warmup, args.steps, args.chunk_size = (
            min(args.packing_length, 512),
            1,
            2,
            128,
        )
        args.attn_host_calls = min(args.attn_host_calls, 20)
    samples, _ = samples_for(
        args.samples,
        vocab=vocab or 151936,
        tokens=args.steps * args.packing_length * 1.3,
        hi=args.packing_length,
        seed=args.seed,
    )
    ds, chosen, info = fullest_packs(samples, args.packing_length, args.steps)
    graph_note, args.vocab_size = None, vocab  # train.py's static shape builds the model on the meta device
    if "graphs" in T.split_config(args.config)[1] and device.type == "cuda":  # the attention varpack sft captures
        args.attn_backend, graph_note = T.graph_attention_for(ds, args)
    steps = T.collate_steps(args.config, ds, chosen, args)
    n, dtype = len(steps), getattr(torch, args.dtype)
    model = build_model(
        args.model,
        device=device,
        dtype=dtype,
        seed=args.seed,
        vocab_size=vocab,
        hf_attn="sdpa",
        backend=args.attn_backend,
    )
    opt = make_optimizer(model, device, impl=args.optimizer)  # first: compiled, it resets torch.compile's caches
    options = T.apply_step_options(model, args.config, args.graphs_inductor_options)
    loss_fn, loss_note = T.make_loss_fn(args.config, args)
    counts = [T.supervised_count(st) for st in steps]
    labelled = [[T.labelled_count(mb) for mb in st] for st in steps]  # counted once, outside the timed steps
    keep_cpu = T.keep_cpu_keys(args.config)
    T.step_context(
        args.config
    ).__enter__()  # _graphs: a graph not captured raises; for this one-config process

    def run(i: int) -> torch.Tensor:
        for mb, bound in zip(steps[i % n], labelled[i % n]):
            loss = loss_fn(model, T.to_device(mb, device, keep_cpu), counts[i % n], bound)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def timed(fn) -> float:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0

    cold_s = timed(lambda: [run(i) for i in range(n)])  # the untimed pass: every compile of the packs' shapes
    timed(lambda: [run(i) for i in range(args.warmup)])
    plain_ms = 1e3 * timed(lambda: [run(i) for i in range(n)]) / n
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        wall = timed(lambda: [run(i) for i in range(n)])
    summary = summarize(prof, wall, int(model.config.vocab_size), device.type, n)
    if args.trace:
        prof.export_chrome_trace(args.trace)
    host = None
    if args.attn_host_calls > 0:
        host = attention_host_time(model, steps[0][0], device, dtype, args.attn_backend, args.attn_host_calls)

    tokens = sum(T.real_token_count(st) for st in steps) / n
    cuda = device.type == "cuda"
    print(
        f"# profile of one {args.config} step, {args.device} {args.dtype}, packing_length "
        f"{args.packing_length}"
    )
    attention = f"varpack {args.attn_backend}" + (f" ({graph_note})" if graph_note else "")
    print(
        f"- loss: {loss_note}; attention: {attention}; options: {options or 'none'}; AdamW "
        f"{args.optimizer}; static empty pads {args.static_empty_pads}; "
        f"~{tokens:.0f} tokens/step; {n} packs, each run untimed first (cold pass {cold_s:.1f} s) + "
        f"{args.warmup} warm-up steps; {info}"
    )
    unit = "kernels" if cuda else "leaf ATen ops (CPU time stands in for kernel time)"
    print(
        f"- step time without profiler {plain_ms:.1f} ms, with profiler {summary['wall_ms_per_step']:.1f} "
        "ms; "
        f"{summary['kernels_per_step']:.0f} {unit} + {summary['copies_per_step']:.0f} memcpy/memset per "
        "step; "
        f"excluded: {summary['annotation_spans_excluded_per_step']:.0f} GPU-side annotation spans per step "
        f"({summary['annotation_ms_excluded_per_step']:.1f} ms, e.g. `## Call CompiledFxGraph ##`); "
        f"{summary['unlinked_ms_per_step']:.2f} ms/step of kernels with no launching host range (by name)"
    )
    wall_ms = summary["wall_ms_per_step"]
    ktot = summary["kernel_total_ms_per_step"]
    busy = summary["busy_ms_per_step"]

    def pct(x: float, of: float) -> str:
        return f"{100 * x / of:.1f}%" if of else "-"

    rows = [
        [c, ms, summary["busy_ms_per_step_by_category"][c], pct(ms, ktot), pct(ms, wall_ms)]
        for c, ms in summary["kernel_ms_per_step"].items()
    ]
    nan = float("nan")
    rows.append(["**kernel time total** (sum of the above)", ktot, nan, pct(ktot, ktot), pct(ktot, wall_ms)])
    rows.append(["overlap (kernel total - GPU busy)", summary["stream_overlap_ms_per_step"], nan, "", ""])
    rows.append(["**GPU busy** (union of kernel intervals)", nan, busy, "", pct(busy, wall_ms)])
    rows.append(
        [
            "**host gaps** (wall - GPU busy)",
            nan,
            summary["host_gap_ms_per_step"],
            "",
            pct(summary["host_gap_ms_per_step"], wall_ms),
        ]
    )
    rows.append(["**step wall** (profiled)", nan, wall_ms, "", "100%"])
    print()
    print(
        markdown_table(["category", "kernel ms / step", "busy ms / step", "of kernel time", "of wall"], rows)
    )
    cat_sum = sum(summary["kernel_ms_per_step"].values())
    print()
    print(
        f"check: categories sum = {cat_sum:.3f} ms = kernel time total {ktot:.3f} ms "
        f"(difference {cat_sum - ktot:+.2e} ms); same-stream kernel overlap "
        f"{summary['same_stream_overlap_ms_per_step']:.3f} ms; wall {wall_ms:.2f} ms = GPU busy {busy:.2f} + "
        f"host gaps {summary['host_gap_ms_per_step']:.2f} ms"
    )
    for problem in summary["check_problems"]:
        print(f"CHECK FAILED: {problem}")
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
    print_gaps_and_categories(summary)
    if host is not None:
        print()
        print(
            f"attention host time per call (one layer, {host['tokens']} tokens in {host['segments']} "
            "segments; "
            f"x{host['layers']} layers per forward): "
            + ", ".join(f"{k} {v:.1f} us" for k, v in host.items() if k.endswith(")"))
            + f"; {host['note']}"
        )
    write_json(
        args.out,
        {
            "machine": machine_info(device),
            "args": vars(args),
            "workload": info,
            "cold_pass_s": cold_s,
            "step_ms_without_profiler": plain_ms,
            "tokens_per_step": tokens,
            "attention_host_us_per_call": host,
            **summary,
        },
    )
    return 1 if summary["check_problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
