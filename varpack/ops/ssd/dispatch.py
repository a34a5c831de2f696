"""Backend selection for the SSD (Mamba-2) scan: mamba_ssm's Triton kernels when they can run, else varpack's.

Backends (``name -> what``):

* ``"mamba_ssm"``: mamba_ssm's ``mamba_chunk_scan_combined(..., seq_idx=...)`` (state-spaces/mamba,
  ``mamba_ssm/ops/triton/ssd_combined.py``), CUDA only, used when importable and its probe (a tiny packed
  problem, forward and backward, against ``chunk`` in fp32) passes. Never required: varpack does not
  depend on it.
* ``"chunk"``: :func:`varpack.ops.ssd.chunk_ssd_scan`, PyTorch, vectorized over the samples; any device.
* ``"naive"``: :func:`varpack.ops.ssd.naive_recurrent_ssd_scan`, token by token (the truth; slow).

``"auto"``: ``mamba_ssm`` on CUDA where its probe passed (forward, and backward when gradients are needed),
else ``chunk``. A forced backend that cannot run raises with the reason; nothing falls back silently from a
forced choice. Set ``VARPACK_DISABLE_MAMBA_SSM=1`` to never use mamba_ssm.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from varpack._probe import ProbeOnce

from .._fla import PROBE_TOL, bf16_randn, first_line, fla_device, probe_key, probe_problem, rel_err
from ._common import normalize_dt_limit
from .chunk import SSDLayout, chunk_ssd_scan
from .naive import naive_recurrent_ssd_scan

__all__ = ["BACKENDS", "load_mamba_ssm", "mamba_ssm_status", "resolve_ssd_backend", "ssd_scan"]

BACKENDS = ("mamba_ssm", "chunk", "naive")

Capability = tuple[bool, str]


def load_mamba_ssm() -> tuple[Any, str]:
    """``(mamba_chunk_scan_combined, "ok")``, or ``(None, reason)`` when mamba_ssm is absent or disabled."""
    if os.environ.get("VARPACK_DISABLE_MAMBA_SSM", "") not in ("", "0"):
        return None, "disabled by VARPACK_DISABLE_MAMBA_SSM"
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as exc:  # ImportError, or a broken install (no triton, a CUDA mismatch)
        return None, f"mamba_ssm not importable ({first_line(exc)})"
    return mamba_chunk_scan_combined, "ok"


def _mamba_ssm_scan(x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, dt_limit, seq_idx) -> torch.Tensor:
    fn, reason = load_mamba_ssm()
    if fn is None:
        raise RuntimeError(f"SSD backend 'mamba_ssm' unavailable: {reason}")
    out = fn(
        x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, seq_idx=seq_idx,
        dt_softplus=dt_softplus, dt_limit=dt_limit,
    )  # fmt: skip
    return out[0] if isinstance(out, tuple) else out


def _probe_mamba_ssm(device: torch.device) -> tuple[Capability, Capability]:
    """mamba_ssm's scan forward and backward on a tiny packed bf16 problem (198 tokens in samples of 67, 1
    and 130; chunk 64, so chunks straddle the boundaries) vs :func:`chunk_ssd_scan` in fp32:
    ``((ok, reason) forward, (ok, reason) backward)``."""
    if device.type != "cuda":
        no = (False, f"mamba_ssm needs a CUDA device, got {device}")
        return no, no
    fn, reason = load_mamba_ssm()
    if fn is None:
        return (False, reason), (False, reason)
    gen, T, cu_cpu, _ = probe_problem(device)
    H, P, G, S = 4, 16, 2, 16
    x = bf16_randn(gen, device, 1, T, H, P).requires_grad_()
    dt = bf16_randn(gen, device, 1, T, H).requires_grad_()
    B = bf16_randn(gen, device, 1, T, G, S).requires_grad_()
    C = bf16_randn(gen, device, 1, T, G, S).requires_grad_()
    A = -torch.linspace(0.5, 2.0, H, device=device)
    D = torch.ones(H, device=device)
    dt_bias = torch.zeros(H, device=device)
    inputs = (x, dt, B, C)
    refs = [t.detach().float().requires_grad_() for t in inputs]
    y_ref, _ = chunk_ssd_scan(
        refs[0], refs[1], A, refs[2], refs[3], chunk_size=64, D=D, dt_bias=dt_bias, dt_softplus=True,
        cu_seqlens=cu_cpu,
    )  # fmt: skip
    dy = bf16_randn(gen, device, 1, T, H, P)
    ref_grads = torch.autograd.grad((y_ref * dy.float()).sum(), refs)
    seq_idx = torch.repeat_interleave(torch.arange(cu_cpu.numel() - 1, dtype=torch.int32), cu_cpu.diff())[
        None
    ].to(device)
    try:
        y = _mamba_ssm_scan(x, dt, A, B, C, 64, D, dt_bias, True, (0.0, math.inf), seq_idx)
    except Exception as exc:
        return (False, f"mamba_ssm scan failed: {first_line(exc)}"), (False, "forward unusable")
    err = rel_err(y, y_ref)
    if err >= PROBE_TOL:
        return (False, f"mamba_ssm disagrees with the chunk path (rel err {err:.3g})"), (
            False,
            "forward unusable",
        )
    try:
        grads = torch.autograd.grad((y.float() * dy.float()).sum(), inputs)
    except Exception as exc:
        return (True, "ok"), (False, f"mamba_ssm backward failed: {first_line(exc)}")
    bad = max(rel_err(a, b) for a, b in zip(grads, ref_grads))
    if bad >= PROBE_TOL:
        return (True, "ok"), (False, f"mamba_ssm backward disagrees (rel err {bad:.3g})")
    return (True, "ok"), (True, "ok")


_MAMBA_SSM_PROBE = ProbeOnce(_probe_mamba_ssm, key=probe_key, name="mamba_ssm ssd scan")


def mamba_ssm_status(device: torch.device | str | None = None) -> tuple[Capability, Capability]:
    """``((ok, reason) forward, (ok, reason) backward)`` of mamba_ssm's scan on ``device`` (default: CUDA if
    available, else CPU), probed once per device (:class:`varpack._probe.ProbeOnce`)."""
    return _MAMBA_SSM_PROBE(fla_device(device))


def resolve_ssd_backend(backend: str, device: torch.device | str, *, needs_grad: bool = True) -> str:
    """The backend a call runs: a forced name (checked), or ``auto``'s pick (module docstring).

    Raises:
        ValueError: an unknown backend name.
        RuntimeError: ``"mamba_ssm"`` forced where it cannot run, with the probe's reason.
    """
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown SSD backend {backend!r}; expected 'auto' or one of {BACKENDS}")
    device = torch.device(device)
    if backend in ("chunk", "naive"):
        return backend
    if backend == "auto" and device.type != "cuda":
        return "chunk"
    forward, backward = mamba_ssm_status(device)
    ok, reason = forward
    if ok and needs_grad:
        ok, reason = backward
    if ok:
        return "mamba_ssm"
    if backend == "auto":
        return "chunk"
    raise RuntimeError(f"SSD backend 'mamba_ssm' cannot run on {device}: {reason}")


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int = 256,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: Any = (0.0, math.inf),
    cu_seqlens: Any = None,
    seq_idx: torch.Tensor | None = None,
    layout: SSDLayout | None = None,
    return_final_states: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The SSD (Mamba-2) scan with the state reset at every sample boundary, on the chosen backend.

    Arguments and results as :func:`chunk_ssd_scan` (``x [B, T, H, P]``, ``dt [B, T, H]``, ``A [H]``,
    ``B``/``C [B, T, G, S]``, ``D``/``dt_bias [H]``; ``y [B, T, H, P]`` fp32, final states ``[N, H, P, S]``),
    plus ``backend`` (module docstring). ``mamba_ssm`` reads ``seq_idx`` (built from ``cu_seqlens`` when only
    those are given: one host-to-device copy) and returns no final states.

    Raises:
        ValueError / TypeError: as :func:`chunk_ssd_scan`; an unknown backend; ``return_final_states`` on
            ``mamba_ssm``.
        RuntimeError: a forced ``mamba_ssm`` that cannot run here.
    """
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, dt, A, B, C, D, dt_bias)
    )
    name = resolve_ssd_backend(backend, x.device, needs_grad=needs_grad)
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    if name == "naive":
        if cu_seqlens is None and seq_idx is not None:
            raise ValueError("the naive SSD backend takes cu_seqlens (host offsets), not seq_idx")
        return naive_recurrent_ssd_scan(
            x, dt, A, B, C, cu_seqlens=cu_seqlens, return_final_states=return_final_states, **kw
        )
    if name == "chunk":
        return chunk_ssd_scan(
            x, dt, A, B, C, chunk_size=chunk_size, cu_seqlens=cu_seqlens, seq_idx=seq_idx, layout=layout,
            return_final_states=return_final_states, **kw,
        )  # fmt: skip
    if return_final_states:
        raise ValueError("the mamba_ssm SSD backend returns no final states here; use backend='chunk'")
    if seq_idx is None and cu_seqlens is not None:
        from varpack.varlen.boundaries import seq_idx_from_cu_seqlens

        seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, x.shape[1]).to(x.device, non_blocking=True)
    if seq_idx is not None:
        seq_idx = (seq_idx[None] if seq_idx.dim() == 1 else seq_idx).to(x.device, torch.int32).contiguous()
    y = _mamba_ssm_scan(
        x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, normalize_dt_limit(dt_limit), seq_idx
    )
    return y.to(torch.float64 if x.dtype == torch.float64 else torch.float32), None
