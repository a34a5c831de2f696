"""Backend selection for the gated delta rule: ``fla`` when it can run, else varpack's own paths.

Backends (``name -> what``):

* ``"fla"``: flash-linear-attention's Triton ``chunk_gated_delta_rule`` with ``cu_seqlens`` (CUDA only;
  usable for training only if its backward runs on this device, see :func:`fla_gated_delta_status`).
* ``"fla_hybrid"``: fla's forward and backward kernels with the one backward step fla flags as wrong on
  Hopper with Triton >= 3.4, < 3.7.1 (``chunk_bwd_dqkwg``) done by varpack's own Triton kernel
  (:mod:`varpack.ops.gated_delta_rule.fla_hybrid`); CUDA only, probed forward and backward at the caller's
  head dims (:func:`fla_hybrid_status`).
* ``"chunk"``: :func:`chunk_gated_delta_rule`, PyTorch, vectorized over sequences; any device.
* ``"chunk_compiled"``: the same, with ``torch.compile(dynamic=True)`` on its two hot blocks.
* ``"naive"``: :func:`naive_recurrent_gated_delta_rule`, token by token (the truth; slow).

``"auto"``: on CUDA, ``fla`` if fla runs forward and backward there (or forward, when no gradient is
needed), else ``fla_hybrid`` if :data:`AUTO_FLA_HYBRID` is on and its probe passes, else ``chunk``; on CPU
``chunk`` (it equals ``naive`` to fp32 rounding, tested forward and
backward, and is orders of magnitude faster than a token loop). A forced backend that cannot run raises
with the reason; nothing falls back silently from a forced choice.
"""

from __future__ import annotations

import torch

from varpack._probe import ProbeOnce

from .._fla import (
    PROBE_TOL,
    autotune_notice,
    bf16_randn,
    first_line,
    fla_chunk_gated_delta_rule,
    fla_device,
    load_fla,
    probe_key,
    probe_problem,
    rel_err,
)
from ._common import normalize_optional_cu
from .chunk import ChunkLayout, chunk_gated_delta_rule
from .fla_hybrid import FlaHybridBoundaries, fla_hybrid_gated_delta_rule, load_hybrid
from .naive import naive_recurrent_gated_delta_rule

__all__ = [
    "BACKENDS",
    "available_backends",
    "fla_gated_delta_status",
    "fla_hybrid_status",
    "gated_delta_rule",
    "head_dims",
    "resolve_backend",
    "resolve_backend_reason",
]

BACKENDS = ("fla", "fla_hybrid", "chunk", "chunk_compiled", "naive")

#: Whether ``auto`` may pick ``fla_hybrid`` (where fla's own backward refuses; its probe must pass too). On
#: the H200 (torch 2.11, Triton 3.6, fla-core 0.6.0) with varpack's Triton step, benchmarks/gated_delta.py:
#: 5.78 ms forward + backward at 64 x 512 (chunk: 35.8; the PyTorch step: 13.9), 5.19 at 16 x 2048, 5.53 on real
#: lengths (benchmarks/RESULTS.md#gated-delta-rule); benchmarks/hybrid_step.py: the Qwen3.5-shaped step at 248 ms
#: vs 707 ms on chunk (2.85x; benchmarks/RESULTS.md#hybrid-step). Exactness: every fla_hybrid / dqkwg GPU test
#: (``bash scripts/gpu.sh tests:2``) and ``varpack check --model tiny-qwen3.5 --dtype bf16 --device cuda``.
AUTO_FLA_HYBRID = True

Capability = tuple[bool, str]


#: Head counts and dims ``(Hk, H, K, V)`` of the probe problem when the caller does not name its own.
PROBE_DIMS = (2, 4, 64, 64)  # callers that know their shape pass it (model layers, the GPU tests: GPU_DIMS)
Dims = tuple[int, int, int, int]


def head_dims(q: torch.Tensor, v: torch.Tensor) -> Dims | None:
    """``(Hk, H, K, V)`` of q ``[B, T, Hk, K]`` and v ``[B, T, H, V]``: the probe dims of a call (``None``
    for malformed shapes, which the backends then refuse with their own message)."""
    if q.dim() != 4 or v.dim() != 4:
        return None
    dims = (int(q.shape[2]), int(v.shape[2]), int(q.shape[3]), int(v.shape[3]))
    return dims if min(dims) >= 1 and dims[1] % dims[0] == 0 else None


