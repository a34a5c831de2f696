"""``sdpa`` backend: a per-segment loop over ``torch.nn.functional.scaled_dot_product_attention``.

The fast exact path where no varlen kernel exists (the CPU; ``auto``'s first choice there). Like the
reference it reads cu_seqlens on the host (a device sync per layer on a GPU, so on CUDA ``auto`` places it
after every varlen kernel) and cuts the segments with one ``torch.split`` per tensor
(``reference.split_segments``), so the backward is O(T) where a slice per segment would cost O(N * T).
Segments with as many queries as keys go through SDPA (``is_causal`` is exact there because top-left and
bottom-right alignment coincide; a window becomes an explicit boolean mask, which always keeps the diagonal,
so no row is empty). Segments with ``Lq != Lk`` use the reference's explicit math (bottom-right alignment,
empty rows -> 0). No softcap (SDPA has no score modifier). A value head dim other than the query / key one
(MLA) is SDPA's own ``Ev``. Attention sinks: one extra key per segment whose key and value are zero and whose
additive score (a float ``attn_mask`` column) is the head's sink logit, so ``exp(sink)`` joins the softmax
denominator and adds nothing to the output; the sink's gradient flows through the mask.

Source: ``torch.nn.functional.scaled_dot_product_attention`` (``enable_gqa`` since torch 2.5).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ._base import Backend, Capabilities
from .reference import read_offsets, segment_attention, segment_mask, split_segments

if TYPE_CHECKING:
    from varpack.varlen.meta import VarlenMeta

__all__ = ["SdpaBackend"]


def _segment_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    causal: bool,
    window_size: tuple[int, int],
    scale: float,
    gqa: bool,
) -> torch.Tensor:
    """One segment (``Lq == Lk``) with sinks: SDPA over the segment's keys plus a zero key / zero value whose
    additive score is ``sinks[h]``. Returns ``[L, H, Dv]``."""
    length, num_heads = q.shape[0], q.shape[1]
    allowed = segment_mask(length, length, causal=causal, window_size=window_size, device=q.device)
    bias = torch.zeros(length, length + 1, dtype=q.dtype, device=q.device)
    bias[:, :length] = bias[:, :length].masked_fill(~allowed, float("-inf"))
    sink_col = sinks.to(q.dtype).view(num_heads, 1, 1).expand(num_heads, length, 1)
    mask = torch.cat([bias[:, :length].expand(num_heads, length, length), sink_col], dim=-1)
    k_ext = torch.cat([k, k.new_zeros(1, k.shape[1], k.shape[2])])
    v_ext = torch.cat([v, v.new_zeros(1, v.shape[1], v.shape[2])])
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k_ext.transpose(0, 1),
        v_ext.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=gqa,
    )
    return out.transpose(0, 1)


class SdpaBackend(Backend):
    name = "sdpa"
    capabilities = Capabilities(
        devices=frozenset({"*"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        host_sync=True,
        softcap=False,
        sinks=True,
        distinct_v_head_dim=True,
        notes="per-segment torch SDPA loop (reads cu_seqlens on the host); the fast exact CPU path",
    )

    def _probe(self) -> tuple[bool, str]:
        # a builtin without an introspectable signature: its docstring lists the keywords
        if "enable_gqa" not in (F.scaled_dot_product_attention.__doc__ or ""):
            return False, f"torch {torch.__version__} SDPA has no enable_gqa (needs torch >= 2.5)"
        return True, f"torch {torch.__version__} scaled_dot_product_attention"

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
        cu_q, cu_k = read_offsets(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], meta)
        left, right = window_size
        windowed = left >= 0 or (right >= 0 and not causal)
        gqa = q.shape[1] != k.shape[1]
        outs: list[torch.Tensor] = []
        # one split per tensor, not a slice per segment: the backward stays O(T) (see split_segments)
        for qs, ks, vs in split_segments(q, k, v, cu_q, cu_k):
            len_q, len_k = qs.shape[0], ks.shape[0]
            if len_q == 0:
                continue
            if len_q != len_k:
                outs.append(
                    segment_attention(
                        qs,
                        ks,
                        vs,
                        causal=causal,
                        window_size=window_size,
                        scale=softmax_scale,
                        softcap=softcap,
                        compute_dtype=torch.promote_types(q.dtype, torch.float32),
                        sinks=sinks,
                    )
                )
                continue
            if sinks is not None:
                outs.append(_segment_with_sinks(qs, ks, vs, sinks, causal, window_size, softmax_scale, gqa))
                continue
            mask = None
            if windowed:
                mask = segment_mask(len_q, len_k, causal=causal, window_size=window_size, device=q.device)
            out = F.scaled_dot_product_attention(
                qs.transpose(0, 1),
                ks.transpose(0, 1),
                vs.transpose(0, 1),
                attn_mask=mask,
                is_causal=causal and not windowed,
                scale=softmax_scale,
                enable_gqa=gqa,
            )
            outs.append(out.transpose(0, 1))
        if not outs:
            return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        return torch.cat(outs, dim=0)
