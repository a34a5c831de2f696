"""``fla_hybrid``: fla's gated delta rule kernels, with the one part fla flags as wrong here done by varpack.

fla-core 0.6.0 refuses its own gated ``chunk_bwd_dqkwg`` kernel on Hopper with Triton >= 3.4, < 3.7.1
("produces incorrect results"; github.com/fla-org/flash-linear-attention/issues/640), and with it the whole backward of
``chunk_gated_delta_rule``. Every other kernel of the forward and the backward runs there. This backend runs
fla's forward (``chunk_gated_delta_rule_fwd``) and fla's backward pipeline step by step
(``fla/ops/gated_delta_rule/chunk.py::chunk_gated_delta_rule_bwd`` of 0.6.0: recompute ``w, u``; recompute
the chunk states ``h`` and new values ``v_new``; ``chunk_bwd_dv_local``; ``chunk_gated_delta_rule_bwd_dhu``;
*dq, dk, dw, dg*; ``prepare_wy_repr_bwd``; the reverse chunk-local cumsum of ``dg``; the l2norm backward),
with the flagged step replaced by varpack's own, never fla's kernel: :func:`chunk_bwd_dqkwg_triton` on CUDA (one
Triton kernel, ``_dqkwg_kernels.py``, that never transposes a ``tl.dot`` result: the pattern Triton >= 3.4
miscompiles on Hopper in fla's kernel, fla PR #826) or :func:`chunk_bwd_dqkwg_torch` (the same quantities in
batched PyTorch: cuBLAS GEMMs and elementwise ops; any device, every precision), :func:`chunk_bwd_dqkwg`
choosing (:data:`DQKWG_IMPL`). fla's other backward kernels run as fla ships them and are verified here, not
trusted: the GPU tests compare the whole backend with the fp32 chunk path (github.com/fla-org/flash-linear-attention/issues/984 reports another
Hopper miscompile, in the *ungated* delta rule's ``prepare_wy_repr_bwd``; the gated one used here passes).

What ``chunk_bwd_dqkwg`` computes (read from fla 0.6.0 ``fla/ops/common/chunk_o.py``; written here from the
chunk equations, not copied). Per chunk of ``BT = 64`` tokens of one sequence and value head, with ``G`` the
chunk-local cumulative log decay (fla stores it in log2 units: ``exp2(g) = exp(G)``), ``S`` the state at the
chunk start (``h``), ``dS'`` the gradient of the state at the chunk end (``dh``), ``V'`` the new values
(``v_new``) and ``dV'`` their full gradient (``dv`` after ``bwd_dhu``)::

    O   = scale * (exp(G) * Q) S + scale * tril(Q K^T * exp(G_i - G_j)) V'
    S'  = exp(G_last) S + (exp(G_last - G) * K)^T V'
    V'  = U - W S
    dQ  = scale * exp(G) * (dO S^T) + dA K                   dA = scale * tril(dO V'^T * exp(G_i - G_j))
    dK  = exp(G_last - G) * (V' dS'^T) + dA^T Q
    dW  = -dV' S^T
    dG  = rowsum(dQ * Q) - rowsum(dK * K);  dG_last += exp(G_last) <S, dS'> + sum(dK_inter * K)

``dG`` is the gradient of the *cumulative* decay (natural units); fla's reverse chunk-local cumsum then gives
the gradient of ``g``. q/k heads are grouped (``i_h = i_hv // (H // Hk)``), their gradients summed per group.

Tensors (fla 0.6.0 layouts): q, k ``[1, T, Hk, K]``; v, v_new, do, dv ``[1, T, H, V]``; w ``[1, T, H, K]``;
g, beta ``[1, T, H]``; h, dh ``[1, NT, H, K, V]`` (``NT`` chunks of all sequences, sequence-major, the
order of fla's ``chunk_indices`` ``[NT, 2]`` = (sequence, chunk within it)); cu_seqlens ``[N+1]`` int64 on
the device. Without ``cu_seqlens`` the ``B`` rows are packed as ``B`` sequences of ``T`` tokens (the same
math). Devices: CUDA (fla's kernels); :func:`chunk_bwd_dqkwg_torch` itself runs on any device.
"""

from __future__ import annotations

import contextlib
import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from varpack.varlen.boundaries import checked_host_cu_seqlens, seq_idx_from_cu_seqlens

from .._fla import FLA_CHUNK_SIZE, fla_chunk_indices, fla_chunk_tables, load_fla_internals
from ._common import acc_dtype, check_inputs, cu_seqlens_to_cpu, normalize_optional_cu

__all__ = [
    "DEFAULT_PRECISION",
    "FLA_CHUNK_SIZE",
    "DqkwgPlan",
    "FlaHybridBoundaries",
    "DQKWG_IMPL",
    "DQKWG_TRITON_LAUNCH",
    "chunk_bwd_dqkwg",
    "chunk_bwd_dqkwg_torch",
    "chunk_bwd_dqkwg_triton",
    "device_fla_hybrid_boundaries",
    "dqkwg_plan",
    "fla_hybrid_backward",
    "fla_hybrid_forward",
    "fla_hybrid_gated_delta_rule",
    "fla_hybrid_residual_shapes",
    "load_hybrid",
    "prepare_fla_hybrid_boundaries",
]

RCP_LN2 = 1.0 / math.log(2.0)  # fla stores the chunk cumsum of g in log2 units (exp2 in its kernels)
PRECISIONS = ("fp32", "mixed", "input")
#: The replaced step's default precision: ``"mixed"``, fla's own kernel semantics. Measured on the H200
#: (2026-12-01, benchmarks/gated_delta.py, T = 32,768, H = 16, K = V = 128), PyTorch step: fwd + bwd 12.5 ms vs
#: 15.7 ms in ``"fp32"``, and the same errors against the fp32 chunk path in tests/ops/test_fla_hybrid.py (GPU);
#: with the Triton step fwd + bwd 5.8 ms (benchmarks/RESULTS.md#gated-delta-rule).
DEFAULT_PRECISION = "mixed"


def load_hybrid() -> tuple[dict | None, str]:
    """fla's internal kernels this backend calls (:func:`varpack.ops._fla.load_fla_internals`), or
    ``(None, reason)``."""
    return load_fla_internals()


# ----------------------------------------------------------------------------------------------------
# dq, dk, dw, dg of the chunk form in batched PyTorch (replaces fla's chunk_bwd_dqkwg)


@dataclass(frozen=True)
class _Group:
    """Chunks padded to the same length ``P`` (a power of two): their ids ``[G]``, lengths ``[G]``, and the
    tokens they hold ``[n]`` with each token's slot ``chunk_in_group * P + position`` ``[n]`` (device)."""

    P: int
    num: int
    chunk_ids: torch.Tensor | None  # None: every chunk, in order
    lengths: torch.Tensor
    tokens: torch.Tensor
    slots: torch.Tensor


