"""Liger-Kernel's fused linear cross entropy as backend ``"liger"`` (pure Triton, CUDA only).

It is used only where it computes exactly varpack's loss: with ``reduction="sum"`` its gradient is
``softmax - onehot`` summed over tokens and its backward multiplies by the scalar ``grad_output``, so
``liger(sum) / num_items`` is the token mean with any divisor (the same construction as transformers' Liger
integration with ``num_items_in_batch``). Per-token weights need Liger's ``reduction="none"`` with a
per-token backward (:func:`_liger_probe` reports whether the installed version has it).

Uniform weights run :class:`_LigerSumLinearCrossEntropy`: Liger's cross-entropy Triton kernel
(``liger_kernel.ops.cross_entropy.liger_cross_entropy_kernel``, the kernel of Liger's own fused linear cross
entropy) driven chunk by chunk without Liger's two host syncs -- its Python function reads the supervised
count with ``.item()`` in forward (a count ``reduction="sum"`` never uses) and compares ``grad_output`` with
1.0 on the host in backward; each drains the device queue while the host waits. The kernel is called only
when its arguments are exactly those this module passes (:func:`_liger_kernel_probe`); otherwise, and for
per-token weights, Liger's Python function runs, with its syncs.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from varpack._probe import probe_once

from .chunked import _accumulate_mm, save_grads, scale_saved_grads

__all__: list[str] = []

#: The arguments of Liger's ``liger_cross_entropy_kernel`` (liger-kernel 0.8.5) that
#: :class:`_LigerSumLinearCrossEntropy` passes; a kernel with any other argument list is not called.
_KERNEL_ARGS = (
    "X_ptr", "X_stride", "Y_ptr", "Y_stride", "weight_ptr", "loss_ptr", "z_loss_ptr", "loss_stride",
    "token_accuracy_ptr", "token_accuracy_stride", "predicted_tokens_ptr", "predicted_tokens_stride",
    "n_cols", "n_non_ignore", "sum_non_ignore_weight", "weight_sum", "ignore_index", "lse_square_scale",
    "label_smoothing", "reduction", "softcap", "RETURN_Z_LOSS", "RETURN_TOKEN_ACCURACY",
    "RETURN_PREDICTED_TOKENS", "BLOCK_SIZE", "HAS_WEIGHT", "HAS_SOFTCAPPING", "HAS_GRADIENTS",
)  # fmt: skip


@probe_once
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


@probe_once
def _liger_kernel_probe() -> tuple[Any, str]:
    """``(kernel, reason)``: Liger's cross-entropy Triton kernel when importable with exactly the arguments of
    :data:`_KERNEL_ARGS`, else ``(None, why not)``."""
    try:
        from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel as kernel
    except Exception as exc:  # ImportError, or Triton failing to initialise
        return None, f"liger_cross_entropy_kernel is not importable ({type(exc).__name__}: {exc})"
    names = tuple(getattr(kernel, "arg_names", ()) or ())
    if names != _KERNEL_ARGS:
        diff = sorted(set(names) ^ set(_KERNEL_ARGS)) or "their order"
        return None, f"liger_cross_entropy_kernel's arguments differ from the ones varpack passes: {diff}"
    return kernel, "liger_cross_entropy_kernel, driven without host syncs"


def _kernel_launch(
    kernel: Any,
    logits: torch.Tensor,
    target: torch.Tensor,
    loss: torch.Tensor,
    ignore_index: int,
    with_grad: bool,
) -> None:
    """One launch over the rows of ``logits`` ``[C, V]`` (contiguous, overwritten in place by
    ``softmax - onehot``, zero on ignored rows, when ``with_grad``); ``loss`` ``[C]`` float32 gets each
    supervised row's cross entropy (ignored rows are left as they are)."""
    vocab = logits.shape[1]
    kernel[(logits.shape[0],)](
        X_ptr=logits, X_stride=logits.stride(0), Y_ptr=target, Y_stride=target.stride(0),
        weight_ptr=None, loss_ptr=loss, z_loss_ptr=None, loss_stride=loss.stride(0),
        token_accuracy_ptr=None, token_accuracy_stride=0, predicted_tokens_ptr=None, predicted_tokens_stride=0,
        n_cols=vocab, n_non_ignore=1, sum_non_ignore_weight=1, weight_sum=0.0, ignore_index=ignore_index,
        lse_square_scale=0.0, label_smoothing=0.0, reduction="sum", softcap=None,
        RETURN_Z_LOSS=False, RETURN_TOKEN_ACCURACY=False, RETURN_PREDICTED_TOKENS=False,
        BLOCK_SIZE=min(_MAX_FUSED_SIZE, 1 << max(vocab - 1, 0).bit_length()),
        HAS_WEIGHT=False, HAS_SOFTCAPPING=False, HAS_GRADIENTS=with_grad,
        num_warps=16 if torch.version.hip else 32,
    )  # fmt: skip


