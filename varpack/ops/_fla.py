"""flash-linear-attention (``fla``, Triton) as an optional fast path: import, probe once, respect refusals.

fla's kernels need a CUDA device and a Triton that fla trusts on it. fla itself refuses some
combinations, e.g. fla 0.6.0 on Hopper with Triton >= 3.4, < 3.7.1 runs the gated delta rule forward but
raises in the backward ("... produces incorrect results for gated chunk_bwd_dqkwg ..."). So the probe
runs a tiny packed problem through fla's forward AND backward (gated delta rule and causal conv) on the
device, compares with varpack's own chunked path, and records ``(ok, reason)`` for each; callers pick
fla only for what passed. Set ``VARPACK_DISABLE_FLA=1`` to never use fla.

This module is the bottom floor of the fla path: it imports fla (lazily) and no varpack op. Each op probes
its own fla kernel against its own PyTorch path, next to its dispatch, once per device
(:class:`varpack._probe.ProbeOnce`): the gated delta rule in
:func:`varpack.ops.gated_delta_rule.dispatch.fla_gated_delta_status`, the causal conv in
:func:`varpack.ops.short_conv.fla_conv_status`; :func:`varpack.ops.fla_probe.fla_status` gathers both in a
:class:`FlaStatus`.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "PROBE_TOL",
    "autotune_notice",
    "FlaStatus",
    "bf16_randn",
    "FLA_CHUNK_SIZE",
    "fla_causal_conv1d",
    "fla_chunk_gated_delta_rule",
    "fla_chunk_indices",
    "fla_chunk_tables",
    "install_shipped_autotune",
    "max_chunks",
    "fla_device",
    "first_line",
    "load_fla",
    "load_fla_internals",
    "probe_key",
    "probe_problem",
    "rel_err",
]

PROBE_TOL = 0.05  # relative max error allowed vs the fp32 reference (bf16 kernels)
#: tokens per chunk of fla's chunked kernels (the gated delta rule and ``causal_conv1d`` of fla-core 0.6.0)
FLA_CHUNK_SIZE = 64


@dataclass(frozen=True)
class FlaStatus:
    """What fla can do on one device: ``(ok, reason)`` per capability.

    ``hybrid``: the ``fla_hybrid`` gated delta rule (fla's kernels with varpack's own ``chunk_bwd_dqkwg``
    step), forward and backward, probed against varpack's fp32 chunk path.
    """

    forward: tuple[bool, str]
    backward: tuple[bool, str]
    conv_forward: tuple[bool, str]
    conv_backward: tuple[bool, str]
    hybrid: tuple[bool, str] = (False, "not probed")


def load_fla():
    """``(chunk_gated_delta_rule, causal_conv1d, reason)``; the functions are ``None`` when unavailable."""
    if os.environ.get("VARPACK_DISABLE_FLA", "") not in ("", "0"):
        return None, None, "disabled by VARPACK_DISABLE_FLA"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # ImportError, or fla failing at import (no triton, ...)
        return (
            None,
            None,
            f"fla not importable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
        )
    conv = None
    for mod in ("fla.modules.causal_conv1d", "fla.modules.convolution", "fla.modules"):
        try:
            conv = getattr(__import__(mod, fromlist=["causal_conv1d"]), "causal_conv1d", None)
        except Exception:
            conv = None
        if conv is not None:
            break
    return chunk_gated_delta_rule, conv, "ok"


# fla's internal functions the ``fla_hybrid`` gated delta rule calls (fla-core 0.6.0 names), with the keyword
# parameters it passes: a release that renamed or re-signed any of them is refused, never guessed at.
FLA_INTERNALS: dict[str, tuple[str, tuple[str, ...]]] = {
    "l2norm_fwd": ("fla.modules.norm.l2norm", ("x",)),
    "l2norm_bwd": ("fla.modules.norm.l2norm", ("y", "rstd", "dy")),
    "prepare_chunk_indices": ("fla.ops.utils.index", ("cu_seqlens", "chunk_size", "cu_seqlens_cpu")),
    "chunk_gated_delta_rule_fwd": (
        "fla.ops.gated_delta_rule.chunk",
        (
            "q",
            "k",
            "v",
            "g",
            "beta",
            "scale",
            "initial_state",
            "output_final_state",
            "cu_seqlens",
            "chunk_indices",
            "chunk_size",
        ),
    ),  # fmt: skip
    "recompute_w_u_fwd": (
        "fla.ops.gated_delta_rule.wy_fast",
        ("k", "v", "beta", "A", "g", "cu_seqlens", "chunk_indices"),
    ),
    "prepare_wy_repr_bwd": (
        "fla.ops.gated_delta_rule.wy_fast",
        ("k", "v", "beta", "A", "dw", "du", "g", "cu_seqlens", "chunk_indices"),
    ),
    "chunk_gated_delta_rule_fwd_h": (
        "fla.ops.common.chunk_delta_h",
        (
            "k",
            "w",
            "u",
            "g",
            "initial_state",
            "output_final_state",
            "chunk_size",
            "state_v_first",
            "cu_seqlens",
            "chunk_indices",
        ),
    ),  # fmt: skip
    "chunk_gated_delta_rule_bwd_dhu": (
        "fla.ops.common.chunk_delta_h",
        (
            "q",
            "k",
            "w",
            "do",
            "dv",
            "g",
            "h0",
            "dht",
            "scale",
            "state_v_first",
            "cu_seqlens",
            "chunk_size",
            "chunk_indices",
        ),
    ),  # fmt: skip
    "chunk_bwd_dv_local": (
        "fla.ops.common.chunk_o",
        ("q", "k", "do", "g", "scale", "cu_seqlens", "chunk_size", "chunk_indices"),
    ),
    "chunk_local_cumsum": (
        "fla.ops.utils.cumsum",
        ("g", "chunk_size", "reverse", "scale", "cu_seqlens", "chunk_indices"),
    ),
    "chunk_gated_delta_rule_fwd_intra": (
        "fla.ops.gated_delta_rule.chunk_fwd",
        ("k", "v", "g", "beta", "cu_seqlens", "chunk_size", "chunk_indices"),
    ),
    "chunk_fwd_o": (
        "fla.ops.common.chunk_o",
        ("q", "k", "v", "h", "g", "scale", "state_v_first", "cu_seqlens", "chunk_size", "chunk_indices"),
    ),
}


_INTERNALS: dict[str, tuple[dict | None, str]] = {}


def load_fla_internals() -> tuple[dict | None, str]:
    """``({name: function}, "ok")`` for fla's internal gated-delta kernels in :data:`FLA_INTERNALS`, or
    ``(None, reason)``: fla absent / disabled, a function missing, or one without the keyword parameters
    varpack passes (another fla release: refused with the name, not guessed). Looked up once per value of
    ``VARPACK_DISABLE_FLA`` (every layer call asks)."""
    key = os.environ.get("VARPACK_DISABLE_FLA", "")
    if key not in _INTERNALS:
        _INTERNALS[key] = _load_fla_internals()
    return _INTERNALS[key]


def _load_fla_internals() -> tuple[dict | None, str]:
    import importlib
    import inspect

    rule, _, reason = load_fla()
    if rule is None:
        return None, reason
    try:
        version = getattr(importlib.import_module("fla"), "__version__", "?")
    except Exception:  # pragma: no cover - load_fla imported it already
        version = "?"
    out = {}
    for name, (module, params) in FLA_INTERNALS.items():
        try:
            fn = getattr(importlib.import_module(module), name)
        except Exception as exc:
            return None, (
                f"fla {version}: {module}.{name} not found ({first_line(exc)}); fla_hybrid is written for "
                "fla-core 0.6.0"
            )
        try:
            have = set(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            return None, f"fla {version}: cannot read the signature of {module}.{name}"
        missing = [p for p in params if p not in have]
        if missing:
            return None, (
                f"fla {version}: {module}.{name} has no parameter(s) {missing}; fla_hybrid is written for "
                "fla-core 0.6.0's internal signatures"
            )
        out[name] = fn
    return out, "ok"


_NOTICED: set[tuple[str, str, tuple]] = set()

#: fla's autotune results that varpack ships (``{"stack": ..., "files": {"<key>/<kernel>.autotune.json": {...}}}``)
SHIPPED_AUTOTUNE = Path(__file__).with_name("fla_autotune.json")
_SHIPPED_INSTALLED: dict[str, int] = {}


def install_shipped_autotune(cache_dir: str | os.PathLike[str] | None = None) -> int:
    """Write varpack's shipped fla autotune results (:data:`SHIPPED_AUTOTUNE`) into Triton's cache folder, each
    file that is not there yet; returns how many were written (0 when all are there, the folder cannot be
    written, or ``VARPACK_FLA_SHIPPED_AUTOTUNE=0``).

    fla autotunes each Triton kernel on its first use of a shape and keeps the result in Triton's cache
    (``cache_results``); a first run on a new machine spends 1-4 min there (measured on the H200: step 1 of the
    Qwen3.5 shape at 63 s without the results, 16-27 s with them). Triton reads a result only under the folder
    named by its hash of the Triton build, the GPU target (``sm90``: H100 / H200), the kernel's source, the
    tuning key (head shapes, dtypes) and the configs (triton/runtime/autotuner.py ``check_disk_cache``), so a
    shipped file is read only on the stack that produced it (see the file's ``stack``) and is inert elsewhere.
    Files already in the cache are never overwritten. Called once per process by :func:`autotune_notice`.

    Args:
        cache_dir: the folder; default Triton's (``TRITON_CACHE_DIR``, else ``~/.triton/cache``).

    Raises:
        ValueError: a shipped file name that is not ``<folder>/<kernel>.autotune.json``.
    """
    if os.environ.get("VARPACK_FLA_SHIPPED_AUTOTUNE", "1") in ("0", "false", "no"):
        return 0
    root = Path(os.path.expanduser(str(cache_dir if cache_dir is not None else _triton_cache_dir())))
    files = json.loads(SHIPPED_AUTOTUNE.read_text(encoding="utf-8"))["files"]
    written = 0
    for name, content in files.items():
        parts = Path(name).parts
        if len(parts) != 2 or not parts[1].endswith(".autotune.json") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"{SHIPPED_AUTOTUNE}: {name!r} is not <folder>/<kernel>.autotune.json")
        path = root.joinpath(*parts)
        if path.exists():
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(content), encoding="utf-8")
            os.replace(tmp, path)  # atomic: another process never reads half a file
        except OSError:
            return written  # a read-only cache: fla tunes as before
        written += 1
    return written


def _triton_cache_dir() -> str:
    """Triton's cache folder as Triton resolves it (``TRITON_CACHE_DIR``, else ``$TRITON_HOME/.triton/cache``,
    else ``~/.triton/cache``)."""
    try:
        from triton import knobs

        return str(knobs.cache.dir)
    except Exception:  # an older Triton without knobs
        return os.environ.get("TRITON_CACHE_DIR") or "~/.triton/cache"


def autotune_notice(
    device: torch.device,
    dims: tuple,
    *,
    what: str = "gated delta rule",
    dims_name: str = "(Hk, H, K, V)",
    file=None,
) -> bool:
    """Say once per process, kernel family (``what``), device and dims that fla's kernels are about to be
    checked, and that fla autotunes each Triton kernel on its first use of a shape (returns whether it printed).

    Measured on the H200 (torch 2.11, Triton 3.6, fla-core 0.6.0; benchmarks/RESULTS.md#hybrid-step): a cold
    pass of 192.6 s before the first step of a Qwen3.5-shaped model or ``varpack check --model tiny-qwen3.5``, with no
    output meanwhile. fla keeps the results in Triton's cache (``FLA_CACHE_RESULTS``, on by default; the
    folder as Triton resolves it), so later processes on the same machine skip most of it; before the first
    notice of a process, varpack's shipped results are installed there (:func:`install_shipped_autotune`). Printed to
    ``file`` (default stderr), never on CPU. Called by the probes of the gated delta rule
    (:mod:`varpack.ops.gated_delta_rule.dispatch`) and of the short causal conv (:mod:`varpack.ops.short_conv`)."""
    key = (what, str(device), tuple(dims))
    if torch.device(device).type != "cuda" or key in _NOTICED:
        return False
    _NOTICED.add(key)
    cache = _triton_cache_dir()
    shipped = ""
    if cache not in _SHIPPED_INSTALLED:  # once per process and folder, said by the notice that installs them
        _SHIPPED_INSTALLED[cache] = install_shipped_autotune(cache)
        shipped = f"; {_SHIPPED_INSTALLED[cache]} shipped results installed" if _SHIPPED_INSTALLED[cache] else ""
    print(
        f"varpack: checking fla's {what} kernels on {device} at {dims_name} = {tuple(dims)}; fla autotunes each "
        f"Triton kernel on first use of a shape (1-4 min on an H200 without output; cached in "
        f"{cache} for later runs{shipped})",
        file=file if file is not None else sys.stderr,
        flush=True,
    )
    return True


def first_line(exc: BaseException) -> str:
    """``"<Type>: <first line of the message>"``: how a refusal raised by fla is reported."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max absolute error of ``a`` relative to the largest ``|b|`` (float32)."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def fla_device(device: torch.device | str | None = None) -> torch.device:
    """The device a probe is cached under: default CUDA if available, else CPU; ``cuda`` -> ``cuda:<current>``."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def probe_key(device: torch.device) -> str:
    """Cache key of a per-device fla probe (:class:`varpack._probe.ProbeOnce`)."""
    return str(device)


def probe_problem(device: torch.device) -> tuple[torch.Generator, int, torch.Tensor, torch.Tensor]:
    """The tiny packed problem every fla probe runs: ``(generator, T, cu_seqlens_cpu, cu_seqlens)`` -- a CPU
    generator seeded with 0, T = 198 tokens in samples of 67, 1 and 130, ``cu_seqlens`` int64 on the CPU and
    on ``device``."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    cu_cpu = torch.tensor([0, 67, 68, 198], dtype=torch.int64)
    return gen, int(cu_cpu[-1]), cu_cpu, cu_cpu.to(device)


