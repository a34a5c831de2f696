"""Kernel attribution of a profiled step (benchmarks/profile_step.py), as pure functions over simple records.

:func:`attribute` takes a list of :class:`Event` records (one per profiler event: a device kernel, a memcpy /
memset, a GPU-side annotation range, a host call) and returns per-category kernel time, per-category and total
GPU busy time (union of intervals), kernel counts and the checks that make the table add up; no torch needed.
:func:`events_from_profiler` turns ``torch.profiler`` events into these records (it imports torch); the unit
tests (tests/benchmarks/test_profile_step.py) build them by hand.

What counts as device work: ``device == "cuda"`` and not ``is_annotation``. ``torch.profiler`` reports every
``record_function`` range twice: on the host, and, when it encloses kernels, as a GPU-side span
(kineto activity ``gpu_user_annotation``, ``FunctionEvent.device_type == DeviceType.CUDA`` and
``FunctionEvent.is_user_annotation == True``) covering the kernels inside it: ``## Call CompiledFxGraph ##``
(every compiled region call), ``ProfilerStep#N``, ``Optimizer.step#...``. Counting those spans as kernels
counts their kernels twice. torch's own tables drop them the same way
(``torch.autograd.profiler_util._build_table``: device events ``and not evt.is_user_annotation``).

Checks (:func:`check`): the categories sum to the kernel time total (each kernel attributed exactly once),
and on each stream the kernels' summed durations equal the union of their intervals (kernels of one stream run
one after another; a range counted as a kernel overlaps the kernels it encloses and breaks this).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
_ATTN_OP = re.compile(r"varlen|flash_?attn|flex|attention|scaled_dot_product|sdpa|fmha", re.I)
_GEMM_KERNEL = re.compile(
    r"gemm|gemv|xmma|cutlass|cublas|nvjet|wgmma|sm90_|sm80_|ampere_|hopper|^triton_tem_", re.I
)
_GEMM_OP = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm)$")
_LOSS = re.compile(
    r"cross_entropy|nll_loss|log_softmax|logsumexp|LinearCrossEntropy|linear_cross_entropy|Liger", re.I
)
_OPT = re.compile(r"^Optimizer\.|zero_grad|adam", re.I)
_COPY = re.compile(r"^(memcpy|memset)\b", re.I)
#: Inductor's generated Triton kernels: pointwise / reduction / persistent-reduction fusions (norms, RoPE,
#: SiLU * mul, casts, adds) and foreach; its GEMM templates (``triton_tem_``) are caught by ``_GEMM_KERNEL``.
_TRITON_FUSED = re.compile(r"^triton_(poi|red|per|for)_")
_ELEMENTWISE_KERNEL = re.compile(r"elementwise|vectorized|unrolled|reduce_kernel|index_|scatter|gather", re.I)
#: Host ranges that carry no op information (compiled-region wrappers, profiler steps): skipped when matching
#: the op patterns (a graph's cache key is random letters and could spell ``flex``).
_WRAPPER_RANGE = re.compile(r"^## .* ##$|^ProfilerStep#|^CompiledFunction(Backward)?$|^Torch-Compiled Region")


@dataclass(frozen=True)
class Event:
    """One profiler event, reduced to what attribution needs.

    Attributes:
        name: kernel / range / call name.
        device: ``"cuda"`` for events on the device timeline (kernels, memcpy, memset, GPU-side annotation
            spans), ``"cpu"`` for host events (ops, ranges, ``cudaLaunchKernel``).
        start_us: start, microseconds (any common origin).
        dur_us: duration, microseconds (>= 0).
        parents: names of the host ranges open when the kernel was launched, innermost first (the launching
            ATen op or Triton kernel range, then the autograd node, compiled region ...); empty when no
            launch was linked.
        is_annotation: a user annotation (``record_function`` range, its GPU-side span included).
        stream: device stream (``FunctionEvent.device_resource_id``).
        vocab_dim: one of the 4 innermost launching ops had a tensor with a vocabulary-sized dimension.
    """

    name: str
    device: str
    start_us: float
    dur_us: float
    parents: tuple[str, ...] = ()
    is_annotation: bool = False
    stream: int = 0
    vocab_dim: bool = False


def is_copy(e: Event) -> bool:
    """Kineto's memcpy / memset activities (``Memcpy HtoD (Pinned -> Device)``, ``Memset (Device)``)."""
    return bool(_COPY.search(e.name))