#: The widest block of Liger's own launch of the kernel (``fused_linear_cross_entropy.MAX_FUSED_SIZE``).
_MAX_FUSED_SIZE = 32768


class _LigerSumLinearCrossEntropy(torch.autograd.Function):
    """``sum_t CE(hidden[t] @ W.T + b, labels[t])`` over the supervised ``t``, its gradients computed in the
    forward pass by Liger's kernel, ``chunk_size`` rows at a time; no host sync in forward or backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        ignore_index: int,
        chunk_size: int,
        grad_enabled: bool,
        kernel: Any,
    ) -> torch.Tensor:
        needs_h, needs_w, needs_b = (grad_enabled and ctx.needs_input_grad[i] for i in range(3))
        any_grad = needs_h or needs_w or needs_b
        num_tokens = hidden.shape[0]
        one_chunk = num_tokens <= chunk_size
        loss = torch.zeros(num_tokens, device=hidden.device, dtype=torch.float32)
        grad_h = torch.empty_like(hidden) if needs_h else None
        # float32 accumulation across chunks; one chunk writes its GEMM's result directly
        grad_w = (
            torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
            if needs_w and not one_chunk
            else None
        )
        grad_b = torch.zeros(bias.shape, device=bias.device, dtype=torch.float32) if needs_b else None
        for start in range(0, num_tokens, chunk_size):
            stop = min(start + chunk_size, num_tokens)
            h = hidden[start:stop]
            logits = h @ weight.T
            if bias is not None:
                logits = logits + bias
            logits = logits.contiguous()
            _kernel_launch(
                kernel, logits, labels[start:stop].contiguous(), loss[start:stop], ignore_index, any_grad
            )
            if not any_grad:
                del logits
                continue
            if needs_h:
                torch.mm(logits, weight, out=grad_h[start:stop])
            if needs_w and one_chunk:
                grad_w = torch.mm(logits.T, h)
            elif needs_w:
                _accumulate_mm(grad_w, logits.T, h)
            if needs_b:
                grad_b += logits.sum(dim=0, dtype=torch.float32)
            del logits  # freed before the next chunk's GEMM allocates: one chunk's logits alive at a time
        if needs_w and grad_w is None:  # no rows at all
            grad_w = torch.zeros_like(weight)
        save_grads(ctx, grad_h, grad_w, grad_b, weight, bias)
        return loss.sum()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):  # type: ignore[override]
        return (*scale_saved_grads(ctx, grad_output), None, None, None, None, None)


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
    """The loss on validated inputs (weight and bias in hidden's dtype, labels int64 shifted): ``sum / denom``
    for uniform weights (``denom`` a device scalar), else ``sum_t token_weight[t] * CE_t``."""
    if denom is not None:  # uniform weights: sum / num_items (exact: grad_output scales the stored grads)
        kernel, _ = _liger_kernel_probe()
        if kernel is not None:
            total = _LigerSumLinearCrossEntropy.apply(
                hidden, weight, bias, labels, ignore_index, chunk_size, torch.is_grad_enabled(), kernel
            )
            return total / denom
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    kw = dict(ignore_index=ignore_index, accum_dtype=torch.float32)
    kw.update(_liger_chunk_kwargs(liger_fused_linear_cross_entropy, hidden, weight, chunk_size))
    if denom is not None:
        total = liger_fused_linear_cross_entropy(hidden, weight, labels, bias, reduction="sum", **kw)
        return total.float() / denom
    per_token = liger_fused_linear_cross_entropy(hidden, weight, labels, bias, reduction="none", **kw)
    return (per_token.float() * token_weight).sum()
