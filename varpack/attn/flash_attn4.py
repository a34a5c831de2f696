"""``flash_attn_4`` backend: FlashAttention-4 (CuTe DSL), ``flash_attn.cute.flash_attn_varlen_func``
(pip ``flash-attn-4``; checked against 4.0.0b36, the release that runs on the H200 here, shared/ASSETS.md).

Every argument after q, k, v is passed by keyword: in 4.0.0b36 the fourth positional parameter is ``qv``,
not ``cu_seqlens_q``. The call returns ``(out, lse)``. FA4 spells an unbounded window side ``None`` (not -1)
and treats ``(-1, x)`` as a real window, so the backend translates: no window -> ``(None, None)``; a window
with one unbounded side -> that side = ``max(max_seqlen_q, max_seqlen_k)``, which masks nothing.

Limits (4.0.0b36 interface.py): fp16 / bf16; sm90 head dims 8..256, sm100 8..128 or 256, multiples of 8;
softcap backward not on sm100 with D = 256. Zero-length segments are not declared (unverified). A value head
dim other than the query / key one only as FA4's DeepSeek shape ``(D, Dv) = (192, 128)`` on sm100 (its
interface's list of supported features); refused elsewhere, so ``auto`` moves on.

Attention sinks: FA4's ``learnable_sink`` (one bfloat16 logit per query head, folded into each row's softmax
statistics, so the returned ``lse`` includes it) when the installed FA4 takes it with ``return_lse``. FA4's
varlen backward returns no gradient for the sinks: :class:`_SinkGradient` (an identity on the output) adds it,
``dsink[h] = -sum_i exp(sink[h] - lse[h, i]) * (dout_i . out_i)`` (the rule FA4's softmax.py states), while
q / k / v get FA4's own gradients (its backward reads the ``lse`` that holds the sink).

Source: FlashAttention-4 (Dao-AILab/flash-attention, flash_attn/cute/interface.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._base import Backend, CallSpec, Capabilities, _cuda_arch
from ._flash_common import dist_version, first_output, import_function, parameters

if TYPE_CHECKING:
    from varpack.varlen.meta import VarlenMeta

__all__ = ["FlashAttn4Backend", "fa4_window"]


class _SinkGradient(torch.autograd.Function):
    """Identity on FA4's output ``[T, H, Dv]`` whose backward also returns the sinks' gradient (``[H]``) from the
    output, the incoming gradient and FA4's ``lse`` (``[H, T]`` fp32, sink included)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, sinks: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(out, sinks, lse)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        out, sinks, lse = ctx.saved_tensors
        acc = torch.promote_types(out.dtype, torch.float32)
        dpsum = (dout.to(acc) * out.to(acc)).sum(-1).transpose(0, 1)  # [H, T]
        p_sink = torch.exp(sinks.to(acc).view(-1, 1) - lse.to(acc))  # [H, T]
        dsinks = -(p_sink * dpsum).sum(-1)
        return dout, dsinks.to(sinks.dtype), None


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
        sinks=True,  # when the installed FA4 takes learnable_sink and return_lse (_extra_supports)
        distinct_v_head_dim=True,  # (192, 128) on sm100 only (_extra_supports)
        notes="FlashAttention-4 CuTe flash_attn_varlen_func (sm90 / sm100); first call per shape compiles ~3 s",
    )

    def _probe(self) -> tuple[bool, str]:
        fn, reason = import_function("flash_attn.cute", "flash_attn_varlen_func")
        if fn is None:
            return False, reason
        self._fn = fn
        self._has_sinks = {"learnable_sink", "return_lse"} <= parameters(fn)
        return True, f"flash-attn-4 {dist_version('flash-attn-4', 'flash_attn_4', 'fa4')}"

    def _extra_supports(self, spec: CallSpec) -> tuple[bool, str]:
        d = spec.head_dim
        if d % 8 or d < 8:
            return False, f"head dim D={d} must be a multiple of 8 and >= 8"
        arch = _cuda_arch(spec.device)
        if spec.sinks and not getattr(self, "_has_sinks", False):
            return False, "this flash-attn-4 has no learnable_sink / return_lse (attention sinks)"
        dv = spec.head_dim_v if spec.head_dim_v is not None else d
        if dv != d and not (arch is not None and arch[0] == 10 and (d, dv) == (192, 128)):
            return False, f"FA4 runs D != Dv only as (192, 128) on sm100, got (D, Dv) = ({d}, {dv})"
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
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        extra = {}
        if sinks is not None:  # FA4 wants a bfloat16 sink; its gradient comes from _SinkGradient
            extra = {"learnable_sink": sinks.detach().to(torch.bfloat16), "return_lse": True}
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
            **extra,
        )
        if sinks is None:
            return first_output(out)
        out, lse = out[0], out[1]
        return _SinkGradient.apply(out, sinks, lse)