def categorize(e: Event) -> str:
    """Category of one device event (first match wins; see profile_step.py's module table)."""
    k = e.name
    names = [n for n in e.parents if not _WRAPPER_RANGE.search(n)]
    if _OPT.search(k) or any(_OPT.search(n) for n in names):
        return "optimizer"
    if _ATTN_KERNEL.search(k) or any(_ATTN_OP.search(n) for n in names):
        return "attention"
    if "embedding" in k or any("embedding" in n for n in names):
        return "embedding"
    if e.vocab_dim or _LOSS.search(k) or any(_LOSS.search(n) for n in names):
        return "LM head + loss"
    if is_copy(e):
        return "memcpy / memset"
    if _GEMM_KERNEL.search(k) or any(_GEMM_OP.match(n) for n in names[:3]):
        return "GEMM"
    if _TRITON_FUSED.search(k) or _ELEMENTWISE_KERNEL.search(k) or (names and names[0].startswith("aten::")):
        return "elementwise / norm"
    return "other"


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end)`` intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@dataclass
class Attribution:
    """Sums over the profiled steps, microseconds (divide by the step count for per-step figures)."""

    kernel_us: dict[str, float]  # category -> summed kernel durations
    busy_us_by_category: dict[str, float]  # category -> union of that category's kernel intervals
    kernel_total_us: float  # summed durations of all device work (kernels + memcpy / memset)
    busy_us: float  # union of all device-work intervals
    n_kernels: int  # device kernels (memcpy / memset not included)
    n_copies: int  # memcpy / memset activities
    n_annotations: int  # GPU-side annotation spans excluded
    annotation_us: float  # their summed durations (what counting them would add)
    stream_overlap_us: dict[int, float]  # stream -> summed durations - union (0 for serial kernels)
    unlinked_us: float  # device work with no host parent (categorised by name only)
    top: list[tuple[str, str, float, int]] = field(default_factory=list)  # name, category, us, calls
    overlap_pairs: list[tuple[str, str, float]] = field(
        default_factory=list
    )  # same stream: enclosing, enclosed, us
    top_by_category: dict[str, list[tuple[str, float, int]]] = field(default_factory=dict)  # cat -> name, us, calls
    short_gap_us: float = 0.0  # idle device time in gaps shorter than LONG_GAP_US (mostly launch latency)
    n_short_gaps: int = 0
    long_gap_us: float = 0.0  # idle device time in the longer gaps, all of them
    n_long_gaps: int = 0
    long_gaps: list[tuple[str, float, int]] = field(default_factory=list)  # the top: what ends them, idle us, count


#: device-idle gaps are split at this length (microseconds): shorter ones are mostly the launch latency between
#: kernels queued back to back (a graph's node switch, a kernel's tail); longer ones mostly the device waiting
#: for the host. A size cutoff, not a cause: a launch-bound stretch of small kernels can leave short gaps too
LONG_GAP_US = 10.0


def gap_label(e: Event) -> str:
    """What a device-idle gap is attributed to: the device work that ends it, as ``category: what launched it``
    (its innermost host range that is not a wrapper, else the kernel's name), 80 characters."""
    names = [n for n in e.parents if not _WRAPPER_RANGE.search(n) and not n.startswith("triton_")]
    return f"{categorize(e)}: {(names[0] if names else e.name)}"[:80]


def device_gaps(
    work: Sequence[Event], gap_us: float = LONG_GAP_US
) -> tuple[float, int, list[tuple[str, float, int]]]:
    """The idle gaps of the device timeline formed by ``work`` (kernels and copies, any streams): the summed
    idle time and count of gaps shorter than ``gap_us`` (:data:`LONG_GAP_US`), and the longer gaps grouped by
    :func:`gap_label` of the work that ends them, largest idle time first (sum them for the total). Idle before
    the first and after the last event is not a gap here (:func:`per_step`'s host gaps count it against the
    wall)."""
    short_us, n_short, end = 0.0, 0, None
    long: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in sorted(work, key=lambda e: e.start_us):
        if end is not None and e.start_us > end:
            idle = e.start_us - end
            if idle < gap_us:
                short_us, n_short = short_us + idle, n_short + 1
            else:
                agg = long[gap_label(e)]
                agg[0] += idle
                agg[1] += 1
        end = e.start_us + e.dur_us if end is None else max(end, e.start_us + e.dur_us)
    ranked = sorted(((k, v[0], int(v[1])) for k, v in long.items()), key=lambda t: -t[1])
    return short_us, n_short, ranked


