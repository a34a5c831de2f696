"""Attention (and any per-head / per-channel token mixer) over a packed row split across a context-parallel
group: Ulysses all-to-all and ring attention.

The ``N`` ranks of a group each hold ``T_r`` tokens of one packed row of ``T`` tokens
(:class:`varpack.varlen.shard.ContextParallelShard`); the row's boundaries are the batch's whole-row
:class:`varpack.varlen.VarlenMeta`. Two ways to attend over the whole row:

**Ulysses** (:func:`ulysses_attention`; DeepSpeed-Ulysses, arXiv:2309.14509). One all-to-all turns the
sequence shards ``[T_r, H, D]`` into head shards ``[T, H/N, D]`` (every token of the row, ``H/N`` heads), in
row order; each rank runs :func:`varpack.attn.varlen_attention` with the whole row's ``meta`` (any backend,
the same call as without context parallelism) for its heads; a second all-to-all brings the output back to
the sequence shards. Exact with every backend. Needs ``H % N == 0``; key/value heads that do not divide
``N`` are replicated (each KV head repeated ``N / gcd(Hkv, N)`` times, the smallest count that divides
over the ranks while keeping every query head with its own KV head), which costs all-to-all volume, not
exactness. :func:`seq_to_heads` / :func:`heads_to_seq` are the two all-to-alls, also used for the gated
delta rule and its short convolution (per head / per channel) in
:mod:`varpack.integrations.gated_delta`.

**Ring attention** (:func:`ring_attention`; Liu et al., arXiv:2310.01889). Queries stay where they are;
key/value blocks travel round the ring (rank ``r`` sends to ``r + 1``), ``N`` steps. At each step a rank
attends its queries to the visiting block under the block-diagonal causal mask of the WHOLE row
(query and key in one document, key position <= query position, both read from the global token positions
of the split and the row's ``seq_idx``), and merges the partial output with the running one through the
log-sum-exp: ``lse = logaddexp(lse_a, lse_b)``, ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``.
The backward passes the key/value blocks round the ring again with their gradient accumulators, which end
where the block lives. It needs no head divisibility (the mode where heads do not divide ``N``) and holds
one visiting block at a time. The per-block math is explicit fp32 math (as the ``reference`` backend:
varpack's kernels do not return the log-sum-exp), with a custom backward that recomputes the block's
probabilities from the saved log-sum-exp (FlashAttention's backward: ``dS = P * (dP - rowsum(dO * O))``).
A block is computed in tiles of :data:`RING_QUERY_TILE` queries, each against the contiguous range of the
block's keys its documents can see (found once per batch on the host): the block-diagonal mask's sparsity
is skipped, not computed and masked.

Communication uses torch.distributed's building blocks: the functional all-to-all with autograd
(``torch.distributed._functional_collectives.all_to_all_single_autograd``) for Ulysses, ``batch_isend_irecv``
for the ring; CPU (gloo) and GPU (NCCL) alike.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from varpack.varlen.meta import VarlenMeta
from varpack.varlen.shard import ContextParallelShard

__all__ = [
    "CONTEXT_PARALLEL_ATTENTION",
    "RING_BACKENDS",
    "context_parallel_attention",
    "heads_to_seq",
    "kv_replication",
    "resolve_context_parallel_attention",
    "ring_attention",
    "seq_to_heads",
    "ulysses_attention",
]

#: the attention modes of ``--context-parallel-attention``
CONTEXT_PARALLEL_ATTENTION = ("auto", "ulysses", "ring")
#: attention backends ring attention accepts: its blocks run varpack's explicit fp32 math (the log-sum-exp
#: merge needs each block's log-sum-exp, which varpack's kernels do not return); a forced other backend is
#: refused rather than silently replaced
RING_BACKENDS = ("auto", "reference")


def _a2a(
    x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int], group: Any
) -> torch.Tensor:
    from torch.distributed import _functional_collectives as fc

    out = fc.all_to_all_single_autograd(x.contiguous(), output_split_sizes, input_split_sizes, group)
    return fc.wait_tensor(out)


def seq_to_heads(x: torch.Tensor, shard: ContextParallelShard) -> torch.Tensor:
    """All-to-all from sequence shards to head shards, with autograd.

    Args:
        x: ``[T_r, C, ...]`` this rank's tokens (``T_r = shard.num_local``), ``C`` heads or channels with
            ``C % N == 0``; rank ``j`` receives ``x[:, j * C/N : (j + 1) * C/N]``.
        shard: a bound shard (:meth:`~varpack.varlen.shard.ContextParallelShard.bind`).

    Returns:
        ``[T, C/N, ...]``: every token of the row, in row order, for this rank's ``C/N`` heads / channels.

    Raises:
        ValueError: ``C`` not divisible by ``N``, ``x`` not ``T_r`` long, an unbound shard.
    """
    n, local = shard.size, shard.num_local
    _bound(shard)
    if x.shape[0] != local or x.shape[1] % n:
        raise ValueError(
            f"seq_to_heads: x of shape {tuple(x.shape)} on rank {shard.rank} must be [T_r={local}, C, ...] with "
            f"C divisible by the {n} context-parallel ranks"
        )
    rest = tuple(x.shape[2:])
    per = x.shape[1] // n
    blocks = x.reshape(local, n, per, *rest).transpose(0, 1).reshape(n * local, per, *rest)
    y = _a2a(
        blocks, list(shard.counts), [local] * n, shard.group
    )  # [T] in layout order (rank 0's tokens, ...)
    return y.index_select(0, shard.on("inverse", y.device))


def heads_to_seq(y: torch.Tensor, shard: ContextParallelShard) -> torch.Tensor:
    """All-to-all from head shards back to sequence shards, with autograd (the inverse of :func:`seq_to_heads`).

    Args:
        y: ``[T, c, ...]`` every token of the row in row order, this rank's ``c`` heads / channels.
        shard: a bound shard.

    Returns:
        ``[T_r, c * N, ...]``: this rank's tokens with every rank's heads (rank ``j``'s at ``[j * c, (j + 1) * c)``).

    Raises:
        ValueError: ``y`` not ``T`` long, an unbound shard.
    """
    n, local = shard.size, shard.num_local
    _bound(shard)
    if y.shape[0] != shard.total:
        raise ValueError(
            f"heads_to_seq: y of shape {tuple(y.shape)} must have the row's T={shard.total} tokens"
        )
    rest = tuple(y.shape[1:])
    y = y.index_select(0, shard.on("order", y.device))  # row order -> layout order
    x = _a2a(y, [local] * n, list(shard.counts), shard.group)  # [N * T_r, c, ...]: rank j's heads in block j
    c = rest[0]
    return x.reshape(n, local, c, *rest[1:]).transpose(0, 1).reshape(local, n * c, *rest[1:])


def _bound(shard: ContextParallelShard) -> None:
    if shard.group is None:
        raise ValueError(
            "the context-parallel shard is not bound to a process group: the model's packing guard binds it "
            "(varpack.integrations.context_parallel.enable_context_parallel)"
        )


def kv_replication(num_heads: int, num_kv_heads: int, size: int) -> int:
    """How many times Ulysses repeats each key/value head so that they divide over ``size`` ranks: 1 when
    ``num_kv_heads % size == 0``, else ``size // gcd(num_kv_heads, size)`` (then ``num_kv_heads * rep`` divides
    ``num_heads`` and ``size``, and every query head keeps its own key/value head).

    Raises:
        ValueError: ``num_heads % size != 0`` (Ulysses cannot split the query heads: ring attention can) or
            ``num_heads % num_kv_heads != 0``.
    """
    if num_heads % size:
        raise ValueError(
            f"Ulysses splits the {num_heads} attention heads over {size} context-parallel ranks, which does not "
            "divide; use ring attention (--context-parallel-attention ring or auto)"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} key/value heads")
    return 1 if num_kv_heads % size == 0 else size // math.gcd(num_kv_heads, size)


def resolve_context_parallel_attention(mode: str, num_heads: int, size: int) -> str:
    """``"ulysses"`` or ``"ring"`` for an attention layer of ``num_heads`` heads over ``size`` ranks:
    ``auto`` takes Ulysses where the heads divide (exact with every backend, two all-to-alls per layer),
    ring attention where they do not.

    Raises:
        ValueError: an unknown mode; ``"ulysses"`` with heads that do not divide.
    """
    if mode not in CONTEXT_PARALLEL_ATTENTION:
        raise ValueError(
            f"unknown context-parallel attention {mode!r}; choose one of {list(CONTEXT_PARALLEL_ATTENTION)}"
        )
    if mode == "auto":
        return "ulysses" if num_heads % size == 0 else "ring"
    if mode == "ulysses" and num_heads % size:
        kv_replication(num_heads, num_heads, size)  # raises, naming the heads
    return mode


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    meta: VarlenMeta,
    shard: ContextParallelShard,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Varlen attention of a context-parallel shard through two all-to-alls (module docstring).

    Args:
        q: ``[T_r, H, D]`` this rank's queries; k, v: ``[T_r, Hkv, D]``.
        meta: the whole row's boundaries (``total_q == shard.total``).
        shard: the bound shard of this rank.
        causal, window_size, softmax_scale, softcap, backend: as :func:`varpack.attn.varlen_attention`.

    Returns:
        ``[T_r, H, D]`` in q's dtype.

    Raises:
        ValueError: ``H % N != 0`` (use ring attention), a meta of another row, an unbound shard; the errors of
            :func:`varpack.attn.varlen_attention`.
    """
    from varpack.attn.interface import varlen_attention

    if meta.total_q != shard.total:
        raise ValueError(
            f"the boundaries cover {meta.total_q} tokens, the context-parallel row {shard.total}"
        )
    rep = kv_replication(q.shape[1], k.shape[1], shard.size)
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    n, local = shard.size, shard.num_local
    hq, hk = q.shape[1] // n, k.shape[1] // n
    if q.shape[-1] == k.shape[-1] == v.shape[-1] and q.dtype == k.dtype == v.dtype:
        # one all-to-all for q, k and v: each rank's heads of the three side by side
        both = torch.cat(
            [q.reshape(local, n, hq, -1), k.reshape(local, n, hk, -1), v.reshape(local, n, hk, -1)], dim=2
        )
        qkv = seq_to_heads(both.reshape(local, n * (hq + 2 * hk), -1), shard)
        qh, kh, vh = torch.split(qkv, [hq, hk, hk], dim=1)
    else:
        qh, kh, vh = seq_to_heads(q, shard), seq_to_heads(k, shard), seq_to_heads(v, shard)
    out = varlen_attention(
        qh.contiguous(),
        kh.contiguous(),
        vh.contiguous(),
        causal=causal,
        window_size=window_size,
        softmax_scale=softmax_scale,
        softcap=softcap,
        backend=backend,
        meta=meta,
    )
    return heads_to_seq(out, shard)


