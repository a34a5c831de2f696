"""Backend protocol for :func:`varpack.attn.varlen_attention`: declared capabilities, an availability probe,
and the check of one call against both.

Each backend lives in its own module (``reference.py``, ``torch_varlen.py``, ``flex.py``, ``flash_attn2.py``,
``flash_attn3.py``, ``flash_attn4.py``, ``triton_short.py``) and subclasses :class:`Backend`. A backend never
guesses: it declares what it supports in a :class:`Capabilities` record, and :meth:`Backend.supports` answers ``(ok, reason)`` for one
call (the verifier pattern of flash-linear-attention's backend registry).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from varpack._probe import ProbeOnce, probe_failed

if TYPE_CHECKING:
    from varpack.varlen.meta import VarlenMeta

__all__ = ["Backend", "BackendUnavailableError", "CallSpec", "Capabilities"]


class BackendUnavailableError(ValueError, RuntimeError):
    """A backend (forced by name, or every candidate of ``auto``) cannot run this call.

    The message says which backend and why (not installed, wrong device, unsupported dtype / head dim /
    window / softcap / zero-length segment, no backward, ...). Subclasses both ``ValueError`` and
    ``RuntimeError`` so callers may catch either.
    """


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run. Every field is checked by :meth:`Backend.supports` before a call.

    Attributes:
        devices: device types the backend runs on (``"cuda"``, ``"cpu"``; ``"*"`` = any).
        dtypes: accepted dtypes of q/k/v.
        head_dims: accepted head dims D; ``None`` = any positive D.
        max_head_dim: largest D (used when ``head_dims`` is None); ``None`` = unbounded.
        cuda_archs: accepted CUDA compute capability majors (9 = Hopper sm90, 10 = Blackwell sm100);
            ``None`` = any; only checked on CUDA.
        min_cuda_arch: smallest accepted compute capability major on CUDA; ``None`` = any.
        gqa: accepts H > Hkv (H % Hkv == 0: grouped-query / multi-query attention).
        causal: supports ``causal=True``.
        non_causal: supports ``causal=False``.
        window: supports a sliding window (``window_size != (-1, -1)``).
        softcap: supports ``softcap > 0``.
        empty_segments: supports zero-length segments (repeated values in cu_seqlens). Only checkable when
            cu_seqlens lives on the CPU (varpack never reads GPU boundaries on the hot path).
        backward: differentiable (q, k, v gradients).
        sinks: supports attention sinks (``sinks``: one learned logit per query head that joins every row's
            softmax without a value, GPT-OSS), their gradient included.
        distinct_v_head_dim: supports a value head dim ``Dv`` other than the query / key head dim ``D``
            (multi-head latent attention: DeepSeek-V2/V3, MiniCPM3).
        host_sync: reads cu_seqlens values on the host (one device-to-host sync per call on a GPU).
        notes: free text shown by ``varpack check`` / :func:`available_backends`.
    """

    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    head_dims: frozenset[int] | None = None
    max_head_dim: int | None = None
    cuda_archs: frozenset[int] | None = None
    min_cuda_arch: int | None = None
    gqa: bool = True
    causal: bool = True
    non_causal: bool = True
    window: bool = True
    softcap: bool = True
    empty_segments: bool = True
    backward: bool = True
    sinks: bool = False
    distinct_v_head_dim: bool = False
    host_sync: bool = False
    notes: str = ""


