"""``flash_attn_3`` backend: FlashAttention-3 for Hopper, ``flash_attn_interface.flash_attn_varlen_func``
(built from Dao-AILab/flash-attention ``hopper/``; module ``flash_attn_interface``).

Call (keywords after the seven positional arguments, as hopper/flash_attn_interface.py defines them):
``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=,
causal=, window_size=, softcap=)``; returns ``out`` or ``(out, lse)`` depending on the release. sm90, fp16 /
bf16, head dim up to 256.

Source: FlashAttention-3 (Shah et al., 2024, arXiv:2407.08608).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._base import Backend, Capabilities
from ._flash_common import dist_version, first_output, import_function

if TYPE_CHECKING:
    from varpack.varlen.meta import VarlenMeta

__all__ = ["FlashAttn3Backend"]

_MODULES = ("flash_attn_interface", "flash_attn_3.flash_attn_interface")


class FlashAttn3Backend(Backend):
    name = "flash_attn_3"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        max_head_dim=256,
        cuda_archs=frozenset({9}),
        notes="FlashAttention-3 (Hopper) flash_attn_varlen_func",
    )

    def _probe(self) -> tuple[bool, str]:
        reasons = []
        for module in _MODULES:
            fn, reason = import_function(module, "flash_attn_varlen_func")
            if fn is not None:
                self._fn = fn
                return (
                    True,
                    f"FlashAttention-3 from {module} ({dist_version('flash_attn_3', 'flash-attn-3')})",
                )
            reasons.append(reason)
        return False, "; ".join(reasons)

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
        out = self._fn(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
        )
        return first_output(out)