@dataclass(frozen=True)
class DqkwgPlan:
    """Where every chunk and token of a packed row goes in :func:`chunk_bwd_dqkwg_torch`'s padded batches,
    built once on the CPU from ``cu_seqlens`` (:func:`dqkwg_plan`): chunks grouped by their length rounded
    up to a power of two, so rows of short sequences are not padded to 64 (memory ~ tokens, not chunks x 64).

    A *device plan* (:func:`device_fla_hybrid_boundaries`) has no groups: only the chunk table, built on the
    device with a fixed row count (padding rows of length 0), which only :func:`chunk_bwd_dqkwg_triton` reads.
    """

    total_tokens: int
    num_chunks: int
    groups: tuple[_Group, ...]
    #: every chunk's first token and length ``[NT]`` int32 on the device, fla's chunk order (the chunk table
    #: of :func:`chunk_bwd_dqkwg_triton`)
    chunk_start: torch.Tensor | None = None
    chunk_len: torch.Tensor | None = None

    @property
    def device_built(self) -> bool:
        """A device plan: chunks but no host groups (only :func:`chunk_bwd_dqkwg_triton` reads it)."""
        return self.num_chunks > 0 and not self.groups


def dqkwg_plan(
    cu_seqlens: Any,
    chunk_size: int = FLA_CHUNK_SIZE,
    device: torch.device | str | None = None,
    *,
    uniform: bool = False,
) -> DqkwgPlan:
    """The :class:`DqkwgPlan` of ``cu_seqlens`` ``[N+1]`` (CPU work, O(T); a device tensor is copied to the
    host once) in fla's chunk order (per sequence, its chunks of ``chunk_size`` tokens; the last one
    shorter), index tensors on ``device``. ``uniform``: one batch, every chunk padded to ``chunk_size``.

    Raises:
        ValueError / TypeError: invalid ``cu_seqlens`` (:func:`varpack.varlen.normalize_cu_seqlens`).
    """
    cu = cu_seqlens_to_cpu(cu_seqlens).numpy().astype(np.int64)
    lengths = np.diff(cu)
    T = int(cu[-1]) if cu.size else 0
    nch = -(-lengths // chunk_size)
    NT = int(nch.sum())
    chunk_cu = np.concatenate([[0], np.cumsum(nch)]).astype(np.int64)
    seq = seq_idx_from_cu_seqlens(chunk_cu, NT)[0].numpy().astype(np.int64)  # sequence of every chunk
    j = np.arange(NT) - chunk_cu[:-1][seq]
    start = cu[:-1][seq] + j * chunk_size
    clen = np.minimum(chunk_size, cu[1:][seq] - start)
    padded = np.left_shift(1, np.ceil(np.log2(np.maximum(clen, 1))).astype(np.int64))
    if uniform:
        padded = np.full_like(clen, chunk_size)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    groups = []
    for P in np.unique(padded)[::-1]:
        ids = np.nonzero(padded == P)[0]
        cl = clen[ids]
        tok_cu = np.concatenate([[0], np.cumsum(cl)]).astype(np.int64)
        local = seq_idx_from_cu_seqlens(tok_cu, int(tok_cu[-1]))[0].numpy().astype(np.int64)  # chunk of token
        pos = np.arange(int(tok_cu[-1])) - tok_cu[:-1][local]
        tokens = start[ids][local] + pos
        whole = ids.size == NT
        groups.append(
            _Group(
                P=int(P),
                num=int(ids.size),
                chunk_ids=None if whole else torch.from_numpy(ids).to(dev, non_blocking=True),
                lengths=torch.from_numpy(cl).to(dev, non_blocking=True),
                tokens=torch.from_numpy(tokens).to(dev, non_blocking=True),
                slots=torch.from_numpy(local * int(P) + pos).to(dev, non_blocking=True),
            )
        )
    return DqkwgPlan(
        total_tokens=T,
        num_chunks=NT,
        groups=tuple(groups),
        chunk_start=torch.from_numpy(start.astype(np.int32)).to(dev, non_blocking=True),
        chunk_len=torch.from_numpy(clen.astype(np.int32)).to(dev, non_blocking=True),
    )


def _checked_plan(q, v_new, h, dh, cu_seqlens, chunk_size, plan):
    """The dq/dk/dw/dg step's :class:`DqkwgPlan` (built from ``cu_seqlens`` when ``None``) and
    ``(T, Hk, H, K, V)``, once the tensors are checked against it (both implementations).

    Raises:
        ValueError: shapes or a ``plan`` that disagree with the tensors; ``H`` not a multiple of ``Hk``.
    """
    B, T, Hk, K = q.shape
    H, V = v_new.shape[2], v_new.shape[3]
    if plan is None:
        plan = dqkwg_plan(cu_seqlens, chunk_size, device=q.device)
    NT = plan.num_chunks
    if B != 1 or h.shape != (1, NT, H, K, V) or dh.shape != h.shape or plan.total_tokens != T or H % Hk:
        raise ValueError(
            f"expected packed q [1, T={plan.total_tokens}, Hk, K] and h/dh [1, NT={NT}, H={H}, K={K}, V={V}] "
            f"(the plan of cu_seqlens; H a multiple of Hk), got q {tuple(q.shape)}, h {tuple(h.shape)}, "
            f"dh {tuple(dh.shape)}"
        )
    return plan, (T, Hk, H, K, V)


def chunk_bwd_dqkwg_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v_new: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    dv: torch.Tensor,
    do: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor,
    *,
    chunk_size: int = FLA_CHUNK_SIZE,
    plan: DqkwgPlan | None = None,
    precision: str = DEFAULT_PRECISION,
    w_dtype: torch.dtype | None = None,
    dq_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dw, dg)`` of the gated chunk form, exactly what fla 0.6.0's ``chunk_bwd_dqkwg`` returns
    (module docstring), in batched PyTorch over all chunks of all sequences (one batch per padded chunk
    length, :class:`DqkwgPlan`).

    Args:
        q, k: ``[1, T, Hk, K]`` (l2-normalised already if the layer asks for it).
        v_new: ``[1, T, H, V]`` new values ``U - W S``; do, dv: ``[1, T, H, V]`` output gradient and the
            full gradient of ``v_new``.
        g: ``[1, T, H]`` fp32 chunk-local cumsum of the log decay in **log2 units** (fla's convention).
        h, dh: ``[1, NT, H, K, V]`` state at each chunk start and gradient of the state at its end, chunks in
            fla's order (``chunk_indices``: per sequence, its chunks).
        scale: query scale.
        cu_seqlens: ``[N+1]`` boundaries (only read, on the host, when ``plan`` is ``None``).
        chunk_size: fla's chunk length (64).
        plan: :func:`dqkwg_plan` of ``cu_seqlens`` (built here when ``None``: one host copy of a device
            ``cu_seqlens``).
        precision: ``"fp32"``: GEMMs on fp32 copies (fp32 accumulation and outputs); ``"mixed"``: GEMM
            operands in ``h``'s dtype, fp32 accumulation and outputs (``torch.bmm(..., out_dtype=float32)`` on
            CUDA, fp32 copies elsewhere: the same values), the semantics of fla's kernel (bf16 ``tl.dot``
            operands, its ``dA`` cast to bf16 too); ``"input"``: GEMMs in ``h``'s dtype with outputs rounded
            to it (fastest, least exact). Equal for fp32 / fp64 states.
        w_dtype: dtype of ``dw`` (fla's ``prepare_wy_repr_bwd`` needs ``w``'s dtype); default ``h``'s.
        dq_dtype: dtype of ``dq`` (rounded once from the fp32 sum, for a caller with nothing left to add to it:
            the rule without its l2norm); default fp32.

    Returns:
        ``dq``, ``dk`` ``[1, T, Hk, K]`` fp32 (``dq`` in ``dq_dtype`` when given); ``dw`` ``[1, T, H, K]`` in ``w_dtype``; ``dg`` ``[1, T, H]``
        fp32 (gradient of the natural-unit chunk cumsum, before fla's reverse cumsum). fp64 for fp64 ``h``.

    Raises:
        ValueError: ``precision`` unknown, shapes or a ``plan`` that disagree with the tensors, a device plan
            (no host groups: :func:`chunk_bwd_dqkwg_triton` runs it).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    plan, (T, Hk, H, K, V) = _checked_plan(q, v_new, h, dh, cu_seqlens, chunk_size, plan)
    if plan.device_built:
        raise ValueError(
            "chunk_bwd_dqkwg_torch needs a host-built plan (dqkwg_plan); a device plan "
            "(device_fla_hybrid_boundaries: a fixed-size chunk table, no host groups) runs chunk_bwd_dqkwg_triton"
        )
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    mm = acc if precision == "fp32" else h.dtype
    out_acc = precision == "mixed" and mm != acc  # GEMM outputs in acc from low-precision operands
    w_dtype = w_dtype or h.dtype
    dq = q.new_empty((T, Hk, K), dtype=acc)
    dk = q.new_empty((T, Hk, K), dtype=acc)
    dw = q.new_empty((T, H, K), dtype=w_dtype)
    dg = q.new_empty((T, H), dtype=acc)
    flat = [x[0] for x in (q, k, v_new, do, dv, g)]
    for grp in plan.groups:
        hs = h[0] if grp.chunk_ids is None else h[0].index_select(0, grp.chunk_ids)
        dhs = dh[0] if grp.chunk_ids is None else dh[0].index_select(0, grp.chunk_ids)
        outs = _dqkwg_group(grp, *flat, hs, dhs, scale, acc, mm, out_acc)
        for out, val in zip((dq, dk, dw, dg), outs):
            out.index_copy_(0, grp.tokens, val.to(out.dtype))
    dq = dq.to(dq_dtype) if dq_dtype is not None else dq
    return dq.unsqueeze(0), dk.unsqueeze(0), dw.unsqueeze(0), dg.unsqueeze(0)


def _matmul(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype, out_acc: bool) -> torch.Tensor:
    """``a @ b`` (equal leading dims) as ``acc``; ``out_acc``: low-precision operands, ``acc`` accumulation
    and output (``torch.bmm(out_dtype=)`` on CUDA; exact fp32 copies of the operands elsewhere)."""
    if not out_acc:
        return torch.matmul(a, b).to(acc)
    if a.device.type != "cuda":
        return torch.matmul(a.to(acc), b.to(acc))
    lead = a.shape[:-2]
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=acc)
    return out.view(*lead, a.shape[-2], b.shape[-1])


