"""The gated delta rule, token by token: the truth that every faster path is tested against.

Recurrence (Yang, Kautz & Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025;
the same update as fla's ``naive_recurrent_gated_delta_rule`` and transformers'
``torch_recurrent_gated_delta_rule``), per head, with the state ``S`` of shape ``[K, V]``::

    S   <- exp(g_t) * S                          # gate (decay), g_t <= 0 in log space
    S   <- S + k_t (beta_t * (v_t - k_t^T S))^T  # delta rule: write the correction of v_t
    o_t  = (scale * q_t)^T S

With ``cu_seqlens`` the state restarts at every boundary: from zero, or from ``initial_state[n]`` for
sequence ``n``. No state, and nothing else, crosses a boundary.
"""

from __future__ import annotations

import torch

from ._common import acc_dtype, check_inputs, cu_seqlens_to_cpu, expand_heads, l2norm, normalize_optional_cu

__all__ = ["naive_recurrent_gated_delta_rule"]


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule computed token by token in fp32 (slow; the reference).

    Same arguments and results as fla's ``chunk_gated_delta_rule`` (flash-linear-attention,
    ``fla/ops/gated_delta_rule/chunk.py``); a Python loop over sequences and tokens.

    Args:
        q: ``[B, T, Hk, K]`` queries.
        k: ``[B, T, Hk, K]`` keys.
        v: ``[B, T, H, V]`` values; ``H`` a multiple of ``Hk`` (each q/k head serves ``H // Hk``
            consecutive value heads).
        g: ``[B, T, H]`` log decay (the state is multiplied by ``exp(g)`` before each write).
        beta: ``[B, T, H]`` write strength.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` state at the start of each sequence (zero when ``None``).
        output_final_state: also return the ``[N, H, K, V]`` fp32 state after each sequence's last token.
        cu_seqlens: ``[N+1]`` int32/int64 cumulative lengths of the sequences packed along ``T``
            (requires ``B == 1``); a list / NumPy array of integers is converted once
            (:func:`varpack.varlen.normalize_cu_seqlens`). Zero-length sequences are allowed (their final state is their
            initial state). ``None``: every batch row is one sequence (``N = B``).
        use_qk_l2norm_in_kernel: L2-normalise q and k over ``K`` first (eps 1e-6, as fla).

    Returns:
        ``(o, final_state)``: ``o`` is ``[B, T, H, V]`` in ``q.dtype``; ``final_state`` is
        ``[N, H, K, V]`` fp32 (fp64 for fp64 inputs) or ``None``.

    Raises:
        ValueError: shape mismatches, ``B > 1`` with ``cu_seqlens``, invalid ``cu_seqlens``,
            a wrong ``initial_state`` shape.
        TypeError: non-tensor or integer inputs.
    """
    cu_seqlens = normalize_optional_cu(cu_seqlens)
    B, T, Hk, H, K, V = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if cu_seqlens is not None:
        cu = cu_seqlens_to_cpu(cu_seqlens).tolist()
    else:
        cu = None
    out_dtype = q.dtype
    if scale is None:
        scale = K**-0.5

    acc = acc_dtype(q)
    q, k, v, g, beta = (x.to(acc) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = expand_heads(q, H) * scale
    k = expand_heads(k, H)

    if cu is None:  # B rows, each one sequence: the same loop over N = B rows of one token stream each
        rows = [(b, 0, T) for b in range(B)]
    else:
        rows = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]

    # per-token views from one unbind per tensor (and per row): their backward is one stack, O(T); indexing
    # x[b, t] per token would add a zero-filled gradient of the whole tensor per token, O(T^2)
    q_tok, k_tok, v_tok, g_tok, beta_tok = (
        [row.unbind(0) for row in x.unbind(0)] for x in (q, k, v, g, beta)
    )
    h0 = initial_state.unbind(0) if initial_state is not None else None
    outputs: list[torch.Tensor] = []
    finals: list[torch.Tensor] = []
    for n, (b, start, stop) in enumerate(rows):
        if h0 is not None:
            S = h0[n].to(acc)
        else:
            S = q.new_zeros(H, K, V)
        for t in range(start, stop):
            S = S * g_tok[b][t].exp()[:, None, None]
            kt = k_tok[b][t]  # [H, K]
            delta = beta_tok[b][t][:, None] * (v_tok[b][t] - torch.einsum("hk,hkv->hv", kt, S))
            S = S + kt[:, :, None] * delta[:, None, :]
            outputs.append(torch.einsum("hk,hkv->hv", q_tok[b][t], S))
        finals.append(S)

    if outputs:
        o = torch.stack(outputs, dim=0).reshape(B, T, H, V)
    else:  # no token: an empty output that still belongs to the inputs' graph
        o = v.reshape(B, T, H, V) * 0
    final_state = torch.stack(finals, dim=0) if output_final_state else None
    return o.to(out_dtype), final_state
