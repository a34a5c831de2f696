"""Linear cross entropy: the LM head and the causal-LM loss in one pass, without the ``[T, V]`` logits.

A causal LM's last step is ``logits = hidden @ W.T`` (``[T, V]``, V = vocabulary) followed by a float32 cross
entropy. With Qwen3's V = 151,936 and a pack of T = 8,192 tokens the float32 logits alone are 5 GB, and
autograd keeps them (and their gradient) alive; at T = 16,384 it is 10 GB. :func:`linear_cross_entropy`
never builds them: it walks the tokens in chunks of ``chunk_size``, computes the chunk's logits (upcast to
float32), its per-token losses and -- in the same pass -- the chunk's contribution to the gradients w.r.t.
``hidden``, ``weight`` and ``bias``. Peak extra memory is ``chunk_size x V`` instead of ``T x V``; the
backward pass only multiplies the stored gradients by the incoming ``grad_output``.

Labels contract
---------------
Unlike :func:`varpack.loss.causal_lm_loss`, which shifts inside, :func:`linear_cross_entropy` takes labels
that are **already shifted**: ``labels[t]`` is the target of ``hidden[t]`` (the prediction made at token t).
:func:`shift_labels` turns the collator's unshifted ``[1, T]`` labels into them: within the padding-free row
``shifted[t] = labels[t + 1]`` and the last position gets ``ignore_index``. Each sample's first label is
``ignore_index`` (the encoder guarantees it, ARCHITECTURE.md "Encoded sample"), so the last token of sample
n never predicts the first token of sample n + 1; with ``seq_idx`` those cross-boundary predictions are also
masked explicitly.

Reductions (all expressed as one float32 weight per token, ``loss = sum_t w_t * CE_t``)
--------------------------------------------------------------------------------------
* ``"token"``: ``w_t = 1 / num_items`` for supervised tokens, where ``num_items`` is ``num_items_in_batch``
  when given (Hugging Face ``Trainer`` semantics: the supervised tokens of the whole optimizer step, so
  gradient-accumulation micro-steps sum to the big step) and this batch's count of supervised tokens
  otherwise.
* ``"sample"``: ``w_t = 1 / (n_tokens(sample of t) * n_samples)``: the mean over samples of each sample's
  token mean. Samples are ``seq_idx`` values with at least one supervised token; ``n_samples`` is
  ``num_items_in_batch`` when given (samples of the whole step), else the local count.
* ``loss_scale`` (per token, aligned with the shifted labels) multiplies ``w_t``; weighted tokens still count
  1 in the denominators -- the semantics of :func:`varpack.loss.causal_lm_loss`.

Nothing supervised (all labels ignored): the loss is 0 and every gradient is 0 (no NaN).

Backends
--------
* ``"chunked"``: the PyTorch implementation here (any device, fp64/fp32/bf16/fp16). Per chunk: one GEMM for
  the logits, then the log-sum-exp, the loss and ``w_t * (softmax - onehot)`` -- on CUDA fused by
  ``torch.compile`` into one reduction and one pointwise kernel over the bf16 logits (no float32 chunk
  buffer), elsewhere eagerly in place on a float32 chunk -- then two GEMMs for the gradients (the weight
  gradient accumulated in float32). No host sync.
* ``"liger"``: Liger-Kernel's fused linear cross entropy (``liger_kernel.transformers.functional.
  liger_fused_linear_cross_entropy``, pure Triton, CUDA only). It is used only where it computes exactly
  this loss: with ``reduction="sum"`` its gradient is ``softmax - onehot`` summed over tokens and its backward
  multiplies by the scalar ``grad_output``, so ``liger(sum) / num_items`` is the token mean with any divisor
  (the same construction as transformers' Liger integration with ``num_items_in_batch``). Per-token weights
  (``"sample"`` or ``loss_scale``) need Liger's ``reduction="none"`` with a per-token backward, which
  recomputes the logits in backward; it is used only when forced and when the installed Liger has that path
  (0.8.5 does), else refused with the reason. Liger reads the supervised-token count with ``.item()`` (one
  host sync per call).
* ``"auto"``: ``liger`` for uniform token weights on CUDA when importable and :data:`AUTO_PREFERS_LIGER`,
  otherwise ``chunked``.

Source: the chunked "compute the gradient in the forward pass" scheme of Liger-Kernel's
``fused_linear_cross_entropy`` (after mgmalek/efficient_cross_entropy) and Apple's Cut Cross-Entropy
(Wijmans et al., 2024, "Cut Your Losses in Large-Vocabulary Language Models"); the reduction semantics of
transformers' ``ForCausalLMLoss`` (``num_items_in_batch``).
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from typing import Any, Literal

import torch

from varpack.loss import loss_denominator
from varpack.schema import IGNORE_INDEX, LOSS_FIELDS, SEQ_IDX

__all__ = [
    "AUTO_PREFERS_LIGER",
    "causal_lm_forward_with_linear_ce",
    "linear_cross_entropy",
    "linear_ce_backends",
    "resolve_linear_ce_backend",
    "shift_labels",
    "token_loss_weights",
]

Reduction = Literal["token", "sample"]
_BACKENDS = ("auto", "chunked", "liger")

#: Whether ``auto`` takes Liger (when importable on CUDA, uniform weights) over the chunked implementation.
#: Issue 7 asks to prefer the maintained library; ``benchmarks/train.py`` measures both
#: (``varpack_lce`` vs ``varpack_lce_chunked``) on the H200 -- flip this from those figures.
AUTO_PREFERS_LIGER = True


# ----------------------------------------------------------------------------------------------------------
# labels and per-token weights
# ----------------------------------------------------------------------------------------------------------


def _shift_tokens(x: torch.Tensor, fill: float | int) -> torch.Tensor:
    """``[B, T]`` -> ``[B, T]`` with ``out[:, t] = x[:, t + 1]`` and ``out[:, -1] = fill``."""
    out = torch.full_like(x, fill)
    out[:, :-1] = x[:, 1:]
    return out


def shift_labels(
    labels: torch.Tensor, *, seq_idx: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Causal shift of padding-free labels: ``[1, T]`` (or ``[B, T]``, or ``[T]``) -> ``[B * T]``.

    ``out[t] = labels[t + 1]`` within each row; the last position of each row gets ``ignore_index``. The
    result is aligned with ``hidden.reshape(-1, D)`` for :func:`linear_cross_entropy`.

    >>> shift_labels(torch.tensor([[-100, 5, 6, -100, 7]])).tolist()
    [5, 6, -100, 7, -100]

    Args:
        labels: int64 ``[B, T]`` or ``[T]``; every sample's first label is ``ignore_index`` (collator
            contract), so no prediction crosses a sample boundary.
        seq_idx: optional ``[B, T]`` / ``[T]`` sample index of every token; predictions whose target lies in
            another sample are set to ``ignore_index`` too (defence in depth).
        ignore_index: the label value that is not scored.

    Returns:
        int64 ``[B * T]``.

    Raises:
        ValueError: labels not 1-D / 2-D, or ``seq_idx`` of another shape.
    """
    rows = _rows(labels, "labels")
    out = _shift_tokens(rows, ignore_index)
    if seq_idx is not None:
        seg = _rows(seq_idx, "seq_idx")
        if seg.shape != rows.shape:
            raise ValueError(
                f"seq_idx shape {tuple(seq_idx.shape)} does not match labels shape {tuple(labels.shape)}"
            )
        seg = seg.to(rows.device)
        crosses = torch.zeros_like(rows, dtype=torch.bool)
        crosses[:, :-1] = seg[:, 1:] != seg[:, :-1]
        out = out.masked_fill(crosses, ignore_index)
    return out.reshape(-1)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() == 1:
        return x.unsqueeze(0)
    if x.dim() == 2:
        return x
    raise ValueError(f"{name} must be [T] or [B, T], got shape {tuple(x.shape)}")