def _dqkwg_group(grp: _Group, q, k, v_new, do, dv, g, hs, dhs, scale, acc, mm, out_acc):
    """One padded batch of :func:`chunk_bwd_dqkwg_torch`: token-major ``[n, ...]`` results of its tokens."""
    G, P = grp.num, grp.P
    Hk, K = q.shape[1], q.shape[2]
    H = v_new.shape[1]
    r = H // Hk
    dev = q.device

    def chunks(x: torch.Tensor, dtype) -> torch.Tensor:  # [T, X, D] -> [G, X, P, D], zero padded
        x = x.index_select(0, grp.tokens).to(dtype)
        out = x.new_zeros((G * P, *x.shape[1:])).index_copy_(0, grp.slots, x)
        return out.view(G, P, *x.shape[1:]).transpose(1, 2).contiguous()

    def tokens(x: torch.Tensor) -> torch.Tensor:  # [G, X, P, D] -> [n, X, D]
        x = x.transpose(1, 2)
        return x.reshape(G * P, *x.shape[2:]).index_select(0, grp.slots)

    qc, kc = chunks(q, mm), chunks(k, mm)  # [G, Hk, P, K]
    vc, doc, dvc = chunks(v_new, mm), chunks(do, mm), chunks(dv, mm)  # [G, H, P, V]
    gc = chunks(g.unsqueeze(-1), acc).squeeze(-1)  # [G, H, P] log2 units, 0 in padding
    hs, dhs = hs.to(mm), dhs.to(mm)  # [G, H, K, V]

    ar = torch.arange(P, device=dev)
    valid = ar < grp.lengths[:, None]  # [G, P]
    last = grp.lengths - 1
    g_last = gc.gather(2, last.view(G, 1, 1).expand(G, H, 1))  # [G, H, 1]
    zero = torch.zeros((), dtype=acc, device=dev)

    # GEMMs against the states: [dO; dV'] S^T in one batch, V' dS'^T, <S, dS'>
    inter = _matmul(torch.cat([doc, dvc], dim=2), hs.transpose(-1, -2), acc, out_acc)  # [G, H, 2P, K]
    dq_inter, dw_neg = inter.split([P, P], dim=2)
    dk_inter = _matmul(vc, dhs.transpose(-1, -2), acc, out_acc)  # [G, H, P, K]
    hdh = _matmul(hs.flatten(2).unsqueeze(2), dhs.flatten(2).unsqueeze(3), acc, out_acc).view(G, H, 1)

    dq = dq_inter * (torch.exp2(gc) * scale).unsqueeze(-1)
    dk = dk_inter * torch.where(valid[:, None, :], torch.exp2(g_last - gc), zero).unsqueeze(-1)

    def grouped(x: torch.Tensor) -> torch.Tensor:  # [G, Hk, P, D] -> [G, H, P, D] (value head groups)
        return x if r == 1 else x.repeat_interleave(r, dim=1)

    qg, kg = grouped(qc), grouped(kc)
    qf, kf = qg.to(acc), kg.to(acc)
    dg_last = hdh * torch.exp2(g_last) + (dk * kf).sum((-1, -2)).unsqueeze(-1)  # [G, H, 1]

    causal = (ar[:, None] >= ar[None, :]) & valid[:, None, :, None] & valid[:, None, None, :]  # [G, 1, P, P]
    expo = torch.where(
        causal, gc.unsqueeze(-1) - gc.unsqueeze(-2), torch.full((), -math.inf, dtype=acc, device=dev)
    )
    ds = (_matmul(doc, vc.transpose(-1, -2), acc, out_acc) * torch.exp2(expo) * scale).to(mm)  # [G,H,P,P]
    dq = dq + _matmul(ds, kg, acc, out_acc)
    dk = dk + _matmul(ds.transpose(-1, -2), qg, acc, out_acc)

    dg = (dq * qf).sum(-1) - (dk * kf).sum(-1)  # [G, H, P]
    dg = dg + torch.where(ar[None, None, :] == last.view(G, 1, 1), dg_last, zero)

    if r > 1:
        dq = dq.view(G, Hk, r, P, K).sum(2)
        dk = dk.view(G, Hk, r, P, K).sum(2)
    return tokens(dq), tokens(dk), tokens(-dw_neg), tokens(dg.unsqueeze(-1)).squeeze(-1)


