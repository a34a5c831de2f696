"""``flash_attn_4`` backend: FlashAttention-4 (CuTe DSL), ``flash_attn.cute.flash_attn_varlen_func``
(pip ``flash-attn-4``; checked against 4.0.0b36, the release that runs on the H200 here, shared/ASSETS.md).

Every argument after q, k, v is passed by keyword: in 4.0.0b36 the fourth positional parameter is ``qv``,
not ``cu_seqlens_q``. The call returns ``(out, lse)``. FA4 spells an unbounded window side ``None`` (not -1)
and treats ``(-1, x)`` as a real window, so the backend translates: no window -> ``(None, None)``; a window
with one unbounded side -> that side = ``max(max_seqlen_q, max_seqlen_k)``, which masks nothing.

Limits (4.0.0b36 interface.py): fp16 / bf16; sm90 head dims 8..256, sm100 8..128 or 256, multiples of 8;
softcap backward not on sm100 with D = 256. Zero-length segments are not declared (unverified).

Source: FlashAttention-4 (Dao-AILab/flash-attention, flash_attn/cute/interface.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._base import Backend, CallSpec, Capabilities, _cuda_arch
from ._flash_common import dist_version, first_output, import_function

if TYPE_CHECKING:
    from varpack.varlen.meta import VarlenMeta

__all__ = ["FlashAttn4Backend", "fa4_window"]


def fa4_window(
    causal: bool, window_size: tuple[int, int], max_seqlen_q: int, max_seqlen_k: int
) -> tuple[int | None, int | None]:
    """flash-attn (-1 = unbounded) window -> FA4's ``(left, right)`` with ``None`` for "no window"."""
    left, right = window_size
    if causal:
        right = 0
    if left < 0 and (causal or right < 0):
        return None, None  # plain causal / full attention: FA4 applies `causal` itself
    unbounded = max(max_seqlen_q, max_seqlen_k, 1)
    return (left if left >= 0 else unbounded), (right if right >= 0 else unbounded)


class FlashAttn4Backend(Backend):
    name = "flash_attn_4"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        max_head_dim=256,
        cuda_archs=frozenset({9, 10}),
        empty_segments=False,
        notes="FlashAttention-4 CuTe flash_attn_varlen_func (sm90 / sm100); first call per shape compiles ~3 s",
    )

    def _probe(self) -> tuple[bool, str]:
        fn, reason = import_function("flash_attn.cute", "flash_attn_varlen_func")
        if fn is None:
            return False, reason
        self._fn = fn
        return True, f"flash-attn-4 {dist_version('flash-attn-4', 'flash_attn_4', 'fa4')}"

    def _extra_supports(self, spec: CallSpec) -> tuple[bool, str]:
        d = spec.head_dim
        if d % 8 or d < 8:
            return False, f"head dim D={d} must be a multiple of 8 and >= 8"
        arch = _cuda_arch(spec.device)
        if arch is not None and arch[0] == 9 and d < 64 and spec.needs_grad:
            # Seen on the H200 (flash-attn-4 4.0.0b36, 2026-11-29): with D=16 the forward matched the reference
            # but dq/dk/dv were wrong (packed grad error 60x the unpacked one in `varpack check`); D=64 and
            # D=128 pass tests/attn/test_attn_gpu.py. Refuse rather than train on wrong gradients.
            return False, f"FA4 backward on sm90 is only verified for D >= 64, got D={d}"
        if arch is not None and arch[0] == 10:
            if d > 128 and d != 256:
                return False, f"FA4 on sm100 supports D <= 128 or D = 256, got D={d}"
            if d == 256 and spec.softcap > 0 and spec.needs_grad:
                return False, "FA4 on sm100 has no softcap backward for D = 256"
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
    ) -> torch.Tensor:
        out = self._fn(
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=fa4_window(causal, window_size, max_seqlen_q, max_seqlen_k),
            softcap=softcap,
        )
        return first_output(out)
