"""Varlen attention: every varpack backend against padded SDPA and a dense causal call, same inputs, same run.

For each length mix and head configuration, T packed tokens (default 65,536) are cut into documents whose
lengths sum to exactly T; q ``[T, H, D]``, k / v ``[T, Hkv, D]`` (bf16, D = 128, causal). Rows:

* every backend ``varpack.attn.available_backends`` reports usable (``varlen_attention(..., backend=name)``),
  and ``auto`` (what it resolves to is in the note);
* ``triton_short[NAME]`` per ``--ts-variant NAME=JSON``: ``triton_short`` under that
  ``VARPACK_TRITON_SHORT_CONFIG``, on the same inputs, so a launch option is compared within one run;
* ``padded_sdpa``: what a user without packing runs -- documents in data order, batches of ``--pad-batch``,
  each right-padded to its longest, ``F.scaled_dot_product_attention(is_causal=True)`` (right padding +
  causal: real tokens never see pads);
* ``dense_cudnn``: one causal sequence of T tokens (SDPA's cuDNN backend, flash if cuDNN cannot run): the
  hardware's ceiling for the same work per token.

Useful FLOPs (FlashAttention's convention): causal forward ``2 * sum_i L_i^2 * H * D``; backward 2.5x the
forward; the dense call counts ``2 * T^2 * H * D``. TFLOP/s = useful FLOPs / median time. Every call is timed
twice (:func:`benchmarks._common.time_fn`): *queued* (calls issued back to back: the steady state of a
training loop, whose host runs ahead of the GPU; the table's ``ms``, the ratios and the verdict) and *synced*
(each call waited for: the host's launch path counts; the ``synced`` columns and a second verdict). Before
timing, every output is compared with the ``reference`` backend (per-document SDPA): ``max|d|`` (a backend
that mixes documents shows).

``--batch-meta`` builds one ``VarlenMeta`` per case and passes it to every call, as a model does (per-batch
objects such as FlexAttention's block mask or triton_short's tile tables are then built once, as in training).
``--rounds R`` (R > 1): the compared configurations (backends and variants) are first run once untimed (their
figures kept as ``*_first``: the cold pass), then timed R times in :func:`benchmarks._common.round_order`; a
row is the median of its rounds (``*_rounds``). The padded and dense references run once afterwards, since a
dense 65K call runs the GPU at full power for seconds and slows what follows.

Length mixes: ``lognormal`` -- the real lengths (``--lengths-file``: a samples ``.npz`` of
``benchmarks/_common.py encode``, a ``.npy`` or a text file of ints) drawn with replacement, else
lognormal(``--mu``, ``--sigma``) clipped to [16, ``--max-len``]; ``uniformN`` -- every document N tokens;
``short`` -- uniform in [16, 128].

    python benchmarks/attention.py --lengths-file .gpu/samples.npz --mixes short,lognormal --heads 16/4 \\
        --backends flash_attn_4,torch_varlen,flex,triton_short,auto --batch-meta --rounds 3 --out
        attention.json
    python benchmarks/attention.py --device cpu --small      # smoke run, seconds
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
    REAL_MU,
    REAL_SIGMA,
    add_common_args,
    checked_device,
    error_text,
    fit_lognormal,
    length_stats,
    machine_info,
    markdown_table,
    read_lengths_file,
    round_order,
    sync,
    time_fn,
    write_json,
)
from varpack.attn import available_backends, resolve_backend, varlen_attention  # noqa: E402
from varpack.varlen import VarlenMeta  # noqa: E402

MIXES = ("lognormal", "uniform512", "uniform2048", "short")
#: varlen peers of ``triton_short`` in the verdict: the strongest a user would configure is the fastest
VARLEN_PEERS = ("flash_attn_4", "flash_attn_3", "flash_attn", "torch_varlen", "flex")
#: fwd + bwd targets of ``triton_short`` per mix: (peer: "best" or a backend, ratio, absolute TFLOP/s floor)
TARGETS = {"short": ("best", 2.0, 56.0), "lognormal": ("flash_attn_4", 1.3, 175.0)}
#: margin by which triton_short must beat both auto's pick and the best peer, same run, to propose a row
PROPOSE_MARGIN = 1.05


# ----------------------------------------------------------------------------------------------------------
# lengths and inputs
# ----------------------------------------------------------------------------------------------------------


def fill_to(total: int, draw, rng: np.random.Generator) -> list[int]:
    """Draw lengths until they cover ``total`` tokens; the last one is cut so the sum is exactly ``total``."""
    out: list[int] = []
    while sum(out) < total:
        out.append(max(1, min(int(draw(rng)), total - sum(out))))
    return out


def mix_lengths(
    mix: str, total: int, *, real: np.ndarray | None, mu: float, sigma: float, max_len: int, seed: int = 0
) -> list[int]:
    """Document lengths of one mix, summing to exactly ``total``.

    Raises:
        ValueError: unknown mix.
    """
    rng = np.random.default_rng(seed)
    if mix == "lognormal":
        if real is not None:
            pool = np.clip(real, 1, max_len)
            return fill_to(total, lambda r: pool[r.integers(len(pool))], rng)
        return fill_to(total, lambda r: np.clip(round(r.lognormal(mu, sigma)), 16, max_len), rng)
    if mix.startswith("uniform") and mix[len("uniform") :].isdigit():
        return fill_to(total, lambda r: int(mix[len("uniform") :]), rng)
    if mix == "short":
        return fill_to(total, lambda r: r.integers(16, 129), rng)
    raise ValueError(f"unknown length mix {mix!r}; choose from {MIXES}")


def causal_fwd_flops(lengths: list[int], heads: int, head_dim: int) -> float:
    return 2.0 * float(sum(int(n) ** 2 for n in lengths)) * heads * head_dim


def inputs(
    total: int, heads: int, kv_heads: int, head_dim: int, device, dtype, seed: int, dout: bool = False
):
    """Random ``q [T, H, D]``, ``k`` / ``v [T, Hkv, D]`` (and ``dout [T, H, D]``), the same for the same
    seed."""
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = [(total, heads, head_dim), (total, kv_heads, head_dim), (total, kv_heads, head_dim)]
    shapes += [(total, heads, head_dim)] if dout else []
    return tuple(torch.randn(*s, device=device, dtype=dtype, generator=g) for s in shapes)


def parse_heads(text: str) -> list[tuple[int, int]]:
    """``"16/4,32/8"`` -> ``[(16, 4), (32, 8)]``.

    Raises:
        ValueError: an H that is not a multiple of its Hkv."""
    out = []
    for part in text.split(","):
        h, _, kv = part.partition("/")
        heads, kv_heads = int(h), int(kv or h)
        if heads % kv_heads:
            raise ValueError(f"--heads {part}: H={heads} is not a multiple of Hkv={kv_heads}")
        out.append((heads, kv_heads))
    return out


# ----------------------------------------------------------------------------------------------------------
# runners: fwd() (no grad), fwd_bwd() (forward + backward of a fixed upstream gradient), output() ([T, H, D])
# ----------------------------------------------------------------------------------------------------------


class Runner:
    def __init__(self, fwd, fwd_bwd, output) -> None:
        self.fwd, self.fwd_bwd, self.output = fwd, fwd_bwd, output


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_()


@contextlib.contextmanager
def ts_config_env(text: str | None):
    """``VARPACK_TRITON_SHORT_CONFIG=text`` for the block (read by triton_short at every launch), then
    restored; ``None``: nothing changes."""
    from varpack.attn.triton_short import CONFIG_ENV

    old = os.environ.get(CONFIG_ENV)
    if text is not None:
        os.environ[CONFIG_ENV] = text
    try:
        yield
    finally:
        if text is not None and old is None:
            os.environ.pop(CONFIG_ENV, None)
        elif text is not None:
            os.environ[CONFIG_ENV] = old


def varlen_runner(backend, q, k, v, cu, max_len: int, batch_meta: bool = False, ts_config: str | None = None):
    """``varlen_attention`` on ``backend``. ``batch_meta``: one :class:`VarlenMeta` (built here, outside the
    timing) passed to every call. ``ts_config``: the ``VARPACK_TRITON_SHORT_CONFIG`` around every call (a
    variant)."""
    meta = VarlenMeta(cu, None, max_len, max_len, total_q=q.shape[0]) if batch_meta else None

    def call(q_, k_, v_):
        with ts_config_env(ts_config):
            if meta is not None:
                return varlen_attention(q_, k_, v_, causal=True, backend=backend, meta=meta)
            return varlen_attention(q_, k_, v_, cu, cu, max_len, max_len, causal=True, backend=backend)

    qg, kg, vg, dout = _leaf(q), _leaf(k), _leaf(v), torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            return call(q, k, v)

    def fwd_bwd():
        with ts_config_env(ts_config):  # the backward's kernels read the config at their launch too
            call(qg, kg, vg).backward(dout)
        qg.grad = kg.grad = vg.grad = None

    return Runner(fwd, fwd_bwd, fwd)


def padded_runner(q, k, v, lengths: list[int], batch: int) -> Runner:
    """Right-padded batches of ``batch`` documents in data order (padding built here, outside the timing),
    ``F.scaled_dot_product_attention(is_causal=True)`` per batch (no padding mask needed: SDPA keeps its flash
    path)."""
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
        outs = [o.transpose(1, 2) for o in fwd()]
        return torch.cat([o[j, : lengths[i]] for grp, o in zip(groups, outs) for j, i in enumerate(grp)])

    return Runner(fwd, fwd_bwd, output)


def dense_runner(q, k, v, device) -> tuple[Runner, str]:
    """One causal sequence ``[1, H, T, D]`` (k / v expanded to H heads); SDPA's cuDNN backend on CUDA (flash
    when cuDNN cannot run), plain SDPA on the CPU. Returns the runner and the SDPA backend it uses."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (x.repeat_interleave(group if x is not q else 1, dim=1).transpose(0, 1)[None].contiguous()
                  for x in (q, k, v))  # fmt: skip
    leaves, dout = (_leaf(qd), _leaf(kd), _leaf(vd)), torch.randn_like(qd)
    name, kernels = "math/cpu", None
    if torch.device(device).type == "cuda":
        for candidate, kernels in (
            ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
            ("flash", [SDPBackend.FLASH_ATTENTION]),
        ):
            try:
                with sdpa_kernel(kernels):
                    F.scaled_dot_product_attention(*leaves, is_causal=True).backward(dout)
                name = candidate
                break
            except RuntimeError:
                kernels = None
        if kernels is None:
            raise RuntimeError("neither cuDNN nor flash SDPA runs a dense causal sequence here")

    def sdpa(*t):
        with sdpa_kernel(kernels) if kernels else contextlib.nullcontext():
            return F.scaled_dot_product_attention(*t, is_causal=True)

    def fwd():
        with torch.no_grad():
            return sdpa(qd, kd, vd)

    def fwd_bwd():
        sdpa(*leaves).backward(dout)
        for t in leaves:
            t.grad = None

    return Runner(fwd, fwd_bwd, fwd), name


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