# ----------------------------------------------------------------------------------------------------
# the same step as one Triton kernel (varpack's own, _dqkwg_kernels.py), and the choice between the two

#: Which implementation runs the replaced step: ``"auto"`` (the Triton kernel on CUDA for the ``"mixed"`` and
#: ``"fp32"`` precisions, else the batched PyTorch one), ``"triton"`` or ``"torch"``. Module-level so that
#: benchmarks/gated_delta.py can time both; the backward reads it when it runs.
DQKWG_IMPLS = ("auto", "triton", "torch")
DQKWG_IMPL = "auto"
#: Launch of :func:`chunk_bwd_dqkwg_triton`: key / value block (each capped at the head dim's power of two),
#: warps, pipeline stages.
DQKWG_TRITON_LAUNCH = {"block_k": 64, "block_v": 128, "num_warps": 4, "num_stages": 2}


def _pow2(n: int) -> int:
    return max(16, 1 << (int(n) - 1).bit_length())


def chunk_bwd_dqkwg_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v_new: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    dv: torch.Tensor,
    do: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor,
    *,
    chunk_size: int = FLA_CHUNK_SIZE,
    plan: DqkwgPlan | None = None,
    precision: str = DEFAULT_PRECISION,
    w_dtype: torch.dtype | None = None,
    dq_dtype: torch.dtype | None = None,
    launch: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`chunk_bwd_dqkwg_torch`'s ``(dq, dk, dw, dg)`` from one Triton kernel
    (:mod:`varpack.ops.gated_delta_rule._dqkwg_kernels`: one program per key block, chunk and value head; it
    never transposes a ``tl.dot`` result, the miscompiled pattern of fla's own kernel on Hopper).

    Same arguments, shapes and results as :func:`chunk_bwd_dqkwg_torch` for ``precision`` ``"mixed"``
    (operands in ``h``'s dtype, fp32 accumulation; fp32 states use IEEE fp32) and ``"fp32"`` (IEEE fp32 dots);
    ``launch``: :data:`DQKWG_TRITON_LAUNCH`'s keys; ``dq_dtype``: the kernel writes ``dq`` in it (rounded
    from fp32 in the store) when the heads are not grouped. Grouped q/k heads: per-value-head ``dq, dk`` are summed
    over each group afterwards (a ``[T, H, K]`` fp32 buffer each). Devices: CUDA; the CPU under Triton's
    interpreter (``TRITON_INTERPRET=1`` before ``import triton``; how the tests run it).

    Raises:
        ValueError: ``precision`` ``"input"`` or unknown, fp64 tensors, a chunk size other than 64, shapes or a
            ``plan`` that disagree with the tensors.
        RuntimeError: a CPU tensor while Triton runs compiled (or CUDA while it runs interpreted).
    """
    from varpack._triton import import_kernels, triton_interpreted

    if precision not in ("mixed", "fp32"):
        raise ValueError(f"chunk_bwd_dqkwg_triton runs precision 'mixed' or 'fp32', got {precision!r}")
    if h.dtype == torch.float64 or q.dtype == torch.float64:
        raise ValueError("chunk_bwd_dqkwg_triton has no fp64 path (use chunk_bwd_dqkwg_torch)")
    if chunk_size != FLA_CHUNK_SIZE:
        raise ValueError(
            f"chunk_bwd_dqkwg_triton is built for fla's chunk of {FLA_CHUNK_SIZE}, got {chunk_size}"
        )
    interpreted = triton_interpreted()
    if (q.device.type == "cuda") == interpreted:
        mode = "interpreted" if interpreted else "compiled"
        raise RuntimeError(f"chunk_bwd_dqkwg_triton: tensors on {q.device} while Triton runs {mode}")
    plan, (T, Hk, H, K, V) = _checked_plan(q, v_new, h, dh, cu_seqlens, chunk_size, plan)
    NT = plan.num_chunks
    kern = import_kernels("varpack.ops.gated_delta_rule._dqkwg_kernels")
    cfg = {**DQKWG_TRITON_LAUNCH, **(launch or {})}
    BK = min(int(cfg["block_k"]), _pow2(K))
    BV = min(int(cfg["block_v"]), _pow2(V))
    NK = -(-K // BK)
    ieee = precision == "fp32" or h.dtype == torch.float32
    mm = torch.float32 if ieee else h.dtype
    import triton.language as tl

    MM = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[mm]
    q3, k3 = q[0].contiguous(), k[0].contiguous()
    vn, do3, dv3 = v_new[0].contiguous(), do[0].contiguous(), dv[0].contiguous()
    g2 = g[0].contiguous().float()
    hs, dhs = h[0].contiguous(), dh[0].contiguous()
    r = H // Hk
    dq = q.new_empty((T, H, K), dtype=dq_dtype if dq_dtype is not None and r == 1 else torch.float32)
    dk = q.new_empty((T, H, K), dtype=torch.float32)
    dw = q.new_empty((T, H, K), dtype=w_dtype or h.dtype)
    dg = q.new_empty((NK, T, H), dtype=torch.float32)
    if NT:
        opts = (
            {} if interpreted else {"num_warps": int(cfg["num_warps"]), "num_stages": int(cfg["num_stages"])}
        )
        kern.chunk_bwd_dqkwg_kernel[(NT, NK, H)](
            q3, k3, vn, do3, dv3, g2, hs, dhs, plan.chunk_start, plan.chunk_len,
            dq, dk, dw, dg,
            float(scale), T,
            q3.stride(0), q3.stride(1), vn.stride(0), vn.stride(1), g2.stride(0),
            hs.stride(0), hs.stride(1), hs.stride(2), hs.stride(3),
            dq.stride(0), dq.stride(1), dw.stride(0), dw.stride(1), dg.stride(0),
            GROUP=H // Hk, KDIM=K, VDIM=V, BT=FLA_CHUNK_SIZE, BK=BK, BV=BV,
            MM=MM, IEEE=ieee, UPCAST=bool(kern.INTERPRETED) and mm != torch.float32,
            **opts,
        )  # fmt: skip
    if r > 1:
        dq = dq.view(T, Hk, r, K).sum(2)
        dk = dk.view(T, Hk, r, K).sum(2)
    dq = dq.to(dq_dtype) if dq_dtype is not None else dq
    dg = dg[0] if NK == 1 else dg.sum(0)
    return dq.unsqueeze(0), dk.unsqueeze(0), dw.unsqueeze(0), dg.unsqueeze(0)


def chunk_bwd_dqkwg(*args, impl: str | None = None, **kwargs):
    """:func:`chunk_bwd_dqkwg_triton` or :func:`chunk_bwd_dqkwg_torch` (same arguments) by ``impl``
    (default :data:`DQKWG_IMPL`; ``"auto"``: Triton on CUDA for ``"mixed"`` / ``"fp32"`` and for every device
    plan (:func:`device_fla_hybrid_boundaries`; interpreted on the CPU), else PyTorch).

    Raises:
        ValueError: an unknown ``impl``; as the chosen function.
    """
    impl = DQKWG_IMPL if impl is None else impl
    if impl not in DQKWG_IMPLS:
        raise ValueError(f"dqkwg impl must be one of {DQKWG_IMPLS}, got {impl!r}")
    q = args[0] if args else kwargs["q"]
    precision = kwargs.get("precision", DEFAULT_PRECISION)
    plan = kwargs.get("plan")
    device_plan = plan is not None and plan.device_built
    if impl == "auto":
        triton_ok = precision in ("mixed", "fp32")
        impl = "triton" if triton_ok and (q.device.type == "cuda" or device_plan) else "torch"
    fn = chunk_bwd_dqkwg_triton if impl == "triton" else chunk_bwd_dqkwg_torch
    return fn(*args, **kwargs)


# ----------------------------------------------------------------------------------------------------
# the autograd Function: fla forward, fla backward with dqkwg replaced


def _device_ctx(t: torch.Tensor):
    import contextlib

    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


@contextlib.contextmanager
def _fla_tensor_cache_off(off: bool):
    """fla's identity-keyed per-tensor cache (``fla.utils.FLA_DISABLE_TENSOR_CACHE``, read at every call) off
    inside, when ``off``: with device-built tables the offsets are a new tensor every call, so the cache would
    only keep tensors alive (its last results, e.g. ``chunk_offsets``); under CUDA-graph trees a kept tensor
    from the graph's memory pool is a live allocation the graph does not own, which the trees refuse."""
    module = sys.modules.get("fla.utils") if off else None
    if module is None:
        yield
        return
    before = getattr(module, "FLA_DISABLE_TENSOR_CACHE", False)
    module.FLA_DISABLE_TENSOR_CACHE = True
    try:
        yield
    finally:
        module.FLA_DISABLE_TENSOR_CACHE = before


def _fns() -> dict:
    fns, reason = load_hybrid()
    if fns is None:
        raise RuntimeError(f"fla_hybrid unavailable: {reason}")
    return fns


def _forward_impl(
    q, k, v, g, beta, h0, scale, output_final_state, cu_seqlens, cu_seqlens_cpu, l2, chunk_indices, keep_states=False,
):  # fmt: skip
    """fla's forward (l2norm, ``chunk_gated_delta_rule_fwd``; the batch's ``chunk_indices``, built by fla when
    ``None``): ``(o, final_state, saved)`` with ``saved`` what the backward reads (fla's own choice of saved
    tensors). ``keep_states``: fla's forward run as its four steps (chunk cumsum, intra-chunk WY form, chunk
    states, output; what ``chunk_gated_delta_rule_fwd`` calls) so that ``saved`` also holds ``(w, h, v_new)``,
    which the backward would otherwise recompute."""
    fns = _fns()
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = h0.contiguous() if h0 is not None else None
    device_tables = cu_seqlens_cpu is None and chunk_indices is not None
    states = None
    with _device_ctx(q), torch.autocast(q.device.type, enabled=False), _fla_tensor_cache_off(device_tables):
        q_rstd = k_rstd = None
        if l2:
            q, q_rstd = fns["l2norm_fwd"](q)
            k, k_rstd = fns["l2norm_fwd"](k)
        if chunk_indices is None:
            chunk_indices = fns["prepare_chunk_indices"](
                cu_seqlens, FLA_CHUNK_SIZE, cu_seqlens_cpu=cu_seqlens_cpu
            )
        common = {"cu_seqlens": cu_seqlens, "chunk_indices": chunk_indices, "chunk_size": FLA_CHUNK_SIZE}
        if keep_states:
            gcum = fns["chunk_local_cumsum"](g, reverse=False, scale=RCP_LN2, **common)
            w, u, A = fns["chunk_gated_delta_rule_fwd_intra"](k=k, v=v, g=gcum, beta=beta, **common)
            h, v_new, final_state = fns["chunk_gated_delta_rule_fwd_h"](
                k=k, w=w, u=u, g=gcum, initial_state=h0, output_final_state=output_final_state,
                state_v_first=False, **common,
            )  # fmt: skip
            o = fns["chunk_fwd_o"](q=q, k=k, v=v_new, h=h, g=gcum, scale=scale, state_v_first=False, **common)
            states = (w, h, v_new)
        else:
            gcum, o, A, final_state, _, _ = fns["chunk_gated_delta_rule_fwd"](
                q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=h0,
                output_final_state=output_final_state, **common,
            )  # fmt: skip
    saved = (q, q_rstd, k, k_rstd, v, gcum, beta, A, h0, cu_seqlens, chunk_indices, states)
    return o.to(q.dtype), final_state, saved


def _backward_impl(saved, do, dht, scale, l2, plan, precision):
    """fla's backward pipeline (0.6.0 ``chunk_gated_delta_rule_bwd``) with ``chunk_bwd_dqkwg`` replaced by
    :func:`chunk_bwd_dqkwg_torch`: ``(dq, dk, dv, dg, dbeta, dh0)`` (dq/dk in the l2norm's dtype, or q's
    without it; dg fp32; dh0 fp32 or ``None``)."""
    q, q_rstd, k, k_rstd, v, g, beta, A, h0, cu, chunk_indices, states = saved
    fns = _fns()
    BT = FLA_CHUNK_SIZE
    do = do.contiguous()
    dht = dht.contiguous() if dht is not None else None
    device_plan = plan is not None and plan.device_built
    with _device_ctx(q), torch.autocast(q.device.type, enabled=False), _fla_tensor_cache_off(device_plan):
        common = {"cu_seqlens": cu, "chunk_indices": chunk_indices}
        if states is not None:  # the forward's (w, h, v_new)
            w, h, v_new = states
        else:
            w, u = fns["recompute_w_u_fwd"](k=k, v=v, beta=beta, A=A, g=g, **common)
            h, v_new, _ = fns["chunk_gated_delta_rule_fwd_h"](
                k=k, w=w, u=u, g=g, initial_state=h0, output_final_state=False, chunk_size=BT,
                state_v_first=False, **common,
            )  # fmt: skip
        dv = fns["chunk_bwd_dv_local"](q=q, k=k, do=do, g=g, scale=scale, chunk_size=BT, **common)
        dh, dh0, dv = fns["chunk_gated_delta_rule_bwd_dhu"](
            q=q, k=k, w=w, do=do, dv=dv, g=g, h0=h0, dht=dht, scale=scale, state_v_first=False, chunk_size=BT,
            **common,
        )  # fmt: skip
        # fla's chunk_bwd_dqkwg is flagged wrong on this stack: never run it; varpack's own step instead
        # without the l2norm dq and dk are final here: rounded to q's dtype where they are written (no casts)
        dq, dk, dw, dg = chunk_bwd_dqkwg(
            q, k, v_new, g, h, dh, dv, do, scale, cu,
            chunk_size=BT, plan=plan, precision=precision, w_dtype=w.dtype, dq_dtype=None if l2 else q.dtype,
        )  # fmt: skip
        del h, dh, v_new
        dk2, dv, db, dg2 = fns["prepare_wy_repr_bwd"](k=k, v=v, beta=beta, A=A, dw=dw, du=dv, g=g, **common)
        dk = dk + dk2 if l2 else torch.add(dk, dk2, out=torch.empty_like(k))
        dg = dg + dg2
        dg = fns["chunk_local_cumsum"](dg.contiguous(), chunk_size=BT, reverse=True, **common)
        if l2:
            dq = fns["l2norm_bwd"](q, q_rstd, dq.contiguous())
            dk = fns["l2norm_bwd"](k, k_rstd, dk.contiguous())
    return dq, dk, dv, dg, db, dh0


class _FlaHybridGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens, cu_seqlens_cpu,
                use_qk_l2norm_in_kernel, plan, precision, chunk_indices):  # fmt: skip
        o, final_state, saved = _forward_impl(
            q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens, cu_seqlens_cpu,
            use_qk_l2norm_in_kernel, chunk_indices,
        )  # fmt: skip
        ctx.save_for_backward(*saved)
        ctx.args = (scale, use_qk_l2norm_in_kernel, plan, precision)
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
        ctx.has_final = output_final_state
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        saved = ctx.saved_tensors
        dq, dk, dv, dg, db, dh0 = _backward_impl(saved, do, dht if ctx.has_final else None, *ctx.args)
        h0 = saved[8]
        dts = ctx.dtypes
        return (dq.to(dts[0]), dk.to(dts[1]), dv.to(dts[2]), dg.to(dts[3]), db.to(dts[4]),
                dh0.to(h0.dtype) if h0 is not None else None, None, None, None, None, None, None, None, None)  # fmt: skip


