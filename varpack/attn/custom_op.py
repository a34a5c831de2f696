"""Varlen attention as a ``torch.library`` custom op, so ``torch.compile`` traces a whole decoder layer through it.

:func:`varpack.attn.varlen_attention` is Python (validation, backend resolution, host reads of CPU boundaries,
identity caches): inside a compiled layer it is a graph break. This module wraps one *resolved* backend call
in two opaque operators that the compiler keeps as single nodes of the graph, with fake (meta) implementations
that give output shapes and dtypes without touching values:

* ``varpack::varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
  softmax_scale, window_left, window_right, softcap, backend) -> (out, lse)``;
* ``varpack::varlen_attention_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, ...) -> (dq, dk,
  dv)``, the op's autograd formula (``register_autograd``).

``backend`` is a concrete backend name (never ``"auto"``): resolution is Python logic and runs before the op,
in :func:`varlen_attention_op`. Arguments have :func:`varpack.attn.varlen_attention`'s meaning; ``window_left``
/ ``window_right`` are its ``window_size`` (``-1`` = unbounded), already normalized (``causal`` forces
``right = 0``); ``softcap = 0`` is off.

Backward, per backend (:func:`op_backward_kind`):

* ``"native"``: ``triton_short`` (its own forward / backward kernels, :mod:`varpack.attn.triton_short`);
  ``flash_attn_4`` when the installed FlashAttention-4 exposes ``_flash_attn_fwd`` /
  ``_flash_attn_bwd`` with the varlen and window keywords (checked by signature; flash_attn/cute/interface.py,
  called exactly as its ``FlashAttnVarlenFunc`` does). The forward returns the kernel's log-sum-exp ``lse``
  (``[H, Tq]`` fp32) and the backward op runs the FA4 backward kernel: no recomputation. Softcap is refused
  there (FA4's own varlen backward asserts ``softcap == 0``).
* ``"recompute"``: ``reference`` and ``sdpa`` (plain PyTorch). The backward op runs the backend's forward again under ``torch.func.vjp`` and pulls
  ``dout`` back through it: one extra forward per backward (about +1/3 of attention's fwd+bwd FLOPs, plus the
  backend's forward activations alive during that layer's backward only). ``torch.func`` and not
  ``torch.enable_grad()`` + ``torch.autograd.grad``: an op's implementation runs below the autograd dispatch
  key (``torch.library`` excludes it), where autograd records nothing; functorch's transform re-enables it
  for its own scope. ``lse`` is then an empty ``[0]`` fp32 tensor.
* ``None``: the backends ``torch.func`` cannot pull back through (:data:`_NO_OP_BACKWARD` gives each
  reason): ``flash_attn`` (FA2), ``flash_attn_3`` and ``flash_attn_4`` without the native pair (old-style
  ``torch.autograd.Function``), ``torch_varlen`` (torch's ``varlen_attn`` is a custom op whose autograd has
  no functorch rule) and ``flex`` (the compiled ``flex_attention`` higher-order op does not trace functorch
  tensors); seen on the H200 with torch 2.11. Forward-only calls work; a call that needs gradients raises
  :class:`BackendUnavailableError` (never a silent switch to another backend).
  A native path plugs into :data:`_NATIVE` (a forward returning ``(out, lse)`` and a backward).

Costs: the op's output is made contiguous (a copy only for ``flex``, whose output is a transposed view).

Source: ``torch.library.custom_op``, ``register_fake``, ``register_autograd`` (PyTorch custom operators
manual); FlashAttention-4 (Dao-AILab/flash-attention, flash_attn/cute/interface.py).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from varpack.varlen.meta import VarlenMeta

from ._base import BackendUnavailableError, CallSpec
from .flash_attn4 import fa4_window
from .registry import BACKENDS, normalize_mask_args, resolve_spec

__all__ = ["op_backward_kind", "varlen_attention_op"]

_NO_LSE_SHAPE = (0,)


# -- native forward / backward pairs --------------------------------------------------------------------


@dataclass(frozen=True)
class _Native:
    """A backend's separate forward (returning ``(out, lse)``) and backward kernels."""

    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    softcap: bool  # whether the backward supports softcap > 0