# ----------------------------------------------------------------------------------------------------------
# one case: (mix, H, Hkv)
# ----------------------------------------------------------------------------------------------------------

TIMINGS = ("fwd_ms", "fwd_bwd_ms", "fwd_ms_synced", "fwd_bwd_ms_synced")


def run_case(mix, lengths, heads, kv_heads, args, backends, variants=()) -> list[dict[str, Any]]:
    """The rows of one case, in table order: backends, variants, then the padded and dense references."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    total, max_len = sum(lengths), max(lengths)
    q, k, v = inputs(total, heads, kv_heads, args.head_dim, device, dtype, args.seed)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    flops = causal_fwd_flops(lengths, heads, args.head_dim)
    truth = None
    if not args.no_check:
        with torch.no_grad():
            truth = varlen_runner("reference", q, k, v, cu, max_len).output().float()
    base = {"mix": mix, "H": heads, "Hkv": kv_heads, "D": args.head_dim, "T": total, "N": len(lengths)}
    meta = "; batch meta" if args.batch_meta else ""
    entries = []  # (name, make runner, useful FLOPs, note, compare with the reference)
    for name in backends:
        note = (
            f"-> {resolve_backend('auto', q.detach().requires_grad_(), k, v, cu_seqlens_q=cu.cpu())}"
            if name == "auto"
            else ""
        )
        make = lambda name=name: varlen_runner(name, q, k, v, cu, max_len, args.batch_meta)  # noqa: E731
        entries.append((name, make, flops, (note + meta).lstrip("; "), True))
    for name, text in variants:
        make = lambda text=text: varlen_runner(  # noqa: E731
            "triton_short", q, k, v, cu, max_len, args.batch_meta, text
        )
        entries.append((name, make, flops, f"VARPACK_TRITON_SHORT_CONFIG={text}", True))
    compared = len(entries)
    entries.append(("padded_sdpa", lambda: padded_runner(q, k, v, lengths, args.pad_batch), flops,
                    f"batches of {args.pad_batch}", True))  # fmt: skip
    if not args.no_dense:
        entries.append(("dense_cudnn", lambda: dense_runner(q, k, v, device),
                        causal_fwd_flops([total], heads, args.head_dim), "", False))  # fmt: skip

    def timed(runner) -> dict[str, float]:
        """Queued (the table's: steady state), then synced (each call waited for: host path included)."""
        out = {}
        for suffix, queued in (("", True), ("_synced", False)):
            kw = {"warmup": args.warmup, "iters": args.iters, "queued": queued}
            out[f"fwd_ms{suffix}"] = time_fn(runner.fwd, device, **kw)["ms"]
            if not args.fwd_only:
                out[f"fwd_bwd_ms{suffix}"] = time_fn(runner.fwd_bwd, device, **kw)["ms"]
        return out

    def start(name, make, note, check):
        """Build and time once (with rounds: the untimed-for-the-table cold pass), check the output."""
        row = dict(base, impl=name, note=note)
        try:
            runner = make()
            if isinstance(runner, tuple):
                runner, which = runner
                row["note"] = f"SDPA {which}, one sequence of {total}"
            row.update(timed(runner))
            if truth is not None and check:
                with torch.no_grad():
                    row["max_abs_diff"] = float((runner.output().float() - truth).abs().max())
        except Exception as exc:  # a backend that cannot run this case: recorded, never fatal
            row["error"], runner = error_text(exc), None
        return row, runner

    def release():
        sync(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    rows: list[dict[str, Any]] = []
    if args.rounds == 1:  # each configuration timed once, in order, its memory freed before the next
        for name, make, _, note, check in entries[:compared]:
            rows.append(start(name, make, note, check)[0])
            release()
    else:  # the compared configurations alive at once: the cold pass, then the rounds
        started = [start(name, make, note, check) for name, make, _, note, check in entries[:compared]]
        per_round: list[dict[str, list[float]]] = [{} for _ in started]
        for r in range(args.rounds):
            for i in round_order(len(started), r):
                if started[i][1] is not None:
                    for key, ms in timed(started[i][1]).items():
                        per_round[i].setdefault(key, []).append(ms)
        for (row, _), timings in zip(started, per_round):
            for key, values in timings.items():
                row[f"{key}_first"], row[key], row[f"{key}_rounds"] = (
                    row[key],
                    statistics.median(values),
                    values,
                )
            rows.append(row)
        started.clear()
        release()
    for name, make, _, note, check in entries[compared:]:  # the references, once, after the rounds
        rows.append(start(name, make, note, check)[0])
        release()
    for row, (_, _, useful, _, _) in zip(rows, entries):
        for suffix in ("", "_synced"):
            if f"fwd_ms{suffix}" in row:
                row[f"fwd_tflops{suffix}"] = useful / row[f"fwd_ms{suffix}"] / 1e9
            if f"fwd_bwd_ms{suffix}" in row:
                row[f"fwd_bwd_tflops{suffix}"] = 3.5 * useful / row[f"fwd_bwd_ms{suffix}"] / 1e9
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Per case: TFLOP/s ratio to torch_varlen and to the dense reference (fwd and fwd+bwd)."""
    cases: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in rows:
        cases.setdefault((r["mix"], r["H"], r["Hkv"]), {})[r["impl"]] = r
    for by in cases.values():
        for r in by.values():
            for key in ("fwd_tflops", "fwd_bwd_tflops"):
                for base in ("torch_varlen", "dense_cudnn"):
                    if by.get(base, {}).get(key) and r.get(key):
                        r[f"{key}_vs_{base}"] = r[key] / by[base][key]


# ----------------------------------------------------------------------------------------------------------
# triton_short's verdict: same-run ratios, targets, a proposed AUTO_TRITON_SHORT row
# ----------------------------------------------------------------------------------------------------------


def triton_short_verdict(rows, mix_info, timing: str = "queued") -> list[dict[str, Any]]:
    """Per case where ``triton_short`` ran fwd + bwd: its speed against the best varlen peer that ran
    (:data:`VARLEN_PEERS`), FA4 and ``auto`` in the same run, the mix's target (:data:`TARGETS`) met or not,
    and a proposed ``AUTO_TRITON_SHORT`` row (``TritonShortRule`` of the mix's longest and mean length) only
    where it beats auto's pick and the best peer by :data:`PROPOSE_MARGIN`; both only where its output is
    within 2x the worst peer's max |diff| to the reference (``exact``; unchecked counts as not). ``timing``:
    ``"queued"`` (the rows' ``fwd_bwd_tflops``) or ``"synced"`` (``fwd_bwd_tflops_synced``).

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
        speed, peers = ts[key], {n: by[n][key] for n in VARLEN_PEERS if n in by}
        v: dict[str, Any] = {
            "mix": mix,
            "H": h,
            "Hkv": hkv,
            "D": ts["D"],
            "timing": timing,
            "triton_short": speed,
        }
        if peers:
            best = max(peers, key=peers.get)
            v.update(best_peer=best, best_peer_tflops=peers[best], vs_best_peer=speed / peers[best])
        if "flash_attn_4" in peers:
            v["vs_flash_attn_4"] = speed / peers["flash_attn_4"]
        if "auto" in by:
            v.update(auto=by["auto"].get("note", ""), vs_auto=speed / by["auto"][key])
        peer_errs = [by[n]["max_abs_diff"] for n in peers if "max_abs_diff" in by[n]]
        v["exact"] = None
        if "max_abs_diff" in ts and peer_errs:
            v["max_abs_diff"], v["peer_max_abs_diff"] = ts["max_abs_diff"], max(peer_errs)
            v["exact"] = bool(ts["max_abs_diff"] <= 2 * max(peer_errs) + 1e-6)
        if mix in TARGETS:
            ref, ratio, floor = TARGETS[mix]
            got = v.get("vs_best_peer") if ref == "best" else v.get(f"vs_{ref}")
            v["target"] = f"{ratio:g}x {'the best peer' if ref == 'best' else ref} and >= {floor:g} TFLOP/s"
            v["target_met"] = bool(v["exact"]) and got is not None and got >= ratio and speed >= floor
        beats = [v.get("vs_auto"), v.get("vs_best_peer")]
        if v["exact"] and all(b is not None and b >= PROPOSE_MARGIN for b in beats) and mix in mix_info:
            st = mix_info[mix]
            v["propose"] = (f"TritonShortRule(max_seqlen={int(st['max'])}, max_mean_seqlen={st['mean']:.0f}, "
                            f"training=True, head_dims=({ts['D']},))")  # fmt: skip
        out.append(v)
    return out


def verdict_lines(verdicts: list[dict[str, Any]]) -> list[str]:
    """The verdicts as printed lines (one per case)."""
    lines = []
    for v in verdicts:
        parts = [f"{v['mix']} H={v['H']}/{v['Hkv']} D={v['D']} ({v.get('timing', 'queued')}): "
                 f"triton_short {v['triton_short']:.1f} TFLOP/s"]  # fmt: skip
        if "best_peer" in v:
            parts.append(f"{v['vs_best_peer']:.2f}x best peer {v['best_peer']} ({v['best_peer_tflops']:.1f})")
        if "vs_flash_attn_4" in v:
            parts.append(f"{v['vs_flash_attn_4']:.2f}x flash_attn_4")
        if "vs_auto" in v:
            parts.append(f"{v['vs_auto']:.2f}x auto ({v['auto']})")
        if v.get("exact") is None:
            parts.append("output NOT checked against the reference (no target, no row)")
        elif not v["exact"]:
            parts.append(f"output WRONG: max diff {v['max_abs_diff']:.1e} > 2x the peers' worst "
                         f"{v['peer_max_abs_diff']:.1e}")  # fmt: skip
        if "target" in v:
            parts.append(f"target ({v['target']}): {'MET' if v['target_met'] else 'not met'}")
        parts.append(
            f"propose AUTO_TRITON_SHORT row {v['propose']}" if "propose" in v else "no AUTO_TRITON_SHORT row"
        )
        lines.append("- " + "; ".join(parts))
    return lines


def table(rows: list[dict[str, Any]]) -> str:
    cols = [
        ("fwd ms", "fwd_ms"),
        ("fwd TFLOP/s", "fwd_tflops"),
        ("fwd+bwd ms", "fwd_bwd_ms"),
        ("fwd+bwd TFLOP/s", "fwd_bwd_tflops"),
        ("fwd+bwd ms synced", "fwd_bwd_ms_synced"),
        ("fwd+bwd TFLOP/s synced", "fwd_bwd_tflops_synced"),
        ("fwd+bwd vs torch_varlen", "fwd_bwd_tflops_vs_torch_varlen"),
        ("fwd+bwd vs dense", "fwd_bwd_tflops_vs_dense_cudnn"),
        ("fwd vs dense", "fwd_tflops_vs_dense_cudnn"),
    ]
    body = [[r["mix"], f"{r['H']}/{r['Hkv']}", r["N"], r["impl"], *(r.get(k, float("nan")) for _, k in cols),
             f"{r['max_abs_diff']:.1e}" if "max_abs_diff" in r else "-", r.get("error", r.get("note", ""))]
            for r in rows]  # fmt: skip
    return markdown_table(["mix", "H/Hkv", "N", "impl", *(h for h, _ in cols), "max|d|", "note"], body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, small="smoke run: T=512, H=4/2, D=32, 1 iteration")
    p.add_argument("--tokens", type=int, default=65536, help="T, packed tokens per call")
    p.add_argument("--mixes", default=",".join(MIXES))
    p.add_argument("--heads", default="16/4,16/8,32/4,32/8", help="comma-separated H/Hkv pairs")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument(
        "--backends", default=None, help="comma-separated varpack backends (default: all usable + auto)"
    )
    p.add_argument(
        "--include-reference", action="store_true", help="also time the per-document reference loop"
    )
    p.add_argument("--lengths-file", default=None, help="real lengths for the lognormal mix (see above)")
    p.add_argument("--mu", type=float, default=REAL_MU)
    p.add_argument("--sigma", type=float, default=REAL_SIGMA)
    p.add_argument("--max-len", type=int, default=8192, help="longest document of the lognormal mix")
    p.add_argument("--pad-batch", type=int, default=8, help="documents per padded SDPA batch")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1,
                   help="timed rounds after one untimed pass, each in another order; a row is their median "
                   "(default 1: each configuration timed once, in order)")  # fmt: skip
    p.add_argument("--fwd-only", action="store_true")
    p.add_argument(
        "--batch-meta",
        action="store_true",
        help="pass one VarlenMeta per case to every call (per-batch objects built once, as in a model)",
    )
    p.add_argument("--no-dense", action="store_true")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with the reference backend")
    p.add_argument(
        "--ts-variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="also time triton_short under this VARPACK_TRITON_SHORT_CONFIG as row triton_short[NAME] "
        "(repeatable), in the same run; not in the verdict",
    )
    args = p.parse_args(argv)
    device = checked_device(p, args)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    try:
        variants = parse_ts_variants(args.ts_variant)
    except ValueError as exc:
        p.error(str(exc))
    mixes = [m for m in args.mixes.split(",") if m]
    if args.small:
        args.tokens, args.head_dim, args.heads, args.warmup, args.iters = 512, 32, "4/2", 1, 1
        args.max_len = min(args.max_len, 256)
        mixes = [f"uniform{int(m[7:]) // 8}" if m.startswith("uniform") else m for m in mixes]
    real = read_lengths_file(args.lengths_file) if args.lengths_file else None
    avail = available_backends(device, getattr(torch, args.dtype))
    if args.backends:
        backends = args.backends.split(",")
    else:
        backends = [n for n, (ok, _) in avail.items() if ok and (n != "reference" or args.include_reference)]
        backends.append("auto")
    if device.type == "cpu" and "reference" not in backends:
        backends.insert(
            0, "reference"
        )  # the only CPU backend of auto besides sdpa: keeps the table meaningful

    print(f"# varlen attention, {args.device} {args.dtype}, T={args.tokens}, D={args.head_dim}, causal")
    for name, (ok, reason) in avail.items():
        print(f"- {name}: {'ok' if ok else 'unavailable'} ({reason})")
    if real is not None:
        print(f"- lognormal mix: {real.size} real lengths from {args.lengths_file} (fit mu, sigma = "
              f"{', '.join(f'{x:.2f}' for x in fit_lognormal(real))})")  # fmt: skip
    rows: list[dict[str, Any]] = []
    mix_info = {}
    for mix in mixes:
        lengths = mix_lengths(mix, args.tokens, real=real, mu=args.mu, sigma=args.sigma, max_len=args.max_len,
                              seed=args.seed)  # fmt: skip
        mix_info[mix] = length_stats(lengths)
        for heads, kv_heads in parse_heads(args.heads):
            rows.extend(run_case(mix, lengths, heads, kv_heads, args, backends, variants))
            print(f"  done {mix} H={heads} Hkv={kv_heads}", file=sys.stderr, flush=True)
    add_ratios(rows)
    print(f"\n{table(rows)}\n")
    print(
        "Useful FLOPs: causal fwd = 2*sum(L_i^2)*H*D, bwd = 2.5x fwd; dense = 2*T^2*H*D. Ratios are of "
        "TFLOP/s."
    )
    for mix, st in mix_info.items():
        print(f"- {mix}: {st}")
    verdicts = triton_short_verdict(rows, mix_info) + triton_short_verdict(rows, mix_info, timing="synced")
    if verdicts:
        print(
            f"\ntriton_short, same run (a row is proposed only at >= {PROPOSE_MARGIN:g}x auto and the best "
            "peer); "
            "queued = calls issued back to back (steady state), synced = each call waited for:"
        )
        print("\n".join(verdict_lines(verdicts)))
    write_json(
        args.out,
        {
            "machine": machine_info(device),
            "args": vars(args),
            "mixes": mix_info,
            "rows": rows,
            "triton_short": verdicts,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