def fla_hybrid_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    cu_seqlens_cpu: Any = None,
    boundaries: FlaHybridBoundaries | None = None,
    precision: str = DEFAULT_PRECISION,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule on fla's kernels with varpack's own ``dq, dk, dw, dg`` step (module docstring).

    Same arguments, shapes and results as :func:`varpack.ops.gated_delta_rule.chunk_gated_delta_rule`:
    q/k ``[B, T, Hk, K]``, v ``[B, T, H, V]``, g/beta ``[B, T, H]``, cu_seqlens ``[N+1]`` (``B == 1``),
    initial/final state ``[N, H, K, V]``; returns ``(o [B, T, H, V] in q's dtype, final_state | None)``, the
    final state fp32 (fp64 for fp64 inputs).

    Args:
        cu_seqlens: boundaries (any integer tensor / list); moved to the device as int64.
        cu_seqlens_cpu: a CPU copy of ``cu_seqlens``. Without it and with device ``cu_seqlens``, the
            boundaries are built on the device (:func:`device_fla_hybrid_boundaries`: no host read, fixed-size
            tables) for ``precision`` ``"mixed"`` / ``"fp32"``; for ``"input"`` one copy to the host is made.
        boundaries: :func:`prepare_fla_hybrid_boundaries` (or :func:`device_fla_hybrid_boundaries`) of these
            offsets, kept per batch (every layer then shares one device copy and one plan: no per-layer host
            work); built here when ``None``.
        precision: :func:`chunk_bwd_dqkwg_torch`'s ``precision`` for the backward (default
            :data:`DEFAULT_PRECISION`).

    Raises:
        RuntimeError: not on CUDA, or fla's internal kernels unavailable / of another release (the reason).
        ValueError / TypeError: as :func:`varpack.ops.gated_delta_rule._common.check_inputs`.
    """
    if q.device.type != "cuda":
        raise RuntimeError(f"fla_hybrid needs a CUDA device (fla's Triton kernels), got {q.device}")
    return _hybrid(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
        cu_seqlens_cpu, precision, boundaries,
    )  # fmt: skip


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, precision, boundaries, chunk_rows=None):
    """Checked arguments in the packed form the kernels take: ``(q, k, v, g, beta, scale, boundaries,
    (B, T, Hk, H, K, V))``; B rows without ``cu_seqlens`` become B packed sequences (the same math, one code
    path)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    _fns()
    cu_seqlens = normalize_optional_cu(cu_seqlens)
    cu_seqlens_cpu = normalize_optional_cu(cu_seqlens_cpu, "cu_seqlens_cpu")
    if cu_seqlens_cpu is None and cu_seqlens is not None and cu_seqlens.device.type == "cpu":
        cu_seqlens_cpu = cu_seqlens
    dims = check_inputs(
        q, k, v, g, beta, initial_state, cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
    )
    B, T, _, _, K, _ = dims
    if scale is None:
        scale = K**-0.5
    if cu_seqlens is None:
        cu_seqlens_cpu = torch.arange(B + 1, dtype=torch.int64) * T
        q, k, v, g, beta = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
        boundaries = None
    elif cu_seqlens_cpu is None and boundaries is None:
        if precision in ("mixed", "fp32"):  # no host read: tables built on the device (Triton dq/dk step)
            boundaries = device_fla_hybrid_boundaries(cu_seqlens, q.shape[1], chunk_rows)
        else:
            cu_seqlens_cpu = cu_seqlens_to_cpu(cu_seqlens)  # one sync; fla would make the same one
    if boundaries is None:
        boundaries = prepare_fla_hybrid_boundaries(cu_seqlens_cpu, q.device)
    else:
        n = boundaries.cu_seqlens.numel()
        if (
            boundaries.cu_seqlens.device != q.device
            or boundaries.plan.total_tokens != q.shape[1]
            or (cu_seqlens is not None and cu_seqlens.numel() != n)
        ):
            raise ValueError(
                f"boundaries were prepared for {n - 1} sequences of {boundaries.plan.total_tokens} tokens on "
                f"{boundaries.cu_seqlens.device}, got {q.shape[1]} tokens on {q.device}"
                + (f" in {cu_seqlens.numel() - 1} sequences" if cu_seqlens is not None else "")
            )
    return q, k, v, g, beta, float(scale), boundaries, dims


