"""Shared argument handling of the SSD (Mamba-2 selective state space) implementations (naive, chunk).

Shapes (docs/ARCHITECTURE.md's letters; ``S`` is the state size, ``G`` the groups of ``B``/``C``, ``P`` the
head dim)::

    x:        [B, T, H, P]     the scanned input (Mamba-2's "x", after the short conv)
    dt:       [B, T, H]        time step, before dt_bias / softplus / dt_limit
    A:        [H]              continuous decay (negative: -exp(A_log))
    B, C:     [B, T, G, S]     input and output projections of the state; H a multiple of G
    D:        [H]              skip connection
    state:    [N, H, P, S]     N = samples (with cu_seqlens) or rows (without)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from varpack.varlen.boundaries import checked_host_cu_seqlens, normalize_cu_seqlens

__all__ = ["acc_dtype", "check_inputs", "discretize_dt", "expand_groups", "normalize_dt_limit"]


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 when ``x`` is fp64 (for gradient checks)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def normalize_dt_limit(dt_limit: Any) -> tuple[float, float]:
    """``(low, high)`` floats of a ``dt_limit`` / Mamba-2 ``time_step_limit``.

    Raises:
        ValueError: not a pair of numbers with ``0 <= low <= high`` (``high`` may be ``inf``).
    """
    try:
        low, high = (float(v) for v in dt_limit)
    except (TypeError, ValueError):
        raise ValueError(f"dt_limit must be a pair (low, high) of numbers, got {dt_limit!r}") from None
    if not (0.0 <= low <= high) or math.isnan(high):
        raise ValueError(f"dt_limit must satisfy 0 <= low <= high, got {dt_limit!r}")
    return low, high


def discretize_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """The time step the scan uses, in ``dt``'s dtype: ``clamp(softplus(dt + dt_bias), *dt_limit)``, each step
    in the order and dtype of transformers' PyTorch ``mamba2_chunk_scan`` (the clamp always applied, as there:
    with the default ``(0, inf)`` it changes nothing)."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])


def expand_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, T, G, S]`` -> ``[B, T, H, S]``: group ``g`` serves heads ``g*r .. g*r + r - 1`` (``r = H // G``),
    ``repeat_interleave`` on the group dim as transformers and mamba_ssm (``head // (H // G)``)."""
    groups = t.shape[2]
    return t if groups == num_heads else t.repeat_interleave(num_heads // groups, dim=2)


def check_inputs(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    cu_seqlens: Any,
    seq_idx: Any,
) -> tuple[int, int, int, int, int, int, torch.Tensor | None, torch.Tensor | None]:
    """Validate shapes and boundaries.

    Returns:
        ``(B, T, H, P, G, S, cu_seqlens, seq_idx)``: ``cu_seqlens`` as an integer tensor (or ``None``),
        ``seq_idx`` as a ``[B, T]`` integer tensor on ``x``'s device (or ``None``).

    Raises:
        ValueError: a shape mismatch, ``H`` not a multiple of ``G``, ``cu_seqlens`` with ``B > 1`` or not
            describing ``T`` tokens (start 0, never decreasing, end ``T``), ``seq_idx`` not ``[B, T]`` /
            ``[T]``.
        TypeError: non-tensor or non-floating inputs, integer-valued boundaries of another type
            (:func:`varpack.varlen.normalize_cu_seqlens`), a floating / bool ``seq_idx``.
    """
    for name, t, nd in (("x", x, 4), ("dt", dt, 3), ("A", A, 1), ("B", B, 4), ("C", C, 4)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != nd:
            raise ValueError(f"{name} must be {nd}-D, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got dtype {t.dtype}")
    Bsz, T, H, P = x.shape
    G, S = B.shape[2], B.shape[3]
    if tuple(dt.shape) != (Bsz, T, H):
        raise ValueError(f"dt must be [B={Bsz}, T={T}, H={H}], got {tuple(dt.shape)}")
    if tuple(A.shape) != (H,):
        raise ValueError(f"A must be [H={H}], got {tuple(A.shape)}")
    if B.shape[:2] != (Bsz, T) or C.shape != B.shape:
        raise ValueError(
            f"B and C must both be [B={Bsz}, T={T}, G, S], got B {tuple(B.shape)}, C {tuple(C.shape)}"
        )
    if G == 0 or H % G != 0:
        raise ValueError(f"the heads H={H} must be a multiple of the groups G={G} of B and C")
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None and tuple(t.shape) != (H,):
            raise ValueError(f"{name} must be [H={H}], got {tuple(t.shape)}")
    if cu_seqlens is not None:
        cu_seqlens = normalize_cu_seqlens(cu_seqlens, "cu_seqlens")
        if Bsz != 1:
            raise ValueError(
                f"with cu_seqlens the batch dimension must be 1 (a packed row), got B={Bsz}; flatten the "
                "batch to [1, B*T, ...] and describe the samples with cu_seqlens"
            )
        if cu_seqlens.device.type == "cpu":  # device offsets are not read (no host sync)
            checked_host_cu_seqlens(cu_seqlens, T)
    if seq_idx is not None:
        if not isinstance(seq_idx, torch.Tensor):
            seq_idx = torch.as_tensor(seq_idx)
        if seq_idx.dtype.is_floating_point or seq_idx.dtype == torch.bool or seq_idx.is_complex():
            raise TypeError(f"seq_idx must be an integer tensor, got dtype {seq_idx.dtype}")
        if seq_idx.dim() == 1:
            seq_idx = seq_idx[None]
        if seq_idx.dim() != 2 or seq_idx.shape[1] != T or seq_idx.shape[0] not in (1, Bsz):
            raise ValueError(f"seq_idx must be [B={Bsz}, T={T}] or [T], got shape {tuple(seq_idx.shape)}")
        seq_idx = seq_idx.to(x.device).expand(Bsz, T)
    return Bsz, T, H, P, G, S, cu_seqlens, seq_idx