_FA4_FWD_KEYS = frozenset(
    {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "softcap",
     "window_size_left", "window_size_right", "return_lse"}
)  # fmt: skip
_FA4_BWD_KEYS = frozenset(
    {"softmax_scale", "causal", "softcap", "window_size_left", "window_size_right", "cu_seqlens_q",
     "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}
)  # fmt: skip


def _fa4_native() -> _Native | None:
    try:
        module = importlib.import_module("flash_attn.cute.interface")
    except Exception:  # not installed, or a broken CUDA stack: no native path, the recompute path stays
        return None
    fwd, bwd = getattr(module, "_flash_attn_fwd", None), getattr(module, "_flash_attn_bwd", None)
    if fwd is None or bwd is None:
        return None
    try:
        fwd_params = set(inspect.signature(fwd).parameters)
        bwd_params = set(inspect.signature(bwd).parameters)
    except (TypeError, ValueError):
        return None
    if not (_FA4_FWD_KEYS <= fwd_params and _FA4_BWD_KEYS <= bwd_params):
        return None  # another internal API than the one this wiring was written against

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap):
        left, right = fa4_window(causal, window, max_q, max_k)
        result = fwd(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
            softmax_scale=scale, causal=causal, softcap=softcap, window_size_left=left,
            window_size_right=right, return_lse=True,
        )  # fmt: skip
        # flash-attn-4 4.0.0b36 returns (out, lse, p, row_max, o_lo); earlier betas (out, lse)
        return result[0], result[1]

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap):
        left, right = fa4_window(causal, window, max_q, max_k)
        dq, dk, dv = bwd(
            q, k, v, out, dout, lse, softmax_scale=scale, causal=causal, softcap=softcap,
            window_size_left=left, window_size_right=right, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
            max_seqlen_q=max_q, max_seqlen_k=max_k,
        )  # fmt: skip
        return dq, dk, dv

    return _Native(forward=forward, backward=backward, softcap=False)


def _triton_short_native() -> _Native | None:
    """triton_short's own forward (``(out, lse)``) and backward kernels; the per-batch tables are rebuilt on
    the device inside each op call (no meta reaches the op; device ops only, no host read)."""
    from . import triton_short

    ok, _ = triton_short.TritonShortBackend().is_available()
    if not ok:
        return None

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap):
        return triton_short.op_forward(q, k, v, cu_q, cu_k, causal, window, scale)

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap):
        return triton_short.op_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, window, scale)

    return _Native(forward=forward, backward=backward, softcap=False)


#: backend name -> loader of its native pair (None when the installed library does not match).
_NATIVE: dict[str, Callable[[], _Native | None]] = {
    "flash_attn_4": _fa4_native,
    "triton_short": _triton_short_native,
}
#: backends whose forward is plain differentiable PyTorch (or a custom op with an autograd formula), which
#: ``torch.func.vjp`` can pull gradients back through.
_RECOMPUTE = frozenset({"reference", "sdpa"})
#: backend name -> why the op has no backward for it (when no native pair is wired).
_NO_OP_BACKWARD = {
    "flash_attn": "its autograd is an old-style autograd.Function that torch.func refuses",
    "flash_attn_3": "its autograd is an old-style autograd.Function that torch.func refuses",
    "flash_attn_4": "the installed FA4 lacks the _flash_attn_fwd/_flash_attn_bwd pair this op calls, and its "
    "autograd.Function is old-style (torch.func refuses it)",
    "torch_varlen": "torch's varlen_attn is a custom op whose autograd has no functorch rule",
    "flex": "the compiled flex_attention higher-order op does not trace functorch tensors",
}


@functools.cache
def _native(backend: str) -> _Native | None:
    loader = _NATIVE.get(backend)
    return loader() if loader is not None else None


