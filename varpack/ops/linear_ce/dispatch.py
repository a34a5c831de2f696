"""Backend choice and the public entry point of linear cross entropy.

Backends (``name -> what``): ``"chunked"`` (:mod:`.chunked`, PyTorch, any device), ``"liger"``
(:mod:`.liger`, Liger-Kernel, CUDA only), ``"auto"`` (``liger`` for uniform token weights on CUDA when
importable and :data:`AUTO_PREFERS_LIGER`, otherwise ``chunked``). A forced backend that cannot compute the
loss exactly here raises with the reason.
"""

from __future__ import annotations

import torch

from varpack.loss import loss_denominator
from varpack.schema import IGNORE_INDEX

from .chunked import chunked_linear_cross_entropy
from .liger import _liger_loss, _liger_probe
from .weights import Reduction, token_loss_weights

__all__ = [
    "AUTO_PREFERS_LIGER",
    "SUPERVISED_ROWS_MULTIPLE",
    "assert_labels_in_range",
    "linear_ce_backends",
    "linear_cross_entropy",
    "resolve_linear_ce_backend",
    "supervised_row_count",
    "supervised_rows",
]

_BACKENDS = ("auto", "chunked", "liger")

#: :func:`supervised_rows` rounds its row count up to a multiple of this (a handful of distinct LM-head
#: shapes per packing length, so neither Liger's kernels nor the compiled chunk see a new shape every step).
SUPERVISED_ROWS_MULTIPLE = 256

#: Whether ``auto`` takes Liger (when importable on CUDA, uniform weights) over the chunked implementation.
#: The maintained library first, where it runs; ``benchmarks/train.py`` measures both (``varpack_lce`` vs
#: ``varpack_lce_chunked``) on the H200 (benchmarks/RESULTS.md#sft-step) -- flip this from those figures.
AUTO_PREFERS_LIGER = True


def linear_ce_backends(device: torch.device | str | None = None) -> dict[str, tuple[bool, str]]:
    """``{name: (ok, reason)}`` for the concrete backends on ``device`` (None: installation only)."""
    dev = None if device is None else torch.device(device).type
    ok, reason, per_token = _liger_probe()
    if ok and dev not in (None, "cuda"):
        ok, reason = False, f"liger-kernel runs Triton kernels on CUDA only, not on {dev}"
    elif ok:
        reason += "; per-token weights (sample mean, loss_scale) " + (
            "supported via reduction='none'" if per_token else "not supported by this version"
        )
    return {"chunked": (True, "PyTorch, any device"), "liger": (ok, reason)}


