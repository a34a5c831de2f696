"""The SSD (Mamba-2 selective state space) scan, token by token: the truth every faster path is tested
against.

Recurrence (Dao & Gu, "Transformers are SSMs", ICML 2024, the Mamba-2 layer; the update of mamba_ssm's
``selective_state_update`` and transformers' ``mamba2_selective_state_update``), per head ``h`` with the state
``S_h`` of shape ``[P, S]`` and the time step ``dt_t`` already discretized (``dt_bias``, softplus,
``dt_limit``)::

    S_h <- exp(dt_t[h] * A[h]) * S_h + dt_t[h] * x_t[h] B_t[g(h)]^T     # decay, then write
    y_t[h] = S_h C_t[g(h)] + D[h] * x_t[h]                               # read, skip connection

``g(h) = h // (H // G)``. With ``cu_seqlens`` the state restarts from zero at every sample start: nothing
crosses a boundary.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from varpack.varlen.boundaries import normalize_cu_seqlens

from ._common import acc_dtype, check_inputs, discretize_dt, expand_groups, normalize_dt_limit

__all__ = ["naive_recurrent_ssd_scan"]


def naive_recurrent_ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: Any = (0.0, math.inf),
    cu_seqlens: Any = None,
    return_final_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SSD scan computed token by token (slow; the reference).

    Args:
        x: ``[B, T, H, P]`` input.
        dt: ``[B, T, H]`` raw time step.
        A: ``[H]`` decay rate (negative).
        B: ``[B, T, G, S]`` write projection; ``C``: ``[B, T, G, S]`` read projection (``H % G == 0``).
        D: ``[H]`` skip weight, or ``None``.
        dt_bias: ``[H]`` added to ``dt`` first, or ``None``.
        dt_softplus: apply softplus to ``dt + dt_bias``.
        dt_limit: ``(low, high)`` clamp of the time step (Mamba-2's ``time_step_limit``).
        cu_seqlens: ``[N+1]`` offsets of the samples packed along ``T`` (``B == 1``; zero-length samples
            allowed), a CPU tensor or a list / NumPy array of integers; ``None``: each row is one sample.
        return_final_states: also return the state after each sample's last token (zero for an empty one).

    Returns:
        ``(y, final_states)``: ``y`` ``[B, T, H, P]`` in fp32 (fp64 for fp64 ``x``), as transformers' PyTorch
        path returns it; ``final_states`` ``[N, H, P, S]`` in the same dtype, or ``None``.

    Raises:
        ValueError / TypeError: as :func:`varpack.ops.ssd._common.check_inputs`, or a bad ``dt_limit``.
    """
    limit = normalize_dt_limit(dt_limit)
    Bsz, T, H, P, G, S, cu, _ = check_inputs(x, dt, A, B, C, D, dt_bias, cu_seqlens, None)
    if cu is not None:
        offsets = normalize_cu_seqlens(cu, "cu_seqlens").to("cpu").tolist()
        rows = [(0, offsets[n], offsets[n + 1]) for n in range(len(offsets) - 1)]
    else:
        rows = [(b, 0, T) for b in range(Bsz)]
    acc = acc_dtype(x)
    step = discretize_dt(dt, dt_bias, dt_softplus, limit).to(acc)
    xs = x.to(acc)
    Bh = expand_groups(B.to(acc), H)
    Ch = expand_groups(C.to(acc), H)
    decay = (step * A.to(acc)).exp()  # [B, T, H]
    skip = None if D is None else D.to(acc)[:, None] * xs  # [B, T, H, P]

    # per-token views from one unbind per tensor and row (their backward is one stack, not a gradient of the
    # whole tensor per token)
    x_tok, dt_tok, b_tok, c_tok, a_tok = (
        [r.unbind(0) for r in t.unbind(0)] for t in (xs, step, Bh, Ch, decay)
    )
    outputs: list[torch.Tensor] = []
    finals: list[torch.Tensor] = []
    for b, start, stop in rows:
        state = xs.new_zeros(H, P, S)
        for t in range(start, stop):
            write = (dt_tok[b][t][:, None] * x_tok[b][t])[:, :, None] * b_tok[b][t][:, None, :]  # [H, P, S]
            state = a_tok[b][t][:, None, None] * state + write
            outputs.append(torch.einsum("hps,hs->hp", state, c_tok[b][t]))
        finals.append(state)
    y = torch.stack(outputs, 0).reshape(Bsz, T, H, P) if outputs else xs.new_zeros(Bsz, T, H, P)
    if skip is not None:
        y = y + skip
    return y, (torch.stack(finals, 0) if return_final_states else None)