# -----------------------------------------------------------------------------------------------------------
# ring attention
# -----------------------------------------------------------------------------------------------------------
#: queries per tile of a ring step: a tile attends only the keys of the visiting block that its documents
#: can see (a contiguous range, found once per batch on the host), so a step's scores are at most
#: ``H x RING_QUERY_TILE x keys of those documents`` fp32 values, and short documents cost only their own
#: blocks (the block-diagonal mask's sparsity). 1024 keeps that to 2 GiB for 16 heads and 32K visible keys.
RING_QUERY_TILE = 1024


def _ring_plan(shard: ContextParallelShard, meta: VarlenMeta, causal: bool) -> dict[str, Any]:
    """Per batch, on the host, for this rank's queries: every rank's token positions and document ids, and per
    visiting block ``src`` the tiles ``(q0, q1, k0, k1)``: queries ``[q0, q1)`` of this rank may see only keys
    ``[k0, k1)`` of rank ``src`` (from the first query's document start to the last query's position, or its
    document's end without causality; the mask inside is exact). Tiles with no key are left out. Kept on the
    shard."""

    def build() -> dict[str, Any]:
        seq = meta.seq_idx().to("cpu").reshape(-1).to(torch.int64)
        starts = torch.tensor(meta.host_offsets()[0], dtype=torch.int64)
        pos = [shard.rank_index(r) for r in range(shard.size)]
        doc = [seq[p] for p in pos]
        q_pos, q_doc = pos[shard.rank], doc[shard.rank]
        tiles: list[list[tuple[int, int, int, int]]] = []
        for src in range(shard.size):
            keys = pos[src].contiguous()
            per_src = []
            for q0 in range(0, q_pos.numel(), RING_QUERY_TILE):
                q1 = min(q_pos.numel(), q0 + RING_QUERY_TILE)
                lo = starts[q_doc[q0]]
                hi = q_pos[q1 - 1] if causal else starts[q_doc[q1 - 1] + 1] - 1
                k0 = int(torch.searchsorted(keys, lo.reshape(1), right=False))
                k1 = int(torch.searchsorted(keys, hi.reshape(1), right=True))
                if k1 > k0:
                    per_src.append((q0, q1, k0, k1))
            tiles.append(per_src)
        return {"pos": pos, "doc": doc, "tiles": tiles}

    return shard.memo(("ring_plan", meta.total_q, bool(causal)), build)