@dataclass(frozen=True)
class CallSpec:
    """The facts of one ``varlen_attention`` call that decide which backend may run it (no tensor values).

    ``has_empty_segments`` is ``None`` when unknown (cu_seqlens on the GPU: not read, to avoid a host sync).
    """

    device: torch.device
    dtype: torch.dtype
    head_dim: int
    num_heads: int
    num_kv_heads: int
    causal: bool = True
    window_size: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    needs_grad: bool = False
    has_empty_segments: bool | None = None
    #: longest segment (max of max_seqlen_q/k, a Python int) or None when unknown: picks ``auto``'s shape class
    max_seqlen: int | None = None
    #: mean segment length ``Tq / number of segments`` (Python numbers from shapes: no sync) or None when unknown;
    #: with ``max_seqlen`` it decides ``auto``'s use of ``triton_short`` (registry.AUTO_TRITON_SHORT)
    mean_seqlen: float | None = None
    #: value head dim Dv (None: the same as ``head_dim``)
    head_dim_v: int | None = None
    #: the call has attention sinks
    sinks: bool = False

    @classmethod
    def from_tensors(
        cls,
        q: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        *,
        causal: bool = True,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        has_empty_segments: bool | None = None,
        max_seqlen: int | None = None,
        mean_seqlen: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> CallSpec:
        k = q if k is None else k
        tensors = [t for t in (q, k, v, sinks) if t is not None]
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        return cls(
            device=q.device,
            dtype=q.dtype,
            head_dim=int(q.shape[-1]),
            num_heads=int(q.shape[-2]),
            num_kv_heads=int(k.shape[-2]),
            causal=bool(causal),
            window_size=(int(window_size[0]), int(window_size[1])),
            softcap=float(softcap),
            needs_grad=needs_grad,
            has_empty_segments=has_empty_segments,
            max_seqlen=max_seqlen,
            mean_seqlen=mean_seqlen,
            head_dim_v=int(v.shape[-1]) if v is not None else None,
            sinks=sinks is not None,
        )


@functools.lru_cache(maxsize=16)
def _cuda_arch_cached(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def _cuda_arch(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_arch_cached(index)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class Backend:
    """One way to compute varlen attention. Subclasses set ``name`` and ``capabilities`` and implement
    :meth:`_probe` (import check) and :meth:`forward`.

    ``forward`` receives validated, normalized arguments: ``window_size`` already has ``right = 0`` when
    ``causal``; ``softmax_scale`` is a float; cu_seqlens are int32 on q's device.
    """

    name: str = ""
    capabilities: Capabilities

    # -- availability ----------------------------------------------------------------------------------
    def _probe(self) -> tuple[bool, str]:
        """Import/installation check, run once. Return ``(ok, reason)``."""
        return True, "built in"

    def is_available(self) -> tuple[bool, str]:
        """``(ok, reason)``: whether the backend's library is importable here (probed once per backend object,
        :class:`varpack._probe.ProbeOnce`; a probe that raises answers ``(False, "probe failed: ...")``)."""
        probe = self.__dict__.get("_availability")
        if probe is None:  # a broken install must not break dispatch: probe_failed turns it into a reason
            probe = ProbeOnce(self._probe, on_error=probe_failed, name=f"attention backend {self.name!r}")
            self._availability = probe
        return probe()

    # -- one call --------------------------------------------------------------------------------------
    def supports_platform(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> tuple[bool, str]:
        """``(ok, reason)``: installed, and (when given) able to run on ``device`` with ``dtype``."""
        ok, reason = self.is_available()
        if not ok:
            return False, reason
        cap = self.capabilities
        if device is not None:
            device = torch.device(device)
            dev = device.type
            if "*" not in cap.devices and dev not in cap.devices:
                return False, f"runs on {sorted(cap.devices)}, not on device {dev!r}"
            arch = _cuda_arch(device) if dev == "cuda" and torch.cuda.is_available() else None
            if arch is not None:
                sm = f"sm{arch[0]}{arch[1]}"
                if cap.cuda_archs is not None and arch[0] not in cap.cuda_archs:
                    want = ", ".join(f"sm{a}x" for a in sorted(cap.cuda_archs))
                    return False, f"needs a GPU of compute capability {want}, this one is {sm}"
                if cap.min_cuda_arch is not None and arch[0] < cap.min_cuda_arch:
                    return False, f"needs compute capability >= sm{cap.min_cuda_arch}0, this GPU is {sm}"
        if dtype is not None and dtype not in cap.dtypes:
            want = ", ".join(sorted(_dtype_name(d) for d in cap.dtypes))
            return False, f"dtype {_dtype_name(dtype)} not supported (supports {want})"
        return True, reason

    def supports(self, spec: CallSpec) -> tuple[bool, str]:
        """``(ok, reason)`` for running the call described by ``spec`` (reason says what is missing)."""
        ok, reason = self.supports_platform(spec.device, spec.dtype)
        if not ok:
            return False, reason
        cap = self.capabilities
        d = spec.head_dim
        if cap.head_dims is not None and d not in cap.head_dims:
            return False, f"head dim D={d} not supported (supports {sorted(cap.head_dims)})"
        if cap.max_head_dim is not None and d > cap.max_head_dim:
            return False, f"head dim D={d} > {cap.max_head_dim}"
        if spec.num_heads != spec.num_kv_heads and not cap.gqa:
            return False, f"GQA/MQA (H={spec.num_heads}, Hkv={spec.num_kv_heads}) not supported"
        if spec.causal and not cap.causal:
            return False, "causal=True not supported"
        if not spec.causal and not cap.non_causal:
            return False, "causal=False not supported"
        left, right = spec.window_size
        is_window = left >= 0 or (right >= 0 and not spec.causal)
        if is_window and not cap.window:
            return False, f"sliding window window_size={spec.window_size} not supported"
        if spec.softcap > 0 and not cap.softcap:
            return False, f"softcap={spec.softcap} not supported"
        if spec.has_empty_segments and not cap.empty_segments:
            return False, "zero-length segments in cu_seqlens not supported"
        if spec.needs_grad and not cap.backward:
            return False, "no backward (q/k/v require grad)"
        if spec.sinks and not cap.sinks:
            return False, "attention sinks (a learned per-head logit in the softmax) not supported"
        if spec.head_dim_v is not None and spec.head_dim_v != d and not cap.distinct_v_head_dim:
            return False, f"value head dim Dv={spec.head_dim_v} != q/k head dim D={d} not supported"
        return self._extra_supports(spec)

    def _extra_supports(self, spec: CallSpec) -> tuple[bool, str]:
        """Backend-specific checks beyond :class:`Capabilities` (e.g. a feature missing in this version)."""
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
        """The attention output ``[Tq, H, Dv]``; ``sinks`` (``[H]``, only where :attr:`Capabilities.sinks`) adds
        ``exp(sinks[h])`` to every row's softmax denominator of head ``h``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<varpack attention backend {self.name!r}>"
