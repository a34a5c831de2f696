"""Shared argument handling of the gated delta rule implementations (naive, chunk, fla).

Shapes (one letter vocabulary of docs/ARCHITECTURE.md):
    q, k:     [B, T, Hk, K]
    v:        [B, T, H, V]      H = num_v_heads, a multiple of Hk (grouped value heads)
    g, beta:  [B, T, H]         g is the log decay (<= 0), beta the write strength
    cu_seqlens: [N+1]           with cu_seqlens, B must be 1 and the N sequences are packed along T
    initial_state / final state: [N, H, K, V] (N = B without cu_seqlens)
"""

from __future__ import annotations

from typing import Any

import torch

from varpack.varlen.boundaries import checked_host_cu_seqlens, normalize_cu_seqlens

__all__ = [
    "acc_dtype",
    "check_inputs",
    "cu_seqlens_to_cpu",
    "expand_heads",
    "l2norm",
    "normalize_optional_cu",
]


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 when the inputs are fp64 (for gradient checks)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim: fla's ``l2norm`` and transformers' ``l2norm``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def expand_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Grouped value heads: q/k head ``i`` serves value heads ``i*r .. i*r + r - 1`` (``r = H // Hk``).

    This is ``repeat_interleave`` on the head dim, as in transformers' ``torch_chunk_gated_delta_rule`` and
    fla (``i_h = i_hv // (HV // H)``).
    """
    hk = x.shape[-2]
    if hk == num_heads:
        return x
    return x.repeat_interleave(num_heads // hk, dim=-2)


def cu_seqlens_to_cpu(cu_seqlens: Any) -> torch.Tensor:
    """A CPU int64 copy of ``cu_seqlens`` (one device->host copy, hence one sync, if it lives on a device).

    Types and shape as :func:`varpack.varlen.normalize_cu_seqlens` (a list / NumPy array of integers is
    accepted; floats, bools and non-1-D input raise naming ``cu_seqlens``).
    """
    return normalize_cu_seqlens(cu_seqlens, "cu_seqlens").detach().to("cpu", torch.int64)


def normalize_optional_cu(cu_seqlens: Any, name: str = "cu_seqlens") -> torch.Tensor | None:
    """``None`` or :func:`varpack.varlen.normalize_cu_seqlens` of ``cu_seqlens`` (the ops' entry check)."""
    return None if cu_seqlens is None else normalize_cu_seqlens(cu_seqlens, name)


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[int, int, int, int, int, int]:
    """Validate shapes; return ``(B, T, Hk, H, K, V)``.

    Raises:
        ValueError: a shape mismatch, ``B > 1`` together with ``cu_seqlens``, ``H`` not a multiple of
            ``Hk``, an ``initial_state`` of the wrong shape, or ``cu_seqlens`` that does not describe the
            ``T`` tokens (must start at 0, never decrease, end at ``T``).
        TypeError: non floating inputs or ``cu_seqlens`` that are not integers
            (:func:`varpack.varlen.normalize_cu_seqlens`).
    """
    for name, x, nd in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != nd:
            raise ValueError(f"{name} must be {nd}-D, got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")
    B, T, Hk, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"q and k must have the same shape, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B={B}, T={T}, H, V], got {tuple(v.shape)}")
    H, V = v.shape[2], v.shape[3]
    if H % Hk != 0:
        raise ValueError(f"num_v_heads H={H} must be a multiple of num_k_heads Hk={Hk} (grouped value heads)")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (B, T, H):
            raise ValueError(f"{name} must be [B={B}, T={T}, H={H}], got {tuple(x.shape)}")
    if cu_seqlens is not None:
        cu_seqlens = normalize_cu_seqlens(cu_seqlens, "cu_seqlens")
        if B != 1:
            raise ValueError(
                f"with cu_seqlens the batch dimension must be 1 (a packed row), got B={B}; flatten the batch "
                f"to [1, B*T, ...] and describe the sequences with cu_seqlens"
            )
        if cu_seqlens.device.type == "cpu":  # device offsets are not read (no host sync)
            checked_host_cu_seqlens(cu_seqlens, T)
        N = cu_seqlens.numel() - 1
    else:
        N = B
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        raise ValueError(
            f"initial_state must be [N={N}, H={H}, K={K}, V={V}], got {tuple(initial_state.shape)}"
        )
    return B, T, Hk, H, K, V