def _ring_on(
    shard: ContextParallelShard, meta: VarlenMeta, causal: bool, device: torch.device
) -> dict[str, Any]:
    plan = _ring_plan(shard, meta, causal)
    if device.type == "cpu":
        return plan

    def copy() -> dict[str, Any]:
        return {
            "pos": [p.to(device, non_blocking=True) for p in plan["pos"]],
            "doc": [d.to(device, non_blocking=True) for d in plan["doc"]],
            "tiles": plan["tiles"],
        }

    return shard.memo(("ring_plan", meta.total_q, bool(causal), str(device)), copy)


def _block_mask(
    pos_q: torch.Tensor, doc_q: torch.Tensor, pos_k: torch.Tensor, doc_k: torch.Tensor, causal: bool,
    window: tuple[int, int],
) -> torch.Tensor:  # fmt: skip
    """``[Tq, Tk]`` bool: query i may attend key j (same document; causal / window from global positions,
    flash-attn's semantics for self-attention, where the bottom-right diagonal is the main one)."""
    pq, pk = pos_q[:, None], pos_k[None, :]
    mask = doc_q[:, None] == doc_k[None, :]
    left, right = int(window[0]), int(window[1])
    if causal:
        right = 0
    if right >= 0:
        mask &= pk <= pq + right
    if left >= 0:
        mask &= pk >= pq - left
    return mask


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _tile_scores(ctx_like: dict, q32, k32, r: int, src: int, tile, scale) -> torch.Tensor:
    """Masked scores ``[H, q1 - q0, k1 - k0]`` of one tile (``-inf`` where the mask forbids)."""
    q0, q1, k0, k1 = tile
    plan = ctx_like["plan"]
    mask = _block_mask(
        plan["pos"][r][q0:q1], plan["doc"][r][q0:q1], plan["pos"][src][k0:k1], plan["doc"][src][k0:k1],
        ctx_like["causal"], ctx_like["window"],
    )  # fmt: skip
    s = torch.einsum("qhd,khd->hqk", q32[q0:q1], k32[k0:k1]) * scale
    return s.masked_fill(~mask, float("-inf"))