def token_loss_weights(
    labels: torch.Tensor,
    *,
    reduction: Reduction = "token",
    seq_idx: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | float | None = None,
    ignore_index: int = IGNORE_INDEX,
    loss_scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The float32 weight ``w_t`` of every (already shifted) label: ``loss = sum_t w_t * CE_t``.

    Args:
        labels: int64 ``[T]``, already shifted (see the module docstring).
        reduction, seq_idx, num_items_in_batch, ignore_index, loss_scale: as in :func:`linear_cross_entropy`;
            ``seq_idx`` and ``loss_scale`` are ``[T]``.
        dtype: float32 (default) or float64 (used for fp64 hidden states).

    Returns:
        ``dtype`` ``[T]``, 0 where the label is ignored. Computed on the labels' device without a host sync.

    Raises:
        ValueError: an unknown reduction, ``"sample"`` without ``seq_idx``, shapes that differ from labels',
            a non-positive ``num_items_in_batch``.
        TypeError: a ``num_items_in_batch`` that is not a number or tensor.
    """
    if reduction not in ("token", "sample"):
        raise ValueError(f"reduction must be 'token' or 'sample', got {reduction!r}")
    if labels.dim() != 1:
        raise ValueError(
            f"labels must be [T] (already shifted, see shift_labels), got shape {tuple(labels.shape)}"
        )
    device = labels.device
    valid = labels != ignore_index
    weight = valid.to(dtype)
    if loss_scale is not None:
        if loss_scale.shape != labels.shape:
            raise ValueError(
                f"loss_scale shape {tuple(loss_scale.shape)} does not match labels shape {tuple(labels.shape)}"
            )
        weight = weight * loss_scale.to(device=device, dtype=dtype)
    if reduction == "token":
        if num_items_in_batch is None:
            denom = valid.sum().to(dtype).clamp(min=1.0)
        else:
            denom = loss_denominator(num_items_in_batch, device, dtype)
        return weight / denom
    if seq_idx is None:
        raise ValueError(
            "reduction='sample' needs seq_idx (the sample index of every token, from the collator)"
        )
    if seq_idx.shape != labels.shape:
        raise ValueError(
            f"seq_idx shape {tuple(seq_idx.shape)} does not match labels shape {tuple(labels.shape)}"
        )
    seg = seq_idx.to(device=device, dtype=torch.int64)
    num_slots = labels.shape[0]  # seq_idx values are sample indices in [0, N) with N <= T
    if seg.device.type == "cpu" and seg.numel() and (int(seg.min()) < 0 or int(seg.max()) >= num_slots):
        raise ValueError(
            f"seq_idx values must lie in [0, T={num_slots}), got min {int(seg.min())} max {int(seg.max())}"
        )
    counts = torch.zeros(num_slots, device=device, dtype=dtype).index_add_(0, seg, valid.to(dtype))
    per_token_count = counts[seg].clamp(min=1.0)
    if num_items_in_batch is None:
        n_samples = (counts > 0).sum().to(dtype).clamp(min=1.0)
    else:
        n_samples = loss_denominator(num_items_in_batch, device, dtype)
    return weight / (per_token_count * n_samples)


# ----------------------------------------------------------------------------------------------------------
# chunked PyTorch implementation
# ----------------------------------------------------------------------------------------------------------

_ADDMM_OUT_DTYPE_OK: dict[str, bool] = {}


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in a wider dtype than ``a``/``b`` when needed (fp32 accumulation)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
        return
    key = f"{acc.device.type}:{a.dtype}"
    if acc.device.type == "cuda" and _ADDMM_OUT_DTYPE_OK.get(key, True):
        try:  # torch >= 2.8 on CUDA: bf16/fp16 operands, fp32 accumulator, no temporary
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            _ADDMM_OUT_DTYPE_OK[key] = True
            return
        except (RuntimeError, TypeError):
            _ADDMM_OUT_DTYPE_OK[key] = False
    acc.add_(torch.mm(a, b).to(acc.dtype))


def _chunk_loss_and_grad_inplace(
    logits: torch.Tensor,
    safe_target: torch.Tensor,
    tw: torch.Tensor,
    want_grad: bool,
    want_bias: bool,
    grad_dtype,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Eager chunk step: ``(sum_t w_t CE_t, w_t * (softmax - onehot) in grad_dtype, its column sum)``.

    ``logits`` ``[C, V]`` in the accumulation dtype is overwritten (softmax computed in place: one ``C x V``
    buffer). ``safe_target`` ``[C, 1]`` int64 (ignored labels clamped to a valid index; their weight is 0).
    """
    lse = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(1, safe_target).squeeze(1)
    loss = ((lse - target_logit) * tw).sum()
    if not want_grad:
        return loss, None, None
    probs = logits.sub_(lse.unsqueeze(1)).exp_()
    probs.scatter_add_(1, safe_target, torch.full_like(target_logit, -1.0).unsqueeze(1))
    probs.mul_(tw.unsqueeze(1))
    grad_bias = probs.sum(dim=0) if want_bias else None
    return loss, probs.to(grad_dtype), grad_bias


def _chunk_loss_and_grad_fused(
    logits: torch.Tensor,
    safe_target: torch.Tensor,
    tw: torch.Tensor,
    want_grad: bool,
    want_bias: bool,
    grad_dtype,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The same step written out of place for ``torch.compile``: Inductor fuses it into a reduction (the
    log-sum-exp) and one pointwise pass that reads the matmul's ``logits`` (any dtype, upcast to float32 in
    registers) and writes the gradient in ``grad_dtype``; no float32 ``C x V`` buffer is materialized."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    lse = torch.logsumexp(x, dim=-1)
    target_logit = x.gather(1, safe_target).squeeze(1)
    loss = ((lse - target_logit) * tw).sum()
    if not want_grad:
        return loss, None, None
    onehot = torch.arange(x.shape[1], device=x.device).unsqueeze(0) == safe_target  # pointwise, fusable
    probs = (torch.exp(x - lse.unsqueeze(1)) - onehot.to(x.dtype)) * tw.unsqueeze(1)
    grad_bias = probs.sum(dim=0) if want_bias else None
    return loss, probs.to(grad_dtype), grad_bias


_COMPILED: dict[str, Any] = {}


def _compiled_chunk_fn():
    """``torch.compile`` of :func:`_chunk_loss_and_grad_fused` (dynamic chunk length: one graph for every
    chunk), or None when compilation fails (reported once as a warning; the eager path is then used)."""
    if "fn" not in _COMPILED:
        try:
            _COMPILED["fn"] = torch.compile(_chunk_loss_and_grad_fused, dynamic=True)
        except Exception as exc:  # torch.compile unavailable on this platform
            warnings.warn(
                f"linear_ce: torch.compile unavailable ({exc}); using the eager chunk", stacklevel=3
            )
            _COMPILED["fn"] = None
    return _COMPILED["fn"]


def _run_compiled(step, *args):
    """Call the compiled chunk step; if its first compilation fails, warn once and return None (eager from
    then on). A failure after a successful first call is raised."""
    if _COMPILED.get("ok"):
        return step(*args)
    try:
        out = step(*args)
    except Exception as exc:
        warnings.warn(
            f"linear_ce: torch.compile of the chunk step failed ({type(exc).__name__}: {exc}); using the eager "
            "chunk step",
            stacklevel=4,
        )
        _COMPILED["fn"] = None
        return None
    _COMPILED["ok"] = True
    return out


def _use_compile(compile: bool | None, device: torch.device, dtype: torch.dtype) -> bool:
    if compile is None:  # auto: CUDA (Triton) only, never for float64
        return (
            device.type == "cuda"
            and dtype != torch.float64
            and os.environ.get("VARPACK_LINEAR_CE_COMPILE", "1") != "0"
        )
    return bool(compile)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum_t w_t * CE(hidden[t] @ W.T + b, labels[t])`` with the gradients computed in the forward pass."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        token_weight: torch.Tensor,
        chunk_size: int,
        grad_enabled: bool,
        compiled: bool,
    ) -> torch.Tensor:
        # needs_input_grad reflects requires_grad even under torch.no_grad(): also ask the caller's grad mode
        needs_h, needs_w, needs_b = (grad_enabled and ctx.needs_input_grad[i] for i in range(3))
        compute_dtype = hidden.dtype
        acc_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
        w_c = weight if weight.dtype == compute_dtype else weight.to(compute_dtype)
        b_c = None if bias is None else (bias if bias.dtype == compute_dtype else bias.to(compute_dtype))
        num_tokens = hidden.shape[0]

        loss = torch.zeros((), device=hidden.device, dtype=acc_dtype)
        grad_h = torch.empty(hidden.shape, device=hidden.device, dtype=hidden.dtype) if needs_h else None
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=acc_dtype) if needs_w else None
        grad_b = torch.zeros(bias.shape, device=bias.device, dtype=acc_dtype) if needs_b else None
        any_grad = needs_h or needs_w or needs_b
        step = _compiled_chunk_fn() if compiled else None

        for start in range(0, num_tokens, chunk_size):
            stop = min(start + chunk_size, num_tokens)
            h = hidden[start:stop]
            logits = h @ w_c.T
            if b_c is not None:
                logits = logits + b_c
            safe_target = labels[start:stop].clamp(min=0).unsqueeze(1)  # ignored labels: weight 0, any index
            tw = token_weight[start:stop].to(acc_dtype)
            result = None
            if step is not None:
                result = _run_compiled(step, logits, safe_target, tw, any_grad, needs_b, compute_dtype)
                step = step if result is not None else None
            if result is not None:
                loss_c, grad_logits, gb = result
            else:  # upcast (no copy when already acc_dtype), then softmax in place
                logits = logits.to(acc_dtype)
                loss_c, grad_logits, gb = _chunk_loss_and_grad_inplace(
                    logits, safe_target, tw, any_grad, needs_b, compute_dtype
                )
            del logits
            loss += loss_c
            if gb is not None:
                grad_b += gb
            if grad_logits is None:
                continue
            if needs_h:
                torch.mm(grad_logits, w_c, out=grad_h[start:stop])
            if needs_w:
                _accumulate_mm(grad_w, grad_logits.T, h)
            del grad_logits

        ctx.save_for_backward(
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
        )
        return loss.to(torch.float32) if acc_dtype == torch.float32 else loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        grad_h, grad_w, grad_b = ctx.saved_tensors
        out = []
        for g in (grad_h, grad_w, grad_b):
            out.append(None if g is None else g * grad_output.to(g.dtype))
        return out[0], out[1], out[2], None, None, None, None, None