def op_backward_kind(backend: str, *, softcap: float = 0.0) -> str | None:
    """How ``varpack::varlen_attention`` differentiates a call on ``backend``: ``"native"`` (the backend's
    own backward kernel, fed the forward's log-sum-exp), ``"recompute"`` (the backend's forward run again
    under ``torch.func.vjp`` in the backward), or ``None`` (no backward through the op: forward only).

    Raises:
        ValueError: unknown backend name.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {sorted(BACKENDS)}")
    native = _native(backend)
    if native is not None and (softcap == 0 or native.softcap):
        return "native"
    if backend in _RECOMPUTE:
        return "recompute"
    return None


def _uses_native(backend: str, softcap: float) -> bool:
    return op_backward_kind(backend, softcap=softcap) == "native"


# -- the operators ------------------------------------------------------------------------------------


@torch.library.custom_op("varpack::varlen_attention", mutates_args=())
def _varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    window = (window_left, window_right)
    if _uses_native(backend, softcap):
        out, lse = _native(backend).forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window,
            softcap,
        )  # fmt: skip
        return out.contiguous(), lse.contiguous()
    out = BACKENDS[backend].forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        causal=causal, window_size=window, softmax_scale=softmax_scale, softcap=softcap,
    )  # fmt: skip
    return out.contiguous(), q.new_empty(_NO_LSE_SHAPE, dtype=torch.float32)


@_varlen_attention.register_fake
def _varlen_attention_fake(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left,
    window_right, softcap, backend,
):  # fmt: skip
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
    if _uses_native(backend, softcap):
        return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, q.new_empty(_NO_LSE_SHAPE, dtype=torch.float32)


@torch.library.custom_op("varpack::varlen_attention_backward", mutates_args=())
def _varlen_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    window = (window_left, window_right)
    kind = op_backward_kind(backend, softcap=softcap)
    dout = dout.contiguous()
    if kind == "native":
        dq, dk, dv = _native(backend).backward(
            dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
            softmax_scale, window, softcap,
        )  # fmt: skip
        return dq.contiguous(), dk.contiguous(), dv.contiguous()
    if kind is None:
        raise BackendUnavailableError(f"attention backend {backend!r} has no backward through varpack's op")

    def forward(q_, k_, v_):
        return BACKENDS[backend].forward(
            q_, k_, v_, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            causal=causal, window_size=window, softmax_scale=softmax_scale, softcap=softcap,
        )  # fmt: skip

    _, pull_back = torch.func.vjp(forward, q, k, v)
    dq, dk, dv = pull_back(dout.to(q.dtype))
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_varlen_attention_backward.register_fake
def _varlen_attention_backward_fake(dout, q, k, v, *rest):
    # contiguous, as the implementation returns them: q / k / v may be strided views (heads-first projections
    # transposed), and inductor asserts the real strides against these
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_SCALARS = ("max_seqlen_q", "max_seqlen_k", "causal", "softmax_scale", "window_left", "window_right",
            "softcap", "backend")  # fmt: skip


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *scalars = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.scalars = scalars


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _varlen_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.scalars)
    return (dq, dk, dv) + (None,) * (2 + len(_SCALARS))


_varlen_attention.register_autograd(_backward, setup_context=_setup_context)


# -- the public wrapper -------------------------------------------------------------------------------


@torch.compiler.assume_constant_result
def _resolve_constant(
    backend: str,
    device_type: str,
    device_index: int,
    dtype: torch.dtype,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    causal: bool,
    window: tuple[int, int],
    softcap: float,
    needs_grad: bool,
    max_seqlen: int,
) -> str:
    """Backend resolution from facts the compiler guards on (dtype, device, head sizes, grad mode, mask
    arguments, the short-documents class of ``max_seqlen``): traced as a constant, evaluated at trace time."""
    device = torch.device(device_type, device_index) if device_index >= 0 else torch.device(device_type)
    spec = CallSpec(
        device=device, dtype=dtype, head_dim=head_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
        causal=causal, window_size=window, softcap=softcap, needs_grad=needs_grad, max_seqlen=max_seqlen,
    )  # fmt: skip
    name = str(resolve_spec(backend, spec, exclude=_no_op_backward(needs_grad, softcap)))
    _check_differentiable(name, softcap, needs_grad)
    return name


def varlen_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    backend: str = "auto",
    meta: VarlenMeta | None = None,
) -> torch.Tensor:
    """:func:`varpack.attn.varlen_attention` through the ``varpack::varlen_attention`` custom op: same
    arguments, shapes, semantics and errors; the result equals it (same backend, same kernel).

    Outside ``torch.compile`` the arguments are validated exactly as :func:`varlen_attention` does (CPU
    ``cu_seqlens`` values included, copied to q's device once per batch) and the backend is resolved
    (``auto`` included) before the op runs. Under ``torch.compile`` the wrapper is traced: shapes and types
    are checked, tensor values are never read (validate ``cu_seqlens`` once per batch where they are built,
    as the packing guard of :func:`varpack.integrations.transformers.enable_varpack` does), CPU
    ``cu_seqlens`` are copied to q's device inside the graph (a no-op on the CPU), and ``auto`` is resolved
    at trace time from facts the compiler guards on (dtype, device, head sizes, grad mode, mask arguments,
    the short-documents class of ``max_seqlen``) without zero-length-segment detection.

    Gradients: see the module docstring (:func:`op_backward_kind`): native backward kernel for
    ``flash_attn_4``; recomputation for the PyTorch backends; none for ``flash_attn`` / ``flash_attn_3``.

    Raises:
        as :func:`varpack.attn.varlen_attention`; BackendUnavailableError also when the call needs gradients
        and the resolved backend has no backward through the op (``flash_attn``, ``flash_attn_3``).
    """
    if torch.compiler.is_compiling():
        if meta is not None:  # the batch's boundaries (validated when built): plain attribute reads
            cu_seqlens_q, cu_seqlens_k = meta.cu_seqlens_q, meta.cu_seqlens_k
            max_seqlen_q, max_seqlen_k = meta.max_seqlen_q, meta.max_seqlen_k
        return _traced_call(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_size,
            softmax_scale, softcap, backend,
        )  # fmt: skip
    from .interface import prepare_call

    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    call = prepare_call(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, meta,
        causal=causal, window_size=window_size, softmax_scale=softmax_scale, softcap=softcap, backend=backend,
        exclude=_no_op_backward(needs_grad, float(softcap or 0.0)),
    )  # fmt: skip
    _check_differentiable(call.backend, call.softcap, call.spec.needs_grad)
    out, _ = _varlen_attention(
        q, k, v, call.cu_q, call.cu_k, call.meta.max_seqlen_q, call.meta.max_seqlen_k, call.causal,
        call.softmax_scale, call.window_size[0], call.window_size[1], call.softcap, call.backend,
    )  # fmt: skip
    return out


@functools.cache  # the eager op path asks once per attention call: built once per (grad, softcap)
def _no_op_backward(needs_grad: bool, softcap: float) -> dict[str, str] | None:
    """The backends ``auto`` passes over on the op's path when the call needs gradients: those with no
    backward through the op (:func:`op_backward_kind` None), each with the reason; None without gradients.
    Without it ``auto`` could pick one for a shape class (``torch_varlen`` for short documents,
    :data:`varpack.attn.registry.AUTO_PRIORITY_SHORT`) and the training step would refuse. The dict is
    cached and shared: read it, never change it."""
    if not needs_grad:
        return None
    return {
        name: f"no backward through varpack's custom op ({_NO_OP_BACKWARD.get(name, 'no native backward is wired')})"
        for name in BACKENDS
        if op_backward_kind(name, softcap=softcap) is None
    }


def _check_differentiable(name: str, softcap: float, needs_grad: bool) -> None:
    if needs_grad and op_backward_kind(name, softcap=softcap) is None:
        raise BackendUnavailableError(
            f"attention backend {name!r} has no backward through varpack's custom op "
            f"({_NO_OP_BACKWARD.get(name, 'no native backward is wired')}); train through "
            "varpack.attn.varlen_attention (compile_layers without custom_ops), or pick flash_attn_4 (native "
            "backward), sdpa or reference"
        )


def _traced_call(
    q, k, v, cu_q, cu_k, max_q, max_k, causal, window_size, softmax_scale, softcap, backend
) -> torch.Tensor:
    """The compiled-path body: shape/type checks only, no value read, resolution as a trace-time constant."""
    from .interface import _check_tensors, _check_window

    _check_tensors(q, k, v)
    if cu_q.dim() != 1 or cu_k.dim() != 1 or cu_q.is_floating_point() or cu_k.is_floating_point():
        raise TypeError("cu_seqlens_q / cu_seqlens_k must be 1-D integer tensors [N + 1]")
    window_size = _check_window(window_size)
    # module constants here (Python floats, checked when eager); never validated as values in the graph
    softcap = softcap or 0.0
    softmax_scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    causal, window_size = normalize_mask_args(bool(causal), window_size)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    from .registry import AUTO_SHORT_MAX_SEQLEN

    # the short-documents class only (a guard on `max_seqlen <= 128`, not on the value itself)
    short = max(max_q, max_k) <= AUTO_SHORT_MAX_SEQLEN
    name = _resolve_constant(
        backend, q.device.type, -1 if q.device.index is None else q.device.index, q.dtype, int(q.shape[-1]),
        int(q.shape[1]), int(k.shape[1]), causal, window_size, softcap, needs_grad,
        AUTO_SHORT_MAX_SEQLEN if short else AUTO_SHORT_MAX_SEQLEN + 1,
    )  # fmt: skip
    cu_q_dev = cu_q.to(device=q.device, dtype=torch.int32)
    cu_k_dev = cu_q_dev if cu_k is cu_q else cu_k.to(device=q.device, dtype=torch.int32)
    out, _ = _varlen_attention(
        q, k, v, cu_q_dev, cu_k_dev, max_q, max_k, causal, softmax_scale, window_size[0], window_size[1],
        softcap, name,
    )  # fmt: skip
    return out