@dataclass(frozen=True)
class FlaHybridBoundaries:
    """One batch's boundaries as ``fla_hybrid`` uses them, built once (:func:`prepare_fla_hybrid_boundaries`)
    and shared by every layer: ``cu_seqlens_cpu`` / ``cu_seqlens`` int64 ``[N+1]`` on the CPU and on the
    device, the :class:`DqkwgPlan`, and fla's ``chunk_indices`` ``[NT, 2]`` int64 on the device
    (:func:`varpack.ops._fla.fla_chunk_indices`: no layer waits for fla's own blocking copy of them).

    Built on the device instead (:func:`device_fla_hybrid_boundaries`): ``cu_seqlens_cpu`` is ``None``,
    ``chunk_indices`` and the plan's chunk table have :func:`varpack.ops._fla.max_chunks` rows (padding rows
    past the real chunks), and the plan has no host groups."""

    cu_seqlens_cpu: torch.Tensor | None
    cu_seqlens: torch.Tensor
    plan: DqkwgPlan
    chunk_indices: torch.Tensor


def prepare_fla_hybrid_boundaries(cu_seqlens_cpu: Any, device: torch.device | str) -> FlaHybridBoundaries:
    """:class:`FlaHybridBoundaries` of CPU offsets ``[N+1]`` for ``device`` (CPU work O(T), non-blocking
    copies: no host sync). Keep it per batch (e.g. ``VarlenMeta.memo``) and pass it as ``boundaries=``.

    Raises:
        ValueError / TypeError: invalid offsets (:func:`varpack.varlen.normalize_cu_seqlens`).
    """
    device = torch.device(device)
    cu64 = cu_seqlens_to_cpu(cu_seqlens_cpu)
    checked_host_cu_seqlens(cu64)
    return FlaHybridBoundaries(
        cu64,
        cu64.to(device, non_blocking=True),
        dqkwg_plan(cu64, FLA_CHUNK_SIZE, device=device),
        fla_chunk_indices(cu64, device, FLA_CHUNK_SIZE),
    )