def _merge(out, lse, o_b, lse_b, q0, q1) -> None:
    """Merge a tile's partial attention into the running one, in place, through the log-sum-exp; a side
    whose ``lse`` is ``-inf`` (no key seen yet / in this tile) weighs 0."""
    a, o_a = lse[:, q0:q1], out[q0:q1]
    new = torch.logaddexp(a, lse_b)
    w_a = torch.where(torch.isneginf(a), torch.zeros_like(a), torch.exp(a - new))
    w_b = torch.where(torch.isneginf(lse_b), torch.zeros_like(lse_b), torch.exp(lse_b - new))
    out[q0:q1] = o_a * w_a.transpose(0, 1)[..., None] + o_b * w_b.transpose(0, 1)[..., None]
    lse[:, q0:q1] = new


def _exchange(sends: list[torch.Tensor], recv_shapes: list[tuple], shard: ContextParallelShard, dtype) -> Any:
    """Send ``sends`` to the next rank of the ring and receive tensors of ``recv_shapes`` from the previous
    one (non-blocking): ``(requests, received)``."""
    group, n, r = shard.group, shard.size, shard.rank
    nxt = dist.get_global_rank(group, (r + 1) % n)
    prv = dist.get_global_rank(group, (r - 1) % n)
    device = sends[0].device
    bufs = [torch.empty(s, dtype=dtype, device=device) for s in recv_shapes]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in sends]
    ops += [dist.P2POp(dist.irecv, b, prv, group) for b in bufs]
    return dist.batch_isend_irecv(ops), bufs