def bf16_randn(gen: torch.Generator, device: torch.device, *shape: int) -> torch.Tensor:
    """Standard normal bf16 tensor of ``shape`` on ``device``, drawn on the CPU from ``gen``."""
    return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)


def fla_chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale,
    initial_state,
    output_final_state,
    cu_seqlens,
    cu_seqlens_cpu,
    use_qk_l2norm_in_kernel,
):
    """Call fla's ``chunk_gated_delta_rule`` (cu_seqlens int64 on the device, plus its CPU copy)."""
    rule, _, reason = load_fla()
    if rule is None:
        raise RuntimeError(f"fla backend unavailable: {reason}")
    kwargs = {}
    if cu_seqlens is not None:
        kwargs["cu_seqlens"] = cu_seqlens.to(device=q.device, dtype=torch.int64, non_blocking=True)
        if cu_seqlens_cpu is not None:
            kwargs["cu_seqlens_cpu"] = cu_seqlens_cpu.to(torch.int64)
    o, final = rule(
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        **kwargs,
    )
    return o, (final.float() if final is not None else None)


def fla_chunk_indices(
    cu_seqlens_cpu: torch.Tensor, device: torch.device | str, chunk_size: int = FLA_CHUNK_SIZE
) -> torch.Tensor:
    """fla's chunk indices of one batch, built on the host: ``[NT, 2]`` int64 on ``device``, row ``c`` =
    (sequence, chunk within the sequence) of the ``c``-th chunk of ``chunk_size`` tokens, sequence-major (each
    sequence's last chunk may be shorter; a zero-length sequence has none). The layout of fla's
    ``fla.ops.utils.index.prepare_chunk_indices`` (fla-core 0.6.0), which every fla chunked kernel takes as
    ``chunk_indices``.

    Why: fla builds them itself on a cache miss of its per-tensor cache and moves them to the device with a
    blocking copy (one ``cudaStreamSynchronize`` per call; 23 per step of a Qwen3.5-shaped model, measured with
    ``benchmarks/profile_sft.py``). Built once per batch here and copied with ``non_blocking=True``, no call
    waits for the device.

    Args:
        cu_seqlens_cpu: ``[N+1]`` offsets on the CPU (any integer dtype).
        device: where the indices go.
        chunk_size: tokens per chunk (fla's kernels: :data:`FLA_CHUNK_SIZE`).

    Raises:
        ValueError: offsets on a device other than the CPU, or not 1-D.
    """
    if cu_seqlens_cpu.device.type != "cpu" or cu_seqlens_cpu.dim() != 1:
        raise ValueError(
            f"fla_chunk_indices needs 1-D CPU offsets [N+1], got {tuple(cu_seqlens_cpu.shape)} on "
            f"{cu_seqlens_cpu.device}"
        )
    lengths = torch.diff(cu_seqlens_cpu.to(torch.int64))
    counts = (lengths + (chunk_size - 1)) // chunk_size
    seq = torch.repeat_interleave(torch.arange(counts.numel(), dtype=torch.int64), counts)
    first = torch.cumsum(counts, 0) - counts  # each sequence's first chunk
    within = torch.arange(seq.numel(), dtype=torch.int64) - first[seq]
    return torch.stack([seq, within], 1).to(device, non_blocking=True)