def device_fla_hybrid_boundaries(
    cu_seqlens: torch.Tensor, total_tokens: int, rows: int | None = None
) -> FlaHybridBoundaries:
    """:class:`FlaHybridBoundaries` built on ``cu_seqlens``' device from the offsets alone: no host read, and
    tables whose shapes depend only on ``(T, N)`` (:func:`varpack.ops._fla.fla_chunk_tables`: fla's chunk
    indices and the dq/dk chunk table, :func:`varpack.ops._fla.max_chunks` rows, padding rows masked by
    every kernel), so the launches of one static shape are the same for every pack: what a captured CUDA
    graph replays (``varpack sft`` with CUDA graphs on a Gated DeltaNet model). The offsets are copied to a
    new int64 tensor: fla's identity-keyed per-tensor cache (its ``chunk_offsets``) never hits an entry
    computed outside the current call, so under capture those offsets are recorded with the rest.

    Args:
        cu_seqlens: ``[N+1]`` int32 / int64 offsets on the device, trusted as valid (checked where they were
            built, e.g. :class:`varpack.varlen.VarlenMeta`).
        total_tokens: ``T`` of the packed row.
        rows: the tables' row count (:func:`varpack.ops._fla.fla_chunk_tables`' ``rows``: a static shape's
            ``linear_chunks``); default: the bound of any offsets of ``(T, N)``.

    Raises:
        TypeError / ValueError: offsets that are not a 1-D integer tensor.
    """
    indices, start, length = fla_chunk_tables(cu_seqlens, total_tokens, FLA_CHUNK_SIZE, rows)  # checks the offsets
    cu64 = cu_seqlens.to(torch.int64, copy=True)
    plan = DqkwgPlan(
        total_tokens=int(total_tokens), num_chunks=int(indices.shape[0]), groups=(), chunk_start=start,
        chunk_len=length,
    )  # fmt: skip
    return FlaHybridBoundaries(None, cu64, plan, indices)


def _hybrid(
    q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
    cu_seqlens_cpu, precision, boundaries=None,
):  # fmt: skip
    """:func:`fla_hybrid_gated_delta_rule` past its device check (the CPU tests run it on stand-ins for
    fla's kernels)."""
    q, k, v, g, beta, scale, bnd, dims = _prepare(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, precision, boundaries
    )
    B, T, Hk, H, K, V = dims
    if T * B == 0 or bnd.plan.total_tokens == 0:
        o = v.new_zeros(v.shape).reshape(B, T, H, V).to(q.dtype)
        n = bnd.cu_seqlens.numel() - 1
        fs = None
        if output_final_state:
            acc = acc_dtype(q)
            fs = initial_state.to(acc) if initial_state is not None else q.new_zeros(n, H, K, V, dtype=acc)
        return o, fs
    o, final = _FlaHybridGatedDeltaRule.apply(
        q, k, v, g, beta, initial_state, scale, bool(output_final_state), bnd.cu_seqlens, bnd.cu_seqlens_cpu,
        bool(use_qk_l2norm_in_kernel), bnd.plan, precision, bnd.chunk_indices,
    )  # fmt: skip
    o = o.reshape(B, T, H, V)
    return o, (final.to(acc_dtype(q)) if final is not None else None)


def fla_hybrid_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Any = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    cu_seqlens_cpu: Any = None,
    boundaries: FlaHybridBoundaries | None = None,
    precision: str = DEFAULT_PRECISION,
    chunk_rows: int | None = None,
    qk_residuals: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """:func:`fla_hybrid_gated_delta_rule`'s forward without autograd, returning what its backward reads:
    ``(o, final_state | None, residuals)``, for an op whose backward is a second op
    (``varpack::gated_delta_rule``, :func:`fla_hybrid_backward`): fla's forward runs once per step, not again
    in the backward.

    ``residuals`` (packed rows, ``BT = B * T`` tokens): ``[q', k', gcum, A]`` and, with
    ``use_qk_l2norm_in_kernel``, ``[q_rstd, k_rstd]`` after them. ``q'``, ``k'`` ``[1, BT, Hk, K]`` in q's
    dtype: the l2-normalised q and k (a copy of q and k without the l2norm); ``gcum`` ``[1, BT, H]`` fp32 (fp64
    for fp64 inputs): fla's chunk-local cumulative decay in log2 units; ``A`` ``[1, BT, H, 64]`` in k's dtype:
    fla's inverted ``(I + beta K K^T)`` blocks per chunk; ``q_rstd``, ``k_rstd`` ``[1, BT, Hk]`` fp32: the
    l2norm's reciprocal norms. :func:`fla_hybrid_residual_shapes` gives them from the input shapes.
    ``chunk_rows``: the row count of chunk tables built on the device (:func:`device_fla_hybrid_boundaries`).
    ``qk_residuals=False`` without ``use_qk_l2norm_in_kernel``: ``q'`` and ``k'`` (then q and k themselves) are
    left out rather than copied, for a caller that keeps q and k and puts them (packed ``[1, BT, Hk, K]``)
    back in front of the residuals for :func:`fla_hybrid_backward`.

    Raises:
        RuntimeError / ValueError / TypeError: as :func:`fla_hybrid_gated_delta_rule`.
    """
    if q.device.type != "cuda":
        raise RuntimeError(f"fla_hybrid needs a CUDA device (fla's Triton kernels), got {q.device}")
    return _hybrid_forward(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
        cu_seqlens_cpu, precision, boundaries, chunk_rows, qk_residuals,
    )  # fmt: skip


