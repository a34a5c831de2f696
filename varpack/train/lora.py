"""LoRA for a packed SFT run: :func:`apply_lora` wraps a varpack-enabled model in a peft ``PeftModel`` and
:func:`save_lora` writes the adapter (and, on request, the merged model).

Why packing stays exact under LoRA: peft injects its ``lora.Linear`` layers in place of the model's
``nn.Linear`` modules and ``PeftModel.forward`` calls the wrapped transformers model with the same keyword
arguments, so the batch's boundaries (``varlen_meta``, ``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx``)
still reach :func:`varpack.integrations.transformers.enable_varpack`'s guard on the text model and every
layer; varpack attention and the gated-delta mixers call the projection modules (adapters included) and mix
tokens only inside each sample. Where varpack reads a weight directly instead of calling the module -- the LM
head of the linear cross entropy, a Gated DeltaNet's ``conv1d`` -- an adapter on that module is refused
(:func:`varpack.ops.linear_ce.causal_lm._base_and_head`, :mod:`varpack.integrations.gated_delta`), never
dropped. tests/test_lora.py checks packed == each sample alone for logits, loss and every adapter gradient,
with and without gradient checkpointing, and the negative control without boundaries.

Gradient checkpointing: with the base weights frozen, a checkpointed layer's input must require grad for
the adapters inside it to get gradients under reentrant checkpointing; peft's ``PeftModel`` calls
``enable_input_require_grads`` when it wraps the model and transformers' ``activation_checkpointing_enable``
does too (transformers 5.x), so nothing is added here.
"""

from __future__ import annotations

import os
from typing import Any

from varpack.train.config import SFTConfig

__all__ = ["MERGED_SUBDIR", "apply_lora", "lora_config", "peft_available", "require_peft", "save_lora"]

#: where :func:`save_lora` writes the merged model, under ``config.output_dir``
MERGED_SUBDIR = "merged"


def peft_available() -> bool:
    """Whether ``peft`` can be imported."""
    import importlib.util

    return importlib.util.find_spec("peft") is not None


def require_peft() -> None:
    """Raises ``ValueError`` (with the install command) when ``peft`` is missing."""
    if not peft_available():
        raise ValueError("lora needs peft: pip install 'varpack[lora]' (or pip install peft)")


def lora_config(config: SFTConfig, **lora_kw: Any) -> Any:
    """peft ``LoraConfig`` of ``config`` (``lora_r``, ``lora_alpha``, ``lora_dropout``,
    ``lora_target_modules``), task type ``CAUSAL_LM``, no bias trained; ``lora_kw`` added last."""
    from peft import LoraConfig

    kw: dict[str, Any] = dict(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.lora_target_module_list(),
        bias="none",
        task_type="CAUSAL_LM",
    )
    kw.update(lora_kw)
    return LoraConfig(**kw)


def apply_lora(model: Any, config: SFTConfig, **lora_kw: Any) -> Any:
    """Wrap ``model`` (already on varpack attention) in a LoRA ``PeftModel``; only the adapter weights train.

    Args:
        model: a transformers causal LM after :func:`varpack.integrations.transformers.enable_varpack` (and
            Liger / per-layer compile, if any).
        config: the run settings (``lora_*`` fields).
        **lora_kw: more ``peft.LoraConfig`` keywords (tests: ``init_lora_weights=False``).

    Returns:
        The ``peft.PeftModel``; the LoRA layers are injected into ``model`` in place.

    Raises:
        ValueError: peft is not installed; a name of ``lora_target_modules`` matches no module of the model
            (peft's error, re-raised naming the field).
    """
    require_peft()
    from peft import get_peft_model

    try:
        return get_peft_model(model, lora_config(config, **lora_kw))
    except ValueError as e:
        if "target modules" in str(e).lower() or "target_modules" in str(e):
            raise ValueError(
                f"SFTConfig.lora_target_modules={config.lora_target_modules!r} does not fit "
                f"{type(model).__name__}: {e}"
            ) from e
        raise


def save_lora(model: Any, tokenizer: Any, config: SFTConfig) -> str | None:
    """After ``Trainer.save_model`` wrote the adapter (``adapter_config.json``, ``adapter_model.safetensors``)
    to ``config.output_dir``: with ``config.lora_merge``, merge the adapter into the base weights (peft's
    ``merge_and_unload``, in place: ``model``'s LoRA layers are gone afterwards) and save the merged
    transformers model + tokenizer to ``<output_dir>/merged``.

    Returns:
        The merged model's directory, or ``None`` without ``lora_merge``.
    """
    if not config.lora_merge:
        return None
    merged_dir = os.path.join(config.output_dir, MERGED_SUBDIR)
    merged = model.merge_and_unload()
    merged.save_pretrained(merged_dir)
    tokenizer.save_pretrained(merged_dir)
    return merged_dir