def attribute(
    events: Sequence[Event], device: str = "cuda", top: int = 20, top_per_category: int = 8
) -> Attribution:
    """Attribute every kernel / copy of ``device`` in ``events`` to one category; annotation spans are
    excluded (counted in ``n_annotations``), events of other devices ignored (``device="cpu"``: the CPU smoke
    test's leaf ATen ops stand in for kernels). Also: the ``top`` kernels overall and ``top_per_category`` per
    category, and the device's idle gaps (:func:`device_gaps`)."""
    kernel_us: dict[str, float] = defaultdict(float)
    intervals: dict[str, list[tuple[float, float]]] = defaultdict(list)
    per_stream: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    per_kernel: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    work: list[Event] = []
    n_kernels = n_copies = n_ann = 0
    ann_us = unlinked = 0.0
    for e in events:
        if e.device != device:
            continue
        if e.is_annotation:
            n_ann += 1
            ann_us += e.dur_us
            continue
        cat = categorize(e)
        work.append(e)
        kernel_us[cat] += e.dur_us
        iv = (e.start_us, e.start_us + e.dur_us)
        intervals[cat].append(iv)
        per_stream[e.stream].append((*iv, e.name))
        agg = per_kernel[(e.name, cat)]
        agg[0] += e.dur_us
        agg[1] += 1
        if is_copy(e):
            n_copies += 1
        else:
            n_kernels += 1
        if not e.parents:
            unlinked += e.dur_us
    all_iv = [iv for ivs in intervals.values() for iv in ivs]
    overlap: dict[int, float] = {}
    pairs: dict[tuple[str, str], float] = defaultdict(float)
    for s, ivs in per_stream.items():  # sum - union, walked so that each overlap names its two kernels
        over, end, owner = 0.0, float("-inf"), ""
        for a0, b0, name in sorted(ivs):
            if a0 < end:
                o = min(b0, end) - a0
                over += o
                pairs[(owner[:80], name[:80])] += o
            if b0 > end:
                end, owner = b0, name
        overlap[s] = over
    ranked_all = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])
    ranked = ranked_all[:top]
    by_cat: dict[str, list[tuple[str, float, int]]] = {c: [] for c in CATEGORIES}
    for (name, cat), v in ranked_all:
        if len(by_cat[cat]) < top_per_category:
            by_cat[cat].append((name, v[0], int(v[1])))
    short_us, n_short, long_gaps = device_gaps(work)
    return Attribution(
        kernel_us={c: kernel_us.get(c, 0.0) for c in CATEGORIES},
        busy_us_by_category={c: union_us(intervals.get(c, ())) for c in CATEGORIES},
        kernel_total_us=sum(b - a for a, b in all_iv),
        busy_us=union_us(all_iv),
        n_kernels=n_kernels,
        n_copies=n_copies,
        n_annotations=n_ann,
        annotation_us=ann_us,
        stream_overlap_us=overlap,
        overlap_pairs=sorted(((a, b, us) for (a, b), us in pairs.items()), key=lambda t: -t[2])[:5],
        unlinked_us=unlinked,
        top=[(name, cat, v[0], int(v[1])) for (name, cat), v in ranked],
        top_by_category={c: rows for c, rows in by_cat.items() if rows},
        short_gap_us=short_us,
        n_short_gaps=n_short,
        long_gap_us=sum(us for _, us, _ in long_gaps),
        n_long_gaps=sum(n for _, _, n in long_gaps),
        long_gaps=long_gaps[:top],
    )


def check(a: Attribution, *, rel_tol: float = 0.02, abs_tol_us: float = 1.0) -> list[str]:
    """Problems that make the table not add up (empty list: it adds up).

    * the categories must sum to the kernel time total (``abs_tol_us``: float rounding only);
    * on every stream, summed kernel durations - union of their intervals must be at most ``rel_tol`` of that
      stream's kernel time (+ ``abs_tol_us``): kernels of one stream do not overlap, except for the short
      prologue overlap of programmatic dependent launch (Hopper), hence the tolerance. A range counted as a
      kernel (an annotation span enclosing its kernels) overlaps them fully and exceeds it.
    """
    problems = []
    cat_sum = sum(a.kernel_us.values())
    if abs(cat_sum - a.kernel_total_us) > abs_tol_us:
        problems.append(
            f"categories sum {cat_sum:.1f} us != kernel time total {a.kernel_total_us:.1f} us "
            f"(difference {cat_sum - a.kernel_total_us:+.1f} us)"
        )
    for stream, over in sorted(a.stream_overlap_us.items()):
        if over > rel_tol * a.kernel_total_us + abs_tol_us:
            problems.append(
                f"stream {stream}: kernels overlap by {over:.1f} us "
                f"({100 * over / max(a.kernel_total_us, 1e-9):.1f}% "
                "of kernel time): a range counted as a kernel, or programmatic dependent launch? largest: "
                + "; ".join(f"{x!r} over {y!r} {us:.1f} us" for x, y, us in a.overlap_pairs[:3])
            )
    return problems


