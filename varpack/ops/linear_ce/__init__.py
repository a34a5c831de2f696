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
  (0.8.5 does), else refused with the reason. With uniform weights varpack drives Liger's cross-entropy
  Triton kernel itself, chunk by chunk (the kernel of Liger's own function, same GEMMs around it), without the
  two host syncs of Liger's Python function (its ``.item()`` of the supervised count in forward, its host
  compare of ``grad_output`` with 1.0 in backward); a Liger whose kernel takes other arguments runs its own
  function, syncs included.
* ``"auto"``: ``liger`` for uniform token weights on CUDA when importable, the hidden states are not float64
  and :data:`AUTO_PREFERS_LIGER`, otherwise ``chunked``.

Every call checks on the device, without a host read, that each label is ``ignore_index`` or in ``[0, V)``
(:func:`~varpack.ops.linear_ce.dispatch.assert_labels_in_range`): a fused kernel indexes the logits row with the
label, so an out-of-range one would read another row (Liger) or score class 0 (chunked).

Source: the chunked "compute the gradient in the forward pass" scheme of Liger-Kernel's
``fused_linear_cross_entropy`` (after mgmalek/efficient_cross_entropy) and Apple's Cut Cross-Entropy
(Wijmans et al., 2024, "Cut Your Losses in Large-Vocabulary Language Models"); the reduction semantics of
transformers' ``ForCausalLMLoss`` (``num_items_in_batch``).

Files
-----
* ``weights.py``: :func:`shift_labels`, :func:`token_loss_weights` (the labels contract and the reductions).
* ``chunked.py``: the chunked PyTorch implementation (backend ``"chunked"``).
* ``liger.py``: the Liger-Kernel backend (``"liger"``) and its probe.
* ``dispatch.py``: :func:`resolve_linear_ce_backend`, :func:`linear_ce_backends` and the entry point
  :func:`linear_cross_entropy`.
* ``naive.py``: :func:`naive_linear_cross_entropy`, the naive twin (full ``[T, V]`` logits + PyTorch's cross
  entropy) the fused backends are tested against.
* ``causal_lm.py``: :func:`causal_lm_forward_with_linear_ce` for Hugging Face causal LMs.
"""

from __future__ import annotations

from .causal_lm import causal_lm_forward_with_linear_ce
from .dispatch import (
    AUTO_PREFERS_LIGER,
    SUPERVISED_ROWS_MULTIPLE,
    linear_ce_backends,
    linear_cross_entropy,
    resolve_linear_ce_backend,
    supervised_row_count,
    supervised_rows,
)
from .naive import naive_linear_cross_entropy
from .weights import shift_labels, token_loss_weights

__all__ = [
    "AUTO_PREFERS_LIGER",
    "SUPERVISED_ROWS_MULTIPLE",
    "causal_lm_forward_with_linear_ce",
    "linear_cross_entropy",
    "linear_ce_backends",
    "naive_linear_cross_entropy",
    "resolve_linear_ce_backend",
    "shift_labels",
    "supervised_row_count",
    "supervised_rows",
    "token_loss_weights",
]
