"""The SSD (Mamba-2) scan in chunks, vectorized over every sample of a packed row; autograd backward; any
device.

The chunked form of Dao & Gu's state space duality (mamba_ssm's ``ssd_combined``, transformers' PyTorch
``mamba2_chunk_scan``), with sample boundaries anywhere, chunks straddling them: the stream is cut into chunks
of ``chunk_size`` tokens regardless of the samples, and the sample index ``seq_idx`` masks the three places
where state could cross a boundary, as mamba_ssm does with ``seq_idx``:

1. inside a chunk, token ``l`` reads token ``m <= l`` only if both belong to one sample (``same``);
2. a chunk's end state collects only the tokens of the sample its last token belongs to (``to_end``);
3. the state passed from chunk ``z`` to a later chunk counts only if no boundary lies between them
   (``carry``), and a token reads the state entering its chunk only if it belongs to the sample of the
   previous chunk's last token (``from_prev``).

Per head, with ``a_t = dt_t * A`` and ``seg(m, l) = a_{m+1} + ... + a_l``::

    y_l = sum_{m <= l, same} (C_l . B_m) exp(seg(m, l)) dt_m x_m       # within the chunk
        + [from_prev_l] exp(a_0 + ... + a_l) C_l . state_entering      # from the chunks before
        + D x_l

The masks depend only on the boundaries and the chunk size: :func:`prepare_ssd_layout` builds them once per
batch (a model keeps them on the batch's :class:`varpack.varlen.VarlenMeta` for all its layers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from varpack.varlen.boundaries import checked_host_cu_seqlens, seq_idx_from_cu_seqlens

from ._common import acc_dtype, check_inputs, discretize_dt, expand_groups, normalize_dt_limit

__all__ = ["SSDLayout", "chunk_ssd_scan", "prepare_ssd_layout"]


@dataclass(frozen=True)
class SSDLayout:
    """The chunk masks of one packed batch (module docstring), on one device.

    Attributes:
        chunk_size: ``L``, tokens per chunk.
        total: ``T``; rows: ``B``.
        same: ``[B, nc, L, L]`` bool, token ``l`` and token ``m`` of a chunk in one sample (``None``: each row
            is one sample, nothing to mask).
        to_end: ``[B, nc, L]`` bool, token in the sample of its chunk's last token.
        from_prev: ``[B, nc, L]`` bool, token in the sample of the previous chunk's last token.
        carry: ``[B, nc + 1, nc + 1]`` bool, state passing from chunk ``j - 1`` to chunk ``i`` allowed.
        ends: ``(row, chunk, offset)`` int64 index tensors of every non-empty sample's last token, and
            ``nonempty`` the samples they belong to; ``num_seqs`` ``N``. ``None`` when only a device
            ``seq_idx`` was given (final states then need ``cu_seqlens``).
    """

    chunk_size: int
    total: int
    rows: int
    same: torch.Tensor | None
    to_end: torch.Tensor | None
    from_prev: torch.Tensor | None
    carry: torch.Tensor | None
    ends: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    nonempty: torch.Tensor | None
    num_seqs: int | None

    @property
    def num_chunks(self) -> int:
        """``nc = ceil(T / L)``."""
        return -(-self.total // self.chunk_size)


def _chunk_size(chunk_size: Any) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return chunk_size


def prepare_ssd_layout(
    total: int,
    chunk_size: int,
    *,
    cu_seqlens: Any = None,
    seq_idx: torch.Tensor | None = None,
    rows: int = 1,
    device: torch.device | str | None = None,
) -> SSDLayout:
    """The chunk masks of a stream of ``total`` tokens (module docstring), built once per batch.

    Args:
        total: ``T``.
        chunk_size: ``L``.
        cu_seqlens: ``[N+1]`` host offsets of the samples of one packed row (CPU tensor, list or NumPy array;
            zero-length samples allowed); enables final states.
        seq_idx: ``[B, T]`` / ``[T]`` non-decreasing integer sample index of every token (the collator's
            ``seq_idx``), any device, never read on the host; the masks are built from it when given (it
            must then describe the same samples as ``cu_seqlens``), else from ``cu_seqlens``.
        rows: ``B`` (1 with ``cu_seqlens``).
        device: where the masks live (default: ``seq_idx``'s device, else the CPU).

    Raises:
        ValueError: a bad ``chunk_size``, ``cu_seqlens`` not describing ``total`` tokens or with ``rows > 1``,
            ``seq_idx`` of the wrong shape.
        TypeError: non-integer boundaries.
    """
    L = _chunk_size(chunk_size)
    T = int(total)
    nc = -(-T // L)
    ends = nonempty = None
    num_seqs = None
    if cu_seqlens is not None:
        if rows != 1:
            raise ValueError(f"with cu_seqlens the batch dimension must be 1 (a packed row), got B={rows}")
        offsets = checked_host_cu_seqlens(cu_seqlens, T).tolist()  # one host read, validated against T
        if seq_idx is None:
            seq_idx = seq_idx_from_cu_seqlens(offsets, T)
        num_seqs = len(offsets) - 1
        last = [(n, offsets[n + 1] - 1) for n in range(num_seqs) if offsets[n + 1] > offsets[n]]
        dev = torch.device(device) if device is not None else torch.device("cpu")
        pos = torch.tensor([e for _, e in last], dtype=torch.int64)
        ends = tuple(t.to(dev) for t in (torch.zeros_like(pos), pos // L, pos % L))
        nonempty = torch.tensor([n for n, _ in last], dtype=torch.int64).to(dev)
    elif seq_idx is None:  # each row one sample
        dev = torch.device(device) if device is not None else torch.device("cpu")
        idx = torch.arange(rows, dtype=torch.int64)
        keep = idx if T > 0 else idx[:0]
        last_token = (keep, torch.full_like(keep, (T - 1) // L), torch.full_like(keep, (T - 1) % L))
        ends = tuple(t.to(dev) for t in last_token)
        nonempty = keep.to(dev)
        num_seqs = rows
        return SSDLayout(L, T, rows, None, None, None, None, ends, nonempty, num_seqs)
    if seq_idx.dtype.is_floating_point or seq_idx.dtype == torch.bool:
        raise TypeError(f"seq_idx must be an integer tensor, got dtype {seq_idx.dtype}")
    if seq_idx.dim() == 1:
        seq_idx = seq_idx[None]
    if seq_idx.dim() != 2 or seq_idx.shape[1] != T or seq_idx.shape[0] not in (1, rows):
        raise ValueError(f"seq_idx must be [B={rows}, T={T}] or [T], got shape {tuple(seq_idx.shape)}")
    dev = torch.device(device) if device is not None else seq_idx.device
    si = seq_idx.to(dev, torch.int64).expand(rows, T)
    if T == 0:  # no token: nothing to mask
        return SSDLayout(L, T, rows, None, None, None, None, ends, nonempty, num_seqs)
    pad = nc * L - T
    if pad:  # the padding continues the last sample (its tokens are zero: they change nothing)
        si = torch.cat([si, si[:, -1:].expand(rows, pad)], dim=1)
    si = si.reshape(rows, nc, L)
    # owner[i]: the sample of the state entering chunk i (= leaving chunk i - 1); owner[0]: the row's first
    owner = torch.cat([si[:, :1, 0], si[:, :, -1]], dim=1)  # [B, nc + 1]
    return SSDLayout(
        chunk_size=L,
        total=T,
        rows=rows,
        same=si[:, :, :, None] == si[:, :, None, :],
        to_end=si == owner[:, 1:, None],
        from_prev=si == owner[:, :-1, None],
        carry=owner[:, :, None] == owner[:, None, :],
        ends=ends,
        nonempty=nonempty,
        num_seqs=num_seqs,
    )


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = a[..., j+1] + ... + a[..., i]`` for ``j <= i`` (0 on the diagonal), ``-inf`` above:
    the log decay from token ``j`` to token ``i``, summed by a masked cumsum rather than as a difference of
    prefix sums (no cancellation)."""
    L = a.shape[-1]
    below = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1)
    grid = a[..., :, None].expand(*a.shape, L).masked_fill(~below, 0.0)  # grid[..., k, j] = a[k] for k > j
    sums = grid.cumsum(dim=-2)
    return sums.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=a.device).tril(), -math.inf)