def per_step(a: Attribution, steps: int, wall_us: float) -> dict[str, Any]:
    """The table's figures per step (ms): per category kernel time and busy time, totals, host gaps."""
    ms = 1e-3 / steps
    return {
        "kernel_ms_per_step": {c: v * ms for c, v in a.kernel_us.items()},
        "busy_ms_per_step_by_category": {c: v * ms for c, v in a.busy_us_by_category.items()},
        "kernel_total_ms_per_step": a.kernel_total_us * ms,
        "busy_ms_per_step": a.busy_us * ms,
        "stream_overlap_ms_per_step": (a.kernel_total_us - a.busy_us) * ms,
        "wall_ms_per_step": wall_us * ms,
        "host_gap_ms_per_step": (wall_us - a.busy_us) * ms,
        "kernels_per_step": a.n_kernels / steps,
        "copies_per_step": a.n_copies / steps,
        "annotation_spans_excluded_per_step": a.n_annotations / steps,
        "annotation_ms_excluded_per_step": a.annotation_us * ms,
        "unlinked_ms_per_step": a.unlinked_us * ms,
        "same_stream_overlap_ms_per_step": sum(a.stream_overlap_us.values()) * ms,
        "same_stream_overlap_pairs": [
            {"enclosing": x, "enclosed": y, "ms_per_step": us * ms} for x, y, us in a.overlap_pairs
        ],
        "top_kernels": [
            {"name": n[:120], "category": c, "ms_per_step": us * ms, "calls_per_step": calls / steps}
            for n, c, us, calls in a.top
        ],
        "top_kernels_by_category": {
            c: [{"name": n[:120], "ms_per_step": us * ms, "calls_per_step": calls / steps} for n, us, calls in rows]
            for c, rows in a.top_by_category.items()
        },
        "short_gap_ms_per_step": a.short_gap_us * ms,
        "short_gaps_per_step": a.n_short_gaps / steps,
        "long_gap_ms_per_step": a.long_gap_us * ms,
        "long_gaps_per_step": a.n_long_gaps / steps,
        "long_gaps": [
            {"before": label, "ms_per_step": us * ms, "gaps_per_step": n / steps} for label, us, n in a.long_gaps
        ],
    }


# ----------------------------------------------------------------------------------------------------------
# the adapter from torch.profiler events
# ----------------------------------------------------------------------------------------------------------

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


def events_from_profiler(events: list[Any], vocab: int, device_type: str) -> list[Event]:
    """``torch.profiler`` ``FunctionEvent`` s -> :class:`benchmarks._profile_attr.Event` records.

    CUDA: one record per device-timeline event (``device_type != CPU``): kernels, memcpy / memset, and the
    GPU-side spans of ``record_function`` ranges, flagged ``is_annotation`` from
    ``FunctionEvent.is_user_annotation`` (kineto ``gpu_user_annotation``: ``## Call CompiledFxGraph ##``,
    ``ProfilerStep#``, ``Optimizer.step#``). A kernel's parents: its launch call (``cudaLaunchKernel`` /
    ``cuLaunchKernel``, same CUPTI correlation id as the kernel) -> the innermost host range open at the
    launch (an ATen op; for Inductor's Triton kernels the ``triton_*`` range that its launcher records) ->
    that range's ancestors (autograd node, compiled region ...); else the op the kernel is linked to
    (``linked_correlation_id``, where this torch has it). CPU (smoke test): one record per leaf ATen op (no
    ATen op inside it), its CPU time standing in for a kernel.

    Raises:
        RuntimeError: this torch's ``FunctionEvent`` has no ``is_user_annotation`` (annotations could not be
            told from kernels).
    """
    import torch
    from torch.autograd import DeviceType

    out: list[Event] = []
    if device_type != "cuda":
        for e in events:
            if e.device_type != DeviceType.CPU or not e.name.startswith("aten::"):
                continue
            if any(c.name.startswith("aten::") for c in e.cpu_children):
                continue
            chain = _chain(e)
            out.append(Event(
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
                f"torch {torch.__version__}: FunctionEvent has no is_user_annotation; annotation ranges "
                "cannot "
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
        out.append(Event(
            name=e.name, device=_device_name(e.device_type), start_us=e.time_range.start,
            dur_us=e.time_range.end - e.time_range.start, parents=tuple(c.name for c in chain),
            is_annotation=ann, stream=int(getattr(e, "device_resource_id", 0) or 0),
            vocab_dim=any(_has_dim(c, vocab) for c in chain[:4]),
        ))  # fmt: skip
    return out
