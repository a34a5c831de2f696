"""Varlen attention bake-off (issue 6 item 1): every varpack backend vs padded SDPA vs dense causal SDPA.

For each length mix and head configuration, T packed tokens (default 65,536) are split into samples whose
lengths sum to exactly T; q ``[T, H, D]``, k/v ``[T, Hkv, D]`` (bf16, D = 128, causal). Measured:

* every backend that ``varpack.attn.available_backends(device, dtype)`` reports usable
  (``varlen_attention(..., backend=name)``), plus ``auto`` (what it resolves to is printed). On the H200 that
  includes ``triton_short`` (issue 17: Triton tiles spanning several short documents; not in ``auto`` until
  this bake-off has measured it) beside ``flash_attn_4``, ``torch_varlen`` and ``flex``;
* ``padded_sdpa``: what a user without packing runs -- samples in data order, batches of ``--pad-batch``
  samples, each padded on the right to its longest sample, ``F.scaled_dot_product_attention(is_causal=True)``
  (right padding + causal: real tokens never see pads, so no mask is needed; pads' outputs are discarded);
* ``dense_cudnn``: one causal sequence of the same T with SDPA's cuDNN backend (flash if cuDNN cannot run):
  the hardware reference for the same amount of useful work per token.

Useful FLOPs (FlashAttention's convention): causal forward = ``2 * sum_i L_i^2 * H * D`` (QK^T and PV,
``2 * 2 * L^2 * H * D``, halved by the causal mask); backward = 2.5 x forward; fwd+bwd = 3.5 x forward. The
dense reference counts ``2 * T^2 * H * D``. TFLOP/s = useful FLOPs / median time (CUDA events, after
warm-up; FlashAttention-4 compiles ~3 s per shape class on its first call, which warm-up absorbs). Every call is
timed twice (``benchmarks._common.time_fn``): *queued* -- calls issued back to back, each between its own events,
one wait at the end (``triton.testing.do_bench``'s method): the steady state of a training loop, whose host runs
ahead of the GPU; the table's ``fwd ms`` / ``fwd+bwd ms``, the ratios and the issue 17 verdict -- and *synced* --
the host waits for each call, so a call's host path (Python dispatch, argument binding, launches) counts
whenever the GPU idles behind it: the ``synced`` columns and a second verdict. Before the ninth session
(2026-12-01) the tables held the synced times only.

Per-batch derived objects (FlexAttention's block mask, triton_short's tile tables) are built inside every
timed call by default, as before. ``--batch-meta`` builds the batch's ``VarlenMeta`` once per case and passes it
to every call, as a model does (one meta per batch, read by every layer): those objects are then built once
and reused, which is the per-layer cost in training.

``--ts-variant NAME=JSON`` (repeatable) adds a row ``triton_short[NAME]``: triton_short with that
``VARPACK_TRITON_SHORT_CONFIG`` (e.g. ``rows={"lpt": false}``: row-order tiles instead of longest first), timed
right after the backends on the same inputs, so a launch option is compared within one run; variants are not in
the verdict.

``--rounds R`` (R > 1): the compared configurations of a case (backends and variants) are first run once
untimed-for-the-table (compiles, caches: its figures are kept as ``*_first``, the cold pass), then timed R times,
round r in the order rotated by r and reversed in odd rounds (:func:`round_order`), so none always runs first,
last or right after the same one; a row's figure is the median of its rounds (each round's in ``*_rounds``). Their
inputs and buffers are alive at once. The padded and dense references are timed once afterwards: a dense call
over 65K tokens runs the GPU at full power for seconds and slowed whatever was timed next by up to 6% (twelfth
session, benchmarks/RESULTS.md). R = 1 (default): each configuration timed once, in order, as before.

Before timing, every backend's forward output is compared with the ``reference`` backend (per-sample SDPA)
on the same inputs: ``max|d|`` in the table; a backend that mixes samples shows up there.

Length mixes:
    lognormal: real lengths of ../shared/data (``--lengths-file``: a samples ``.npz`` from
        ``benchmarks/_common.py encode``, H2's ``_lengths`` cache ``.npz``, a ``.npy`` or a text file of ints),
        drawn with replacement; without a file, a lognormal(``--mu``, ``--sigma``) whose defaults are the fit of
        the Qwen3-encoded ../shared/data lengths (``python -m benchmarks._common fit``), clipped to [16, 8192].
    uniform512, uniform2048: every sample exactly 512 / 2048 tokens.
    short: lengths uniform in [16, 128] (many short samples: memory / launch bound).

Run (GPU)::

    python benchmarks/attention.py --out runs/attention.json [--lengths-file .gpu/samples.npz]
    python benchmarks/attention.py --device cpu --small      # smoke test, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    fit_lognormal,
    length_stats,
    machine_info,
    markdown_table,
    sync,
    time_fn,
    write_json,
)
from varpack.attn import available_backends, resolve_backend, varlen_attention  # noqa: E402
from varpack.varlen import VarlenMeta  # noqa: E402

#: Lognormal fit (MLE: mean / std of log length) of the 20,377 conversations of ../shared/data encoded with
#: the embedded Qwen3 tokenizer and chat template (``python -m benchmarks._common fit .gpu/samples.npz``,
#: 2026-11-29): mu 5.05, sigma 0.72; real lengths p50 151, p90 373, p99 1117, max 2916, mean 208 tokens.
DEFAULT_MU = 5.05
DEFAULT_SIGMA = 0.72

MIXES = ("lognormal", "uniform512", "uniform2048", "short")


# ----------------------------------------------------------------------------------------------------------
# lengths
# ----------------------------------------------------------------------------------------------------------


def read_lengths_file(path: str | Path) -> np.ndarray:
    """Token lengths from a samples ``.npz`` (``offsets``), any ``.npz`` of int arrays (concatenated), a
    ``.npy``, or a text file with one int per line.

    Raises:
        FileNotFoundError: no such file. ValueError: no lengths, or a length < 1.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"lengths file {p} does not exist")
    if p.suffix == ".npz":
        with np.load(p, allow_pickle=False) as z:
            if "offsets" in z.files:
                lengths = np.diff(z["offsets"])
            else:
                lengths = np.concatenate(
                    [z[k].ravel() for k in z.files if np.issubdtype(z[k].dtype, np.integer)]
                )
    elif p.suffix == ".npy":
        lengths = np.load(p, allow_pickle=False).ravel()
    else:
        lengths = np.asarray([int(x) for x in p.read_text().split()], dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0 or (lengths < 1).any():
        raise ValueError(
            f"{p}: need >= 1 lengths, all >= 1 (got {lengths.size}, min {lengths.min(initial=0)})"
        )
    return lengths


def fill_to(total: int, draw, rng: np.random.Generator) -> list[int]:
    """Draw lengths until they cover ``total`` tokens; the last one is cut so the sum is exactly ``total``."""
    out: list[int] = []
    remaining = total
    while remaining > 0:
        length = min(int(draw(rng)), remaining)
        out.append(max(1, length))
        remaining -= out[-1]
    return out


def mix_lengths(
    mix: str,
    total: int,
    *,
    real: np.ndarray | None,
    mu: float,
    sigma: float,
    max_len: int,
    seed: int = 0,
) -> list[int]:
    """Sample lengths of one mix, summing to exactly ``total``.

    Raises:
        ValueError: unknown mix.
    """
    rng = np.random.default_rng(seed)
    if mix == "lognormal":
        if real is not None:
            pool = np.clip(real, 1, max_len)
            return fill_to(total, lambda r: pool[r.integers(len(pool))], rng)
        return fill_to(total, lambda r: np.clip(round(r.lognormal(mu, sigma)), 16, max_len), rng)
    if mix.startswith("uniform"):
        n = int(mix[len("uniform") :])
        return fill_to(total, lambda r: n, rng)
    if mix == "short":
        return fill_to(total, lambda r: r.integers(16, 129), rng)
    raise ValueError(f"unknown length mix {mix!r}; choose from {MIXES}")


def causal_fwd_flops(lengths: list[int], heads: int, head_dim: int) -> float:
    return 2.0 * float(sum(int(n) ** 2 for n in lengths)) * heads * head_dim


# ----------------------------------------------------------------------------------------------------------
# runners
# ----------------------------------------------------------------------------------------------------------


def _inputs(total: int, heads: int, kv_heads: int, head_dim: int, device, dtype, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(total, heads, head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(total, kv_heads, head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(total, kv_heads, head_dim, device=device, dtype=dtype, generator=g)
    return q, k, v


class Runner:
    """``fwd()`` (no grad), ``fwd_bwd()`` (forward + backward of a fixed upstream gradient), ``output()``
    (the ``[T, H, D]`` forward output, for the correctness check). Inputs are prepared outside the timing."""

    def __init__(self, fwd, fwd_bwd, output) -> None:
        self.fwd, self.fwd_bwd, self.output = fwd, fwd_bwd, output


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_()


def varlen_runner(
    backend: str,
    q,
    k,
    v,
    cu: torch.Tensor,
    max_len: int,
    batch_meta: bool = False,
    ts_config: str | None = None,
) -> Runner:
    """``varlen_attention`` on ``backend``; with ``batch_meta`` one :class:`VarlenMeta` (built here, outside the
    timing) is passed to every call, so per-batch derived objects are built on the first call only. ``ts_config``:
    the ``VARPACK_TRITON_SHORT_CONFIG`` JSON set around every call (a ``--ts-variant``), restored after it."""
    meta = VarlenMeta(cu, None, max_len, max_len, total_q=q.shape[0]) if batch_meta else None

    def call(q_, k_, v_):
        if meta is not None:
            return varlen_attention(q_, k_, v_, causal=True, backend=backend, meta=meta)
        return varlen_attention(q_, k_, v_, cu, cu, max_len, max_len, causal=True, backend=backend)

    def scope():  # the variant's config around the forward and the backward (read at every kernel launch)
        return contextlib.nullcontext() if ts_config is None else ts_config_env(ts_config)

    qg, kg, vg = _leaf(q), _leaf(k), _leaf(v)
    dout = torch.randn_like(q)

    def fwd():
        with torch.no_grad(), scope():
            return call(q, k, v)

    def fwd_bwd():
        with scope():
            call(qg, kg, vg).backward(dout)
        qg.grad = kg.grad = vg.grad = None

    return Runner(fwd, fwd_bwd, fwd)


def padded_runner(q, k, v, lengths: list[int], batch: int) -> Runner:
    """Right-padded batches of ``batch`` samples in data order (padding done here, outside the timing),
    ``F.scaled_dot_product_attention(is_causal=True)`` per batch: with right padding and a causal mask real
    tokens never attend to pads, so no padding mask is needed (SDPA keeps its flash path)."""
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    groups = [list(range(i, min(i + batch, len(lengths)))) for i in range(0, len(lengths), batch)]
    gqa = q.shape[1] != k.shape[1]

    def pad(x, grp):
        longest = max(lengths[i] for i in grp)
        parts = [F.pad(x[starts[i] : starts[i + 1]], (0, 0, 0, 0, 0, longest - lengths[i])) for i in grp]
        return torch.stack(parts).transpose(1, 2).contiguous()  # [B, H, L, D]

    batches = [(pad(q, g), pad(k, g), pad(v, g)) for g in groups]
    leaves = [tuple(_leaf(t) for t in b) for b in batches]
    douts = [torch.randn_like(b[0]) for b in batches]

    def sdpa(qb, kb, vb):
        return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=gqa)

    def fwd():
        with torch.no_grad():
            return [sdpa(*b) for b in batches]

    def fwd_bwd():
        for b, d in zip(leaves, douts):
            sdpa(*b).backward(d)
            for t in b:
                t.grad = None

    def output():
        outs = []
        for grp, o in zip(groups, fwd()):
            o = o.transpose(1, 2)
            outs.extend(o[j, : lengths[i]] for j, i in enumerate(grp))
        return torch.cat(outs)

    return Runner(fwd, fwd_bwd, output)


def dense_runner(q, k, v, device) -> tuple[Runner, str]:
    """One causal sequence ``[1, H, T, D]`` (k/v expanded to H heads beforehand for GQA); SDPA's cuDNN backend
    on CUDA (flash when cuDNN cannot run), plain SDPA on the CPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    qd, kd, vd = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))
    leaves = (_leaf(qd), _leaf(kd), _leaf(vd))
    dout = torch.randn_like(qd)
    choice: list[Any] = []
    if torch.device(device).type == "cuda":
        for name, b in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel([b]):
                    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
                    out.backward(dout)
                choice = [name, [b]]
                break
            except RuntimeError:
                continue
        if not choice:
            raise RuntimeError("neither cuDNN nor flash SDPA runs a dense causal sequence here")
    else:
        choice = ["math/cpu", None]

    def sdpa(*t):
        if choice[1] is None:
            return F.scaled_dot_product_attention(*t, is_causal=True)
        with sdpa_kernel(choice[1]):
            return F.scaled_dot_product_attention(*t, is_causal=True)

    def fwd():
        with torch.no_grad():
            return sdpa(qd, kd, vd)

    def fwd_bwd():
        sdpa(*leaves).backward(dout)
        for t in leaves:
            t.grad = None

    return Runner(fwd, fwd_bwd, fwd), choice[0]


@contextlib.contextmanager
def ts_config_env(text: str):
    """``VARPACK_TRITON_SHORT_CONFIG=text`` for the block (read by triton_short at every call), then restored."""
    from varpack.attn.triton_short import CONFIG_ENV

    old = os.environ.get(CONFIG_ENV)
    os.environ[CONFIG_ENV] = text
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(CONFIG_ENV, None)
        else:
            os.environ[CONFIG_ENV] = old


def parse_ts_variants(items: list[str]) -> list[tuple[str, str]]:
    """``--ts-variant NAME=JSON`` values as ``(row name "triton_short[NAME]", JSON)``, each JSON checked by
    :meth:`varpack.attn.triton_short.TritonShortConfig.from_json`.

    Raises:
        ValueError: no ``=``, an empty or repeated name, or a JSON the config refuses (its message, naming the
            variant)."""
    from varpack.attn.triton_short import TritonShortConfig

    out: list[tuple[str, str]] = []
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--ts-variant {item!r}: need NAME=JSON, e.g. 'rows={{\"lpt\": false}}'")
        row = f"triton_short[{name.strip()}]"
        if row in (r for r, _ in out):
            raise ValueError(f"--ts-variant {item!r}: the name {name.strip()!r} is given twice")
        try:
            TritonShortConfig.from_json(text)
        except ValueError as exc:
            raise ValueError(f"--ts-variant {name.strip()!r}: {exc}") from None
        out.append((row, text))
    return out


def run_case(
    mix: str,
    lengths: list[int],
    heads: int,
    kv_heads: int,
    args: argparse.Namespace,
    backends: list[str],
    variants: list[tuple[str, str]] = (),
) -> list[dict[str, Any]]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    total = sum(lengths)
    q, k, v = _inputs(total, heads, kv_heads, args.head_dim, device, dtype, args.seed)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    max_len = max(lengths)
    flops = causal_fwd_flops(lengths, heads, args.head_dim)
    truth = None
    if not args.no_check:
        with torch.no_grad():
            truth = varlen_runner("reference", q, k, v, cu, max_len).output().float()
    rows: list[dict[str, Any]] = []
    base = {"mix": mix, "H": heads, "Hkv": kv_heads, "D": args.head_dim, "T": total, "N": len(lengths)}
    #: (name, make, useful FLOPs, note, compare with the reference), in the table's order
    entries: list[tuple[str, Any, float, str, bool]] = []
    for name in backends:
        note = ""
        if name == "auto":
            picked = resolve_backend("auto", q.detach().requires_grad_(), k, v, cu_seqlens_q=cu.cpu())
            note = f"-> {picked}"
        if args.batch_meta:
            note = f"{note}; batch meta".lstrip("; ")
        entries.append(
            (name, lambda name=name: varlen_runner(name, q, k, v, cu, max_len, args.batch_meta), flops, note, True)
        )
    for name, text in variants:  # triton_short under another config, same inputs, right after the backends
        make = lambda text=text: varlen_runner(  # noqa: E731
            "triton_short", q, k, v, cu, max_len, args.batch_meta, ts_config=text
        )
        entries.append((name, make, flops, f"VARPACK_TRITON_SHORT_CONFIG={text}", True))
    entries.append(
        ("padded_sdpa", lambda: padded_runner(q, k, v, lengths, args.pad_batch), flops,
         f"batches of {args.pad_batch}", True)
    )  # fmt: skip
    if not args.no_dense:
        entries.append(
            ("dense_cudnn", lambda: dense_runner(q, k, v, device), causal_fwd_flops([total], heads, args.head_dim),
             "", False)
        )  # fmt: skip

    def time_row(row: dict[str, Any], runner) -> None:
        """One timing of ``runner`` into ``row``: queued (the table's, steady state) then synced (each call waited
        for: host path included)."""
        for suffix, queued in (("", True), ("_synced", False)):
            timed = {"warmup": args.warmup, "iters": args.iters, "queued": queued}
            row[f"fwd_ms{suffix}"] = time_fn(runner.fwd, device, **timed)["ms"]
            if not args.fwd_only:
                row[f"fwd_bwd_ms{suffix}"] = time_fn(runner.fwd_bwd, device, **timed)["ms"]

    def start(name: str, make, note: str, check: bool) -> tuple[dict[str, Any], Any]:
        row = dict(base, impl=name, note=note)
        try:
            runner = make()
            if isinstance(runner, tuple):
                runner, which = runner
                row["note"] = f"SDPA {which}, one sequence of {total}"
            time_row(row, runner)  # rounds > 1: the untimed first pass (compiles, caches); else the timing
            if truth is not None and check:
                with torch.no_grad():
                    row["max_abs_diff"] = float((runner.output().float() - truth).abs().max())
        except Exception as exc:  # a backend that cannot run this case: recorded, never fatal
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            runner = None
        return row, runner

    keys = ("fwd_ms", "fwd_bwd_ms", "fwd_ms_synced", "fwd_bwd_ms_synced")
    rounds = args.rounds
    n_varlen = len(backends) + len(variants)  # the compared configurations; then the padded / dense references

    def one_at_a_time(chosen) -> None:  # each configuration timed once, its memory freed before the next
        for name, make, _, note, check in chosen:
            row, _ = start(name, make, note, check)
            rows.append(row)
            sync(device)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    if rounds == 1:
        one_at_a_time(entries)
    else:
        # the compared configurations alive at once: one untimed-for-the-table pass, then the rounds; the
        # references (a dense 65K-token causal call runs the GPU at full power for seconds, slowing whatever runs
        # next) once each afterwards
        started = [start(name, make, note, check) for name, make, _, note, check in entries[:n_varlen]]
        per_round: list[dict[str, list[float]]] = [{} for _ in started]
        for r in range(rounds):
            for i in round_order(len(started), r):
                row, runner = started[i]
                if runner is None:
                    continue
                one: dict[str, Any] = {}
                time_row(one, runner)
                for key in keys:
                    if key in one:
                        per_round[i].setdefault(key, []).append(one[key])
        for (row, _), timings in zip(started, per_round):
            for key, values in timings.items():
                row[f"{key}_first"] = row[key]  # the untimed pass's figure (cold caches, first compiles)
                row[key] = statistics.median(values)
                row[f"{key}_rounds"] = values
            rows.append(row)
        started.clear()
        sync(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        one_at_a_time(entries[n_varlen:])
    for row, (_, _, useful_flops, _, _) in zip(rows[-len(entries):], entries):
        for suffix in ("", "_synced"):
            if f"fwd_ms{suffix}" in row:
                row[f"fwd_tflops{suffix}"] = useful_flops / row[f"fwd_ms{suffix}"] / 1e9
            if f"fwd_bwd_ms{suffix}" in row:
                row[f"fwd_bwd_tflops{suffix}"] = 3.5 * useful_flops / row[f"fwd_bwd_ms{suffix}"] / 1e9
    return rows


def round_order(n: int, r: int) -> list[int]:
    """Order of ``n`` configurations in round ``r`` of ``--rounds``: the table order rotated by ``r // 2``, reversed
    in odd rounds -- so no configuration is always first or last, nor always right after the same one (a
    configuration that heats the GPU slows the next). Two configurations: 01, 10, 10, 01, ..."""
    order = [(r // 2 + j) % n for j in range(n)]
    return order[::-1] if r % 2 else order


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Per case: TFLOP/s ratio vs torch_varlen and vs dense (fwd and fwd+bwd)."""
    cases: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        cases.setdefault((r["mix"], r["H"], r["Hkv"]), []).append(r)
    for group in cases.values():
        ref = {r["impl"]: r for r in group}
        for r in group:
            for key in ("fwd_tflops", "fwd_bwd_tflops"):
                for base in ("torch_varlen", "dense_cudnn"):
                    b = ref.get(base, {}).get(key)
                    if b and r.get(key):
                        r[f"{key}_vs_{base}"] = r[key] / b


#: varlen peers of ``triton_short`` in the verdict (the strongest a user would configure is the fastest of them)
VARLEN_PEERS = ("flash_attn_4", "flash_attn_3", "flash_attn", "torch_varlen", "flex")
#: issue 17's goals, fwd + bwd useful TFLOP/s: mix -> (peer set, ratio, absolute floor)
GOALS_17 = {"short": ("best", 2.0, 56.0), "lognormal": ("flash_attn_4", 1.3, 175.0)}
#: margin by which triton_short must beat both auto's pick and the best peer, same run, to propose a row
PROPOSE_MARGIN = 1.05


def triton_short_verdict(
    rows: list[dict[str, Any]], mix_info: dict[str, dict[str, float]], timing: str = "queued"
) -> list[dict[str, Any]]:
    """Per case (mix, H, Hkv) where ``triton_short`` ran fwd + bwd: its speed against the best varlen peer that
    ran (:data:`VARLEN_PEERS`), FA4 and ``auto`` in the same run, issue 17's goal for the mix
    (:data:`GOALS_17`) met or not, and a proposed ``AUTO_TRITON_SHORT`` row (``TritonShortRule`` of the mix's
    longest and mean length) only where triton_short beats auto's pick and the best peer by
    :data:`PROPOSE_MARGIN`; both only where its output was checked and is within 2x the worst peer's max |diff|
    to the reference (``exact``). ``timing``: ``"queued"`` (the rows' ``fwd_bwd_tflops``, calls issued back to
    back: the steady state) or ``"synced"`` (``fwd_bwd_tflops_synced``, each call waited for). Pure function of
    the rows (unit-tested).

    Raises:
        ValueError: another ``timing``."""
    if timing not in ("queued", "synced"):
        raise ValueError(f"timing must be 'queued' or 'synced', got {timing!r}")
    key = "fwd_bwd_tflops" if timing == "queued" else "fwd_bwd_tflops_synced"
    cases: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if key in r:
            cases.setdefault((r["mix"], r["H"], r["Hkv"]), {})[r["impl"]] = r
    out = []
    for (mix, h, hkv), by in cases.items():
        ts = by.get("triton_short")
        if ts is None:
            continue
        speed = ts[key]
        peers = {n: by[n][key] for n in VARLEN_PEERS if n in by}
        best = max(peers, key=peers.get) if peers else None
        v: dict[str, Any] = {
            "mix": mix,
            "H": h,
            "Hkv": hkv,
            "D": ts["D"],
            "timing": timing,
            "triton_short": speed,
        }
        if best is not None:
            v.update(best_peer=best, best_peer_tflops=peers[best], vs_best_peer=speed / peers[best])
        if "flash_attn_4" in peers:
            v["vs_flash_attn_4"] = speed / peers["flash_attn_4"]
        if "auto" in by:
            v.update(auto=by["auto"].get("note", ""), vs_auto=speed / by["auto"][key])
        # a speed counts only for a correct output: triton_short's max |diff| to the reference within 2x the worst
        # peer's in the same run (the fp32-truth rule of varpack check); unchecked (--no-check) counts as not
        peer_errs = [by[n]["max_abs_diff"] for n in peers if "max_abs_diff" in by[n]]
        if "max_abs_diff" in ts and peer_errs:
            v["max_abs_diff"], v["peer_max_abs_diff"] = ts["max_abs_diff"], max(peer_errs)
            v["exact"] = bool(ts["max_abs_diff"] <= 2 * max(peer_errs) + 1e-6)
        else:
            v["exact"] = None
        goal = GOALS_17.get(mix)
        if goal is not None:
            ref, ratio, floor = goal
            got = v.get("vs_best_peer") if ref == "best" else v.get(f"vs_{ref}")
            v["goal"] = f"{ratio:g}x {'the best peer' if ref == 'best' else ref} and >= {floor:g} TFLOP/s"
            v["goal_met"] = bool(v["exact"]) and got is not None and got >= ratio and speed >= floor
        beats = [v.get("vs_auto"), v.get("vs_best_peer")]
        if v["exact"] and all(b is not None and b >= PROPOSE_MARGIN for b in beats) and mix in mix_info:
            st = mix_info[mix]
            v["propose"] = (
                f"TritonShortRule(max_seqlen={int(st['max'])}, max_mean_seqlen={st['mean']:.0f}, training=True, "
                f"head_dims=({ts['D']},))"
            )
        out.append(v)
    return out


def verdict_lines(verdicts: list[dict[str, Any]]) -> list[str]:
    """The verdict as printed lines (one per case)."""
    lines = []
    for v in verdicts:
        parts = [
            f"{v['mix']} H={v['H']}/{v['Hkv']} D={v['D']} ({v.get('timing', 'queued')}): "
            f"triton_short {v['triton_short']:.1f} TFLOP/s"
        ]
        if "best_peer" in v:
            parts.append(f"{v['vs_best_peer']:.2f}x best peer {v['best_peer']} ({v['best_peer_tflops']:.1f})")
        if "vs_flash_attn_4" in v:
            parts.append(f"{v['vs_flash_attn_4']:.2f}x flash_attn_4")
        if "vs_auto" in v:
            parts.append(f"{v['vs_auto']:.2f}x auto ({v['auto']})")
        if v.get("exact") is None:
            parts.append("output NOT checked against the reference (no goal, no row)")
        elif not v["exact"]:
            parts.append(
                f"output WRONG: max diff {v['max_abs_diff']:.1e} > 2x the peers' worst {v['peer_max_abs_diff']:.1e}"
            )
        if "goal" in v:
            parts.append(f"issue 17 goal ({v['goal']}): {'MET' if v['goal_met'] else 'not met'}")
        parts.append(
            f"propose AUTO_TRITON_SHORT row {v['propose']}" if "propose" in v else "no AUTO_TRITON_SHORT row"
        )
        lines.append("- " + "; ".join(parts))
    return lines


def table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "mix",
        "H/Hkv",
        "N",
        "impl",
        "fwd ms",
        "fwd TFLOP/s",
        "fwd+bwd ms",
        "fwd+bwd TFLOP/s",
        "fwd+bwd ms synced",
        "fwd+bwd TFLOP/s synced",
        "fwd+bwd vs torch_varlen",
        "fwd+bwd vs dense",
        "fwd vs dense",
        "max|d|",
        "note",
    ]
    nan = float("nan")
    out = []
    for r in rows:
        out.append(
            [
                r["mix"],
                f"{r['H']}/{r['Hkv']}",
                r["N"],
                r["impl"],
                r.get("fwd_ms", nan),
                r.get("fwd_tflops", nan),
                r.get("fwd_bwd_ms", nan),
                r.get("fwd_bwd_tflops", nan),
                r.get("fwd_bwd_ms_synced", nan),
                r.get("fwd_bwd_tflops_synced", nan),
                r.get("fwd_bwd_tflops_vs_torch_varlen", nan),
                r.get("fwd_bwd_tflops_vs_dense_cudnn", nan),
                r.get("fwd_tflops_vs_dense_cudnn", nan),
                f"{r['max_abs_diff']:.1e}" if "max_abs_diff" in r else "-",
                r.get("error", r.get("note", "")),
            ]
        )
    return markdown_table(headers, out)


def parse_heads(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        h, _, kv = part.partition("/")
        heads, kv_heads = int(h), int(kv or h)
        if heads % kv_heads:
            raise ValueError(f"--heads {part}: H={heads} is not a multiple of Hkv={kv_heads}")
        out.append((heads, kv_heads))
    return out


def checked_device(p: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """``args.device`` as a device (a usage error when it is CUDA and none is there); fills ``args.dtype`` when
    unset: bfloat16 on CUDA, float32 on the CPU."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; use --device cpu --small for a smoke run")
    if args.dtype is None:
        args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    return device


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="bfloat16 (cuda default) / float32 (cpu default)")
    p.add_argument("--tokens", type=int, default=65536, help="T, packed tokens per call")
    p.add_argument("--mixes", default=",".join(MIXES))
    p.add_argument("--heads", default="16/4,16/8,32/4,32/8", help="comma-separated H/Hkv pairs")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument(
        "--backends", default=None, help="comma-separated varpack backends (default: all usable + auto)"
    )
    p.add_argument("--include-reference", action="store_true", help="also time the per-sample reference loop")
    p.add_argument("--lengths-file", default=None, help="real lengths for the lognormal mix (see module doc)")
    p.add_argument("--mu", type=float, default=DEFAULT_MU)
    p.add_argument("--sigma", type=float, default=DEFAULT_SIGMA)
    p.add_argument("--max-len", type=int, default=8192, help="longest sample of the lognormal mix")
    p.add_argument("--pad-batch", type=int, default=8, help="samples per padded SDPA batch")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every configuration this many times, each round in another rotation of the order, after one "
        "untimed pass over all of them; the table gives the median of the rounds (default 1: one timing each, "
        "in order)",
    )
    p.add_argument("--fwd-only", action="store_true")
    p.add_argument(
        "--batch-meta",
        action="store_true",
        help="pass one VarlenMeta per case to every call (per-batch objects built once, as in a model)",
    )
    p.add_argument("--no-dense", action="store_true")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the reference backend")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true", help="smoke mode: T=512, H=4/2, D=32, 1 iteration")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument(
        "--ts-variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="also time triton_short with this VARPACK_TRITON_SHORT_CONFIG JSON as row triton_short[NAME] "
        "(repeatable; e.g. 'rows={\"lpt\": false}'), in the same run as the backends; not in the verdict",
    )
    args = p.parse_args(argv)

    device = checked_device(p, args)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    try:
        variants = parse_ts_variants(args.ts_variant)
    except ValueError as exc:
        p.error(str(exc))
    if args.small:
        args.tokens, args.head_dim, args.heads = 512, 32, "4/2"
        args.max_len = min(args.max_len, 256)
        args.warmup, args.iters = 1, 1
    mixes = [m for m in args.mixes.split(",") if m]
    if args.small:
        mixes = [m if not m.startswith("uniform") else f"uniform{int(m[7:]) // 8}" for m in mixes]
    real = read_lengths_file(args.lengths_file) if args.lengths_file else None
    dtype = getattr(torch, args.dtype)
    avail = available_backends(device, dtype)
    if args.backends:
        backends = args.backends.split(",")
    else:
        backends = [n for n, (ok, _) in avail.items() if ok and (n != "reference" or args.include_reference)]
        backends.append("auto")
    if device.type == "cpu" and not args.include_reference and "reference" not in backends:
        backends.insert(0, "reference")  # the only CPU backend of auto; keep the table meaningful

    print(f"# varlen attention, {args.device} {args.dtype}, T={args.tokens}, D={args.head_dim}, causal")
    for name, (ok, reason) in avail.items():
        print(f"- {name}: {'ok' if ok else 'unavailable'} ({reason})")
    if real is not None:
        mu, sigma = fit_lognormal(real)
        print(
            f"- lognormal mix: {real.size} real lengths from {args.lengths_file} (fit mu={mu:.2f} sigma={sigma:.2f})"
        )
    else:
        print(f"- lognormal mix: lognormal(mu={args.mu}, sigma={args.sigma}) clipped to [16, {args.max_len}]")

    rows: list[dict[str, Any]] = []
    mix_info = {}
    for mix in mixes:
        lengths = mix_lengths(
            mix, args.tokens, real=real, mu=args.mu, sigma=args.sigma, max_len=args.max_len, seed=args.seed
        )
        mix_info[mix] = length_stats(lengths)
        for heads, kv_heads in parse_heads(args.heads):
            rows.extend(run_case(mix, lengths, heads, kv_heads, args, backends, variants))
            print(f"  done {mix} H={heads} Hkv={kv_heads}", file=sys.stderr, flush=True)
    add_ratios(rows)
    print()
    print(table(rows))
    print()
    print(
        "Useful FLOPs: causal fwd = 2*sum(L_i^2)*H*D, bwd = 2.5x fwd; dense = 2*T^2*H*D. Ratios are of TFLOP/s."
    )
    for mix, st in mix_info.items():
        print(f"- {mix}: {st}")
    verdicts = triton_short_verdict(rows, mix_info)
    verdicts_synced = triton_short_verdict(rows, mix_info, timing="synced")
    if verdicts:
        print(
            f"\ntriton_short, same run (a row is proposed only at >= {PROPOSE_MARGIN:g}x auto and the best peer); "
            "queued = calls issued back to back (steady state), synced = each call waited for (host path in):"
        )
        print("\n".join(verdict_lines(verdicts + verdicts_synced)))
    write_json(
        args.out,
        {
            "machine": machine_info(device),
            "args": vars(args),
            "mixes": mix_info,
            "rows": rows,
            "triton_short": verdicts,
            "triton_short_synced": verdicts_synced,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
