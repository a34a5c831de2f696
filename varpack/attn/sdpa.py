"""``sdpa`` backend: a per-segment loop over ``torch.nn.functional.scaled_dot_product_attention``.

The fast exact path where no varlen kernel exists (the CPU; ``auto``'s first choice there). Like the
reference it reads cu_seqlens on the host (a device sync per layer on a GPU, so on CUDA ``auto`` places it
after every varlen kernel) and cuts the segments with one ``torch.split`` per tensor
(``reference.split_segments``), so the backward is O(T) where a slice per segment would cost O(N * T).
Segments with as many queries as keys go through SDPA (``is_causal`` is exact there because top-left and
bottom-right alignment coincide; a window becomes an explicit boolean mask, which always keeps the diagonal,
so no row is empty). Segments with ``Lq != Lk`` use the reference's explicit math (bottom-right alignment,
empty rows -> 0). No softcap (SDPA has no score modifier).

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


class SdpaBackend(Backend):
    name = "sdpa"
    capabilities = Capabilities(
        devices=frozenset({"*"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
        host_sync=True,
        softcap=False,
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
                    )
                )
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
