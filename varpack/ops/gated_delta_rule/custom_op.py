"""The gated delta rule as a ``torch.library`` custom op, so ``torch.compile`` traces a layer through it.

``varpack::gated_delta_rule(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, scale,
output_final_state, use_qk_l2norm_in_kernel, backend) -> (o, final_state)`` runs one *resolved* backend of
:func:`varpack.ops.gated_delta_rule.gated_delta_rule` as a single opaque graph node, with a fake (meta)
implementation giving shapes and dtypes without touching values. Shapes as :func:`gated_delta_rule`:
q/k ``[B, T, Hk, K]``, v ``[B, T, H, V]``, g/beta ``[B, T, H]``, cu_seqlens ``[N+1]`` (B = 1) or None,
initial_state ``[N, H, K, V]`` or None; ``o`` ``[B, T, H, V]`` in q's dtype; ``final_state`` ``[N, H, K, V]``
(fp32, fp64 for fp64 inputs) when ``output_final_state``, else an empty ``[0]`` tensor.

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

Backward (``register_autograd``): the second op ``varpack::gated_delta_rule_backward`` recomputes the
backend's forward under ``torch.func.vjp`` (autograd records nothing inside an op's implementation, which
runs below the autograd dispatch key; functorch's transform re-enables it) and pulls the output gradient
back to q, k, v, g, beta and initial_state: one extra forward per backward. A native path would plug in
there: fla's ``chunk_gated_delta_rule_fwd`` / ``chunk_gated_delta_rule_bwd`` (fla/ops/gated_delta_rule/chunk.py)
take the same tensors plus the intermediate ``A``/``w``/``u`` (or recompute them), with q/k l2-normalised
outside them (fla's ``l2norm_fwd`` / ``l2norm_bwd``); their signatures changed across fla releases, so they
are not wired blind here. Through this op ``fla`` is therefore forward-only: a call on ``fla`` that needs
gradients raises ``RuntimeError`` (use ``chunk``, or :func:`gated_delta_rule` directly). ``fla_hybrid`` is
wired natively: its backward op calls :func:`varpack.ops.gated_delta_rule.fla_hybrid.fla_hybrid_backward`
(fla's forward recomputed, then fla's backward kernels with varpack's own ``dq/dk/dw/dg`` step; fla-core
0.6.0's internal signatures, checked at load).

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
from .fla_hybrid import fla_hybrid_backward, fla_hybrid_gated_delta_rule, prepare_fla_hybrid_boundaries
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
    if backend == "fla_hybrid":
        return fla_hybrid_gated_delta_rule(
            q, k, v, g, beta, scale, h0, output_final_state, cu, l2norm, cu_seqlens_cpu=cu_cpu, boundaries=host
        )
    if backend == "fla":
        return fla_chunk_gated_delta_rule(
            q, k, v, g, beta, scale, h0, output_final_state, cu, cu_cpu if cu_cpu is not None else cu, l2norm
        )
    if backend == "naive":
        return naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale, h0, output_final_state, host, l2norm)
    return chunk_gated_delta_rule(q, k, v, g, beta, scale, h0, output_final_state, None, l2norm, layout=host)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    host = _host_boundaries(backend, q, cu_seqlens, cu_seqlens_cpu)
    o, final = _run(
        backend, host, q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, scale, output_final_state,
        use_qk_l2norm_in_kernel,
    )  # fmt: skip
    final = final.contiguous() if output_final_state else _empty_state(q)
    return o.contiguous(), final


@_gated_delta_rule.register_fake
def _gated_delta_rule_fake(
    q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, scale, output_final_state,
    use_qk_l2norm_in_kernel, backend,
):  # fmt: skip
    B, T, _, K = q.shape
    H, V = v.shape[2], v.shape[3]
    o = q.new_empty((B, T, H, V))
    if not output_final_state:
        return o, _empty_state(q)
    n = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else B
    return o, q.new_empty((n, H, K, V), dtype=acc_dtype(q))


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
    if backend not in _DIFFERENTIABLE:
        raise RuntimeError(f"gated delta rule backend {backend!r} has no backward through varpack's op")
    with_state = initial_state is not None
    if backend == "fla_hybrid":  # native: fla's forward recomputed, its backward with varpack's dqkwg step
        grads = fla_hybrid_backward(
            do, dfinal if output_final_state else None, q, k, v, g, beta, scale, initial_state, cu_seqlens,
            use_qk_l2norm_in_kernel, cu_seqlens_cpu=cu_seqlens_cpu,
            boundaries=_host_boundaries(backend, q, cu_seqlens, cu_seqlens_cpu),
        )  # fmt: skip
        grads = [x.contiguous() for x in grads[:5]] + [
            grads[5].contiguous() if with_state else q.new_empty((0,), dtype=acc_dtype(q))
        ]
        return grads
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
    q, k, v, g, beta, cu, cu_cpu, h0, scale, output_final_state, l2norm, backend = inputs
    ctx.save_for_backward(q, k, v, g, beta, cu, cu_cpu, h0)
    ctx.scalars = (scale, output_final_state, l2norm, backend)


def _backward(ctx, do, dfinal):
    q, k, v, g, beta, cu, cu_cpu, h0 = ctx.saved_tensors
    scale, output_final_state, l2norm, backend = ctx.scalars
    if output_final_state and dfinal is None:
        dfinal = torch.zeros(
            (q.shape[0] if cu is None else cu.shape[0] - 1, v.shape[2], q.shape[3], v.shape[3]),
            dtype=acc_dtype(q), device=q.device,
        )  # fmt: skip
    if do is None:
        do = torch.zeros_like(v, dtype=q.dtype)
    grads = _gated_delta_rule_backward(
        do, dfinal if output_final_state else None, q, k, v, g, beta, cu, cu_cpu, h0, scale,
        output_final_state, l2norm, backend,
    )  # fmt: skip
    dh0 = grads[5] if h0 is not None else None
    return (*grads[:5], None, None, dh0, None, None, None, None)


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
    picks the backend of its recomputation).

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
    o, final = _gated_delta_rule(
        q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu, initial_state, float(scale), bool(output_final_state),
        bool(use_qk_l2norm_in_kernel), name,
    )  # fmt: skip
    return o, (final if output_final_state else None)
