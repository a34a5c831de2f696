"""Backend selection for the gated delta rule: ``fla`` when it can run, else varpack's own paths.

Backends (``name -> what``):

* ``"fla"``: flash-linear-attention's Triton ``chunk_gated_delta_rule`` with ``cu_seqlens`` (CUDA only;
  usable for training only if its backward runs on this device, see :func:`varpack.ops._fla.fla_status`).
* ``"chunk"``: :func:`chunk_gated_delta_rule`, PyTorch, vectorized over sequences; any device.
* ``"chunk_compiled"``: the same, with ``torch.compile(dynamic=True)`` on its two hot blocks.
* ``"naive"``: :func:`naive_recurrent_gated_delta_rule`, token by token (the truth; slow).

``"auto"``: on CUDA, ``fla`` if fla runs forward and backward there (or forward, when no gradient is
needed), else ``chunk``; on CPU ``chunk`` (it equals ``naive`` to fp32 rounding, tested forward and
backward, and is orders of magnitude faster than a token loop). A forced backend that cannot run raises
with the reason; nothing falls back silently from a forced choice.
"""

from __future__ import annotations

import torch

from .._fla import fla_chunk_gated_delta_rule, fla_status
from ._common import normalize_optional_cu
from .chunk import ChunkLayout, chunk_gated_delta_rule
from .naive import naive_recurrent_gated_delta_rule

__all__ = ["BACKENDS", "available_backends", "gated_delta_rule", "resolve_backend"]

BACKENDS = ("fla", "chunk", "chunk_compiled", "naive")


def available_backends(
    device: torch.device | str | None = None, *, needs_grad: bool = True
) -> dict[str, tuple[bool, str]]:
    """``{backend: (ok, reason)}`` on ``device`` (default: CUDA if available, else CPU).

    Probes fla once per device (see :func:`varpack.ops._fla.fla_status`).
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
    st = fla_status(device)
    if not st.forward[0]:
        out["fla"] = (False, st.forward[1])
    elif needs_grad and not st.backward[0]:
        out["fla"] = (False, f"fla forward runs but its backward cannot: {st.backward[1]}")
    else:
        out["fla"] = (True, "ok" if st.backward[0] else "ok (forward only: no gradient needed)")
    return out


def resolve_backend(
    backend: str = "auto", device: torch.device | str | None = None, *, needs_grad: bool = True
) -> str:
    """The backend ``backend`` means on ``device``: ``auto`` resolved, a forced one checked.

    Raises:
        ValueError: an unknown backend name.
        RuntimeError: a forced backend that cannot run here, with its reason.
    """
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(
            f"unknown gated delta rule backend {backend!r}; expected 'auto' or one of {BACKENDS}"
        )
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if backend == "auto":
        if device.type == "cuda":
            ok, _ = available_backends(device, needs_grad=needs_grad)["fla"]
            return "fla" if ok else "chunk"
        return "chunk"
    if backend in ("chunk", "naive"):
        return backend
    ok, reason = available_backends(device, needs_grad=needs_grad)[backend]
    if not ok:
        raise RuntimeError(f"gated delta rule backend {backend!r} cannot run on {device}: {reason}")
    return backend


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule with ``cu_seqlens`` on the best (or the forced) backend.

    Arguments, shapes and results as :func:`chunk_gated_delta_rule` / fla's ``chunk_gated_delta_rule``:
    q/k ``[1, T, Hk, K]``, v ``[1, T, H, V]``, g/beta ``[1, T, H]``, cu_seqlens ``[N+1]``,
    initial/final state ``[N, H, K, V]``; returns ``(o [1, T, H, V], final_state | None)``. ``cu_seqlens``
    may be a list / NumPy array of integers, converted once (:func:`varpack.varlen.normalize_cu_seqlens`).

    Args:
        backend: ``"auto"``, ``"fla"``, ``"chunk"``, ``"chunk_compiled"`` or ``"naive"`` (module docstring).
        layout: a :func:`prepare_chunk_layout` result for ``cu_seqlens`` (chunk backends; saves rebuilding it).
        cu_seqlens_cpu: a CPU copy of ``cu_seqlens`` when ``cu_seqlens`` lives on the device (no sync).

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
    name = resolve_backend(backend, q.device, needs_grad=_needs_grad(q, k, v, g, beta, initial_state))
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