def fla_hybrid_residual_shapes(
    q_shape: tuple[int, ...], v_shape: tuple[int, ...], q_dtype: torch.dtype, l2: bool, chunk_rows: int = 0
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """``(shape, dtype)`` of each of :func:`fla_hybrid_forward`'s residuals for q ``[B, T, Hk, K]`` and v
    ``[B, T, H, V]`` (the op's fake implementation; k and v have q's dtype); ``chunk_rows > 0`` adds the chunk
    states ``w`` ``[1, BT, H, K]``, ``h`` ``[1, chunk_rows, H, K, V]`` and ``v_new`` ``[1, BT, H, V]``."""
    B, T, Hk, K = q_shape
    H, V = v_shape[2], v_shape[3]
    acc = torch.float64 if q_dtype == torch.float64 else torch.float32
    out = [((1, B * T, Hk, K), q_dtype), ((1, B * T, Hk, K), q_dtype), ((1, B * T, H), acc),
           ((1, B * T, H, FLA_CHUNK_SIZE), q_dtype)]  # fmt: skip
    if l2:
        out += [((1, B * T, Hk), acc), ((1, B * T, Hk), acc)]
    if chunk_rows:
        out += [((1, B * T, H, K), q_dtype), ((1, int(chunk_rows), H, K, V), q_dtype), ((1, B * T, H, V), q_dtype)]
    return out


def _hybrid_forward(
    q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
    cu_seqlens_cpu, precision, boundaries=None, chunk_rows=None, qk_residuals=True,
):  # fmt: skip
    l2 = bool(use_qk_l2norm_in_kernel)
    rows = int(chunk_rows or 0)
    shapes = fla_hybrid_residual_shapes(tuple(q.shape), tuple(v.shape), q.dtype, l2, rows)
    keep_qk = l2 or qk_residuals
    if not keep_qk:
        shapes = shapes[2:]
    qp, kp, vp, gp, bp, scale, bnd, dims = _prepare(
        q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, precision, boundaries, chunk_rows
    )
    B, T, Hk, H, K, V = dims
    acc = acc_dtype(q)
    if T * B == 0 or bnd.plan.total_tokens == 0:
        n = bnd.cu_seqlens.numel() - 1
        fs = None
        if output_final_state:
            fs = initial_state.to(acc) if initial_state is not None else q.new_zeros(n, H, K, V, dtype=acc)
        return q.new_zeros(B, T, H, V), fs, [q.new_zeros(s, dtype=d) for s, d in shapes]
    with torch.no_grad():
        o, final, saved = _forward_impl(
            qp, kp, vp, gp, bp, initial_state, scale, bool(output_final_state), bnd.cu_seqlens,
            bnd.cu_seqlens_cpu, l2, bnd.chunk_indices, keep_states=rows > 0,
        )  # fmt: skip
    qn, q_rstd, kn, k_rstd, _, gcum, _, A = saved[:8]
    if not l2 and keep_qk:  # fla read q and k as given: copies, so no residual is (a view of) an input
        qn, kn = qn.clone(), kn.clone()
    residuals = ([qn, kn] if keep_qk else []) + [gcum, A] + ([q_rstd, k_rstd] if l2 else [])
    if rows:
        w, h, v_new = saved[11]
        residuals += [w, _pad_chunk_rows(h, rows), v_new]
    residuals = [x.reshape(s).to(d) for x, (s, d) in zip(residuals, shapes)]
    return o.reshape(B, T, H, V), (final.to(acc) if output_final_state else None), residuals


def _pad_chunk_rows(h: torch.Tensor, rows: int) -> torch.Tensor:
    """fla's chunk states ``h`` ``[1, NT, H, K, V]`` as ``[1, rows, H, K, V]`` (the op's fixed shape): as they
    are for device-built tables (``NT == rows``), else zero rows appended (host tables of fewer chunks)."""
    nt = h.shape[1]
    if nt == rows:
        return h
    if nt > rows:
        raise ValueError(f"fla_hybrid: {nt} chunks in this row, more than chunk_rows={rows}")
    return torch.cat([h, h.new_zeros((h.shape[0], rows - nt, *h.shape[2:]))], 1)


def fla_hybrid_backward(
    do: torch.Tensor,
    dfinal: torch.Tensor | None,
    v: torch.Tensor,
    beta: torch.Tensor,
    residuals: list[torch.Tensor],
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: Any = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    g_dtype: torch.dtype = torch.float32,
    cu_seqlens_cpu: Any = None,
    boundaries: FlaHybridBoundaries | None = None,
    precision: str = DEFAULT_PRECISION,
    chunk_rows: int | None = None,
) -> list[torch.Tensor | None]:
    """``[dq, dk, dv, dg, dbeta, dinitial_state | None]`` of :func:`fla_hybrid_forward` from its
    ``residuals`` (no forward recomputed), for the output gradient ``do`` ``[B, T, H, V]`` and the final-state
    gradient ``dfinal`` ``[N, H, K, V]`` (or ``None``); ``v``, ``beta``, ``initial_state``, ``cu_seqlens``,
    ``scale``, ``use_qk_l2norm_in_kernel`` and ``chunk_rows`` as given to the forward. Gradients in the inputs' dtypes (q's
    and k's from the residuals, g's ``g_dtype``); shapes of the inputs.

    Raises:
        RuntimeError / ValueError / TypeError: as :func:`fla_hybrid_gated_delta_rule`; residuals of another
            problem (``ValueError``).
    """
    if do.device.type != "cuda":
        raise RuntimeError(f"fla_hybrid needs a CUDA device (fla's Triton kernels), got {do.device}")
    return _hybrid_backward(
        do, dfinal, v, beta, residuals, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
        g_dtype, cu_seqlens_cpu, precision, boundaries, chunk_rows,
    )  # fmt: skip


def _hybrid_backward(
    do, dfinal, v, beta, residuals, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, g_dtype,
    cu_seqlens_cpu, precision, boundaries=None, chunk_rows=None,
):  # fmt: skip
    l2 = bool(use_qk_l2norm_in_kernel)
    B, T, H, V = v.shape
    rows = int(chunk_rows or 0)
    want = len(fla_hybrid_residual_shapes((B, T, 1, 1), tuple(v.shape), v.dtype, l2, rows))
    if len(residuals) != want:
        raise ValueError(f"fla_hybrid_backward: {len(residuals)} residuals, the forward leaves {want}")
    qn, kn, gcum, A = residuals[:4]
    q_rstd, k_rstd = residuals[4:6] if l2 else (None, None)
    states = tuple(residuals[-3:]) if rows else None
    Hk, K = qn.shape[2], qn.shape[3]
    q_shape, g_shape = (B, T, Hk, K), (B, T, H)
    # the forward's checks and boundaries, on the residuals' shapes
    _, _, vp, _, bp, scale, bnd, _ = _prepare(
        qn.reshape(q_shape), kn.reshape(q_shape), v, gcum.reshape(g_shape), beta, scale, initial_state,
        cu_seqlens, cu_seqlens_cpu, precision, boundaries, chunk_rows,
    )  # fmt: skip
    dtypes = (qn.dtype, kn.dtype, v.dtype, g_dtype, beta.dtype)
    shapes = (q_shape, q_shape, v.shape, g_shape, beta.shape)
    if T * B == 0 or bnd.plan.total_tokens == 0:
        grads = [torch.zeros(s, dtype=d, device=do.device) for s, d in zip(shapes, dtypes)]
        return grads + [dfinal.to(initial_state.dtype) if initial_state is not None and dfinal is not None
                        else (torch.zeros_like(initial_state) if initial_state is not None else None)]  # fmt: skip
    h0 = initial_state.contiguous() if initial_state is not None else None
    if states is not None:  # h back to this row's chunk count (host tables may hold fewer than chunk_rows)
        w, h, v_new = states
        states = (w.reshape(1, B * T, H, -1), h[:, : bnd.chunk_indices.shape[0]], v_new.reshape(1, B * T, H, V))
    saved = (qn, q_rstd, kn, k_rstd, vp.contiguous(), gcum, bp.contiguous(), A, h0, bnd.cu_seqlens,
             bnd.chunk_indices, states)  # fmt: skip
    do = do.reshape(1, B * T, H, V)
    dq, dk, dv, dg, db, dh0 = _backward_impl(saved, do, dfinal, scale, l2, bnd.plan, precision)
    out = [x.reshape(s).to(d) for x, s, d in zip((dq, dk, dv, dg, db), shapes, dtypes)]
    out.append(dh0.to(initial_state.dtype) if initial_state is not None else None)
    return out
