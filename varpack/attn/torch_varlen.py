"""``torch_varlen`` backend: ``torch.nn.attention.varlen.varlen_attn`` (PyTorch's packed flash kernel).

Its signature changed across torch releases, so the backend reads it with ``inspect`` once and adapts:

- torch 2.11: ``varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux, scale, window_size)``; causal is
  ``window_size=(-1, 0)``; GQA accepted (checked on an H200, shared/ASSETS.md);
- torch 2.13: adds ``enable_gqa`` (required for Hkv < H), ``seqused_k``, ``block_table``, ``num_splits``;
- older releases: ``is_causal`` and no window (window calls are then refused; GQA by expanding k/v).

No softcap in any release. CUDA only; fp16 / bf16; head dim a multiple of 8 up to 256 (the flash kernel's
limits).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._base import Backend, CallSpec, Capabilities
from ._flash_common import first_output, import_function, parameters

if TYPE_CHECKING:
    from varpack.varlen.meta import VarlenMeta

__all__ = ["TorchVarlenBackend"]


class TorchVarlenBackend(Backend):
    name = "torch_varlen"
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        max_head_dim=256,
        min_cuda_arch=8,
        softcap=False,
        notes="torch.nn.attention.varlen.varlen_attn; signature detected at first use; no softcap",
    )

    def _probe(self) -> tuple[bool, str]:
        fn, reason = import_function("torch.nn.attention.varlen", "varlen_attn")
        if fn is None:
            return False, f"torch {torch.__version__}: {reason}"
        self._fn = fn
        self._params = parameters(fn)
        form = (
            "window_size"
            if "window_size" in self._params
            else "is_causal"
            if "is_causal" in self._params
            else "?"
        )
        return True, f"torch {torch.__version__} varlen_attn ({form} form)"

    def _extra_supports(self, spec: CallSpec) -> tuple[bool, str]:
        params = self._params
        if spec.head_dim % 8:
            return False, f"head dim D={spec.head_dim} is not a multiple of 8"
        left, right = spec.window_size
        windowed = left >= 0 or (right >= 0 and not spec.causal)
        if "window_size" not in params:
            if windowed:
                return False, f"torch {torch.__version__} varlen_attn has no window_size"
            if spec.causal and "is_causal" not in params:
                return False, f"torch {torch.__version__} varlen_attn has neither window_size nor is_causal"
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
        params = self._params
        kwargs: dict = {}
        if "scale" in params:
            kwargs["scale"] = softmax_scale
        else:  # fold the scale into q (varlen_attn then applies 1/sqrt(D))
            q = q * (softmax_scale * q.shape[-1] ** 0.5)
        if "window_size" in params:
            left, right = window_size
            kwargs["window_size"] = (left, 0) if causal else (left, right)
        elif "is_causal" in params:
            kwargs["is_causal"] = causal
        if q.shape[1] != k.shape[1]:
            if "enable_gqa" in params:
                kwargs["enable_gqa"] = True
            elif "window_size" not in params:  # pre-2.11 form, GQA not known to work: expand k/v (exact)
                groups = q.shape[1] // k.shape[1]
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
        out = self._fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)
        return first_output(out)
