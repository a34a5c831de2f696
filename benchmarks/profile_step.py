"""Where a varpack SFT step spends its time (issue 7 item 1): torch.profiler of train steps, by category.

Builds the same model, samples and packs as ``benchmarks/train.py`` (Qwen3-0.6B shape, bf16, fused AdamW,
``--steps`` packs of ``--packing-length``). Steady state: every pack is first run once untimed (every
torch.compile, Triton autotune and FlashAttention-4 kernel compile of its shapes happens there), then
``--warmup`` more untimed steps; the packs are then timed without the profiler (the true step time) and run
once more under torch.profiler. Every device kernel of the profiled pass is attributed to one category
(:mod:`benchmarks._profile_attr`, pure functions, unit-tested in tests/test_benchmarks_profile.py):

====================  ==================================================================================
category              rule (first match wins)
====================  ==================================================================================
optimizer             launched under ``Optimizer.step`` / ``zero_grad``, or an ``*adam*`` op / kernel
attention             kernel name (flash / fmha / attention / attn / flex ...) or launched under an attention
                      op (``varlen``, ``flash_attn``, ``flex_attention``, ``scaled_dot_product``, ...)
embedding             launched under an ``embedding`` op / Triton range (forward gather, dense backward)
LM head + loss        one of the 4 innermost launching ops has a tensor with a vocabulary-sized dimension, or
                      kernel / op is a cross-entropy / log-softmax / linear-CE / Liger one
memcpy / memset       the runtime's copies and fills (``Memcpy HtoD ...``, ``Memset ...``)
GEMM                  kernel name (gemm / xmma / cutlass / cublas / nvjet / Inductor ``triton_tem_`` ...) or
                      a matmul op among the 3 innermost launching ops
elementwise / norm    Inductor's fused Triton kernels (``triton_poi_`` / ``triton_red_`` / ``triton_per_``:
                      RMSNorm, RoPE, SiLU, casts, adds) and everything else launched by an ATen op
other                 the rest (listed in the top kernels when it matters)
====================  ==================================================================================

Device kernels only: ``FunctionEvent.device_type != CPU`` and not ``FunctionEvent.is_user_annotation``; the
GPU-side spans of ``record_function`` ranges (``## Call CompiledFxGraph ##`` of every compiled region,
``ProfilerStep#``) enclose kernels and are excluded (issue 18: counted as kernels they were 72.7 ms of "other"
and 2,235 "kernels" per step); their count is printed. A kernel is attributed through its launch call (same
CUPTI correlation id) to the innermost host range open at the launch (an ATen op; for Inductor's Triton
kernels the ``triton_*`` range its launcher records) and that range's ancestors (autograd node, compiled
region). Compiled-region wrappers (``## ... ##``) are skipped when matching op names.

The table adds up: ``kernel time total`` = sum of the categories (sum of kernel durations); ``busy`` = union
of kernel intervals (per category and in all); ``overlap`` = kernel total - GPU busy (kernels of different
streams running at once); ``host gaps`` = profiled wall time - GPU busy (the GPU waiting for the CPU: Python,
launch overhead, syncs). A check line prints ``categories sum = X ms = kernel time total`` with the
difference, and the script exits 1 (after writing ``--out``) when it does not add up or when kernels of one
stream overlap (:func:`benchmarks._profile_attr.check`: an annotation counted as a kernel). The un-profiled
step time is printed beside the profiled one so the profiler's own overhead is visible. Last line: host time
of one varpack attention call at the step's shapes (benchmarks/attention_host_time.py, ``no_kernel``
backend: varpack's work around the kernel), paid once per layer per forward.

Run::

    python benchmarks/profile_step.py --samples .gpu/samples.npz --config varpack_lce_compile --out runs/profile.json
    python benchmarks/profile_step.py --device cpu --small      # smoke test (CPU op self time instead)
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _profile_attr as A  # noqa: E402
from benchmarks import train as T  # noqa: E402
from benchmarks._common import load_samples, machine_info, markdown_table, sync, synthetic_samples, write_json  # noqa: E402

_LAUNCH = re.compile(r"^(cuda|cu)(LaunchKernel|LaunchCooperativeKernel|GraphLaunch|Memcpy|Memset)", re.I)


def _chain(evt: Any, depth: int = 64) -> list[Any]:
    out = []
    while evt is not None and len(out) < depth:
        out.append(evt)
        evt = evt.cpu_parent
    return out


def _has_dim(evt: Any, size: int) -> bool:
    for shape in getattr(evt, "input_shapes", None) or ():
        if isinstance(shape, (list, tuple)) and size in shape:
            return True
    return False


def _device_name(device_type: Any) -> str:
    from torch.autograd import DeviceType

    return {DeviceType.CPU: "cpu", DeviceType.CUDA: "cuda"}.get(device_type, str(device_type))


def events_from_profiler(events: list[Any], vocab: int, device_type: str) -> list[A.Event]:
    """``torch.profiler`` ``FunctionEvent`` s -> :class:`benchmarks._profile_attr.Event` records.

    CUDA: one record per device-timeline event (``device_type != CPU``): kernels, memcpy / memset, and the
    GPU-side spans of ``record_function`` ranges, flagged ``is_annotation`` from ``FunctionEvent.is_user_annotation``
    (kineto ``gpu_user_annotation``: ``## Call CompiledFxGraph ##``, ``ProfilerStep#``, ``Optimizer.step#``).
    A kernel's parents: its launch call (``cudaLaunchKernel`` / ``cuLaunchKernel``, same CUPTI correlation id as
    the kernel) -> the innermost host range open at the launch (an ATen op; for Inductor's Triton kernels the
    ``triton_*`` range that its launcher records) -> that range's ancestors (autograd node, compiled region ...);
    else the op the kernel is linked to (``linked_correlation_id``, where this torch has it).
    CPU (smoke test): one record per leaf ATen op (no ATen op inside it), its CPU time standing in for a kernel.

    Raises:
        RuntimeError: this torch's ``FunctionEvent`` has no ``is_user_annotation`` (annotations could not be
            told from kernels).
    """
    from torch.autograd import DeviceType

    out: list[A.Event] = []
    if device_type != "cuda":
        for e in events:
            if e.device_type != DeviceType.CPU or not e.name.startswith("aten::"):
                continue
            if any(c.name.startswith("aten::") for c in e.cpu_children):
                continue
            chain = _chain(e)
            out.append(A.Event(
                name=e.name, device="cpu", start_us=e.time_range.start,
                dur_us=e.time_range.end - e.time_range.start, parents=tuple(c.name for c in chain),
                stream=e.thread, vocab_dim=any(_has_dim(c, vocab) for c in chain[:4]),
            ))  # fmt: skip
        return out
    launches = {e.id: e for e in events if e.device_type == DeviceType.CPU and _LAUNCH.search(e.name)}
    host_ops = {e.id: e for e in events if e.device_type == DeviceType.CPU and not _LAUNCH.search(e.name)}
    for e in events:
        if e.device_type == DeviceType.CPU:
            continue
        if not hasattr(e, "is_user_annotation"):
            raise RuntimeError(
                f"torch {torch.__version__}: FunctionEvent has no is_user_annotation; annotation ranges cannot "
                "be told from kernels"
            )
        ann = bool(e.is_user_annotation) or getattr(e, "activity_type", None) == "gpu_user_annotation"
        op = None
        if not ann:
            rt = launches.get(e.id)
            op = rt.cpu_parent if rt is not None else None
            if op is None and getattr(e, "linked_correlation_id", 0):
                op = host_ops.get(e.linked_correlation_id)
        chain = _chain(op)
        out.append(A.Event(
            name=e.name, device=_device_name(e.device_type), start_us=e.time_range.start,
            dur_us=e.time_range.end - e.time_range.start, parents=tuple(c.name for c in chain),
            is_annotation=ann, stream=int(getattr(e, "device_resource_id", 0) or 0),
            vocab_dim=any(_has_dim(c, vocab) for c in chain[:4]),
        ))  # fmt: skip
    return out


def summarize(prof: Any, wall_s: float, vocab: int, device_type: str, steps: int) -> dict[str, Any]:
    """The table's figures per step (:func:`benchmarks._profile_attr.per_step`) and the check's problems."""
    records = events_from_profiler(list(prof.events()), vocab, device_type)
    att = A.attribute(records, device="cuda" if device_type == "cuda" else "cpu")
    out = A.per_step(att, steps, wall_s * 1e6)
    out["check_problems"] = A.check(att)
    return out


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
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None)
    p.add_argument("--samples", default=None)
    p.add_argument(
        "--config", default="varpack", choices=[c for c in T.ALL_CONFIGS if c.startswith("varpack")]
    )
    p.add_argument("--packing-length", type=int, default=8192)
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed steps after the untimed pass over the packs (cycling them)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=3,
        help="packs; each is run untimed, timed without, then with the profiler",
    )
    p.add_argument("--attn-backend", default="auto")
    p.add_argument("--lce-backend", default="auto")
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--attn-host-calls", type=int, default=200, help="0: skip the attention host-time row")
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
    args.static_multiple_of, args.static_segments = 64, None  # the static configs' shape: train.py's defaults
    values = dict(T.QWEN3_0_6B)
    if args.small:
        values = dict(T.TINY)
        args.packing_length, args.warmup, args.steps = min(args.packing_length, 512), 1, 2
        args.chunk_size = min(args.chunk_size, 128)
        args.attn_host_calls = min(args.attn_host_calls, 20)
    if args.samples:
        samples = load_samples(args.samples)
        if args.small:
            values["vocab_size"] = T.QWEN3_0_6B["vocab_size"]
    else:
        from benchmarks.attention import DEFAULT_MU, DEFAULT_SIGMA

        samples = synthetic_samples(
            int(args.steps * args.packing_length * 1.3 / 150) + 16,
            vocab=values["vocab_size"],
            mu=DEFAULT_MU,
            sigma=DEFAULT_SIGMA,
            hi=args.packing_length,
            seed=args.seed,
        )
    ds, chosen, info = T.build_workload(samples, args.packing_length, args.steps)
    steps = T.collate_steps(args.config, ds, chosen, args)
    n = len(steps)
    dtype = getattr(torch, args.dtype)
    model = T.build_model(values, device=device, dtype=dtype, attn_implementation="sdpa", seed=args.seed)
    from varpack.integrations.transformers import enable_varpack

    enable_varpack(model, backend=args.attn_backend)
    options = T.apply_step_options(model, args.config)
    loss_fn, loss_note = T.make_loss_fn(args.config, args)
    opt = T.make_optimizer(model, device)
    counts = [T.supervised_count(st) for st in steps]
    keep_cpu = T.keep_cpu_keys(args.config)
    # _graphs: a graph inductor does not capture raises; kept for the rest of this one-config process
    T.step_context(args.config).__enter__()

    def run(i: int) -> None:
        for mb in steps[i]:
            loss = loss_fn(model, T.to_device(mb, device, keep_cpu), counts[i])
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # steady state (issue 18): every pack the timed and profiled passes run is run untimed first (every
    # torch.compile, Triton autotune and FlashAttention-4 kernel compile of its shapes happens here)
    t0 = time.perf_counter()
    for i in range(n):
        run(i)
    sync(device)
    cold_s = time.perf_counter() - t0
    for i in range(args.warmup):
        run(i % n)
    sync(device)
    t0 = time.perf_counter()
    for i in range(n):
        run(i)
    sync(device)
    plain_ms = 1e3 * (time.perf_counter() - t0) / n

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        sync(device)
        t0 = time.perf_counter()
        for i in range(n):
            run(i)
        sync(device)
        wall = time.perf_counter() - t0
    summary = summarize(prof, wall, values["vocab_size"], device.type, n)
    if args.trace:
        prof.export_chrome_trace(args.trace)
    host = None
    if args.attn_host_calls > 0:
        host = attention_host_time(model, steps[0][0], device, dtype, args.attn_backend, args.attn_host_calls)

    tokens = sum(T.real_token_count(st) for st in steps) / n
    cuda = device.type == "cuda"
    print(
        f"# profile of one {args.config} step, {args.device} {args.dtype}, packing_length {args.packing_length}"
    )
    print(
        f"- loss: {loss_note}; attention: varpack {args.attn_backend}; options: {options or 'none'}; "
        f"~{tokens:.0f} tokens/step; {n} packs, each run untimed first (cold pass {cold_s:.1f} s) + "
        f"{args.warmup} warm-up steps; {info}"
    )
    unit = "kernels" if cuda else "leaf ATen ops (CPU time stands in for kernel time)"
    print(
        f"- step time without profiler {plain_ms:.1f} ms, with profiler {summary['wall_ms_per_step']:.1f} ms; "
        f"{summary['kernels_per_step']:.0f} {unit} + {summary['copies_per_step']:.0f} memcpy/memset per step; "
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
    if host is not None:
        print()
        print(
            f"attention host time per call (one layer, {host['tokens']} tokens in {host['segments']} segments; "
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
