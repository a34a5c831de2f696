"""The gated delta rule as a ``torch.library`` custom op, so ``torch.compile`` traces a layer through it.

``varpack::gated_delta_rule(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, scale,
output_final_state, use_qk_l2norm_in_kernel, backend, chunk_rows) -> (o, final_state, residuals)`` runs one *resolved* backend of
:func:`varpack.ops.gated_delta_rule.gated_delta_rule` as a single opaque graph node, with a fake (meta)
implementation giving shapes and dtypes without touching values. Shapes as :func:`gated_delta_rule`:
q/k ``[B, T, Hk, K]``, v ``[B, T, H, V]``, g/beta ``[B, T, H]``, cu_seqlens ``[N+1]`` (B = 1) or None,
initial_state ``[N, H, K, V]`` or None; ``o`` ``[B, T, H, V]`` in q's dtype; ``final_state`` ``[N, H, K, V]``
(fp32, fp64 for fp64 inputs) when ``output_final_state``, else an empty ``[0]`` tensor; ``residuals`` what
``fla_hybrid``'s backward reads (:func:`varpack.ops.gated_delta_rule.fla_hybrid.fla_hybrid_forward`), an empty
list for the other backends; ``chunk_rows`` ``fla_hybrid``'s row count of device-built chunk tables (``0``: the
bound of any offsets); with ``chunk_rows > 0`` the residuals also keep fla's chunk states (``w``, ``h``,
``v_new``), so the backward does not recompute them.

Backends through the op: ``chunk``, ``naive``, ``fla_hybrid`` (native backward, below) and ``fla``
(forward-only). The chunk layout
(:func:`prepare_chunk_layout`) and ``fla_hybrid``'s boundaries are built from ``cu_seqlens_cpu`` (or CPU
``cu_seqlens``) and kept for the last few batches, keyed by the offsets' values (:func:`_host_plan`): CPU work
once per batch, shared by every layer, no device sync; a per-batch object cannot travel through an op's
schema. ``fla_hybrid`` with device ``cu_seqlens`` and no CPU copy builds its tables on the device in every
call instead (:func:`varpack.ops.gated_delta_rule.fla_hybrid.device_fla_hybrid_boundaries`: fixed-size, no
host read), what a layer replayed as a CUDA graph needs; ``chunk`` and ``naive`` read such offsets on the
host (one copy).
``chunk_compiled`` is refused: inside a compiled layer the op is already one node, and a nested
``torch.compile`` would run inside the op's implementation.

Backward (``register_autograd``): ``fla_hybrid``'s is the op ``varpack::fla_hybrid_gated_delta_rule_backward``,
fla's backward kernels with varpack's own ``dq/dk/dw/dg`` step fed by the forward's residuals (the l2-normalised
q/k and their norms, or without the rule's l2norm q and k themselves, kept by autograd rather than copied; fla's
cumulative decay and its ``A`` blocks): fla's forward runs once per step, as in
fla's own autograd function (fla-core 0.6.0's internal signatures, checked at load). For ``chunk`` and
``naive`` the op ``varpack::gated_delta_rule_backward`` recomputes the backend's forward under
``torch.func.vjp`` (autograd records nothing inside an op's implementation, which runs below the autograd
dispatch key; functorch's transform re-enables it) and pulls the output gradient back to q, k, v, g, beta and
initial_state: one extra forward per backward. ``fla`` is forward-only through the op (its backward is not
wired: a call that needs gradients raises ``RuntimeError``; use ``fla_hybrid``, ``chunk``, or
:func:`gated_delta_rule` directly).

Source: ``torch.library.custom_op`` / ``register_fake`` / ``register_autograd`` (PyTorch custom operators
manual); flash-linear-attention ``chunk_gated_delta_rule``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from .._fla import fla_chunk_gated_delta_rule
from ._common import acc_dtype, check_inputs, cu_seqlens_to_cpu, normalize_optional_cu
from .chunk import chunk_gated_delta_rule, prepare_chunk_layout
from .dispatch import head_dims, resolve_backend
from .fla_hybrid import (
    fla_hybrid_backward,
    fla_hybrid_forward,
    fla_hybrid_residual_shapes,
    prepare_fla_hybrid_boundaries,
)
from .naive import naive_recurrent_gated_delta_rule

__all__ = ["OP_BACKENDS", "gated_delta_rule_op"]

#: backends the op runs (``fla``: forward only).
OP_BACKENDS = ("chunk", "naive", "fla_hybrid", "fla")
_DIFFERENTIABLE = ("chunk", "naive", "fla_hybrid")


#: How many batches' host plans :func:`_host_plan` keeps (a step's forward and backward use one batch).
PLANS_KEPT = 4
_PLANS: OrderedDict = OrderedDict()
_PLANS_LOCK = threading.Lock()


def _host_plan(kind: str, host_cu: torch.Tensor, device: torch.device, build: Callable[[], Any]) -> Any:
    """``build()`` once per ``(kind, device, offsets' values)``, kept for the last :data:`PLANS_KEPT` batches.

    The op cannot carry a per-batch object through its schema, so every layer of a step (forward, and the
    backward's recomputation) would rebuild its plan from the CPU offsets: the ``chunk`` layout, or
    ``fla_hybrid``'s boundaries (device offsets, the dq/dk plan; one device copy shared by every layer, so
    fla's own per-tensor chunk-index cache hits). Keyed by the offsets' values (a CPU read, no device sync),
    a kept plan is always the one of the same segmentation, as the eager path's per-batch
    :meth:`varpack.varlen.VarlenMeta.memo`."""
    key = (kind, str(device), cu_seqlens_to_cpu(host_cu).numpy().tobytes())
    with _PLANS_LOCK:
        plan = _PLANS.get(key)
        if plan is not None:
            _PLANS.move_to_end(key)
            return plan
    plan = build()
    with _PLANS_LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > PLANS_KEPT:
            _PLANS.popitem(last=False)
    return plan


def _host_boundaries(backend, q, cu, cu_cpu):
    """What the backend reads on the host, built before any autograd transform: the chunk layout for
    ``chunk`` (its device copies made here), ``fla_hybrid``'s boundaries, the offsets as a Python list for
    ``naive`` (``torch.func`` wraps every tensor made inside its scope, and a wrapped tensor has no storage to
    read). ``fla_hybrid`` with device offsets and no CPU copy: ``None`` (no host read, nothing kept across
    calls; fla_hybrid builds fixed-size tables on the device, what a CUDA-graph replay needs)."""
    host_cu = cu if cu_cpu is None else cu_cpu
    if backend == "chunk":
        if host_cu is None:
            host_cu = torch.arange(q.shape[0] + 1, dtype=torch.int64) * q.shape[1]

        def layout():
            built = prepare_chunk_layout(host_cu)
            built.tensors(q.device)
            return built

        return _host_plan("chunk", host_cu, q.device, layout)
    if backend == "fla_hybrid" and host_cu is not None:
        if host_cu.device.type != "cpu":  # device offsets alone: fla_hybrid builds its tables on the device
            return None
        return _host_plan(
            "fla_hybrid", host_cu, q.device, lambda: prepare_fla_hybrid_boundaries(host_cu, q.device)
        )
    if backend == "naive" and host_cu is not None:
        return cu_seqlens_to_cpu(host_cu).tolist()
    return None


def _run(backend, host, q, k, v, g, beta, cu, cu_cpu, h0, scale, output_final_state, l2norm):
    """Every backend but ``fla_hybrid`` (:func:`fla_hybrid_forward` in the op)."""
    if backend == "fla":
        return fla_chunk_gated_delta_rule(
            q, k, v, g, beta, scale, h0, output_final_state, cu, cu_cpu if cu_cpu is not None else cu, l2norm
        )
    if backend == "naive":
        return naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale, h0, output_final_state, host, l2norm)
    return chunk_gated_delta_rule(q, k, v, g, beta, scale, h0, output_final_state, None, l2norm, layout=host)


def _qk_left_out(l2norm: bool) -> int:
    """How many of ``fla_hybrid``'s residuals the op leaves out: q' and k' without the l2norm (they are q and k,
    which autograd keeps)."""
    return 0 if l2norm else 2


def _empty_state(q: torch.Tensor) -> torch.Tensor:
    return q.new_empty((0,), dtype=acc_dtype(q))


@torch.library.custom_op("varpack::gated_delta_rule", mutates_args=())
def _gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_cpu: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    scale: float,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    backend: str,
    chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    host = _host_boundaries(backend, q, cu_seqlens, cu_seqlens_cpu)
    if backend == "fla_hybrid":  # fla's forward once: what its backward reads comes out as residuals
        o, final, residuals = fla_hybrid_forward(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
            cu_seqlens_cpu=cu_seqlens_cpu, boundaries=host, chunk_rows=chunk_rows or None, qk_residuals=False,
        )  # fmt: skip
    else:
        o, final = _run(
            backend, host, q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, scale,
            output_final_state, use_qk_l2norm_in_kernel,
        )  # fmt: skip
        residuals = []
    final = final.contiguous() if output_final_state else _empty_state(q)
    return o.contiguous(), final, [x.contiguous() for x in residuals]


@_gated_delta_rule.register_fake
def _gated_delta_rule_fake(
    q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, scale, output_final_state,
    use_qk_l2norm_in_kernel, backend, chunk_rows,
):  # fmt: skip
    B, T, _, K = q.shape
    H, V = v.shape[2], v.shape[3]
    o = q.new_empty((B, T, H, V))
    residuals = []
    if backend == "fla_hybrid":
        shapes = fla_hybrid_residual_shapes(tuple(q.shape), tuple(v.shape), q.dtype, use_qk_l2norm_in_kernel,
                                            chunk_rows)  # fmt: skip
        residuals = [q.new_empty(shape, dtype=dtype) for shape, dtype in shapes[_qk_left_out(use_qk_l2norm_in_kernel):]]
    if not output_final_state:
        return o, _empty_state(q), residuals
    n = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    return o, q.new_empty((n, H, K, V), dtype=acc_dtype(q)), residuals


@torch.library.custom_op("varpack::fla_hybrid_gated_delta_rule_backward", mutates_args=())
def _fla_hybrid_backward(
    do: torch.Tensor,
    dfinal: torch.Tensor | None,
    v: torch.Tensor,
    beta: torch.Tensor,
    residuals: list[torch.Tensor],
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_cpu: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    scale: float,
    use_qk_l2norm_in_kernel: bool,
    g_dtype: torch.dtype,
    chunk_rows: int,
) -> list[torch.Tensor]:
    """``[dq, dk, dv, dg, dbeta, dinitial_state]`` of the ``fla_hybrid`` forward from its residuals (fla's
    backward pipeline with varpack's dq/dk step; no forward recomputed); the last is an empty ``[0]`` tensor
    without ``initial_state``."""
    host = _host_boundaries("fla_hybrid", v, cu_seqlens, cu_seqlens_cpu)
    grads = fla_hybrid_backward(
        do, dfinal, v, beta, residuals, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel,
        g_dtype=g_dtype, cu_seqlens_cpu=cu_seqlens_cpu, boundaries=host, chunk_rows=chunk_rows or None,
    )  # fmt: skip
    last = grads[5].contiguous() if initial_state is not None else v.new_empty((0,), dtype=acc_dtype(v))
    return [x.contiguous() for x in grads[:5]] + [last]


@_fla_hybrid_backward.register_fake
def _fla_hybrid_backward_fake(
    do, dfinal, v, beta, residuals, cu_seqlens, cu_seqlens_cpu, initial_state, scale, use_qk_l2norm_in_kernel,
    g_dtype, chunk_rows,
):  # fmt: skip
    B, T, H, _ = v.shape
    qn, kn = residuals[0], residuals[1]
    q_shape = (B, T, qn.shape[2], qn.shape[3])
    state = (
        torch.empty_like(initial_state)
        if initial_state is not None
        else v.new_empty((0,), dtype=acc_dtype(v))
    )
    return [qn.new_empty(q_shape), kn.new_empty(q_shape), torch.empty_like(v), v.new_empty((B, T, H), dtype=g_dtype),
            torch.empty_like(beta), state]  # fmt: skip


@torch.library.custom_op("varpack::gated_delta_rule_backward", mutates_args=())
def _gated_delta_rule_backward(
    do: torch.Tensor,
    dfinal: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_cpu: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    scale: float,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    backend: str,
) -> list[torch.Tensor]:
    """``[dq, dk, dv, dg, dbeta, dinitial_state]`` (the last is an empty ``[0]`` tensor without
    ``initial_state``) by recomputation under ``torch.func.vjp``."""
    if backend not in _DIFFERENTIABLE or backend == "fla_hybrid":  # fla_hybrid: _fla_hybrid_backward
        raise RuntimeError(f"gated delta rule backend {backend!r} has no backward through this op")
    with_state = initial_state is not None
    primals = (q, k, v, g, beta) + ((initial_state,) if with_state else ())

    host = _host_boundaries(backend, q, cu_seqlens, cu_seqlens_cpu)

    def forward(*xs):
        h0 = xs[5] if with_state else None
        o, final = _run(
            backend,
            host,
            *xs[:5],
            cu_seqlens,
            cu_seqlens_cpu,
            h0,
            scale,
            output_final_state,
            use_qk_l2norm_in_kernel,
        )
        return (o, final) if output_final_state else o

    _, pull_back = torch.func.vjp(forward, *primals)
    if output_final_state and dfinal is None:
        raise RuntimeError("internal: output_final_state=True needs the final state's gradient")
    grads = list(pull_back((do, dfinal) if output_final_state else do))
    grads = [x.contiguous() for x in grads]
    if not with_state:
        grads.append(q.new_empty((0,), dtype=acc_dtype(q)))
    return grads


@_gated_delta_rule_backward.register_fake
def _gated_delta_rule_backward_fake(
    do, dfinal, q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, *rest
):
    state = (
        torch.empty_like(initial_state)
        if initial_state is not None
        else q.new_empty((0,), dtype=acc_dtype(q))
    )
    return [torch.empty_like(x) for x in (q, k, v, g, beta)] + [state]


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, cu, cu_cpu, h0, scale, output_final_state, l2norm, backend, chunk_rows = inputs
    residuals = output[2]
    ctx.mark_non_differentiable(*residuals)
    if backend == "fla_hybrid":  # the residuals replace g, and q and k where the rule normalises them
        kept = () if l2norm else (q, k)  # q, k as given: the backward reads them, not a copy
        ctx.save_for_backward(v, beta, cu, cu_cpu, h0, *kept, *residuals)
        ctx.g_dtype = g.dtype
    else:
        ctx.save_for_backward(q, k, v, g, beta, cu, cu_cpu, h0)
    ctx.scalars = (scale, output_final_state, l2norm, backend, chunk_rows)


def _backward(ctx, do, dfinal, _dresiduals):
    scale, output_final_state, l2norm, backend, chunk_rows = ctx.scalars
    if backend == "fla_hybrid":
        v, beta, cu, cu_cpu, h0, *residuals = ctx.saved_tensors
        if not l2norm:  # q and k themselves, packed as the residuals they stand for
            residuals[:2] = [t.reshape(1, -1, *t.shape[2:]) for t in residuals[:2]]
        q_like = residuals[0]  # the l2-normalised q: q's shape (packed) and dtype
    else:
        q, k, v, g, beta, cu, cu_cpu, h0 = ctx.saved_tensors
        q_like = q
    if output_final_state and dfinal is None:
        n = v.shape[0] if cu is None else cu.shape[0] - 1
        dfinal = torch.zeros(
            (n, v.shape[2], q_like.shape[3], v.shape[3]), dtype=acc_dtype(q_like), device=v.device
        )
    if do is None:
        do = torch.zeros_like(v, dtype=q_like.dtype)
    dfinal = dfinal if output_final_state else None
    if backend == "fla_hybrid":
        grads = _fla_hybrid_backward(
            do, dfinal, v, beta, residuals, cu, cu_cpu, h0, scale, l2norm, ctx.g_dtype, chunk_rows
        )
    else:
        grads = _gated_delta_rule_backward(
            do, dfinal, q, k, v, g, beta, cu, cu_cpu, h0, scale, output_final_state, l2norm, backend
        )
    dh0 = grads[5] if h0 is not None else None
    return (*grads[:5], None, None, dh0, None, None, None, None, None)


_gated_delta_rule.register_autograd(_backward, setup_context=_setup_context)


@torch.compiler.assume_constant_result
def _resolve_constant(
    backend: str, device_type: str, device_index: int, needs_grad: bool, dims: tuple | None = None
) -> str:
    """Backend resolution from guarded facts (device, grad mode, head dims), a trace-time constant under
    compile."""
    device = torch.device(device_type, device_index) if device_index >= 0 else torch.device(device_type)
    return _resolve(backend, device, needs_grad, dims)


def _resolve(backend: str, device: torch.device, needs_grad: bool, dims: tuple | None = None) -> str:
    if backend == "chunk_compiled":
        raise ValueError(
            "backend 'chunk_compiled' is not run through the custom op (the op is one node of a compiled "
            "graph already); use 'chunk'"
        )
    name = resolve_backend(backend, device, needs_grad=needs_grad, dims=dims)
    if name == "chunk_compiled":  # not chosen by auto today; kept exact if that changes
        name = "chunk"
    if needs_grad and name not in _DIFFERENTIABLE:
        raise RuntimeError(
            f"gated delta rule backend {name!r} has no backward through varpack's custom op (fla's separate "
            "forward/backward kernels are not wired); use backend='chunk' or gated_delta_rule directly"
        )
    return name


def gated_delta_rule_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    backend: str = "auto",
    cu_seqlens_cpu: torch.Tensor | None = None,
    needs_grad: bool | None = None,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`varpack.ops.gated_delta_rule.gated_delta_rule` through the ``varpack::gated_delta_rule``
    custom op: same arguments (no ``layout``: the op rebuilds it per call), shapes and results
    (``(o, final_state | None)``); equal values and gradients on the same backend.

    Outside ``torch.compile``, the inputs are validated as the backends do (:func:`check_inputs`, CPU
    ``cu_seqlens`` values included) and ``backend`` is resolved before the op; under ``torch.compile`` only
    shapes are checked (tensor values are never read) and ``auto`` is resolved at trace time from the
    device and grad mode, facts the compiler guards on. ``needs_grad``: resolve ``backend`` as for a call
    that will (``True``) or will not need gradients; default ``None``: whether this call records them (a
    layer in training mode passes ``True``, so that the no-grad first pass of reentrant gradient checkpointing
    picks the backend of its recomputation). ``chunk_rows``: ``fla_hybrid``'s row count of chunk tables built
    on the device (device ``cu_seqlens`` without a CPU copy): a bound of the batch's 64-token chunks known to
    hold (:class:`varpack.varlen.VarlenMeta`'s ``linear_chunk_rows``); default: the bound of any offsets.

    Raises:
        ValueError / TypeError: as :func:`gated_delta_rule`; ``backend="chunk_compiled"``.
        RuntimeError: a forced backend that cannot run here; a call that needs gradients on ``fla``.
    """
    if needs_grad is None:
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state)
        )
    if torch.compiler.is_compiling():
        name = _resolve_constant(backend, q.device.type, -1 if q.device.index is None else q.device.index,
                                 needs_grad, head_dims(q, v))  # fmt: skip
    else:
        cu_seqlens = normalize_optional_cu(cu_seqlens)
        cu_seqlens_cpu = normalize_optional_cu(cu_seqlens_cpu, "cu_seqlens_cpu")
        if cu_seqlens_cpu is not None and cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(
                f"cu_seqlens_cpu must be a CPU copy of cu_seqlens, got a tensor on {cu_seqlens_cpu.device}"
            )
        check_inputs(
            q, k, v, g, beta, initial_state, cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens
        )
        name = _resolve(backend, q.device, needs_grad, head_dims(q, v))
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if (
        name != "fla"
        and cu_seqlens_cpu is None
        and cu_seqlens is not None
        and cu_seqlens.device.type == "cpu"
    ):
        cu_seqlens_cpu = cu_seqlens
    o, final, _ = _gated_delta_rule(
        q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, float(scale), bool(output_final_state),
        bool(use_qk_l2norm_in_kernel), name, int(chunk_rows or 0),
    )  # fmt: skip
    return o, (final if output_final_state else None)
