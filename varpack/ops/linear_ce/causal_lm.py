"""Linear cross entropy on a Hugging Face causal LM: the base model, then the LM head fused with the loss.

:func:`causal_lm_forward_with_linear_ce` is the fused twin of ``model(**batch).logits`` followed by
:func:`varpack.loss.causal_lm_loss`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from varpack.schema import IGNORE_INDEX, LOSS_FIELDS, SEQ_IDX

from .dispatch import linear_cross_entropy
from .weights import Reduction, _rows, _shift_tokens, shift_labels

__all__ = ["causal_lm_forward_with_linear_ce", "head_has_adapter", "logit_transform"]

#: Config attributes that change the logits after the LM head (the loss here would not include them):
#: Gemma's softcapping, Cohere's logit_scale, Granite's logits_scaling, Falcon-H1's lm_head_multiplier, ...
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_logits_scale",
    "lm_head_multiplier",
)


def logit_transform(model_or_config: Any) -> tuple[str, Any] | None:
    """``(attribute, value)`` of the first config setting in :data:`_LOGIT_TRANSFORMS` by which the model
    changes its logits after the LM head (a value other than ``None`` and 1), or ``None``: linear cross
    entropy (the plain head) computes the model's loss only when this is ``None``."""
    config = getattr(model_or_config, "config", model_or_config)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in _LOGIT_TRANSFORMS:
        value = getattr(config, attr, None)
        if value is not None and value != 1:
            return attr, value
    return None


def _without_peft_wrapper(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft ``PeftModel`` (its adapters are injected into that model's
    modules in place, so calling its base model runs them), else ``model``."""
    peft = sys.modules.get("peft")  # not imported: ``model`` cannot be a PeftModel
    if peft is not None and isinstance(model, peft.PeftModel):
        return model.get_base_model()
    return model


def head_has_adapter(model: torch.nn.Module) -> bool:
    """Whether ``model``'s LM head (``get_output_embeddings()``) carries a peft adapter: linear cross
    entropy multiplies by ``head.weight`` directly and would leave the adapter out."""
    peft = sys.modules.get("peft")
    if peft is None:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    model = _without_peft_wrapper(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return isinstance(head, BaseTunerLayer)


def _base_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    if head_has_adapter(model):
        raise ValueError(
            f"the LM head of {type(_without_peft_wrapper(model)).__name__} carries a LoRA / peft adapter; linear "
            "cross entropy reads head.weight directly and would drop it: use loss_impl='logits', or leave "
            "the head out of the adapter's target modules"
        )
    model = _without_peft_wrapper(model)
    base = getattr(model, "base_model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if base is None or base is model or head is None or not hasattr(head, "weight"):
        raise ValueError(
            f"{type(model).__name__} does not expose a base model (model.base_model, e.g. model.model) and an "
            "LM head (model.get_output_embeddings()); linear cross entropy needs a *ForCausalLM-style model"
        )
    transform = logit_transform(model)
    if transform is not None:
        raise ValueError(
            f"{type(model).__name__} transforms its logits ({transform[0]}={transform[1]}); linear cross "
            "entropy applies the plain LM head only, so it would compute a different loss"
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
    max_supervised: int | None = None,
) -> torch.Tensor:
    """The causal-LM loss of a Hugging Face model on a collated batch, without the ``[T, V]`` logits.

    A peft ``PeftModel`` (LoRA) is seen through: its transformers model's base model runs, adapters
    included; an adapter on the LM head is refused (:func:`head_has_adapter`).

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
        reduction, num_items_in_batch, ignore_index, chunk_size, backend, max_supervised: as in
            :func:`linear_cross_entropy` (``max_supervised`` bounds the batch's ``labels != ignore_index``; the
            shifted labels never have more; varpack's trainers pass the collator's ``batch_stats`` count).

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
    inner = _without_peft_wrapper(model)
    if inner is not model:  # PeftModel(**batch) calls the transformers model: its hooks run too
        model_inputs = _run_forward_pre_hooks(inner, model_inputs)
    outputs = base(**model_inputs)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    if torch.is_autocast_enabled(hidden.device.type):
        # mixed precision: autocast would run the LM head (a linear) in its dtype, as model.lm_head does on the
        # logits path; the final norm's float32 weight leaves hidden in float32
        hidden = hidden.to(torch.get_autocast_dtype(hidden.device.type))
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
        max_supervised=max_supervised,
    )
