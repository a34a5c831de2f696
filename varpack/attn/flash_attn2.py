"""``flash_attn`` backend: FlashAttention-2, ``flash_attn.flash_attn_varlen_func`` (pip ``flash-attn`` 2.x).

Call: ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
softmax_scale, causal, window_size, softcap, ...)`` (Dao-AILab/flash-attention,
flash_attn/flash_attn_interface.py); ``window_size`` since 2.3, ``softcap`` since 2.6 (detected). Ampere or
newer (sm80+), fp16 / bf16, head dim up to 256. Zero-length segments are skipped by the kernel.
Note: installing only flash-attn-4 creates a ``flash_attn`` namespace without this function; the probe
says so.

Source: FlashAttention-2 (Dao, 2023, arXiv:2307.08691).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._base import Backend, CallSpec, Capabilities
from ._flash_common import dist_version, first_output, import_function, parameters

if TYPE_CHECKING:
    from varpack.varlen.meta import VarlenMeta

__all__ = ["FlashAttn2Backend"]


class FlashAttn2Backend(Backend):
    name = "flash_attn"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        max_head_dim=256,
        min_cuda_arch=8,
        notes="FlashAttention-2 flash_attn_varlen_func (softcap needs flash-attn >= 2.6)",
    )

    def _probe(self) -> tuple[bool, str]:
        fn, reason = import_function("flash_attn", "flash_attn_varlen_func")
        if fn is None:
            return False, reason
        self._fn = fn
        self._params = parameters(fn)
        return True, f"flash-attn {dist_version('flash-attn', 'flash_attn')}"

    def _extra_supports(self, spec: CallSpec) -> tuple[bool, str]:
        if spec.softcap > 0 and "softcap" not in self._params:
            return False, f"flash-attn {dist_version('flash-attn')} has no softcap (needs >= 2.6)"
        left, right = spec.window_size
        if (left >= 0 or (right >= 0 and not spec.causal)) and "window_size" not in self._params:
            return False, f"flash-attn {dist_version('flash-attn')} has no window_size (needs >= 2.3)"
        return True, "ok"

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
        kwargs: dict = {"dropout_p": 0.0, "softmax_scale": softmax_scale, "causal": causal}
        if "window_size" in self._params:
            kwargs["window_size"] = window_size
        if softcap > 0:
            kwargs["softcap"] = softcap
        out = self._fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)
        return first_output(out)