def _wait(reqs: Any) -> None:
    for req in reqs:
        req.wait()


def _kv_shapes(shard: ContextParallelShard, src: int, k: torch.Tensor, v: torch.Tensor) -> list[tuple]:
    return [(shard.counts[src], k.shape[1], k.shape[-1]), (shard.counts[src], v.shape[1], v.shape[-1])]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, shard, plan, scale, causal, window):  # noqa: D102
        n, r = shard.size, shard.rank
        groups = q.shape[1] // k.shape[1]
        info = {"plan": plan, "causal": causal, "window": window}
        q32 = q.float()
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
        kk, vv = k.contiguous(), v.contiguous()
        for step in range(n):
            src = (r - step) % n
            reqs = None
            if step < n - 1:  # the next block travels while this one is computed
                reqs, bufs = _exchange([kk, vv], _kv_shapes(shard, (src - 1) % n, k, v), shard, k.dtype)
            if plan["tiles"][src]:
                k32, v32 = _expand(kk.float(), groups), _expand(vv.float(), groups)
                for tile in plan["tiles"][src]:
                    q0, q1, k0, k1 = tile
                    s = _tile_scores(info, q32, k32, r, src, tile, scale)
                    lse_b = torch.logsumexp(s, dim=-1)  # [H, q1 - q0]; -inf for a row with no key here
                    p = torch.exp(s - torch.where(torch.isneginf(lse_b), 0.0, lse_b)[..., None])
                    _merge(out, lse, torch.einsum("hqk,khd->qhd", p, v32[k0:k1]), lse_b, q0, q1)
            if reqs is not None:
                _wait(reqs)
                kk, vv = bufs
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.shard, ctx.info, ctx.scale = shard, info, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):  # noqa: D102
        q, k, v, out, lse = ctx.saved_tensors
        shard, info, plan = ctx.shard, ctx.info, ctx.info["plan"]
        n, r = shard.size, shard.rank
        kv_heads = k.shape[1]
        groups = q.shape[1] // kv_heads
        q32, do32 = q.float(), dout.float()
        delta = (do32 * out).sum(-1).transpose(0, 1)  # [H, Tq]
        dq = torch.zeros_like(q32)
        kk, vv = k.contiguous(), v.contiguous()
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for step in range(n):
            src = (r - step) % n
            reqs = None
            if step < n - 1:
                reqs, bufs = _exchange([kk, vv], _kv_shapes(shard, (src - 1) % n, k, v), shard, k.dtype)
            if plan["tiles"][src]:
                k32, v32 = _expand(kk.float(), groups), _expand(vv.float(), groups)
                dk_e, dv_e = torch.zeros_like(k32), torch.zeros_like(v32)
                for tile in plan["tiles"][src]:
                    q0, q1, k0, k1 = tile
                    p = torch.exp(_tile_scores(info, q32, k32, r, src, tile, ctx.scale) - lse[:, q0:q1, None])
                    dp = torch.einsum("qhd,khd->hqk", do32[q0:q1], v32[k0:k1])
                    ds = p * (dp - delta[:, q0:q1, None])
                    dq[q0:q1] += torch.einsum("hqk,khd->qhd", ds, k32[k0:k1]) * ctx.scale
                    dk_e[k0:k1] += torch.einsum("hqk,qhd->khd", ds, q32[q0:q1]) * ctx.scale
                    dv_e[k0:k1] += torch.einsum("hqk,qhd->khd", p, do32[q0:q1])
                if groups > 1:  # the repeated heads' gradients back onto their key/value head
                    dk_e = dk_e.reshape(dk_e.shape[0], kv_heads, groups, -1).sum(2)
                    dv_e = dv_e.reshape(dv_e.shape[0], kv_heads, groups, -1).sum(2)
                dk, dv = dk + dk_e, dv + dv_e
            if n == 1:
                break
            # the block's gradient travels on with it: after n hops it is back on the rank that owns the block
            dreqs, dbufs = _exchange([dk, dv], _kv_shapes(shard, (src - 1) % n, dk, dv), shard, torch.float32)
            if reqs is not None:
                _wait(reqs)
                kk, vv = bufs
            _wait(dreqs)
            dk, dv = dbufs
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    meta: VarlenMeta,
    shard: ContextParallelShard,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Varlen ring attention of a context-parallel shard (module docstring).

    Args:
        q: ``[T_r, H, D]`` this rank's queries; k, v: ``[T_r, Hkv, D]`` (``H % Hkv == 0``; no head divisibility
            by ``N`` needed).
        meta: the whole row's boundaries (its ``seq_idx`` gives every token's document).
        shard: the bound shard of this rank.
        causal, window_size, softmax_scale: as :func:`varpack.attn.varlen_attention`.
        softcap: must be 0.

    Returns:
        ``[T_r, H, D]`` in q's dtype (computed in fp32).

    Raises:
        ValueError: ``softcap`` (not implemented in the ring's blocks), a meta of another row, an unbound
            shard, ``H % Hkv != 0``.
    """
    _bound(shard)
    if softcap:
        raise ValueError(
            f"ring attention does not implement softcap={softcap}; use Ulysses (heads must divide)"
        )
    if meta.total_q != shard.total:
        raise ValueError(
            f"the boundaries cover {meta.total_q} tokens, the context-parallel row {shard.total}"
        )
    if q.shape[0] != shard.num_local or k.shape[0] != shard.num_local:
        raise ValueError(f"ring attention on rank {shard.rank}: q/k must hold its {shard.num_local} tokens")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    plan = _ring_on(shard, meta, causal, q.device)
    return _RingAttention.apply(q, k, v, shard, plan, scale, causal, tuple(window_size))


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    meta: VarlenMeta,
    shard: ContextParallelShard,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of a context-parallel shard: Ulysses or ring attention as the shard's mode resolves for these
    heads (:func:`resolve_context_parallel_attention`). Shapes as :func:`ulysses_attention`.

    Raises:
        ValueError: forced Ulysses with heads that do not divide; ring attention with a forced backend other
            than :data:`RING_BACKENDS` or with ``softcap``; the errors of the chosen path.
    """
    mode = resolve_context_parallel_attention(shard.attention or "auto", q.shape[1], shard.size)
    if mode == "ulysses":
        return ulysses_attention(
            q, k, v, meta=meta, shard=shard, causal=causal, window_size=window_size,
            softmax_scale=softmax_scale, softcap=softcap, backend=backend,
        )  # fmt: skip
    if backend not in RING_BACKENDS:
        raise ValueError(
            f"ring attention runs its blocks in varpack's explicit fp32 math (it merges them through each block's "
            f"log-sum-exp, which the {backend!r} backend does not return here); use --attn-backend auto or "
            "reference, or Ulysses (attention heads divisible by --context-parallel)"
        )
    return ring_attention(
        q, k, v, meta=meta, shard=shard, causal=causal, window_size=window_size, softmax_scale=softmax_scale,
        softcap=softcap,
    )  # fmt: skip
