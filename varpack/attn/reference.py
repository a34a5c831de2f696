"""``reference`` backend: one plain attention per segment, in fp32 (or fp64) math. The truth in tests.

Loops over the segments of ``cu_seqlens`` (reading their values with ``.tolist()``: a host sync, acceptable
for the reference), computes ``softmax(mask(softcap(q k^T * scale))) v`` for each with explicit PyTorch ops,
and concatenates. The segments are cut with one ``torch.split`` per tensor (:func:`split_segments`), so the
backward is one concatenation, O(T): a slice per segment would add a full-size zero gradient per segment in
the backward, O(N * T) for N segments. Supports every feature (GQA, causal / non-causal with bottom-right
alignment, sliding window, softcap, zero-length segments, attention sinks, a value head dim other than the
query / key one), any device, any floating dtype, and autograd.

Semantics follow flash-attn's ``flash_attn_varlen_func`` (Dao-AILab/flash-attention,
flash_attn/flash_attn_interface.py), including its convention that a query row with no visible key
(possible when a segment has fewer keys than queries, or with a window) outputs zeros.
"""

from __future__ import annotations

import math

import torch

from varpack.varlen.meta import VarlenMeta

from ._base import Backend, Capabilities

__all__ = [
    "ReferenceBackend",
    "read_offsets",
    "reference_varlen_attention",
    "segment_attention",
    "segment_mask",
    "split_segments",
]


def segment_mask(
    seqlen_q: int,
    seqlen_k: int,
    *,
    causal: bool,
    window_size: tuple[int, int] = (-1, -1),
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean ``[seqlen_q, seqlen_k]`` mask of one segment (True = query i may attend key j).

    flash-attn semantics: the diagonal is aligned bottom-right, ``diag(i) = i + seqlen_k - seqlen_q``;
    ``causal`` keeps ``j <= diag(i)``; ``window_size=(left, right)`` keeps
    ``diag(i) - left <= j <= diag(i) + right`` (``-1`` = unbounded on that side; causal forces right = 0).
    """
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    diag = i + (seqlen_k - seqlen_q)
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        mask &= j <= diag + right
    if left >= 0:
        mask &= j >= diag - left
    return mask


def reference_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    upcast: bool = True,
    meta: VarlenMeta | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-segment attention loop (the truth). Shapes as :func:`varpack.attn.varlen_attention`.

    Args:
        q: ``[Tq, H, D]``; k: ``[Tk, Hkv, D]``, v: ``[Tk, Hkv, Dv]`` with ``H % Hkv == 0``.
        cu_seqlens_q, cu_seqlens_k: ``[N+1]`` integer offsets (read on the host).
        meta: the batch's :class:`varpack.varlen.VarlenMeta` (its host offsets are read once per batch).
        upcast: compute in ``promote(dtype, float32)`` (default) and cast the output back; ``False`` computes
            in the input dtype, like a plain low-precision PyTorch implementation (the baseline of the
            fp32-truth tolerance rule: ``attention_ref(upcast=False)`` in flash-attn's tests).
        sinks: ``[H]`` attention-sink logits (GPT-OSS) or None: ``exp(sinks[h])`` joins every row's softmax
            denominator of head ``h`` (a key without a value), so a row's weights sum to less than 1.

    Returns:
        ``[Tq, H, Dv]`` in q's dtype.

    Raises:
        ValueError: cu_seqlens that do not start at 0, decrease, disagree in length, or do not end at
            Tq / Tk.
    """
    cu_q, cu_k = read_offsets(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], meta)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    compute_dtype = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    outs = [
        segment_attention(
            qs,
            ks,
            vs,
            causal=causal,
            window_size=window_size,
            scale=scale,
            softcap=softcap,
            compute_dtype=compute_dtype,
            sinks=sinks,
        )
        for qs, ks, vs in split_segments(q, k, v, cu_q, cu_k)
        if qs.shape[0] > 0
    ]
    if not outs:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    return torch.cat(outs, dim=0)