def _probe_dims_key(device: torch.device, dims: Dims | None = None) -> tuple[str, Dims]:
    return probe_key(device), tuple(dims) if dims is not None else PROBE_DIMS


def _probe_fla(device: torch.device, dims: Dims | None = None) -> tuple[Capability, Capability]:
    """fla's ``chunk_gated_delta_rule`` forward and backward on a tiny packed bf16 problem (198 tokens) of
    the caller's head counts and dims ``(Hk, H, K, V)`` (default :data:`PROBE_DIMS`) vs
    :func:`chunk_gated_delta_rule` in fp32: ``((ok, reason) forward, (ok, reason) backward)``. With the
    model's own dims fla's Triton autotuning (once per process and (H, K, V) key; the bulk of a first call's
    time) is shared by the probe and the model's layers instead of being paid twice."""
    rule, _, reason = load_fla()
    if device.type != "cuda":
        no = (False, f"fla needs a CUDA device, got {device}")
        return no, no
    if rule is None:
        no = (False, reason)
        return no, no

    gen, T, cu_cpu, cu = probe_problem(device)
    Hk, H, K, V = dims if dims is not None else PROBE_DIMS
    autotune_notice(device, (Hk, H, K, V))

    def rnd(*shape):
        return bf16_randn(gen, device, *shape)

    q, k, v = rnd(1, T, Hk, K), rnd(1, T, Hk, K), rnd(1, T, H, V)
    g = torch.nn.functional.logsigmoid(rnd(1, T, H).float()).to(torch.bfloat16)
    beta = torch.rand(1, T, H, generator=gen).to(device=device, dtype=torch.bfloat16)
    do = rnd(1, T, H, V)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    ref_leaves = [x.detach().float().requires_grad_() for x in (q, k, v, g, beta)]
    ref_o, _ = chunk_gated_delta_rule(*ref_leaves, cu_seqlens=cu_cpu, use_qk_l2norm_in_kernel=True)
    ref_grads = torch.autograd.grad((ref_o * do.float()).sum(), ref_leaves)

    fwd = bwd = (False, "not run")
    try:
        o, _ = rule(*leaves, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, use_qk_l2norm_in_kernel=True)
        err = rel_err(o, ref_o)
        fwd = (
            (True, "ok")
            if err < PROBE_TOL
            else (False, f"fla forward disagrees with the reference (rel err {err:.3g})")
        )
        if fwd[0]:
            try:
                grads = torch.autograd.grad((o.float() * do.float()).sum(), leaves)
                errs = [rel_err(a, b) for a, b in zip(grads, ref_grads)]
                bad = max(errs)
                bwd = (
                    (True, "ok")
                    if bad < PROBE_TOL
                    else (False, f"fla backward disagrees with the reference (rel err {bad:.3g})")
                )
            except Exception as exc:  # fla's own refusal, e.g. the Triton/Hopper check
                bwd = (False, f"fla backward refused: {first_line(exc)}")
        else:
            bwd = (False, "forward unusable")
    except Exception as exc:
        fwd = (False, f"fla forward failed: {first_line(exc)}")
        bwd = (False, "forward unusable")
    return fwd, bwd


_FLA_PROBE = ProbeOnce(_probe_fla, key=_probe_dims_key, name="fla chunk_gated_delta_rule")


def fla_gated_delta_status(
    device: torch.device | str | None = None, dims: Dims | None = None
) -> tuple[Capability, Capability]:
    """``((ok, reason) forward, (ok, reason) backward)`` of fla's gated delta rule on ``device`` (default:
    CUDA if available, else CPU), probed once per device and head dims ``(Hk, H, K, V)`` (default
    :data:`PROBE_DIMS`; a model's layers pass their own, :func:`_probe_fla`) (:class:`varpack._probe.ProbeOnce`).

    The first call on a CUDA device runs a tiny problem there (a few milliseconds plus Triton compiles) and
    compares it with :func:`chunk_gated_delta_rule` in fp32; fla's own refusals (e.g. its Triton/Hopper check
    in the backward) become the reason.
    """
    return _FLA_PROBE(fla_device(device), _dims(dims))