def chunk_ssd_scan(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SSD scan in chunks of ``chunk_size`` tokens, the state reset at every sample boundary.

    Same arguments and results as :func:`varpack.ops.ssd.naive_recurrent_ssd_scan`, plus:

    Args:
        chunk_size: ``L`` (the result does not depend on it beyond rounding).
        seq_idx: ``[B, T]`` / ``[T]`` non-decreasing integer sample index of every token (the collator's
            ``seq_idx``; a sample is a run of equal values), any device, never read on the host; used when
            ``cu_seqlens`` is not given.
        layout: the batch's masks from :func:`prepare_ssd_layout` (built once, shared by every layer); wins
            over ``cu_seqlens`` / ``seq_idx``.

    Returns:
        ``(y, final_states)``: ``y`` ``[B, T, H, P]`` fp32 (fp64 for fp64 ``x``); ``final_states``
        ``[N, H, P, S]`` or ``None``.

    Raises:
        ValueError: as the naive scan; a ``layout`` for another ``T``, ``B`` or chunk size;
            ``return_final_states`` with only ``seq_idx`` (the samples' ends need host offsets).
        TypeError: as the naive scan.
    """
    limit = normalize_dt_limit(dt_limit)
    L = _chunk_size(chunk_size)
    Bsz, T, H, P, G, S, cu, si = check_inputs(x, dt, A, B, C, D, dt_bias, cu_seqlens, seq_idx)
    if layout is None:
        layout = prepare_ssd_layout(
            T, L, cu_seqlens=cu, seq_idx=None if cu is not None else si, rows=Bsz, device=x.device
        )
    elif (layout.total, layout.rows, layout.chunk_size) != (T, Bsz, L):
        raise ValueError(
            f"layout is for T={layout.total}, B={layout.rows}, chunk_size={layout.chunk_size}; the call has "
            f"T={T}, B={Bsz}, chunk_size={L}"
        )
    if return_final_states and layout.ends is None:
        raise ValueError("return_final_states needs cu_seqlens (the samples' last tokens), not only seq_idx")
    acc = acc_dtype(x)
    xs = x.to(acc)
    step = discretize_dt(dt, dt_bias, dt_softplus, limit).to(acc)  # [B, T, H]
    if T == 0:
        y = xs.new_zeros(Bsz, 0, H, P)
        return y, (xs.new_zeros(layout.num_seqs or 0, H, P, S) if return_final_states else None)
    nc = layout.num_chunks
    pad = nc * L - T
    Bh = F.pad(expand_groups(B.to(acc), H), (0, 0, 0, 0, 0, pad)).reshape(Bsz, nc, L, H, S)
    Ch = F.pad(expand_groups(C.to(acc), H), (0, 0, 0, 0, 0, pad)).reshape(Bsz, nc, L, H, S)
    xdt = F.pad(xs * step[..., None], (0, 0, 0, 0, 0, pad)).reshape(Bsz, nc, L, H, P)
    a = F.pad(step * A.to(acc), (0, 0, 0, pad)).reshape(Bsz, nc, L, H).permute(0, 3, 1, 2)  # [B, H, nc, L]
    a_cum = a.cumsum(dim=-1)

    def masked(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return t if mask is None else t * mask[:, None].to(acc)  # the mask broadcast over heads

    # 1. within each chunk: token l reads token m <= l of its own sample
    decay_in = masked(_segsum(a).exp(), layout.same)  # [B, H, nc, L(l), L(m)]
    scores = torch.einsum("bclhs,bcmhs->bhclm", Ch, Bh) * decay_in
    y = torch.einsum("bhclm,bcmhp->bclhp", scores, xdt)
    # 2. each chunk's end state, from the tokens of its last token's sample
    to_end = masked((a_cum[..., -1:] - a_cum).exp(), layout.to_end)  # [B, H, nc, L]
    states = torch.einsum("bcmhs,bhcm,bcmhp->bchps", Bh, to_end, xdt)  # [B, nc, H, P, S]
    # 3. the state entering each chunk: end states of earlier chunks, decayed, never across a boundary
    carry = masked(_segsum(F.pad(a_cum[..., -1], (1, 0))).exp(), layout.carry)  # [B, H, nc+1, nc+1]
    states = torch.cat([states.new_zeros(Bsz, 1, H, P, S), states], dim=1)
    entering = torch.einsum("bhij,bjhps->bihps", carry, states)[:, :-1]  # [B, nc, H, P, S]
    from_prev = masked(a_cum.exp(), layout.from_prev)  # [B, H, nc, L]
    y = y + torch.einsum("bclhs,bchps,bhcl->bclhp", Ch, entering, from_prev)
    y = y.reshape(Bsz, nc * L, H, P)[:, :T]
    if D is not None:
        y = y + D.to(acc)[:, None] * xs
    if not return_final_states:
        return y, None
    # the state after each sample's last token (row r, chunk c, offset o): its chunk's part + the entering one
    r, c, o = layout.ends
    within = torch.einsum("khm,kmhs,kmhp->khps", decay_in[r, :, c, o], Bh[r, c], xdt[r, c])
    before = entering[r, c] * from_prev[r, :, c, o][:, :, None, None]
    finals = xs.new_zeros(layout.num_seqs, H, P, S)
    finals = finals.index_copy(0, layout.nonempty, within + before)
    return y, finals