def read_offsets(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    total_q: int,
    total_k: int,
    meta: VarlenMeta | None = None,
) -> tuple[list[int], list[int]]:
    """cu_seqlens as Python lists: the batch meta's host offsets (kept once per batch; no device read for a
    meta built on the CPU), or, without a meta, a host copy validated by :class:`varpack.varlen.VarlenMeta`.

    Raises:
        ValueError: lengths differ, or offsets that do not start at 0, decrease, or miss Tq / Tk at the end.
        RuntimeError: the current CUDA stream is capturing a CUDA graph, wherever the offsets are: a host read
            cannot be captured (a graph replays device work only; offsets on the CPU would be baked into the graph
            for every later batch), so the backend is named instead of torch's CPU-copy error
            (:data:`varpack.integrations.cuda_graphs.GRAPH_BACKENDS` run captured).
    """
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "varlen attention reads cu_seqlens on the host (a per-segment backend: sdpa, reference), which a "
            "captured CUDA graph cannot; run the captured layers on triton_short or flash_attn_4 "
            "(varpack.integrations.cuda_graphs.graph_attention chooses one for attention 'auto')"
        )
    if meta is None:
        host_q = cu_seqlens_q.tolist()  # (tolist, not numpy: also works on functionalized tensors)
        host_k = host_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.tolist()
        meta = VarlenMeta(host_q, host_k, total_q=total_q, total_k=total_k)
    return meta.host_offsets()


def split_segments(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The ``(q, k, v)`` views of every segment, zero-length ones included: ``N`` triples of ``[Lq_n, H, D]``,
    ``[Lk_n, Hkv, D]``, ``[Lk_n, Hkv, D]``.

    One ``torch.split`` per tensor (lengths from the host offsets ``cu_q`` / ``cu_k`` of
    :func:`read_offsets`, which must end at ``q.shape[0]`` / ``k.shape[0]``). Autograd then runs one
    ``split`` backward per tensor, a single concatenation of the segment gradients (O(T)); slicing
    ``q[cu_q[n]:cu_q[n + 1]]`` per segment makes each slice's backward allocate and add a zero-filled gradient
    of the whole ``q`` (O(N * T) time and memory traffic for N segments). The views and so the results are
    the same.
    """
    if len(cu_q) < 2:
        return []
    lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    return list(zip(q.split(lens_q), k.split(lens_k), v.split(lens_k)))


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    window_size: tuple[int, int],
    scale: float,
    softcap: float,
    compute_dtype: torch.dtype,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one segment, explicit math: q ``[Lq, H, D]``, k ``[Lk, Hkv, D]``, v ``[Lk, Hkv, Dv]`` ->
    ``[Lq, H, Dv]`` in q's dtype. Rows without a visible key (and ``Lk == 0``) give 0, as in flash-attn.
    ``sinks`` (``[H]`` or None): a per-head logit in every row's softmax denominator, without a value."""
    len_q, num_heads = q.shape[0], q.shape[1]
    len_k, num_kv_heads = k.shape[0], k.shape[1]
    if len_k == 0:  # no key at all: flash-attn writes zeros
        return q.new_zeros(len_q, num_heads, v.shape[-1]) + 0 * q[:, :, :1]
    groups = num_heads // num_kv_heads
    qi = q.to(compute_dtype).transpose(0, 1)  # [H, Lq, D]
    ki = k.to(compute_dtype).repeat_interleave(groups, dim=1).transpose(0, 1)  # [H, Lk, D]
    vi = v.to(compute_dtype).repeat_interleave(groups, dim=1).transpose(0, 1)  # [H, Lk, Dv]
    scores = torch.matmul(qi, ki.transpose(-1, -2)) * scale  # [H, Lq, Lk]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    mask = segment_mask(len_q, len_k, causal=causal, window_size=window_size, device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    sink = None
    if sinks is not None:
        sink = sinks.to(compute_dtype).view(-1, 1, 1)  # [H, 1, 1]
        row_max = torch.maximum(row_max, sink.detach())
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = torch.exp(scores - row_max)
    denom = probs.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - row_max)
    probs = probs / torch.where(denom == 0, torch.ones_like(denom), denom)
    return torch.matmul(probs, vi).transpose(0, 1).to(q.dtype)


class ReferenceBackend(Backend):
    name = "reference"
    capabilities = Capabilities(
        devices=frozenset({"*"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        host_sync=True,
        sinks=True,
        distinct_v_head_dim=True,
        notes="per-segment loop in fp32 math; exact, slow (reads cu_seqlens on the host)",
    )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        causal: bool,
        window_size: tuple[int, int],
        softmax_scale: float,
        softcap: float,
        meta: VarlenMeta | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return reference_varlen_attention(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            causal=causal,
            window_size=window_size,
            softmax_scale=softmax_scale,
            softcap=softcap,
            meta=meta,
            sinks=sinks,
        )