def _probe_fla_hybrid(device: torch.device, dims: Dims | None = None) -> Capability:
    """``fla_hybrid`` forward and backward (initial and final state included) on the tiny packed bf16 probe
    problem of head dims ``dims`` (:func:`_probe_fla`) vs :func:`chunk_gated_delta_rule` in fp32:
    ``(ok, reason)``."""
    if device.type != "cuda":
        return False, f"fla_hybrid needs a CUDA device, got {device}"
    return _run_fla_hybrid_probe(device, fla_hybrid_gated_delta_rule, dims)


def _run_fla_hybrid_probe(device: torch.device, rule, dims: Dims | None = None) -> Capability:
    """The probe's problem through ``rule`` (``fla_hybrid_gated_delta_rule``; the CPU tests pass a stand-in)."""
    fns, reason = load_hybrid()
    if fns is None:
        return False, reason
    gen, T, cu_cpu, cu = probe_problem(device)
    Hk, H, K, V = dims if dims is not None else PROBE_DIMS
    autotune_notice(device, (Hk, H, K, V))
    N = cu_cpu.numel() - 1

    def rnd(*shape):
        return bf16_randn(gen, device, *shape)

    q, k, v = rnd(1, T, Hk, K), rnd(1, T, Hk, K), rnd(1, T, H, V)
    g = torch.nn.functional.logsigmoid(rnd(1, T, H).float()).to(torch.bfloat16)
    beta = torch.rand(1, T, H, generator=gen).to(device=device, dtype=torch.bfloat16)
    h0 = (0.5 * torch.randn(N, H, K, V, generator=gen)).to(device)
    do, dht = rnd(1, T, H, V), (0.5 * torch.randn(N, H, K, V, generator=gen)).to(device)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    ref_leaves = [x.detach().float().requires_grad_() for x in (q, k, v, g, beta, h0)]
    ref_o, ref_s = chunk_gated_delta_rule(
        *ref_leaves[:5], initial_state=ref_leaves[5], output_final_state=True, cu_seqlens=cu_cpu,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    ref_grads = torch.autograd.grad((ref_o * do.float()).sum() + (ref_s * dht).sum(), ref_leaves)
    try:
        o, s = rule(
            *leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        errs = {"o": rel_err(o.detach(), ref_o.detach()), "final_state": rel_err(s.detach(), ref_s.detach())}
        grads = torch.autograd.grad((o.float() * do.float()).sum() + (s * dht).sum(), leaves)
    except Exception as exc:
        return False, f"fla_hybrid failed: {first_line(exc)}"
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    errs.update({n: rel_err(a, b) for n, a, b in zip(names, grads, ref_grads)})
    worst = max(errs, key=errs.get)
    if errs[worst] >= PROBE_TOL:
        return False, f"fla_hybrid disagrees with the reference ({worst}: rel err {errs[worst]:.3g})"
    return True, "ok"


_HYBRID_PROBE = ProbeOnce(_probe_fla_hybrid, key=_probe_dims_key, name="fla_hybrid gated delta rule")


def _dims(dims: Dims | None) -> Dims:
    if dims is None:
        return PROBE_DIMS
    out = tuple(int(x) for x in dims)
    if len(out) != 4 or min(out) < 1 or out[1] % out[0]:
        raise ValueError(f"probe dims must be (Hk, H, K, V) with H a multiple of Hk, got {dims!r}")
    return out  # type: ignore[return-value]


def fla_hybrid_status(device: torch.device | str | None = None, dims: Dims | None = None) -> Capability:
    """``(ok, reason)`` of the ``fla_hybrid`` backend (forward and backward) on ``device`` (default: CUDA
    if available, else CPU), probed once per device and head dims ``(Hk, H, K, V)`` (default
    :data:`PROBE_DIMS`; :func:`_probe_fla`) (:class:`varpack._probe.ProbeOnce`): a tiny packed bf16 problem
    with initial and final state compared with :func:`chunk_gated_delta_rule` in fp32 (Triton compiles and
    fla autotunes on the first call).

    Raises:
        ValueError: malformed ``dims``.
    """
    return _HYBRID_PROBE(fla_device(device), _dims(dims))


def _fla_capability(device: torch.device, needs_grad: bool, dims: Dims | None = None) -> tuple[bool, str]:
    forward, backward = fla_gated_delta_status(device, dims)
    if not forward[0]:
        return False, forward[1]
    if needs_grad and not backward[0]:
        return False, f"fla forward runs but its backward cannot: {backward[1]}"
    return True, "ok" if backward[0] else "ok (forward only: no gradient needed)"


def _fla_hybrid_capability(device: torch.device, dims: Dims | None = None) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"fla_hybrid needs a CUDA device, got {device}"
    return fla_hybrid_status(device, dims)


def available_backends(
    device: torch.device | str | None = None, *, needs_grad: bool = True, dims: Dims | None = None
) -> dict[str, tuple[bool, str]]:
    """``{backend: (ok, reason)}`` on ``device`` (default: CUDA if available, else CPU).

    Probes fla and fla_hybrid once per device and head dims ``dims`` ``(Hk, H, K, V)`` (see
    :func:`fla_gated_delta_status`, :func:`fla_hybrid_status`).
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    out: dict[str, tuple[bool, str]] = {
        "chunk": (True, "ok"),
        "naive": (True, "ok (token by token: slow)"),
    }
    if hasattr(torch, "compile"):
        out["chunk_compiled"] = (True, "ok (first call per shape class compiles)")
    else:
        out["chunk_compiled"] = (False, f"torch {torch.__version__} has no torch.compile")
    out["fla"] = _fla_capability(device, needs_grad, dims)
    out["fla_hybrid"] = _fla_hybrid_capability(device, dims)
    return out


def resolve_backend(
    backend: str = "auto",
    device: torch.device | str | None = None,
    *,
    needs_grad: bool = True,
    dims: Dims | None = None,
) -> str:
    """The backend ``backend`` means on ``device``: ``auto`` resolved, a forced one checked.

    ``dims``: the caller's head counts and dims ``(Hk, H, K, V)`` (:func:`head_dims`): fla's probes then run
    at them, so their autotuning is the model's own (default :data:`PROBE_DIMS`).

    Raises:
        ValueError: an unknown backend name; malformed ``dims``.
        RuntimeError: a forced backend that cannot run here, with its reason.
    """
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(
            f"unknown gated delta rule backend {backend!r}; expected 'auto' or one of {BACKENDS}"
        )
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if backend == "auto":
        if device.type == "cuda":
            if _fla_capability(device, needs_grad, dims)[0]:
                return "fla"
            if AUTO_FLA_HYBRID and _fla_hybrid_capability(device, dims)[0]:
                return "fla_hybrid"
        return "chunk"
    if backend in ("chunk", "naive"):
        return backend
    if backend == "fla":
        ok, reason = _fla_capability(device, needs_grad, dims)
    elif backend == "fla_hybrid":
        ok, reason = _fla_hybrid_capability(device, dims)
    else:
        ok, reason = available_backends(device, needs_grad=needs_grad, dims=dims)[backend]
    if not ok:
        raise RuntimeError(f"gated delta rule backend {backend!r} cannot run on {device}: {reason}")
    return backend


def resolve_backend_reason(
    backend: str = "auto",
    device: torch.device | str | None = None,
    *,
    needs_grad: bool = True,
    dims: Dims | None = None,
) -> tuple[str, str]:
    """``(name, why)``: :func:`resolve_backend` and, for ``auto``, why each faster backend was or was not
    taken (fla's and fla_hybrid's probe results): what ``varpack check`` reports.

    Raises:
        ValueError / RuntimeError: as :func:`resolve_backend`.
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    name = resolve_backend(backend, device, needs_grad=needs_grad, dims=dims)
    if backend != "auto":
        return name, "forced"
    if device.type != "cuda":
        return name, f"auto on {device.type}: varpack's chunked PyTorch path"
    fla_ok, fla_why = _fla_capability(device, needs_grad, dims)
    if fla_ok:
        return name, f"auto: fla {fla_why}"
    if not AUTO_FLA_HYBRID:
        why = "not chosen by auto yet (AUTO_FLA_HYBRID off; opt in with it)"
        return name, f"auto: fla: {fla_why}; fla_hybrid: {why}"
    hyb_ok, hyb_why = _fla_hybrid_capability(device, dims)
    if hyb_ok:
        return name, f"auto: fla_hybrid probe passed (fla: {fla_why})"
    return name, f"auto: fla: {fla_why}; fla_hybrid: {hyb_why}"


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def gated_delta_rule(
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
    layout: ChunkLayout | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    fla_boundaries: FlaHybridBoundaries | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule with ``cu_seqlens`` on the best (or the forced) backend.

    Arguments, shapes and results as :func:`chunk_gated_delta_rule` / fla's ``chunk_gated_delta_rule``:
    q/k ``[1, T, Hk, K]``, v ``[1, T, H, V]``, g/beta ``[1, T, H]``, cu_seqlens ``[N+1]``,
    initial/final state ``[N, H, K, V]``; returns ``(o [1, T, H, V], final_state | None)``. ``cu_seqlens``
    may be a list / NumPy array of integers, converted once (:func:`varpack.varlen.normalize_cu_seqlens`).

    Args:
        backend: ``"auto"``, ``"fla"``, ``"fla_hybrid"``, ``"chunk"``, ``"chunk_compiled"`` or ``"naive"``
            (module docstring).
        layout: a :func:`prepare_chunk_layout` result for ``cu_seqlens`` (chunk backends; saves rebuilding it).
        cu_seqlens_cpu: a CPU copy of ``cu_seqlens`` when ``cu_seqlens`` lives on the device (no sync).
        fla_boundaries: a :func:`~varpack.ops.gated_delta_rule.fla_hybrid.prepare_fla_hybrid_boundaries`
            result for ``cu_seqlens`` (``fla_hybrid``; kept per batch, it saves rebuilding it per layer).

    Raises:
        ValueError: invalid shapes / ``cu_seqlens`` / backend name (see :func:`chunk_gated_delta_rule`).
        TypeError: ``cu_seqlens`` not integers.
        RuntimeError: a forced backend that cannot run here, with its reason.
    """
    cu_seqlens = normalize_optional_cu(cu_seqlens)
    cu_seqlens_cpu = normalize_optional_cu(cu_seqlens_cpu, "cu_seqlens_cpu")
    if cu_seqlens_cpu is not None and cu_seqlens_cpu.device.type != "cpu":
        raise ValueError(
            f"cu_seqlens_cpu must be a CPU copy of cu_seqlens, got a tensor on {cu_seqlens_cpu.device}"
        )
    name = resolve_backend(
        backend, q.device, needs_grad=_needs_grad(q, k, v, g, beta, initial_state), dims=head_dims(q, v)
    )
    if name == "fla":
        if cu_seqlens is not None and q.shape[0] != 1:
            raise ValueError(
                f"with cu_seqlens the batch dimension must be 1 (a packed row), got B={q.shape[0]}"
            )
        if cu_seqlens_cpu is None and cu_seqlens is not None and cu_seqlens.device.type == "cpu":
            cu_seqlens_cpu = cu_seqlens
        return fla_chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            scale,
            initial_state,
            output_final_state,
            cu_seqlens,
            cu_seqlens_cpu,
            use_qk_l2norm_in_kernel,
        )
    if name == "fla_hybrid":
        return fla_hybrid_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            scale,
            initial_state,
            output_final_state,
            cu_seqlens,
            use_qk_l2norm_in_kernel,
            cu_seqlens_cpu=cu_seqlens_cpu,
            boundaries=fla_boundaries,
        )
    if name == "naive":
        return naive_recurrent_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            scale,
            initial_state,
            output_final_state,
            cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu,
            use_qk_l2norm_in_kernel,
        )
    return chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu,
        use_qk_l2norm_in_kernel,
        layout=layout,
        compile=name == "chunk_compiled",
    )
