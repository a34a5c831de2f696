"""Short causal depthwise convolution with sequence boundaries (the conv in front of Gated DeltaNet / Mamba).

Qwen3.5 and Qwen3-Next run ``q, k, v`` through a 4-tap causal depthwise ``Conv1d`` (+ SiLU) before the
gated delta rule. On a packed row, the first ``W - 1`` tokens of a sample would read the previous
sample's last tokens; here every tap that would cross a boundary reads zero instead, exactly what the
sample sees alone (left zero padding, transformers' ``causal_conv1d_fn`` / ``nn.Conv1d(padding=W-1)``,
Dao-AILab ``causal-conv1d`` with ``seq_idx``, fla ``causal_conv1d`` with ``cu_seqlens``)::

    out[t] = act(bias + sum_{d=0}^{W-1} weight[:, W-1-d] * x[t-d] * [t-d in the same sample as t])

Backends of :func:`short_conv`:

* ``torch``: ``W`` shifted multiply-adds over the whole row, boundary masks from ``seq_idx`` (device compare, no
  host sync) or from CPU ``cu_seqlens``; fp32 accumulation; autograd backward.
* ``triton``: the custom op ``varpack::short_conv`` (:mod:`varpack.ops._short_conv_kernels`: one forward kernel
  that reads x once and writes y once; its backward, the op ``varpack::short_conv_backward``, one kernel that
  reads x and dy, recomputes the pre-activation, writes dx and per-block weight / bias gradient sums, summed
  afterwards in a fixed order). Boundaries from ``seq_idx`` read on the device: no host sync, shapes
  independent of the segmentation, so a layer using it can be compiled (``fullgraph=True``) and captured in a
  CUDA graph.
* ``fla``: fla's Triton ``causal_conv1d`` with ``cu_seqlens``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from varpack._probe import ProbeOnce
from varpack.varlen.boundaries import checked_host_cu_seqlens, normalize_cu_seqlens, seq_idx_from_cu_seqlens

from ._fla import (
    PROBE_TOL,
    autotune_notice,
    bf16_randn,
    first_line,
    fla_causal_conv1d,
    fla_device,
    load_fla,
    probe_key,
    probe_problem,
    rel_err,
)

__all__ = [
    "fla_conv_status",
    "resolve_conv_backend",
    "seq_idx_for_conv",
    "short_conv",
    "short_conv_reference",
    "short_conv_triton",
    "short_conv_triton_backward",
    "triton_conv_status",
]

CONV_BACKENDS = ("torch", "fla", "triton")

#: Largest kernel width ``W`` of the ``triton`` backend (a compile-time constant of its kernels).
TRITON_MAX_WIDTH = 8

#: Largest head size of the ``triton`` backend's fused L2 norm (``short_conv(..., l2norm=...)``): one program
#: holds a whole head.
TRITON_MAX_L2NORM_HEAD = 256

#: ``eps`` of the fused L2 norm: ``y / sqrt(sum(y^2) + eps)``, as fla's ``l2norm`` and transformers' Qwen3.5 /
#: Qwen3-Next ``l2norm``.
L2NORM_EPS = 1e-6

#: Launch parameters of the ``triton`` backend (:mod:`varpack.ops._short_conv_kernels`), measured at Qwen3.5's
#: conv (T = 8192, D = 6144, W = 4, bf16) on an H200. Forward: ``[block_t, block_d]`` token x channel blocks.
#: Backward: a program runs ``streams`` runs of ``rows`` consecutive tokens over ``block_d`` channels, loading
#: ``prefetch`` token rows ahead; one ``[W, D]`` fp32 weight gradient slice per ``streams * rows`` tokens.
SHORT_CONV_TRITON_LAUNCH = {
    "fwd": {"block_t": 16, "block_d": 256, "num_warps": 4},
    "bwd": {"streams": 4, "rows": 64, "block_d": 128, "prefetch": 2, "num_warps": 4},
}

Capability = tuple[bool, str]


#: Channels and kernel width ``(D, W)`` of the probe problem when the caller does not name its own.
CONV_PROBE_DIMS = (64, 4)


def _conv_key(device: torch.device, dims: tuple[int, int] | None = None) -> tuple[str, tuple[int, int]]:
    return probe_key(device), tuple(dims) if dims is not None else CONV_PROBE_DIMS


def _probe_fla_conv(
    device: torch.device, dims: tuple[int, int] | None = None
) -> tuple[Capability, Capability]:
    """fla's ``causal_conv1d`` forward and backward on a tiny packed bf16 problem (198 tokens) of the caller's
    channels and width ``(D, W)`` (default :data:`CONV_PROBE_DIMS`) vs :func:`short_conv` (the PyTorch path)
    in fp32: ``((ok, reason) forward, (ok, reason) backward)``. fla autotunes its conv kernels once per process
    and ``(D, W)``: at the model's own dims the probe's autotuning is the model's."""
    rule, conv, reason = load_fla()
    if device.type != "cuda":
        no = (False, f"fla needs a CUDA device, got {device}")
        return no, no
    if rule is None:
        no = (False, reason)
        return no, no
    cfwd = cbwd = (False, "fla causal_conv1d not found")
    if conv is None:
        return cfwd, cbwd
    autotune_notice(
        device, tuple(dims) if dims is not None else CONV_PROBE_DIMS, what="short conv", dims_name="(D, W)"
    )
    gen, T, cu_cpu, cu = probe_problem(device)
    D, W = dims if dims is not None else CONV_PROBE_DIMS
    x = bf16_randn(gen, device, 1, T, D).requires_grad_()
    w = (0.5 * bf16_randn(gen, device, D, W)).requires_grad_()
    x_ref, w_ref = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    y_ref = short_conv(x_ref, w_ref, None, "silu", cu_seqlens=cu_cpu)
    dy = bf16_randn(gen, device, 1, T, D)
    ref_g = torch.autograd.grad((y_ref * dy.float()).sum(), [x_ref, w_ref])
    try:
        y = conv(x, w, None, activation="silu", cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
        y = y[0] if isinstance(y, tuple) else y
        err = rel_err(y, y_ref)
        cfwd = (
            (True, "ok")
            if err < PROBE_TOL
            else (False, f"fla conv disagrees with the reference (rel err {err:.3g})")
        )
        if cfwd[0]:
            try:
                gx = torch.autograd.grad((y.float() * dy.float()).sum(), [x, w])
                bad = max(rel_err(a, b) for a, b in zip(gx, ref_g))
                cbwd = (
                    (True, "ok")
                    if bad < PROBE_TOL
                    else (False, f"fla conv backward disagrees (rel err {bad:.3g})")
                )
            except Exception as exc:
                cbwd = (False, f"fla conv backward refused: {first_line(exc)}")
        else:
            cbwd = (False, "conv forward unusable")
    except Exception as exc:
        cfwd = (False, f"fla conv failed: {first_line(exc)}")
        cbwd = (False, "conv forward unusable")
    return cfwd, cbwd


_FLA_CONV_PROBE = ProbeOnce(_probe_fla_conv, key=_conv_key, name="fla causal_conv1d")


def fla_conv_status(
    device: torch.device | str | None = None, dims: tuple[int, int] | None = None
) -> tuple[Capability, Capability]:
    """``((ok, reason) forward, (ok, reason) backward)`` of fla's ``causal_conv1d`` on ``device`` (default:
    CUDA if available, else CPU), probed once per device and ``(D, W)`` (default :data:`CONV_PROBE_DIMS`;
    :func:`short_conv` passes its own) (:class:`varpack._probe.ProbeOnce`).

    The first call on a CUDA device runs a tiny packed problem there and compares it with this module's
    PyTorch path in fp32; fla's own refusals become the reason.
    """
    return _FLA_CONV_PROBE(fla_device(device), None if dims is None else (int(dims[0]), int(dims[1])))


def resolve_conv_backend(
    backend: str, device: torch.device | str, *, needs_grad: bool = True, dims: tuple[int, int] | None = None
) -> str:
    """``"torch"``, ``"fla"`` or ``"triton"``: ``auto`` picks fla's Triton ``causal_conv1d`` on CUDA when its
    probe passed (forward, and backward when ``needs_grad``), else the PyTorch path; ``"triton"`` (varpack's own
    kernels) is only ever chosen by name. ``dims``: the call's ``(D, W)``, the probe's problem
    (:func:`fla_conv_status`).

    Raises:
        ValueError: an unknown backend name.
        RuntimeError: ``"fla"`` forced where it cannot run, with the reason; ``"triton"`` on a device Triton
            does not run on in this process (:func:`triton_conv_status`).
    """
    if backend != "auto" and backend not in CONV_BACKENDS:
        raise ValueError(f"unknown short conv backend {backend!r}; expected 'auto' or one of {CONV_BACKENDS}")
    device = torch.device(device)
    if backend == "triton":
        ok, reason = triton_conv_status(device)
        if not ok:
            raise RuntimeError(f"short conv backend 'triton' cannot run on {device}: {reason}")
        return "triton"
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return "torch"
    conv_forward, conv_backward = fla_conv_status(device, dims)
    ok, reason = conv_forward
    if ok and needs_grad:
        ok, reason = conv_backward
    if ok:
        return "fla"
    if backend == "auto":
        return "torch"
    raise RuntimeError(f"short conv backend 'fla' cannot run on {device}: {reason}")


def _activation(activation: str | Callable | None) -> Callable | None:
    if activation is None or callable(activation):
        return activation
    if activation in ("silu", "swish"):
        return F.silu
    raise ValueError(f"activation must be None, 'silu'/'swish' or a callable, got {activation!r}")


def _weight_2d(weight: torch.Tensor, D: int) -> torch.Tensor:
    if weight.dim() == 3 and weight.shape[1] == 1:  # nn.Conv1d depthwise weight [D, 1, W]
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(
            f"weight must be [D={D}, W] (or a depthwise Conv1d weight [D, 1, W]), got {tuple(weight.shape)}"
        )
    return weight


def seq_idx_for_conv(cu_seqlens: torch.Tensor | np.ndarray | list[int], device=None) -> torch.Tensor:
    """``[1, T]`` int32 sample index of every token from CPU ``cu_seqlens`` ``[N+1]`` (one host->device copy).

    Raises:
        ValueError: ``cu_seqlens`` not 1-D, not starting at 0, or decreasing.
        TypeError: ``cu_seqlens`` not integers (:func:`varpack.varlen.normalize_cu_seqlens`).
    """
    cu = checked_host_cu_seqlens(cu_seqlens)
    seq_idx = seq_idx_from_cu_seqlens(cu, int(cu[-1]))  # varpack.varlen's one seq_idx builder
    return seq_idx if device is None else seq_idx.to(device, non_blocking=True)


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | Callable | None = "silu",
    *,
    cu_seqlens: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    backend: str = "torch",
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    split: Sequence[int] | None = None,
    l2norm: Sequence[int] | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Causal depthwise convolution that never reads across a sample boundary.

    Args:
        x: ``[B, T, D]`` input (channels last, as fla's ``causal_conv1d``).
        weight: ``[D, W]`` taps (or the depthwise ``nn.Conv1d`` weight ``[D, 1, W]``); ``weight[:, W-1]``
            multiplies the current token.
        bias: ``[D]`` or ``None``.
        activation: ``None``, ``"silu"`` / ``"swish"`` or a callable, applied after the bias.
        cu_seqlens: ``[N+1]`` boundaries of the samples packed along ``T`` (needs ``B == 1``); a CPU tensor
            is turned into ``seq_idx`` here (one host->device copy). Zero-length samples allowed. A list /
            NumPy array of integers is converted once (:func:`varpack.varlen.normalize_cu_seqlens`).
        seq_idx: ``[B, T]`` or ``[T]`` integer sample index of every token (e.g. the collator's ``seq_idx``),
            any device, no host sync; a new sample starts wherever the index changes. Wins over
            ``cu_seqlens`` when both are given.
            With neither, each batch row is one sample.
        backend: ``"torch"`` (default, this vectorized PyTorch path), ``"triton"`` (the custom op
            ``varpack::short_conv``, :func:`short_conv_triton`: ``seq_idx``, ``cu_seqlens`` or neither; no
            host sync with device ``seq_idx``; CUDA, or the CPU when Triton runs interpreted), ``"fla"`` (fla's
            Triton ``causal_conv1d`` with ``cu_seqlens``; needs ``cu_seqlens``) or ``"auto"``
            (:func:`resolve_conv_backend`; never ``"triton"``).
        cu_seqlens_cpu: CPU copy of a device ``cu_seqlens`` (fla backend; avoids a sync).
        chunk_indices: fla backend: the batch's ``[NT, 2]`` chunk indices on ``x``'s device
            (:func:`varpack.ops._fla.fla_chunk_indices` of ``cu_seqlens_cpu``); without them fla builds its own
            with a blocking copy (one host wait per call). Ignored by the ``torch`` backend.
        split: channel counts ``[D_0, D_1, ...]`` summing to ``D``: the output comes back cut into these
            channel groups, each contiguous (``torch.split(y, split, -1)`` made contiguous). The ``triton``
            backend writes each group straight into its own tensor (the op ``varpack::short_conv_split``, one
            launch per group, and its backward reads the groups' gradients without concatenating them); the
            other backends cut and copy.
        l2norm: with ``split``, per group the head size over which that group's output is L2-normalised after
            the activation, ``0`` for none: ``y / sqrt(sum_head y^2 + 1e-6)`` (:data:`L2NORM_EPS`; fla's and
            transformers' ``l2norm``), a Gated DeltaNet layer's q and k normalised where the convolution writes
            them, so the gated delta rule runs with ``use_qk_l2norm_in_kernel=False``. The ``triton`` and
            ``torch`` backends normalise the fp32 result before rounding it to ``x.dtype`` (the ``triton``
            backward recomputes the norm); ``fla`` normalises its rounded output.

    Returns:
        ``[B, T, D]`` in ``x.dtype`` (computed in fp32, fp64 for fp64 inputs); with ``split`` a list of
        ``[B, T, D_i]`` contiguous tensors.

    Raises:
        ValueError: wrong shapes, ``B > 1`` with ``cu_seqlens``, ``cu_seqlens`` that does not cover ``T``
            tokens, an unknown activation or backend, ``backend="fla"`` with only ``seq_idx``; ``l2norm``
            without ``split``, of another length, or with a head size that does not divide its group; with
            ``backend="triton"``: a callable activation, ``W`` above :data:`TRITON_MAX_WIDTH`, a dtype other
            than fp32 / bf16 / fp16, tensors on different devices.
        TypeError: non-integer ``seq_idx`` or ``cu_seqlens``.
        RuntimeError: ``backend="fla"`` where fla cannot run (the reason is given); ``backend="triton"`` on a
            device Triton does not run on in this process (raised by the op when it runs).
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, D], got shape {tuple(x.shape)}")
    if cu_seqlens is not None:
        cu_seqlens = normalize_cu_seqlens(cu_seqlens, "cu_seqlens")
    if cu_seqlens_cpu is not None:
        cu_seqlens_cpu = normalize_cu_seqlens(cu_seqlens_cpu, "cu_seqlens_cpu")
    if seq_idx is not None and not isinstance(seq_idx, torch.Tensor):
        seq_idx = torch.as_tensor(np.asarray(seq_idx))
    B, T, D = x.shape
    weight = _weight_2d(weight, D)
    W = weight.shape[1]
    if split is not None:
        split = [int(n) for n in split]
        _split_bounds(split, D, "short_conv")
    if l2norm is not None:
        if split is None:
            raise ValueError("short_conv: l2norm names head sizes per channel group of split; split is missing")
        l2norm = _l2norm_heads(l2norm, split, "short_conv")
    if backend == "triton":
        act_name = _triton_activation(activation)
        _check_triton_inputs(x, weight, bias)
        act = None
    else:
        act = _activation(activation)
    if backend not in ("torch", "triton"):
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        name = resolve_conv_backend(backend, x.device, needs_grad=needs_grad, dims=(D, W))
        if name == "fla" and seq_idx is not None and cu_seqlens is None:
            if backend == "fla":
                raise ValueError("the fla short conv backend needs cu_seqlens (it does not read seq_idx)")
            name = "torch"
        if name == "fla":
            if activation not in (None, "silu", "swish"):
                raise ValueError(
                    f"the fla short conv backend supports activation None/'silu'/'swish', got {activation!r}"
                )
            if cu_seqlens is not None and B != 1:
                raise ValueError(f"with cu_seqlens the batch dimension must be 1 (a packed row), got B={B}")
            if cu_seqlens_cpu is None and cu_seqlens is not None and cu_seqlens.device.type == "cpu":
                cu_seqlens_cpu = cu_seqlens
            y = fla_causal_conv1d(x, weight, bias, activation, cu_seqlens, cu_seqlens_cpu, chunk_indices)
            return y if split is None else _cut(y, split, l2norm, x.dtype)
    if seq_idx is None and cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch dimension must be 1 (a packed row), got B={B}")
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D [N+1], got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device.type == "cpu":
            checked_host_cu_seqlens(cu_seqlens, T)
        seq_idx = seq_idx_for_conv(cu_seqlens, device=x.device)
    if seq_idx is not None:
        if seq_idx.dtype.is_floating_point or seq_idx.dtype == torch.bool:
            raise TypeError(f"seq_idx must be an integer tensor, got dtype {seq_idx.dtype}")
        if seq_idx.dim() == 1:
            seq_idx = seq_idx[None]
        if seq_idx.shape[-1] != T or seq_idx.shape[0] not in (1, B):
            raise ValueError(f"seq_idx must be [B={B}, T={T}] or [T], got shape {tuple(seq_idx.shape)}")
        seq_idx = seq_idx.to(x.device)
    if backend == "triton":
        if split is not None:
            return _short_conv_split_op(x, weight, bias, seq_idx, act_name, split, l2norm or [0] * len(split))
        return _short_conv_op(x, weight, bias, seq_idx, act_name)
    y = _torch_conv(x, weight, bias, act, seq_idx)
    return y.to(x.dtype) if split is None else _cut(y, split, l2norm, x.dtype)


def _cut(y: torch.Tensor, split: list[int], l2norm: list[int] | None, dtype: torch.dtype) -> list[torch.Tensor]:
    """``y`` cut into the channel groups ``split``, each contiguous in ``dtype``, the groups ``l2norm`` names
    L2-normalised per head by the gated delta rule's own ``l2norm`` (in fp32, fp64 for fp64, then rounded)."""
    from .gated_delta_rule._common import l2norm as head_l2norm

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    parts = []
    for i, part in enumerate(torch.split(y, split, -1)):
        hd = l2norm[i] if l2norm is not None else 0
        if hd:
            part = head_l2norm(part.unflatten(-1, (-1, hd)).to(acc), eps=L2NORM_EPS).flatten(-2)
        parts.append(part.to(dtype).contiguous())
    return parts


def _torch_conv(x, weight, bias, act, seq_idx) -> torch.Tensor:
    """The ``torch`` backend on ``[B, T, D]`` ``x`` and ``[D, W]`` ``weight``: ``[B, T, D]`` in the
    accumulation dtype (fp32, fp64 for fp64 inputs)."""
    B, T, D = x.shape
    W = weight.shape[1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    w = weight.to(acc)
    out = xf * w[:, W - 1]
    for d in range(1, min(W, T)):
        shifted = F.pad(xf[:, : T - d], (0, 0, d, 0))  # x[t - d], zero for t < d
        if seq_idx is not None:
            same = F.pad(seq_idx[:, d:] == seq_idx[:, : T - d], (d, 0), value=False)  # [B|1, T]
            shifted = shifted * same.unsqueeze(-1).to(acc)
        out = out + shifted * w[:, W - 1 - d]
    if bias is not None:
        out = out + bias.to(acc)
    if act is not None:
        out = act(out)
    return out


def short_conv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | Callable | None = "silu",
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sample reference: ``F.conv1d`` (left zero padding ``W - 1``) on each ``cu_seqlens`` slice alone.

    ``x`` ``[1, T, D]`` (or ``[B, T, D]`` without ``cu_seqlens``); a Python loop over samples (tests only).
    """
    B, T, D = x.shape
    weight = _weight_2d(weight, D)
    W = weight.shape[1]
    act = _activation(activation)
    if cu_seqlens is None:
        segments = list(x.split(1, dim=0))  # [1, T, D] each
    else:
        cu = cu_seqlens.tolist()
        if B != 1 or not cu or cu[0] != 0 or cu[-1] != T:
            raise ValueError(
                f"cu_seqlens {cu[:8]} needs x of shape [1, T, D] and offsets from 0 to T={T}, "
                f"got x {tuple(x.shape)}"
            )
        # one split (its backward is one cat, O(T)), not a slice per sample (a full-size zero gradient each)
        segments = list(x.split([b - a for a, b in zip(cu, cu[1:])], dim=1))
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w_acc = weight.to(acc).unsqueeze(1)  # [D, 1, W]
    b_acc = None if bias is None else bias.to(acc)
    pieces = []
    for seg in segments:
        length = seg.shape[1]
        if length == 0:
            continue
        xs = seg.to(acc).transpose(1, 2)  # [1, D, L]
        y = F.conv1d(xs, w_acc, b_acc, padding=W - 1, groups=D)
        y = y[:, :, :length].transpose(1, 2)
        pieces.append(act(y) if act is not None else y)
    out = torch.cat(pieces, dim=1) if pieces else x.new_zeros(1, 0, D, dtype=acc)
    return out.reshape(B, T, D).to(x.dtype)


# ----------------------------------------------------------------------------------------------------
# the triton backend: varpack::short_conv and its backward op


def triton_conv_status(device: torch.device | str) -> Capability:
    """``(ok, reason)``: whether the ``triton`` backend's kernels run on ``device`` in this process: CUDA while
    Triton runs compiled, the CPU while it runs interpreted (``TRITON_INTERPRET=1`` before ``import triton``;
    :func:`varpack._triton.triton_interpreted`)."""
    import importlib.util

    from varpack._triton import triton_interpreted

    device = torch.device(device)
    if importlib.util.find_spec("triton") is None:
        return False, "Triton is not installed"
    interpreted = triton_interpreted()
    if device.type == "cuda" and not interpreted:
        return True, "ok"
    if device.type == "cpu" and interpreted:
        return True, "ok (Triton interpreted)"
    mode = "interpreted (TRITON_INTERPRET=1)" if interpreted else "compiled"
    needs = "CPU" if interpreted else "CUDA"
    return False, f"Triton runs {mode} in this process: its kernels need {needs} tensors"


def _triton_activation(activation: str | Callable | None) -> str:
    if activation is None:
        return "none"
    if activation in ("silu", "swish"):
        return "silu"
    if callable(activation):
        raise ValueError(
            f"the triton short conv backend supports activation None or 'silu'/'swish', got the callable "
            f"{activation!r} (use backend='torch')"
        )
    raise ValueError(f"activation must be None, 'silu'/'swish' or a callable, got {activation!r}")


_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_triton_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Shapes, dtypes and devices the ``triton`` backend runs (``weight`` already ``[D, W]``)."""
    B, _, D = x.shape
    W = weight.shape[1]
    if not 1 <= W <= TRITON_MAX_WIDTH:
        raise ValueError(f"the triton short conv backend runs kernel widths 1..{TRITON_MAX_WIDTH}, got W={W}")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dtype not in _TRITON_DTYPES:
            raise ValueError(
                f"the triton short conv backend runs fp32, bf16 and fp16 tensors, got {name} in {t.dtype} "
                "(use backend='torch')"
            )
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if bias is not None and tuple(bias.shape) != (D,):
        raise ValueError(f"bias must be [D={D}], got shape {tuple(bias.shape)}")
    if B > 65535:
        raise ValueError(f"the triton short conv backend runs at most 65535 batch rows, got B={B}")


def _triton_kernels(x: torch.Tensor, what: str):
    from varpack._triton import import_kernels, triton_interpreted

    interpreted = triton_interpreted()
    if (x.device.type == "cuda") == interpreted or x.device.type not in ("cuda", "cpu"):
        mode = "interpreted" if interpreted else "compiled"
        fix = (
            "run it on CUDA tensors, or set TRITON_INTERPRET=1 before Python imports Triton to run it on the CPU"
            if not interpreted
            else "CUDA tensors need Triton compiled (TRITON_INTERPRET unset)"
        )
        raise RuntimeError(
            f"{what}: tensors on {x.device} while Triton runs {mode}: {fix}; backend='torch' runs anywhere"
        )
    return import_kernels("varpack.ops._short_conv_kernels"), interpreted


def _seq_strides(seq_idx: torch.Tensor | None, B: int) -> tuple[int, int]:
    if seq_idx is None:
        return 0, 0
    return (seq_idx.stride(0) if seq_idx.shape[0] == B else 0), seq_idx.stride(1)


def _device_guard(x: torch.Tensor):
    import contextlib

    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def _checked_op_args(x, weight, bias, seq_idx, activation, what):
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(
            f"{what}: x must be [B, T, D] and weight [D, W], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if activation not in ("silu", "none"):
        raise ValueError(f"{what}: activation must be 'silu' or 'none', got {activation!r}")
    if seq_idx is not None and (
        seq_idx.dim() != 2 or seq_idx.shape[1] != x.shape[1] or seq_idx.shape[0] not in (1, x.shape[0])
    ):
        raise ValueError(
            f"{what}: seq_idx must be [B, T] or [1, T] for x {tuple(x.shape)}, got {tuple(seq_idx.shape)}"
        )
    if seq_idx is not None and (
        seq_idx.dtype.is_floating_point or seq_idx.dtype.is_complex or seq_idx.dtype == torch.bool
    ):
        raise ValueError(f"{what}: seq_idx must be an integer tensor, got dtype {seq_idx.dtype}")
    if seq_idx is not None and seq_idx.device != x.device:
        raise ValueError(f"{what}: seq_idx is on {seq_idx.device} but x is on {x.device}")
    _check_triton_inputs(x, weight, bias)


def short_conv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    activation: str = "silu",
    *,
    launch: dict | None = None,
) -> torch.Tensor:
    """The forward of the ``triton`` backend (what the op ``varpack::short_conv`` runs): one kernel launch.

    Args:
        x: ``[B, T, D]`` fp32 / bf16 / fp16, any strides.
        weight: ``[D, W]`` (``W <= TRITON_MAX_WIDTH``), fp32 / bf16 / fp16.
        bias: ``[D]`` or ``None``.
        seq_idx: ``[B, T]`` or ``[1, T]`` integer sample index on x's device, or ``None`` (each row one sample).
        activation: ``"silu"`` or ``"none"``.
        launch: :data:`SHORT_CONV_TRITON_LAUNCH` ``["fwd"]``'s keys.

    Returns:
        ``[B, T, D]`` contiguous, in ``x.dtype`` (fp32 arithmetic).

    Raises:
        ValueError: shapes, dtypes (x / weight / bias other than fp32, bf16, fp16; a non-integer seq_idx),
            tensors on different devices, ``W > TRITON_MAX_WIDTH`` or an activation the kernels do not run.
        RuntimeError: tensors on a device Triton does not run on in this process (:func:`triton_conv_status`).
    """
    _checked_op_args(x, weight, bias, seq_idx, activation, "short_conv_triton")
    return short_conv_triton_split(x, weight, bias, seq_idx, activation, [x.shape[2]], launch=launch)[0]


def _split_bounds(split: Sequence[int], D: int, what: str) -> list[tuple[int, int]]:
    """``[(first channel, end), ...]`` of the channel groups ``split`` of ``D`` channels."""
    sizes = [int(n) for n in split]
    if not sizes or any(n <= 0 for n in sizes) or sum(sizes) != D:
        raise ValueError(f"{what}: split must be positive channel counts summing to D={D}, got {list(split)}")
    ends = np.cumsum(sizes).tolist()
    return list(zip([0, *ends[:-1]], ends))


def short_conv_triton_split(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    activation: str,
    split: Sequence[int],
    *,
    l2norm: Sequence[int] | None = None,
    launch: dict | None = None,
) -> list[torch.Tensor]:
    """:func:`short_conv_triton` with its output cut into channel groups, each written by its own launch into
    its own contiguous tensor: ``torch.split(y, split, -1)`` without the copies that make the pieces contiguous
    (a Gated DeltaNet layer's q, k and v, which the gated delta rule reads contiguous).

    Args:
        x, weight, bias, seq_idx, activation, launch: as :func:`short_conv_triton`.
        split: channel counts ``[D_0, D_1, ...]``, positive, summing to ``D``.
        l2norm: per group, the head size over which its output is L2-normalised (:data:`L2NORM_EPS`, in fp32
            before rounding; ``0``: not normalised), or ``None`` (no group): see :func:`short_conv`.

    Returns:
        ``[B, T, D_i]`` contiguous tensors in ``x.dtype``.

    Raises:
        ValueError / RuntimeError: as :func:`short_conv_triton`; a ``split`` that does not cover ``D``; an
            ``l2norm`` head size that does not divide its group or exceeds :data:`TRITON_MAX_L2NORM_HEAD`.
    """
    _checked_op_args(x, weight, bias, seq_idx, activation, "short_conv_triton")
    B, T, D = x.shape
    W = weight.shape[1]
    bounds = _split_bounds(split, D, "short_conv_triton")
    heads = _l2norm_heads(l2norm, split, "short_conv_triton")
    ys = [torch.empty((B, T, b - a), dtype=x.dtype, device=x.device) for a, b in bounds]
    if B * T == 0:
        return ys
    kern, interpreted = _triton_kernels(x, "short_conv_triton")
    cfg = {**SHORT_CONV_TRITON_LAUNCH["fwd"], **(launch or {})}
    BT = int(cfg["block_t"])
    s_sb, s_st = _seq_strides(seq_idx, B)
    opts = {} if interpreted else {"num_warps": int(cfg["num_warps"])}
    with _device_guard(x):
        for (a, b), y, hd in zip(bounds, ys, heads):
            xs, ws = x[..., a:b], weight[a:b]
            BD, HD = (_pow2(hd), hd) if hd else (int(cfg["block_d"]),) * 2
            kern.short_conv_fwd_kernel[(_cdiv(T, BT), _cdiv(b - a, HD), B)](
                xs, ws, bias[a:b] if bias is not None else ws, seq_idx if seq_idx is not None else xs, y,
                T, b - a,
                xs.stride(0), xs.stride(1), xs.stride(2), ws.stride(0), ws.stride(1), s_sb, s_st,
                y.stride(0), y.stride(1),
                W=W, HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None, SILU=activation == "silu",
                BT=BT, BD=BD, HD=HD, NORM=hd > 0, EPS=L2NORM_EPS, **opts,
            )  # fmt: skip
    return ys


def short_conv_triton_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    activation: str = "silu",
    *,
    launch: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The backward of :func:`short_conv_triton` (what the op ``varpack::short_conv_backward`` runs): one kernel
    (recomputes the pre-activation from ``x``, writes ``dx`` and per-program ``[W, D]`` / ``[D]`` fp32 weight /
    bias gradient slices) and one sum over the slices (a fixed order: deterministic).

    Args:
        dy: ``[B, T, D]`` gradient of the output (any strides, any of the three float dtypes).
        x, weight, bias, seq_idx, activation: as :func:`short_conv_triton`.
        launch: :data:`SHORT_CONV_TRITON_LAUNCH` ``["bwd"]``'s keys.

    Returns:
        ``(dx, dweight, dbias)``: ``[B, T, D]`` contiguous in ``x.dtype``, ``[D, W]`` in ``weight.dtype``,
        ``[D]`` in ``bias.dtype`` (``None`` without bias).

    Raises:
        ValueError / RuntimeError: as :func:`short_conv_triton`; ``dy`` of another shape, dtype or device.
    """
    _checked_op_args(x, weight, bias, seq_idx, activation, "short_conv_triton_backward")
    return short_conv_triton_split_backward([dy], x, weight, bias, seq_idx, activation, [x.shape[2]], launch=launch)


def short_conv_triton_split_backward(
    dys: Sequence[torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    activation: str,
    split: Sequence[int],
    *,
    l2norm: Sequence[int] | None = None,
    launch: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The backward of :func:`short_conv_triton_split`: one backward kernel per channel group, reading that
    group's output gradient where it lies (no concatenation) and writing its channels of ``dx``.

    Args:
        dys: the groups' output gradients ``[B, T, D_i]`` (any strides, fp32 / bf16 / fp16).
        x, weight, bias, seq_idx, activation, split, l2norm, launch: as :func:`short_conv_triton_split`; a
            normalised group's norm is recomputed from ``x`` (nothing saved).

    Returns:
        ``(dx, dweight, dbias)`` as :func:`short_conv_triton_backward`.

    Raises:
        ValueError / RuntimeError: as :func:`short_conv_triton_backward`; gradients that do not match ``split``.
    """
    _checked_op_args(x, weight, bias, seq_idx, activation, "short_conv_triton_backward")
    B, T, D = x.shape
    W = weight.shape[1]
    bounds = _split_bounds(split, D, "short_conv_triton_backward")
    heads = _l2norm_heads(l2norm, split, "short_conv_triton_backward")
    if len(dys) != len(bounds):
        raise ValueError(f"short_conv_triton_backward: {len(dys)} output gradients for split {list(split)}")
    for dy, (a, b) in zip(dys, bounds):
        if tuple(dy.shape) != (B, T, b - a) or dy.dtype not in _TRITON_DTYPES or dy.device != x.device:
            raise ValueError(
                f"dy must be an fp32 / bf16 / fp16 tensor of shape {(B, T, b - a)} (x {tuple(x.shape)}, channels "
                f"{a}:{b}) on {x.device}, got {tuple(dy.shape)} {dy.dtype} on {dy.device}"
            )
    dx = torch.empty((B, T, D), dtype=x.dtype, device=x.device)
    if dx.numel() == 0:
        dw = torch.zeros((D, W), dtype=weight.dtype, device=x.device)
        db = None if bias is None else torch.zeros((D,), dtype=bias.dtype, device=x.device)
        return dx, dw, db
    kern, interpreted = _triton_kernels(x, "short_conv_triton_backward")
    cfg = {**SHORT_CONV_TRITON_LAUNCH["bwd"], **(launch or {})}
    NR, RS, block_d = _stream_shape(cfg, T)
    NC = _cdiv(T, NR * RS)
    s_sb, s_st = _seq_strides(seq_idx, B)
    opts = {} if interpreted else {"num_warps": int(cfg["num_warps"])}
    dws, dbs = [], []
    with _device_guard(x):
        for dy, (a, b), hd in zip(dys, bounds, heads):
            xs, ws, dxs = x[..., a:b], weight[a:b], dx[..., a:b]
            BD, HD = (_pow2(hd), hd) if hd else (block_d, block_d)
            dwp = torch.empty((B * NC, W, b - a), dtype=torch.float32, device=x.device)
            dbp = torch.empty((B * NC, b - a), dtype=torch.float32, device=x.device)
            kern.short_conv_bwd_kernel[(NC, _cdiv(b - a, HD), B)](
                xs, ws, bias[a:b] if bias is not None else ws, seq_idx if seq_idx is not None else xs, dy, dxs,
                dwp, dbp,
                T, b - a,
                xs.stride(0), xs.stride(1), xs.stride(2), ws.stride(0), ws.stride(1), s_sb, s_st,
                dy.stride(0), dy.stride(1), dy.stride(2), dxs.stride(0), dxs.stride(1),
                W=W, HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None, SILU=activation == "silu",
                NR=NR, RS=RS, BD=BD, P=int(cfg["prefetch"]), HD=HD, NORM=hd > 0, EPS=L2NORM_EPS, **opts,
            )  # fmt: skip
            dws.append(dwp.sum(0))
            dbs.append(dbp.sum(0))
    dw = (dws[0] if len(dws) == 1 else torch.cat(dws, 1)).t().to(weight.dtype).contiguous()
    db = None if bias is None else (dbs[0] if len(dbs) == 1 else torch.cat(dbs)).to(bias.dtype)
    return dx, dw, db


def _cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


def _pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()


def _l2norm_heads(l2norm: Sequence[int] | None, split: Sequence[int], what: str) -> list[int]:
    """Per group of ``split`` the head size of its L2 norm (``0``: none), checked."""
    if l2norm is None:
        return [0] * len(split)
    heads = [int(n) for n in l2norm]
    if len(heads) != len(split):
        raise ValueError(f"{what}: l2norm names {len(heads)} groups, split {len(split)}: {list(l2norm)}")
    for hd, n in zip(heads, split):
        if hd < 0 or (hd and (int(n) % hd or hd > TRITON_MAX_L2NORM_HEAD)):
            raise ValueError(
                f"{what}: an l2norm head size must divide its group and be at most {TRITON_MAX_L2NORM_HEAD} "
                f"(0: no norm), got {hd} for a group of {n} channels"
            )
    return heads


def _stream_shape(cfg: dict, T: int) -> tuple[int, int, int]:
    """``(streams, rows, block_d)`` of a launch; a short ``T`` gets shorter streams (a power of two: few
    compiled variants) rather than steps over absent tokens."""
    NR, RS = int(cfg["streams"]), int(cfg["rows"])
    need = _cdiv(T, NR)
    return NR, min(RS, 1 << (need - 1).bit_length()), int(cfg["block_d"])


@torch.library.custom_op("varpack::short_conv", mutates_args=())
def _short_conv_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    activation: str,
) -> torch.Tensor:
    return short_conv_triton(x, weight, bias, seq_idx, activation)


@_short_conv_op.register_fake
def _short_conv_op_fake(x, weight, bias, seq_idx, activation):
    return x.new_empty(x.shape)


@torch.library.custom_op("varpack::short_conv_backward", mutates_args=())
def _short_conv_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)`` of ``varpack::short_conv`` (:func:`short_conv_triton_backward`); ``dbias`` is an
    empty ``[0]`` tensor without bias."""
    dx, dw, db = short_conv_triton_backward(dy, x, weight, bias, seq_idx, activation)
    return dx, dw, (db if db is not None else weight.new_empty((0,)))


@_short_conv_backward_op.register_fake
def _short_conv_backward_op_fake(dy, x, weight, bias, seq_idx, activation):
    db = bias.new_empty(bias.shape) if bias is not None else weight.new_empty((0,))
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


def _short_conv_setup_context(ctx, inputs, output):
    x, weight, bias, seq_idx, activation = inputs
    ctx.save_for_backward(x, weight, bias, seq_idx)
    ctx.activation = activation


def _short_conv_autograd_backward(ctx, dy):
    x, weight, bias, seq_idx = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(x)
    dx, dw, db = _short_conv_backward_op(dy, x, weight, bias, seq_idx, ctx.activation)
    return dx, dw, (db if bias is not None else None), None, None


_short_conv_op.register_autograd(_short_conv_autograd_backward, setup_context=_short_conv_setup_context)


@torch.library.custom_op("varpack::short_conv_split", mutates_args=())
def _short_conv_split_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    activation: str,
    split: list[int],
    l2norm: list[int],
) -> list[torch.Tensor]:
    return short_conv_triton_split(x, weight, bias, seq_idx, activation, split, l2norm=l2norm)


@_short_conv_split_op.register_fake
def _short_conv_split_op_fake(x, weight, bias, seq_idx, activation, split, l2norm):
    _split_bounds(split, x.shape[2], "short_conv_split")
    _l2norm_heads(l2norm, split, "short_conv_split")
    return [x.new_empty((x.shape[0], x.shape[1], int(n))) for n in split]


@torch.library.custom_op("varpack::short_conv_split_backward", mutates_args=())
def _short_conv_split_backward_op(
    dys: list[torch.Tensor],
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    seq_idx: torch.Tensor | None,
    activation: str,
    split: list[int],
    l2norm: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight, dbias)`` of ``varpack::short_conv_split`` (:func:`short_conv_triton_split_backward`);
    ``dbias`` is an empty ``[0]`` tensor without bias."""
    dx, dw, db = short_conv_triton_split_backward(dys, x, weight, bias, seq_idx, activation, split, l2norm=l2norm)
    return dx, dw, (db if db is not None else weight.new_empty((0,)))


@_short_conv_split_backward_op.register_fake
def _short_conv_split_backward_op_fake(dys, x, weight, bias, seq_idx, activation, split, l2norm):
    db = bias.new_empty(bias.shape) if bias is not None else weight.new_empty((0,))
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


def _short_conv_split_setup_context(ctx, inputs, output):
    x, weight, bias, seq_idx, activation, split, l2norm = inputs
    ctx.save_for_backward(x, weight, bias, seq_idx)
    ctx.activation = activation
    ctx.split = list(split)
    ctx.l2norm = list(l2norm)


def _short_conv_split_autograd_backward(ctx, dys):
    x, weight, bias, seq_idx = ctx.saved_tensors
    dys = [
        dy if dy is not None else x.new_zeros((x.shape[0], x.shape[1], n)) for dy, n in zip(dys, ctx.split)
    ]
    dx, dw, db = _short_conv_split_backward_op(
        dys, x, weight, bias, seq_idx, ctx.activation, ctx.split, ctx.l2norm
    )
    return dx, dw, (db if bias is not None else None), None, None, None, None


_short_conv_split_op.register_autograd(
    _short_conv_split_autograd_backward, setup_context=_short_conv_split_setup_context
)
