"""The chunked PyTorch linear cross entropy: the loss and its gradients in one pass, ``chunk_size x V`` logits
at a time (backend ``"chunked"``, any device).

Per chunk: one GEMM for the logits, then the log-sum-exp, the loss and ``w_t * (softmax - onehot)`` -- on
CUDA fused by ``torch.compile`` into one reduction and one pointwise kernel over the bf16 logits (no float32
chunk buffer), elsewhere eagerly in place on a float32 chunk -- then two GEMMs for the gradients (the weight
gradient accumulated in float32). No host sync. The backward pass only multiplies the stored gradients by
the incoming ``grad_output``.

Source: the "compute the gradient in the forward pass" scheme of Liger-Kernel's
``fused_linear_cross_entropy`` (after mgmalek/efficient_cross_entropy) and Apple's Cut Cross-Entropy.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

__all__ = ["chunked_linear_cross_entropy", "save_grads", "scale_saved_grads"]

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

        save_grads(ctx, grad_h, grad_w, grad_b, weight, bias)
        return loss.to(torch.float32) if acc_dtype == torch.float32 else loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        return (*scale_saved_grads(ctx, grad_output), None, None, None, None, None)


def save_grads(
    ctx: Any,
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> None:
    """Store the gradients a forward pass computed for :func:`scale_saved_grads`: the weight's and the bias's
    in their parameter's dtype (None where not needed)."""
    ctx.save_for_backward(
        grad_h,
        None if grad_w is None else grad_w.to(weight.dtype),
        None if grad_b is None else grad_b.to(bias.dtype),
    )


def scale_saved_grads(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The backward of a loss whose forward stored its gradients (``ctx.saved_tensors``, None where not
    needed): each multiplied by the scalar ``grad_output`` on the device (no host read of it), in
    ``grad_output``'s precision (float32) even for 16-bit gradients, rounded once into the gradient's dtype.

    ``grad_output`` is ``1 / num_items`` times the caller's scale; rounded to bf16 first it would scale every
    gradient of the call by up to 0.4% too much or too little. As a one-element 1-D tensor (not a 0-dim one)
    it takes part in type promotion, so one fused multiply reads the 16-bit gradient, computes in float32 and
    writes the result in the gradient's dtype (no float32 copy of the ``[V, D]`` gradient).
    """
    scale = grad_output.reshape(1)
    out = []
    for g in ctx.saved_tensors:
        if g is None:
            out.append(None)
        elif scale.requires_grad:  # double backward: differentiable, out= is not
            out.append((g * scale).to(g.dtype))
        else:
            out.append(torch.mul(g, scale, out=torch.empty_like(g)))
    return tuple(out)


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    token_weight: torch.Tensor,
    chunk_size: int,
    compile: bool | None,
) -> torch.Tensor:
    """``sum_t token_weight[t] * CE(hidden[t] @ weight.T + bias, labels[t])`` on validated inputs.

    Args:
        hidden: ``[T, D]`` float; weight ``[V, D]``; bias ``[V]`` or None; labels int64 ``[T]`` (already
            shifted, on hidden's device); token_weight float32 / float64 ``[T]`` (:func:`token_loss_weights`).
        chunk_size: tokens per chunk.
        compile: as in :func:`varpack.ops.linear_ce.linear_cross_entropy` (None: CUDA, 16/32-bit, unless
            ``VARPACK_LINEAR_CE_COMPILE=0``).

    Returns:
        The scalar loss, float32 (float64 for fp64 input); differentiable w.r.t. hidden, weight and bias.
    """
    compiled = _use_compile(compile, hidden.device, hidden.dtype)
    return _ChunkedLinearCrossEntropy.apply(
        hidden, weight, bias, labels, token_weight, chunk_size, torch.is_grad_enabled(), compiled
    )
