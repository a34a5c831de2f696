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
Blocks whose mask is empty everywhere (no document shared) are skipped, read once per batch on the host.

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
def _ring_plan(shard: ContextParallelShard, meta: VarlenMeta) -> dict[str, Any]:
    """Per batch, on the host: every rank's token positions and document ids, and which (query rank, key
    rank) blocks share a document at all (an empty block is skipped). Kept on the shard."""

    def build() -> dict[str, Any]:
        seq = meta.seq_idx().to("cpu").reshape(-1).to(torch.int64)
        pos = [shard.rank_index(r) for r in range(shard.size)]
        doc = [seq[p] for p in pos]
        spans = [(int(d.min()), int(d.max())) if d.numel() else (1, 0) for d in doc]
        live = [[max(spans[a][0], spans[b][0]) <= min(spans[a][1], spans[b][1]) for b in range(shard.size)]
                for a in range(shard.size)]  # fmt: skip
        return {"pos": pos, "doc": doc, "live": live}

    return shard.memo(("ring_plan", meta.total_q), build)


def _ring_on(shard: ContextParallelShard, meta: VarlenMeta, device: torch.device) -> dict[str, Any]:
    plan = _ring_plan(shard, meta)
    if device.type == "cpu":
        return plan

    def copy() -> dict[str, Any]:
        return {
            "pos": [p.to(device, non_blocking=True) for p in plan["pos"]],
            "doc": [d.to(device, non_blocking=True) for d in plan["doc"]],
            "live": plan["live"],
        }

    return shard.memo(("ring_plan", meta.total_q, str(device)), copy)


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


def _block_forward(q32, k32, v32, mask, scale):
    """Explicit fp32 attention of one block: ``(out [Tq, H, D], lse [H, Tq])``; rows without any visible key
    get ``lse = -inf`` and a zero output."""
    s = torch.einsum("qhd,khd->hqk", q32, k32) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).masked_fill(~mask, 0.0)
    return torch.einsum("hqk,khd->qhd", p, v32), lse


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


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, shard, plan, scale, causal, window):  # noqa: D102
        n, r = shard.size, shard.rank
        heads, kv_heads = q.shape[1], k.shape[1]
        groups = heads // kv_heads
        q32 = q.float()
        kk, vv = k.contiguous(), v.contiguous()
        out = lse = None
        for step in range(n):
            src = (r - step) % n
            reqs = None
            if step < n - 1:  # the next block travels while this one is computed
                nxt_src = (r - step - 1) % n
                shape = (shard.counts[nxt_src], kv_heads, k.shape[-1])
                reqs, bufs = _exchange(
                    [kk, vv], [shape, (shard.counts[nxt_src], kv_heads, v.shape[-1])], shard, k.dtype
                )
            if plan["live"][r][src]:
                mask = _block_mask(
                    plan["pos"][r], plan["doc"][r], plan["pos"][src], plan["doc"][src], causal, window
                )
                o_b, lse_b = _block_forward(
                    q32, _expand(kk.float(), groups), _expand(vv.float(), groups), mask, scale
                )
                if out is None:  # step 0: every query sees itself, so lse is finite from here on
                    out, lse = o_b, lse_b
                else:
                    new = torch.logaddexp(lse, lse_b)
                    out = (
                        out * torch.exp(lse - new).transpose(0, 1)[..., None]
                        + o_b * torch.exp(lse_b - new).transpose(0, 1)[..., None]
                    )
                    lse = new
            if reqs is not None:
                _wait(reqs)
                kk, vv = bufs
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.shard, ctx.plan, ctx.scale, ctx.causal, ctx.window = shard, plan, scale, causal, window
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):  # noqa: D102
        q, k, v, out, lse = ctx.saved_tensors
        shard, plan = ctx.shard, ctx.plan
        n, r = shard.size, shard.rank
        heads, kv_heads = q.shape[1], k.shape[1]
        groups = heads // kv_heads
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
                nxt_src = (r - step - 1) % n
                reqs, bufs = _exchange(
                    [kk, vv],
                    [
                        (shard.counts[nxt_src], kv_heads, k.shape[-1]),
                        (shard.counts[nxt_src], kv_heads, v.shape[-1]),
                    ],
                    shard,
                    k.dtype,
                )
            if plan["live"][r][src]:
                mask = _block_mask(
                    plan["pos"][r], plan["doc"][r], plan["pos"][src], plan["doc"][src], ctx.causal, ctx.window
                )
                k32, v32 = _expand(kk.float(), groups), _expand(vv.float(), groups)
                s = torch.einsum("qhd,khd->hqk", q32, k32) * ctx.scale
                p = torch.exp(s - lse[..., None]).masked_fill(~mask, 0.0)  # [H, Tq, Tk]
                dp = torch.einsum("qhd,khd->hqk", do32, v32)
                ds = p * (dp - delta[..., None])
                dq += torch.einsum("hqk,khd->qhd", ds, k32) * ctx.scale
                dk_b = torch.einsum("hqk,qhd->khd", ds, q32) * ctx.scale
                dv_b = torch.einsum("hqk,qhd->khd", p, do32)
                if groups > 1:
                    dk_b = dk_b.reshape(dk_b.shape[0], kv_heads, groups, -1).sum(2)
                    dv_b = dv_b.reshape(dv_b.shape[0], kv_heads, groups, -1).sum(2)
                dk, dv = dk + dk_b, dv + dv_b
            # the block's gradient travels on with it: after n hops it is back on the rank that owns the block
            dreqs, dbufs = _exchange(
                [dk, dv],
                [
                    (shard.counts[(src - 1) % n], kv_heads, k.shape[-1]),
                    (shard.counts[(src - 1) % n], kv_heads, v.shape[-1]),
                ],
                shard,
                torch.float32,
            )
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
    plan = _ring_on(shard, meta, q.device)
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
