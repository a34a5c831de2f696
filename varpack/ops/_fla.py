"""flash-linear-attention (``fla``, Triton) as an optional fast path: import, probe once, respect refusals.

fla's kernels need a CUDA device and a Triton that fla trusts on it. fla itself refuses some
combinations, e.g. fla 0.6.0 on Hopper with Triton >= 3.4, < 3.7.1 runs the gated delta rule forward but
raises in the backward ("... produces incorrect results for gated chunk_bwd_dqkwg ..."). So the probe
runs a tiny packed problem through fla's forward AND backward (gated delta rule and causal conv) on the
device, compares with varpack's own chunked path, and records ``(ok, reason)`` for each; callers pick
fla only for what passed. Set ``VARPACK_DISABLE_FLA=1`` to never use fla.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

__all__ = ["FlaStatus", "fla_causal_conv1d", "fla_chunk_gated_delta_rule", "fla_status", "load_fla"]

_LOCK = threading.Lock()
_STATUS: dict[str, FlaStatus] = {}
_PROBE_TOL = 0.05  # relative max error allowed vs the fp32 reference (bf16 kernels)


@dataclass(frozen=True)
class FlaStatus:
    """What fla can do on one device: ``(ok, reason)`` per capability."""

    forward: tuple[bool, str]
    backward: tuple[bool, str]
    conv_forward: tuple[bool, str]
    conv_backward: tuple[bool, str]


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def _probe(device: torch.device) -> FlaStatus:
    rule, conv, reason = load_fla()
    if device.type != "cuda":
        no = (False, f"fla needs a CUDA device, got {device}")
        return FlaStatus(no, no, no, no)
    if rule is None:
        no = (False, reason)
        return FlaStatus(no, no, no, no)
    from .gated_delta_rule.chunk import chunk_gated_delta_rule
    from .short_conv import short_conv

    gen = torch.Generator(device="cpu").manual_seed(0)
    lens = [67, 1, 130]
    T, Hk, H, K, V = sum(lens), 1, 2, 64, 64
    cu_cpu = torch.tensor([0, 67, 68, 198], dtype=torch.int64)
    cu = cu_cpu.to(device)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    q, k, v = rnd(1, T, Hk, K), rnd(1, T, Hk, K), rnd(1, T, H, V)
    g = torch.nn.functional.logsigmoid(rnd(1, T, H).float()).to(torch.bfloat16)
    beta = torch.rand(1, T, H, generator=gen).to(device=device, dtype=torch.bfloat16)
    do = rnd(1, T, H, V)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    ref_leaves = [x.detach().float().requires_grad_() for x in (q, k, v, g, beta)]
    ref_o, _ = chunk_gated_delta_rule(*ref_leaves, cu_seqlens=cu_cpu, use_qk_l2norm_in_kernel=True)
    ref_grads = torch.autograd.grad((ref_o * do.float()).sum(), ref_leaves)

    fwd = bwd = (False, "not run")
    try:
        o, _ = rule(*leaves, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, use_qk_l2norm_in_kernel=True)
        err = _rel_err(o, ref_o)
        fwd = (
            (True, "ok")
            if err < _PROBE_TOL
            else (False, f"fla forward disagrees with the reference (rel err {err:.3g})")
        )
        if fwd[0]:
            try:
                grads = torch.autograd.grad((o.float() * do.float()).sum(), leaves)
                errs = [_rel_err(a, b) for a, b in zip(grads, ref_grads)]
                bad = max(errs)
                bwd = (
                    (True, "ok")
                    if bad < _PROBE_TOL
                    else (False, f"fla backward disagrees with the reference (rel err {bad:.3g})")
                )
            except Exception as exc:  # fla's own refusal, e.g. the Triton/Hopper check
                bwd = (False, f"fla backward refused: {_first_line(exc)}")
        else:
            bwd = (False, "forward unusable")
    except Exception as exc:
        fwd = (False, f"fla forward failed: {_first_line(exc)}")
        bwd = (False, "forward unusable")

    cfwd = cbwd = (False, "fla causal_conv1d not found")
    if conv is not None:
        D = 64
        x = rnd(1, T, D).requires_grad_()
        w = (0.5 * rnd(D, 4)).requires_grad_()
        x_ref, w_ref = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
        y_ref = short_conv(x_ref, w_ref, None, "silu", cu_seqlens=cu_cpu)
        dy = rnd(1, T, D)
        ref_g = torch.autograd.grad((y_ref * dy.float()).sum(), [x_ref, w_ref])
        try:
            y = conv(x, w, None, activation="silu", cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
            y = y[0] if isinstance(y, tuple) else y
            err = _rel_err(y, y_ref)
            cfwd = (
                (True, "ok")
                if err < _PROBE_TOL
                else (False, f"fla conv disagrees with the reference (rel err {err:.3g})")
            )
            if cfwd[0]:
                try:
                    gx = torch.autograd.grad((y.float() * dy.float()).sum(), [x, w])
                    bad = max(_rel_err(a, b) for a, b in zip(gx, ref_g))
                    cbwd = (
                        (True, "ok")
                        if bad < _PROBE_TOL
                        else (False, f"fla conv backward disagrees (rel err {bad:.3g})")
                    )
                except Exception as exc:
                    cbwd = (False, f"fla conv backward refused: {_first_line(exc)}")
            else:
                cbwd = (False, "conv forward unusable")
        except Exception as exc:
            cfwd = (False, f"fla conv failed: {_first_line(exc)}")
            cbwd = (False, "conv forward unusable")
    return FlaStatus(fwd, bwd, cfwd, cbwd)


def fla_status(device: torch.device | str | None = None) -> FlaStatus:
    """Probe fla once per device (cached): forward/backward of the gated delta rule and the causal conv.

    The first call on a CUDA device runs a tiny problem there (a few milliseconds plus Triton compiles).
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    with _LOCK:
        if key not in _STATUS:
            _STATUS[key] = _probe(device)
        return _STATUS[key]


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


def fla_causal_conv1d(x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu):
    """Call fla's ``causal_conv1d`` (``x [B, T, D]``, ``weight [D, W]``) with ``cu_seqlens``."""
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
    y = conv(x, weight, bias, activation=activation, **kwargs)
    return y[0] if isinstance(y, tuple) else y