def max_chunks(total_tokens: int, num_seqs: int, chunk_size: int = FLA_CHUNK_SIZE) -> int:
    """The most chunks of ``chunk_size`` tokens that ``num_seqs`` sequences of ``total_tokens`` tokens in all can
    be cut into (each sequence's last chunk may be shorter; an empty sequence has none): with ``n = min(N, T)``
    non-empty sequences, ``sum ceil(l_i / C) = n + sum floor((l_i - 1) / C) <= n + (T - n) // C``, reached
    when all but one sequence hold one token. A fixed bound of a static shape (``T``, ``N``), so a chunk table
    of this many rows has the same shape for every pack of that shape."""
    T, N, C = int(total_tokens), int(num_seqs), int(chunk_size)
    if T < 0 or N < 0 or C < 1:
        raise ValueError(f"max_chunks needs T >= 0, N >= 0, chunk_size >= 1, got {T}, {N}, {C}")
    n = min(N, T)
    return n + (T - n) // C


def fla_chunk_tables(
    cu_seqlens: torch.Tensor, total_tokens: int, chunk_size: int = FLA_CHUNK_SIZE, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch's chunk tables built where ``cu_seqlens`` lives, with a fixed row count: what a CUDA graph
    replays (no host read of the offsets, no data-dependent shape; every pack of one static shape gets tables
    of one shape, :func:`max_chunks` rows).

    Rows ``c < NT`` (``NT`` the batch's real chunk count) are :func:`fla_chunk_indices`' rows, in fla's
    order. Every row past them is a *padding row*: it names the last non-empty sequence and a chunk at or past
    that sequence's end, so each fla kernel's per-sequence bounds mask every token of it (nothing is read
    from or written to another sequence, and the chunk-end reads ``min((i_t + 1) * BT, T) - 1`` stay inside
    that sequence), and its length in the dq/dk table is 0.

    Args:
        cu_seqlens: ``[N+1]`` integer offsets (int32 / int64) on any device, trusted as valid (validated where
            they were built); zero-length sequences allowed.
        total_tokens: ``T``, the packed row's token count (a static shape's ``tokens``).
        chunk_size: tokens per chunk (fla's kernels: :data:`FLA_CHUNK_SIZE`).
        rows: the row count ``R``, a bound of the batch's chunks known to hold (a static shape's
            ``linear_chunks``, checked on the host where the batch was built: rows past ``R`` would be lost);
            default :func:`max_chunks` ``(T, N, chunk_size)``, which holds for any offsets.

    Returns:
        ``(chunk_indices [R, 2] int64, chunk_start [R] int32, chunk_len [R] int32)`` on ``cu_seqlens``'
        device, ``R = rows`` or ``max_chunks(T, N, chunk_size)``: fla's ``chunk_indices`` (sequence, chunk within it), and
        each row's first token in the row and token count (``fla_hybrid``'s dq/dk chunk table,
        :class:`varpack.ops.gated_delta_rule.fla_hybrid.DqkwgPlan`); a padding row's start is the end of
        its sequence (any token index in range) and its count 0.

    Raises:
        TypeError: offsets that are not an integer tensor. ValueError: offsets that are not 1-D, ``rows < 1``.
    """
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be an integer tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be 1-D [N+1], got shape {tuple(cu_seqlens.shape)}")
    C = int(chunk_size)
    N = int(cu_seqlens.shape[0]) - 1
    rows = max_chunks(total_tokens, N, C) if rows is None else int(rows)
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    cu = cu_seqlens.to(torch.int64)
    counts = torch.div(cu[1:] - cu[:-1] + (C - 1), C, rounding_mode="floor")
    first = torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # each sequence's first chunk, [N+1]
    slots = torch.arange(rows, device=cu.device, dtype=torch.int64)
    seq = torch.searchsorted(first, slots, right=True) - 1  # the sequence whose chunks hold the slot
    # padding rows (slot >= NT): the last non-empty sequence, the first index whose chunk start is NT, minus 1
    last = (torch.searchsorted(first, first[-1:], right=False) - 1).clamp(min=0)
    seq = torch.where(slots < first[-1], seq, last).clamp(0, max(N - 1, 0))
    within = slots - first[seq]
    start = cu[seq] + within * C
    length = (cu[seq + 1] - start).clamp(0, C)
    start = torch.where(length > 0, start, cu[seq + 1])
    return torch.stack([seq, within], 1), start.to(torch.int32), length.to(torch.int32)


def fla_causal_conv1d(x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu, chunk_indices=None):
    """Call fla's ``causal_conv1d`` (``x [B, T, D]``, ``weight [D, W]``) with ``cu_seqlens``; ``chunk_indices``:
    :func:`fla_chunk_indices` of the batch (fla builds them, with a blocking copy, when ``None``)."""
    _, conv, reason = load_fla()
    if conv is None:
        raise RuntimeError(
            f"fla conv unavailable: {reason if reason != 'ok' else 'causal_conv1d not found in fla'}"
        )
    kwargs = {}
    if cu_seqlens is not None:
        kwargs["cu_seqlens"] = cu_seqlens.to(device=x.device, dtype=torch.int64, non_blocking=True)
        if cu_seqlens_cpu is not None:
            kwargs["cu_seqlens_cpu"] = cu_seqlens_cpu.to(torch.int64)
        if chunk_indices is not None:
            kwargs["chunk_indices"] = chunk_indices
    y = conv(x, weight, bias, activation=activation, **kwargs)
    return y[0] if isinstance(y, tuple) else y