def resolve_linear_ce_backend(
    backend: str, device: torch.device | str, *, uniform_weights: bool, dtype: torch.dtype | None = None
) -> tuple[str, str]:
    """Which concrete backend runs a call, and why.

    Args:
        backend: ``"auto"``, ``"chunked"`` or ``"liger"``.
        device: the hidden states' device.
        uniform_weights: True for token mean without ``loss_scale`` (every supervised token weighs the same).
        dtype: the hidden states' dtype, when known: float64 runs ``chunked`` (Liger's kernel computes in
            float32).

    Returns:
        ``(name, reason)``.

    Raises:
        ValueError: an unknown backend, or ``"liger"`` forced where it cannot compute this loss exactly.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "chunked":
        return "chunked", "chunked: forced by the caller"
    ok, reason, per_token = _liger_probe()
    dev = torch.device(device).type
    if ok and dev != "cuda":
        ok, reason = False, f"liger-kernel runs on CUDA only, not on {dev}"
    if ok and dtype == torch.float64:
        ok, reason = False, "float64 hidden states: Liger's kernel computes in float32"
    if ok and not uniform_weights and not per_token:
        ok, reason = (
            False,
            (
                "per-token weights (reduction='sample' or loss_scale) need Liger's reduction='none' with a per-token "
                "backward, which this liger-kernel version lacks"
            ),
        )
    if backend == "liger":
        if not ok:
            raise ValueError(f"linear cross-entropy backend 'liger' cannot run this call: {reason}")
        return "liger", "liger: forced by the caller"
    if ok and uniform_weights and AUTO_PREFERS_LIGER:
        return "liger", "auto: liger-kernel on CUDA with uniform token weights (reduction='sum' / num_items)"
    if ok and uniform_weights:
        return "chunked", "auto: chunked (AUTO_PREFERS_LIGER is False)"
    if ok:
        return (
            "chunked",
            "auto: per-token weights; liger would recompute the logits in backward, chunked does not",
        )
    return "chunked", f"auto: chunked ({reason})"


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    reduction: Reduction = "token",
    seq_idx: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | float | None = None,
    ignore_index: int = IGNORE_INDEX,
    loss_scale: torch.Tensor | None = None,
    chunk_size: int = 4096,
    backend: str = "auto",
    compile: bool | None = None,
    max_supervised: int | None = None,
) -> torch.Tensor:
    """Cross entropy of ``hidden @ weight.T + bias`` against already-shifted labels, without the logits.

    Equal (up to float rounding order) to
    ``sum_t w_t * F.cross_entropy(hidden @ weight.T + bias, labels, reduction="none")[t]`` with the weights of
    :func:`token_loss_weights`; gradients w.r.t. ``hidden``, ``weight`` and ``bias`` likewise.

    ==================  ===============  ====================================================================
    argument            shape            dtype / meaning
    ==================  ===============  ====================================================================
    hidden              ``(T, D)``       fp64 / fp32 / bf16 / fp16; the final hidden states (after the norm)
    weight              ``(V, D)``       the LM head (cast to hidden's dtype for the matmul)
    bias                ``(V,)``         optional
    labels              ``(T,)``         int64, **already shifted**: target of hidden[t]; see shift_labels
    seq_idx             ``(T,)``         int, sample index of hidden[t] (0..N-1); needed for "sample"
    loss_scale          ``(T,)``         optional float per-token weight, aligned with labels
    return              ``()``           float32 (float64 for fp64 input) scalar
    ==================  ===============  ====================================================================

    Args:
        hidden, weight, labels, bias, seq_idx, loss_scale: see the table. ``hidden`` may also be ``(B, T, D)``
            with labels / seq_idx / loss_scale ``(B, T)``: flattened, ``seq_idx`` made unique per row.
        reduction: ``"token"`` (mean over supervised tokens) or ``"sample"`` (mean over samples of each
            sample's token mean); see the module docstring.
        num_items_in_batch: the denominator of the whole optimizer step (supervised tokens for ``"token"``,
            samples with a supervised token for ``"sample"``); None: this batch's own count.
        ignore_index: label value that is not scored.
        chunk_size: tokens per chunk; peak extra memory is about ``chunk_size * V * 6`` bytes for bf16
            (bf16 + fp32 chunk logits) and ``chunk_size * V * 4`` for fp32.
        backend: ``"auto"``, ``"chunked"`` or ``"liger"`` (see the module docstring).
        compile: chunked backend only: fuse each chunk's softmax / loss / gradient with ``torch.compile``
            (one reduction + one pointwise kernel, no float32 chunk buffer). None (default): on CUDA for
            16/32-bit inputs unless ``VARPACK_LINEAR_CE_COMPILE=0``; the eager path computes the same values
            in place.
        max_supervised: a host-known upper bound on the supervised labels (``labels != ignore_index``) of
            the call, e.g. the collator's count of the unshifted labels (shifting within each sample never
            adds one). The LM head then runs on that many rows only, rounded up to a multiple of
            :data:`SUPERVISED_ROWS_MULTIPLE` (fewer distinct shapes): the supervised rows, gathered on the device
            with ``torch.nonzero_static`` (no host read), padded with ignored rows. Unsupervised positions
            (prompts, padding) add nothing to the loss or its gradients, so the result is the same up to
            float summation order; on code_alpaca 39% of the rows are prompts. A bound below the true count
            would drop supervised tokens: it is checked on the device (``torch._assert_async``, no host read),
            which fails the call (on CUDA, the device asserts) instead of losing them. ``None``: every row.

    Returns:
        The scalar loss. 0 with zero gradients when nothing is supervised.

    Raises:
        ValueError: bad shapes, an unknown reduction or backend, ``"sample"`` without ``seq_idx``, a
            non-positive ``chunk_size`` / ``num_items_in_batch``, a negative ``max_supervised``, labels out of
            ``[0, V)`` (named for CPU labels, read on the host), or ``"liger"`` forced where it cannot run.
        RuntimeError: more supervised labels than ``max_supervised``, or a label out of ``[0, V)`` that is not
            ``ignore_index`` (on CUDA, device-side asserts: no host read).
        TypeError: non-integer labels, non-float hidden states.
    """
    if hidden.dim() == 3:
        rows, t = hidden.shape[:2]
        hidden = hidden.reshape(rows * t, hidden.shape[-1])
        labels = _flat(labels, (rows, t), "labels")
        loss_scale = None if loss_scale is None else _flat(loss_scale, (rows, t), "loss_scale")
        if seq_idx is not None:
            seq_idx = _flat(seq_idx, (rows, t), "seq_idx").to(torch.int64)
            seq_idx = seq_idx + torch.arange(rows, device=seq_idx.device).repeat_interleave(t) * t
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, D] or [B, T, D], got shape {tuple(hidden.shape)}")
    if not hidden.is_floating_point():
        raise TypeError(f"hidden must be a float tensor, got {hidden.dtype}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, D={hidden.shape[1]}], got shape {tuple(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [V={weight.shape[0]}], got shape {tuple(bias.shape)}")
    if labels.shape != (hidden.shape[0],):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match hidden's token count T={hidden.shape[0]}"
        )
    if labels.is_floating_point() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if labels.device.type == "cpu" and labels.numel():
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= weight.shape[0]))
        if bool(bad.any()):
            pos = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"labels[{pos}]={int(labels[pos])} is outside [0, V={weight.shape[0]}) and is not ignore_index={ignore_index}"
            )
    labels = labels.to(hidden.device, torch.int64)
    assert_labels_in_range(labels, weight.shape[0], ignore_index)
    if seq_idx is not None:
        seq_idx = seq_idx.to(hidden.device)
    if loss_scale is not None:
        loss_scale = loss_scale.to(hidden.device)

    token_weight = token_loss_weights(
        labels,
        reduction=reduction,
        seq_idx=seq_idx,
        num_items_in_batch=num_items_in_batch,
        ignore_index=ignore_index,
        loss_scale=loss_scale,
        dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32,
    )
    uniform = reduction == "token" and loss_scale is None
    name, _ = resolve_linear_ce_backend(backend, hidden.device, uniform_weights=uniform, dtype=hidden.dtype)
    denom = None
    if name == "liger" and uniform:
        denom = (
            (labels != ignore_index).sum().to(torch.float32).clamp(min=1.0)
            if num_items_in_batch is None
            else loss_denominator(num_items_in_batch, hidden.device)
        )
    if max_supervised is not None:
        hidden, labels, token_weight = supervised_rows(hidden, labels, token_weight, max_supervised, ignore_index)
    if name == "liger":
        if torch.is_autocast_enabled(hidden.device.type) and hidden.dtype == torch.float32:
            hidden = hidden.to(torch.get_autocast_dtype(hidden.device.type))  # the dtype autocast's GEMMs give
        weight = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)
        bias = bias if bias is None or bias.dtype == hidden.dtype else bias.to(hidden.dtype)
        with torch.autocast(hidden.device.type, enabled=False):  # one dtype for the GEMMs and the kernel
            return _liger_loss(hidden, weight, bias, labels, token_weight, denom, ignore_index, chunk_size)
    return chunked_linear_cross_entropy(hidden, weight, bias, labels, token_weight, chunk_size, compile)


def assert_labels_in_range(labels: torch.Tensor, vocab: int, ignore_index: int = IGNORE_INDEX) -> None:
    """Fail the call when a label is neither ``ignore_index`` nor in ``[0, vocab)``, without a host read
    (``torch._assert_async``: on CUDA the device asserts at the next synchronisation). A fused kernel indexes
    the row of logits with the label: Liger's kernel would read and write another row's logits (another
    sample's gradient), the chunked step would score class 0. CPU labels are also checked on the host first,
    with the position named.

    Raises:
        RuntimeError: a label out of range (on CUDA, a device-side assert).
    """
    ok = (labels == ignore_index) | ((labels >= 0) & (labels < vocab))
    torch._assert_async(
        ok.all(), f"linear_cross_entropy: a label outside [0, V={vocab}) that is not ignore_index={ignore_index}"
    )


def supervised_row_count(num_tokens: int, max_supervised: int) -> int:
    """The rows :func:`supervised_rows` gives the LM head: ``min(T, round_up(max(max_supervised, 1),
    SUPERVISED_ROWS_MULTIPLE))`` for ``T = num_tokens`` (ints, host side)."""
    return min(num_tokens, -(-max(max_supervised, 1) // SUPERVISED_ROWS_MULTIPLE) * SUPERVISED_ROWS_MULTIPLE)


def supervised_rows(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    token_weight: torch.Tensor,
    max_supervised: int,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of ``hidden`` / ``labels`` / ``token_weight`` whose label is supervised, without a host read.

    ``R = min(T, round_up(max(max_supervised, 1), SUPERVISED_ROWS_MULTIPLE))`` rows: the supervised ones in
    order (``torch.nonzero_static``), then padding rows (a copy of row 0 with label ``ignore_index`` and weight
    0, so they add nothing). Returns the inputs unchanged when ``R == T``. The gather is differentiable: the
    gradient w.r.t. ``hidden`` is scattered back to the supervised rows, zero elsewhere.

    Args:
        hidden: ``(T, D)`` float; labels ``(T,)`` int64 (already shifted); token_weight ``(T,)`` float.
        max_supervised: a host-known upper bound on ``(labels != ignore_index).sum()``.

    Returns:
        ``(hidden (R, D), labels (R,), token_weight (R,))``.

    Raises:
        ValueError: ``max_supervised`` not a non-negative int.
        RuntimeError: more supervised labels than ``max_supervised`` (``torch._assert_async``: on CUDA the
            device asserts at the next synchronisation, never a silent drop).
    """
    if isinstance(max_supervised, bool) or not isinstance(max_supervised, int) or max_supervised < 0:
        raise ValueError(f"max_supervised must be a non-negative int, got {max_supervised!r}")
    num_tokens = hidden.shape[0]
    rows = supervised_row_count(num_tokens, max_supervised)
    if rows >= num_tokens:
        return hidden, labels, token_weight
    valid = labels != ignore_index
    torch._assert_async(
        valid.sum() <= max_supervised,
        f"linear_cross_entropy: more supervised labels than max_supervised={max_supervised}",
    )
    index = torch.nonzero_static(valid, size=rows, fill_value=-1).squeeze(1)
    real = index >= 0
    index = index.clamp(min=0)
    labels = torch.where(real, labels.index_select(0, index), ignore_index)
    token_weight = torch.where(real, token_weight.index_select(0, index), 0)
    return hidden.index_select(0, index), labels, token_weight


def _flat(x: torch.Tensor, shape: tuple[int, int], name: str) -> torch.Tensor:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} shape {tuple(x.shape)} does not match hidden's [B, T]={shape}")
    return x.reshape(-1)