# ----------------------------------------------------------------------------------------------------------
# Liger backend
# ----------------------------------------------------------------------------------------------------------


@functools.cache
def _liger_probe() -> tuple[bool, str, bool]:
    """(importable, reason, has per-token backward for reduction='none')."""
    try:
        from liger_kernel.ops import fused_linear_cross_entropy as ops_flce
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # noqa: F401
    except Exception as exc:  # ImportError, or Triton failing to initialise
        return False, f"liger-kernel is not importable ({type(exc).__name__}: {exc})", False
    try:
        params = inspect.signature(ops_flce.fused_linear_cross_entropy_forward).parameters
        per_token = "token_grad_output" in params
    except (AttributeError, TypeError, ValueError):
        per_token = False
    return True, "liger-kernel importable", per_token


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
    backend: str, device: torch.device | str, *, uniform_weights: bool
) -> tuple[str, str]:
    """Which concrete backend runs a call, and why.

    Args:
        backend: ``"auto"``, ``"chunked"`` or ``"liger"``.
        device: the hidden states' device.
        uniform_weights: True for token mean without ``loss_scale`` (every supervised token weighs the same).

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


def _liger_chunk_kwargs(
    fn: Any, hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int
) -> dict[str, Any]:
    """Liger sizes its token chunks as ``next_pow2(T / ceil(V / (chunk_mem_const * D)))``; with the default
    ``chunk_mem_const=1`` and Qwen3's V / D = 148 that is 64 tokens, so each chunk re-reads the whole
    ``[V, D]`` head three times. Pick ``chunk_mem_const`` so its chunks are about ``chunk_size`` tokens (when
    the installed Liger has the argument)."""
    try:
        if "chunk_mem_const" not in inspect.signature(fn).parameters:
            return {}
    except (TypeError, ValueError):
        return {}
    num_tokens, dim = hidden.shape
    num_chunks = max(1, -(-num_tokens // chunk_size))
    return {"chunk_mem_const": max(1, -(-weight.shape[0] // (dim * num_chunks)))}


def _liger_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    token_weight: torch.Tensor,
    denom: torch.Tensor | None,
    ignore_index: int,
    chunk_size: int,
) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    kw = dict(ignore_index=ignore_index, accum_dtype=torch.float32)
    kw.update(_liger_chunk_kwargs(liger_fused_linear_cross_entropy, hidden, weight, chunk_size))
    if denom is not None:  # uniform weights: sum / num_items (exact: grad_output scales the stored grads)
        total = liger_fused_linear_cross_entropy(hidden, weight, labels, bias, reduction="sum", **kw)
        return total.float() / denom
    per_token = liger_fused_linear_cross_entropy(hidden, weight, labels, bias, reduction="none", **kw)
    return (per_token.float() * token_weight).sum()


# ----------------------------------------------------------------------------------------------------------
# public entry point
# ----------------------------------------------------------------------------------------------------------


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

    Returns:
        The scalar loss. 0 with zero gradients when nothing is supervised.

    Raises:
        ValueError: bad shapes, an unknown reduction or backend, ``"sample"`` without ``seq_idx``, a
            non-positive ``chunk_size`` / ``num_items_in_batch``, labels out of ``[0, V)`` (checked for CPU
            labels only: reading GPU values would sync), or ``"liger"`` forced where it cannot run.
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
    name, _ = resolve_linear_ce_backend(backend, hidden.device, uniform_weights=uniform)
    if name == "liger":
        if weight.dtype != hidden.dtype:
            weight = weight.to(hidden.dtype)
            bias = None if bias is None else bias.to(hidden.dtype)
        denom = None
        if uniform:
            valid = labels != ignore_index
            denom = (
                valid.sum().to(torch.float32).clamp(min=1.0)
                if num_items_in_batch is None
                else loss_denominator(num_items_in_batch, hidden.device)
            )
        return _liger_loss(hidden, weight, bias, labels, token_weight, denom, ignore_index, chunk_size)
    compiled = _use_compile(compile, hidden.device, hidden.dtype)
    return _ChunkedLinearCrossEntropy.apply(
        hidden, weight, bias, labels, token_weight, chunk_size, torch.is_grad_enabled(), compiled
    )


def _flat(x: torch.Tensor, shape: tuple[int, int], name: str) -> torch.Tensor:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} shape {tuple(x.shape)} does not match hidden's [B, T]={shape}")
    return x.reshape(-1)


# ----------------------------------------------------------------------------------------------------------
# Hugging Face causal LM
# ----------------------------------------------------------------------------------------------------------

#: Config attributes that change the logits after the LM head (the loss here would not include them).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_logits_scale")


def _base_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    base = getattr(model, "base_model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or base is model or head is None or not hasattr(head, "weight"):
        raise ValueError(
            f"{type(model).__name__} does not expose a base model (model.base_model, e.g. model.model) and an "
            "LM head (model.get_output_embeddings()); linear cross entropy needs a *ForCausalLM-style model"
        )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for attr in _LOGIT_TRANSFORMS:
        value = getattr(config, attr, None)
        if value is not None and value != 1.0:
            raise ValueError(
                f"{type(model).__name__} transforms its logits ({attr}={value}); linear cross entropy applies "
                "the plain LM head only, so it would compute a different loss"
            )
    return base, head


def _run_forward_pre_hooks(model: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Run the top model's forward pre-hooks on ``kwargs`` as ``model(**kwargs)`` would (varpack's packing
    guards live there), since the base model is called directly. Hooks that rewrite keyword arguments (e.g.
    ``use_cache=False`` for packed batches) are honoured."""
    hooks = getattr(model, "_forward_pre_hooks", None)
    if not hooks:
        return kwargs
    with_kwargs = getattr(model, "_forward_pre_hooks_with_kwargs", {})
    args: tuple = ()
    for hook_id, hook in list(hooks.items()):
        if hook_id in with_kwargs:
            result = hook(model, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(model, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    if args:
        raise ValueError(
            f"a forward pre-hook of {type(model).__name__} produced positional arguments {len(args)}; "
            "causal_lm_forward_with_linear_ce passes keyword arguments only"
        )
    return dict(kwargs)


def causal_lm_forward_with_linear_ce(
    model: torch.nn.Module,
    batch: dict[str, Any],
    *,
    reduction: Reduction = "token",
    num_items_in_batch: torch.Tensor | int | float | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int = 4096,
    backend: str = "auto",
) -> torch.Tensor:
    """The causal-LM loss of a Hugging Face model on a collated batch, without the ``[T, V]`` logits.

    Runs the model without its head -- ``model.base_model`` (``model.model`` for ``Qwen3ForCausalLM``; the
    multimodal ``*Model`` for ``*ForConditionalGeneration``, so media still flow through) -- then
    :func:`linear_cross_entropy` with ``model.get_output_embeddings()`` (``lm_head``; its weight is the tied
    embedding when ``tie_word_embeddings``). Equal to ``model(**batch).logits`` followed by
    :func:`varpack.loss.causal_lm_loss` with the same reduction (shift within the row, masking of
    cross-sample predictions by ``seq_idx``, ``loss_scale``).

    Every batch key except ``labels`` and ``loss_scale`` is passed to the base model unchanged
    (``input_ids``, ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx``, media: the
    collated batch of ARCHITECTURE.md), after the top model's forward pre-hooks ran on them (so the packing
    guards of :func:`varpack.integrations.transformers.enable_varpack` apply, as in ``model(**batch)``);
    nothing else is added: the base model sees what ``model(**batch)`` would give it. Put ``use_cache=False`` in the batch (or the config) for training: seen
    with transformers 5.24 and sdpa, a Qwen3 model that builds a cache does not detect packed sequences from
    ``position_ids`` and attends across samples, while ``use_cache=False`` keeps them apart.

    Args:
        model: a transformers ``PreTrainedModel`` with a base model and an output embedding.
        batch: the collated batch (tensors already on the model's device); ``labels`` ``[B, T]`` unshifted.
        reduction, num_items_in_batch, ignore_index, chunk_size, backend: as in :func:`linear_cross_entropy`.

    Returns:
        The scalar float32 loss.

    Raises:
        ValueError: no ``labels`` in the batch, a model without base model / head, a model whose logits are
            transformed after the head (softcapping, logit scale), ``"sample"`` without ``seq_idx`` in the
            batch, or the errors of :func:`linear_cross_entropy`.
    """
    if "labels" not in batch:
        raise ValueError(f"batch has no 'labels' (keys: {sorted(batch)})")
    base, head = _base_and_head(model)
    model_inputs = _run_forward_pre_hooks(model, {k: v for k, v in batch.items() if k not in LOSS_FIELDS})
    outputs = base(**model_inputs)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    labels = batch["labels"]
    rows = _rows(labels, "labels")
    if hidden.shape[:-1] != rows.shape:
        raise ValueError(
            f"hidden states {tuple(hidden.shape)} do not match labels {tuple(labels.shape)} (one row per batch row)"
        )
    seq_idx = batch.get(SEQ_IDX)
    shifted = shift_labels(rows, seq_idx=seq_idx, ignore_index=ignore_index)
    flat_seq_idx = None
    if seq_idx is not None:
        seg = _rows(seq_idx, "seq_idx").to(torch.int64)
        offsets = torch.arange(seg.shape[0], device=seg.device).unsqueeze(1) * seg.shape[1]
        flat_seq_idx = (seg + offsets).reshape(-1)
    loss_scale = batch.get("loss_scale")
    if loss_scale is not None:
        loss_scale = _shift_tokens(_rows(loss_scale, "loss_scale").to(torch.float32), 0.0).reshape(-1)
    return linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        head.weight,
        shifted,
        bias=getattr(head, "bias", None),
        reduction=reduction,
        seq_idx=flat_seq_idx,
        num_items_in_batch=num_items_in_batch,
        ignore_index=ignore_index,
        loss_scale=loss_scale,
        chunk_size=chunk_size,
        backend=backend,
    )
