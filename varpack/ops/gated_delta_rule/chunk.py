"""Chunked gated delta rule over a packed row, vectorized across all sequences (PyTorch, any device).

Algorithm: the chunkwise WY form of the gated delta rule (Yang, Kautz & Hatamizadeh, "Gated Delta
Networks", ICLR 2025, section 3; fla's ``chunk_gated_delta_rule``; transformers'
``torch_chunk_gated_delta_rule``), for chunks of ``BT = 64`` tokens. Inside a chunk, with ``G`` the
cumulative log decay and ``A[i, j] = beta_i k_i.k_j exp(G_i - G_j)`` for ``j < i``::

    (I + A) U = beta * V                     # new values ("u"), one triangular system per chunk
    (I + A) W = beta * exp(G) * K            # decayed keys that read the incoming state
    V' = U - W S                              # S: state at the chunk start, [K, V]
    O  = (exp(G) * Q) S + tril(Q K^T * exp(G_i - G_j)) V'
    S <- exp(G_last) S + (exp(G_last - G) * K)^T V'

Varlen layout (what makes it exact and fast for packed rows): every sequence is cut into its own
chunks (``ceil(L_n / BT)`` of them, the last one zero-padded; padded tokens have ``k = v = beta = g = 0``
and change nothing), so no chunk ever holds two sequences. Chunks are stored *step-major*: all first
chunks of all sequences, then all second chunks, ... with the sequences sorted by chunk count
(longest first). Then

* the intra-chunk math (``A``, the triangular solves, ``Q K^T``) runs once, batched over all chunks;
* the inter-chunk recurrence loops only over the chunk index ``j = 0 .. max_chunks - 1``; at step ``j``
  the active sequences are a prefix ``[0, a_j)`` of the sorted order and their chunks a contiguous slice
  of rows, so each step is a handful of batched matmuls over all sequences at once, with Python-int
  slice bounds: no host sync, no per-sequence Python loop, no grid-size limit (plain PyTorch ops).

State accumulation is fp32 whatever the input dtype. Backward is PyTorch autograd through these ops.
The layout index is built once per batch on the CPU from ``cu_seqlens`` (:func:`prepare_chunk_layout`)
and copied to the device once; pass it as ``layout=`` to reuse it across layers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from varpack.varlen.boundaries import checked_host_cu_seqlens, seq_idx_from_cu_seqlens

from ._common import acc_dtype, check_inputs, cu_seqlens_to_cpu, expand_heads, l2norm, normalize_optional_cu

__all__ = ["ChunkLayout", "chunk_gated_delta_rule", "prepare_chunk_layout"]

CHUNK_SIZE = 64


@dataclass(eq=False)
class ChunkLayout:
    """Where every token of a packed row lives in the step-major padded chunk layout.

    Built on the CPU by :func:`prepare_chunk_layout`; all sizes are Python ints so the recurrence never
    reads a device value.

    Attributes:
        total_tokens: ``T``.
        num_seqs: ``N``.
        chunk_size: ``BT`` actually used: ``min(requested, next power of two >= max_seqlen)``.
        num_chunks: ``C``, total chunks over all sequences (``sum ceil(L_n / BT)``).
        active: per chunk step ``j``, how many sequences have a chunk ``j`` (non-increasing).
        offsets: per step ``j``, the first chunk row of step ``j``.
        token_dest: ``[T]`` int64 (CPU): the padded slot ``row * BT + pos`` of every token.
        order: ``[N]`` int64: sequence id at each sorted rank (most chunks first, stable).
        rank: ``[N]`` int64: sorted rank of each sequence id.
        max_seqlen: the longest sequence, in tokens.
    """

    total_tokens: int
    num_seqs: int
    chunk_size: int
    num_chunks: int
    active: tuple[int, ...]
    offsets: tuple[int, ...]
    token_dest: torch.Tensor
    order: torch.Tensor
    rank: torch.Tensor
    max_seqlen: int
    _on_device: dict = field(default_factory=dict, repr=False)

    def tensors(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(token_dest, order, rank)`` on ``device``, copied there once and cached."""
        device = torch.device(device)
        key = str(device)
        if key not in self._on_device:
            if device.type == "cpu":
                self._on_device[key] = (self.token_dest, self.order, self.rank)
            else:
                self._on_device[key] = tuple(
                    t.to(device, non_blocking=True) for t in (self.token_dest, self.order, self.rank)
                )
        return self._on_device[key]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def prepare_chunk_layout(
    cu_seqlens: torch.Tensor | np.ndarray | list[int],
    chunk_size: int = CHUNK_SIZE,
    *,
    device: torch.device | str | None = None,
) -> ChunkLayout:
    """Build the step-major chunk layout of a packed row (CPU work, once per batch).

    Args:
        cu_seqlens: ``[N+1]`` cumulative sequence lengths, ``cu_seqlens[0] == 0``, non-decreasing
            (zero-length sequences allowed). A device tensor is copied to the CPU (one sync).
        chunk_size: maximum chunk length ``BT`` (default 64). When every sequence is shorter, the next
            power of two >= the longest sequence is used instead (same math, less padding).
        device: also copy the index tensors to this device now.

    Returns:
        A :class:`ChunkLayout`.

    Raises:
        ValueError: ``cu_seqlens`` not 1-D with >= 2 entries, not starting at 0, or decreasing;
            ``chunk_size`` not a positive power of two.
        TypeError: ``cu_seqlens`` not integers (:func:`varpack.varlen.normalize_cu_seqlens`).
    """
    if chunk_size <= 0 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a positive power of two, got {chunk_size}")
    cu = checked_host_cu_seqlens(cu_seqlens)  # varpack.varlen's one set of rules
    lengths = np.diff(cu)
    T = int(cu[-1])
    N = int(lengths.size)
    max_seqlen = int(lengths.max()) if N else 0
    BT = min(chunk_size, _next_pow2(max(max_seqlen, 1)))
    nch = (lengths + BT - 1) // BT
    order = np.argsort(-nch, kind="stable")
    rank = np.empty(N, dtype=np.int64)
    rank[order] = np.arange(N, dtype=np.int64)
    cmax = int(nch.max()) if N else 0
    counts = np.bincount(nch, minlength=cmax + 1)
    active = N - np.cumsum(counts)[:cmax]  # active[j] = #sequences with more than j chunks
    offsets = np.concatenate([[0], np.cumsum(active)[:-1]]) if cmax else np.zeros(0, np.int64)
    seq_of_tok = seq_idx_from_cu_seqlens(cu, T)[0].numpy().astype(np.int64)  # varpack.varlen's builder
    pos = np.arange(T, dtype=np.int64) - cu[:-1][seq_of_tok]
    dest = (offsets[pos // BT] + rank[seq_of_tok]) * BT + pos % BT
    layout = ChunkLayout(
        total_tokens=T,
        num_seqs=N,
        chunk_size=BT,
        num_chunks=int(nch.sum()),
        active=tuple(int(a) for a in active),
        offsets=tuple(int(o) for o in offsets),
        token_dest=torch.from_numpy(dest.astype(np.int64)),
        order=torch.from_numpy(order.astype(np.int64)),
        rank=torch.from_numpy(rank),
        max_seqlen=max_seqlen,
    )
    if device is not None:
        layout.tensors(device)
    return layout


# ----------------------------------------------------------------------------------------------------
# Math on chunked tensors: q, k [C, H, BT, K]; v [C, H, BT, V]; g, beta [C, H, BT]; all fp32.


def _unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """``(I + A)^-1`` for strictly lower triangular ``A`` ``[..., BT, BT]`` (``BT`` a power of two).

    Recursive block inversion, bottom-up: with the inverses ``X11``, ``X22`` of the two diagonal halves
    of a block, the block's inverse is ``[[X11, 0], [-X22 A21 X11, X22]]``. ``log2(BT)`` levels of two
    batched GEMMs each, vectorized over all blocks of all chunks: only GEMMs (fast on GPUs, compiles
    well, no batched-TRSM size limits) and as stable as substitution (no powers of ``A``, unlike a
    Neumann/doubling product, which overflows for strongly correlated keys).
    """
    BT = A.shape[-1]
    lead = A.shape[:-2]
    X = torch.ones(*lead, BT, 1, 1, dtype=A.dtype, device=A.device)  # inverses of the 1x1 diagonal blocks
    s = 1
    while s < BT:
        nb = BT // (2 * s)
        # the s x s blocks A[(2p+1)s : (2p+2)s, 2ps : (2p+1)s] for p < nb
        blocks = A.reshape(*lead, nb, 2, s, nb, 2, s).diagonal(dim1=-6, dim2=-3)  # [..., 2, s, 2, s, nb]
        A21 = blocks[..., 1, :, 0, :, :].movedim(-1, -3)  # [..., nb, s, s]
        X11, X22 = X.view(*lead, nb, 2, s, s).unbind(-3)
        X21 = -(X22 @ A21 @ X11)
        top = torch.cat([X11, torch.zeros_like(X11)], dim=-1)
        bottom = torch.cat([X21, X22], dim=-1)
        X = torch.cat([top, bottom], dim=-2)  # [..., nb, 2s, 2s]
        s *= 2
    return X.reshape(*lead, BT, BT)


def _unit_lower_solve(A: torch.Tensor, rhs: torch.Tensor, method: str) -> torch.Tensor:
    """Solve ``(I + A) X = rhs`` for strictly lower triangular ``A`` ``[..., BT, BT]``.

    ``blocked``: :func:`_unit_lower_inverse` then one GEMM (default).
    ``solve``: ``torch.linalg.solve_triangular`` with a unit diagonal.
    """
    if method == "blocked":
        return _unit_lower_inverse(A) @ rhs
    if method == "solve":
        return torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    raise ValueError(f"unknown triangular solve method {method!r} (expected 'blocked' or 'solve')")


def _intra_chunk(q, k, v, g, beta, method: str):
    """All intra-chunk quantities, batched over every chunk of every sequence."""
    BT = q.shape[-2]
    V = v.shape[-1]
    gc = g.cumsum(-1)
    ones = torch.ones(BT, BT, dtype=torch.bool, device=q.device)
    causal = ones.tril()
    strict = ones.tril(-1)
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    A = ((k @ k.transpose(-1, -2)) * decay * beta.unsqueeze(-1)).masked_fill(~strict, 0.0)
    qk = (q @ k.transpose(-1, -2)) * decay
    eg = gc.exp()
    rhs = torch.cat([v * beta.unsqueeze(-1), k * (beta * eg).unsqueeze(-1)], dim=-1)
    x = _unit_lower_solve(A, rhs, method)
    u, w = x.split([V, x.shape[-1] - V], dim=-1)
    qe = q * eg.unsqueeze(-1)
    ke = k * (gc[..., -1:] - gc).exp().unsqueeze(-1)
    dec = gc[..., -1].exp()[..., None, None]
    return u, w, qk, qe, ke, dec


def _first_step(u, qk, ke):
    """Chunk step from a zero state: ``V' = U``."""
    return qk @ u, ke.transpose(-1, -2) @ u


def _step(S, u, w, qk, qe, ke, dec):
    """One chunk step for the active sequences: ``S [a, H, K, V]`` -> (output ``[a, H, BT, V]``, new S).

    3-D ``baddbmm`` over ``a * H`` matrices (fused multiply-adds: fewer kernels per step).
    """
    a, H, K, V = S.shape
    S3, u3, w3 = S.flatten(0, 1), u.flatten(0, 1), w.flatten(0, 1)
    v_new = torch.baddbmm(u3, w3, S3, alpha=-1.0)
    o = torch.baddbmm(qe.flatten(0, 1) @ S3, qk.flatten(0, 1), v_new)
    S3 = torch.baddbmm(S3 * dec.flatten(0, 1), ke.flatten(0, 1).transpose(-1, -2), v_new)
    return o.view(a, H, -1, V), S3.view(a, H, K, V)


@functools.cache
def _compiled(name: str):
    fn = {"intra": _intra_chunk, "first": _first_step, "step": _step}[name]
    return torch.compile(fn, dynamic=True)


def _fn(name: str, compile: bool):
    if compile:
        return _compiled(name)
    return {"intra": _intra_chunk, "first": _first_step, "step": _step}[name]


def _to_chunks(x: torch.Tensor, dest: torch.Tensor, num_chunks: int, BT: int) -> torch.Tensor:
    """``[T, H, *D]`` -> zero padded ``[C, H, BT, *D]`` in the step-major layout."""
    padded = x.new_zeros((num_chunks * BT, *x.shape[1:])).index_copy(0, dest, x)
    padded = padded.view(num_chunks, BT, *x.shape[1:])
    return padded.transpose(1, 2).contiguous()


def chunk_gated_delta_rule(
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
    *,
    chunk_size: int = CHUNK_SIZE,
    layout: ChunkLayout | None = None,
    compile: bool = False,
    solve: str = "blocked",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule with ``cu_seqlens``, vectorized over all sequences of the packed row.

    Same arguments, shapes and results as fla's ``chunk_gated_delta_rule`` (flash-linear-attention,
    ``fla/ops/gated_delta_rule/chunk.py``) and :func:`naive_recurrent_gated_delta_rule` (the reference it is
    tested against, forward and backward); differentiable through PyTorch autograd; runs on any device.

    Args:
        q: ``[B, T, Hk, K]`` queries.
        k: ``[B, T, Hk, K]`` keys.
        v: ``[B, T, H, V]`` values; ``H`` a multiple of ``Hk`` (grouped value heads).
        g: ``[B, T, H]`` log decay (``<= 0``).
        beta: ``[B, T, H]`` write strength.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` state at each sequence start (zero when ``None``).
        output_final_state: also return the ``[N, H, K, V]`` fp32 final state of every sequence.
        cu_seqlens: ``[N+1]`` int32/int64 boundaries of the sequences packed along ``T`` (needs ``B == 1``);
            a list / NumPy array of integers is converted once (:func:`varpack.varlen.normalize_cu_seqlens`).
            Best a CPU tensor (the layout is built on the CPU); a device tensor costs one device->host
            copy unless ``layout`` is given. ``None``: every batch row is one sequence.
        use_qk_l2norm_in_kernel: L2-normalise q and k over ``K`` first (eps 1e-6, as fla).
        chunk_size: maximum chunk length (default 64, a power of two).
        layout: a :func:`prepare_chunk_layout` result for this ``cu_seqlens`` (built once per batch and
            shared by every layer); when given, ``cu_seqlens`` is only shape-checked.
        compile: run the intra-chunk block and the chunk step through ``torch.compile(dynamic=True)``.
        solve: ``"blocked"`` (GEMM-only recursive block inverse, default) or ``"solve"``
            (``torch.linalg.solve_triangular``) for the per-chunk unit lower triangular systems.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, V]`` in ``q.dtype``; ``final_state`` ``[N, H, K, V]``
        fp32, or ``None``.

    Raises:
        ValueError: shape mismatches, ``B > 1`` with ``cu_seqlens``, invalid ``cu_seqlens``, a
            ``layout`` built for another token count or number of sequences, a wrong
            ``initial_state`` shape.
        TypeError: non-tensor or integer inputs.
    """
    cu_seqlens = normalize_optional_cu(cu_seqlens)
    if layout is None:
        B, T, Hk, H, K, V = check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    else:  # cu_seqlens and initial_state are checked against the layout below
        B, T, Hk, H, K, V = check_inputs(q, k, v, g, beta, None, None)
    if layout is not None and B != 1:
        raise ValueError(f"with a packed layout the batch dimension must be 1, got B={B}")
    if layout is None:
        if cu_seqlens is None:
            cu = torch.arange(B + 1, dtype=torch.int64) * T
        else:
            cu = cu_seqlens_to_cpu(cu_seqlens)
        layout = prepare_chunk_layout(cu, chunk_size)
    N = layout.num_seqs
    if layout.total_tokens != B * T:
        raise ValueError(f"layout describes {layout.total_tokens} tokens but the inputs have B*T={B * T}")
    if cu_seqlens is not None and cu_seqlens.numel() - 1 != N:
        raise ValueError(f"cu_seqlens holds {cu_seqlens.numel() - 1} sequences but the layout {N}")
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        raise ValueError(
            f"initial_state must be [N={N}, H={H}, K={K}, V={V}], got {tuple(initial_state.shape)}"
        )
    out_dtype = q.dtype
    if scale is None:
        scale = K**-0.5
    device = q.device
    dest, order, rank = layout.tensors(device)
    BT, C = layout.chunk_size, layout.num_chunks

    # Flat fp32 token stream [T, H, D]
    acc = acc_dtype(q)
    q, k, v, g, beta = (x.reshape(B * T, *x.shape[2:]).to(acc) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = expand_heads(q, H) * scale
    k = expand_heads(k, H)

    if C == 0:  # only empty sequences: an empty output that still belongs to the inputs' graph
        o = (v.reshape(B, T, H, V) * 0).to(out_dtype)
        if not output_final_state:
            return o, None
        fs = initial_state.to(acc) if initial_state is not None else v.new_zeros(N, H, K, V)
        return o, fs

    qc, kc, vc = (_to_chunks(x, dest, C, BT) for x in (q, k, v))
    gc, bc = (_to_chunks(x, dest, C, BT) for x in (g, beta))
    u, w, qk, qe, ke, dec = _fn("intra", compile)(qc, kc, vc, gc, bc, solve)

    # Inter-chunk recurrence over the chunk index only, batched over the active sequences.
    step = _fn("step", compile)
    S: torch.Tensor | None
    finals: list[torch.Tensor] = []
    if initial_state is not None:
        S = initial_state.to(acc).index_select(0, order)
    elif output_final_state and layout.active[0] < N:
        S = v.new_zeros(N, H, K, V)
    else:
        S = None
    outs: list[torch.Tensor] = []
    # one split per tensor (not one slice per step): the backward then concatenates the step gradients
    # once instead of materialising a full-size zero tensor per slice and step
    sizes = list(layout.active)
    parts = [t.split(sizes, dim=0) for t in (u, w, qk, qe, ke, dec)]
    for j, a in enumerate(sizes):
        if S is not None and S.shape[0] > a:
            S, done = S.split([a, S.shape[0] - a], dim=0)
            finals.append(done)
        u_j, w_j, qk_j, qe_j, ke_j, dec_j = (p[j] for p in parts)
        if S is None:
            o_j, S = _fn("first", compile)(u_j, qk_j, ke_j)
        else:
            o_j, S = step(S, u_j, w_j, qk_j, qe_j, ke_j, dec_j)
        outs.append(o_j)
    finals.append(S)
    o = torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]  # [C, H, BT, V]
    o = o.transpose(1, 2).reshape(C * BT, H, V).index_select(0, dest)
    o = o.view(B, T, H, V).to(out_dtype)
    if not output_final_state:
        return o, None
    final_sorted = torch.cat(finals[::-1], dim=0) if len(finals) > 1 else finals[0]
    return o, final_sorted.index_select(0, rank)
