"""Settings of a packed SFT run: :class:`SFTConfig` and its per-model-kind default learning rate.

This module imports neither torch nor transformers (only numpy, through :mod:`varpack.plan`), so the
``varpack sft`` / ``varpack demo`` parsers can read the defaults without the seconds those imports take;
:mod:`varpack.train` re-exports :class:`SFTConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from varpack.plan.plan import DEFAULT_PACKING_LENGTH

__all__ = ["DEFAULT_LR", "SFTConfig", "default_lr"]

#: Default peak learning rate by model kind. A random-init built-in model (``tiny-qwen3``, ...) learns from
#: scratch: 30 steps of ``tiny-qwen3`` on the built-in chats (packing_length 1024, constant schedule, the last
#: 16 chats held back) take the held-out loss from 11.95 to 11.71 at 1e-4 and to 6.95 at 3e-3 (the demo's
#: rate), measured on a CPU. Loaded weights (a model directory or GGUF file) are fine-tuned: 1e-4, a
#: common full fine-tuning rate for small models, and the rate of the README's SmolLM2 example. Every built-in
#: name counts as random-init, also the benchmark shape ``qwen3-0.6b-shape`` (3e-3 was not tuned for it).
DEFAULT_LR: dict[str, float] = {"random-init": 3e-3, "pretrained": 1e-4}


def default_lr(model: str) -> tuple[float, str]:
    """The default peak learning rate for ``model`` and the kind it was chosen for.

    Args:
        model: what :func:`varpack.models.load_model` takes: a built-in name (random init) or a model
            directory / ``.gguf`` file / package (loaded weights).

    Returns:
        ``(lr, kind)`` with ``kind`` ``"random-init"`` or ``"pretrained"`` (:data:`DEFAULT_LR`).

    Raises:
        ValueError: ``model`` names nothing (:func:`varpack.models.resolve_model_source`).
    """
    from varpack.models import resolve_model_source

    source, _ = resolve_model_source(model)
    kind = "random-init" if source in ("builtin", "external") else "pretrained"
    return DEFAULT_LR[kind], kind


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """Settings of a packed SFT run (the ``varpack sft`` flags carry the same names).

    Attributes:
        model: model directory, ``.gguf`` file / package, or a built-in name (``tiny-qwen3``, ``tiny-llama``,
            ``qwen3-0.6b-shape``, ...).
        data: chat data files (JSON / JSONL / parquet with ``messages``); empty: the built-in chats.
        output_dir: where the final model + tokenizer (and the Trainer's files) are written.
        packing_length: tokens per pack (the row length budget of one pack); default
            :data:`varpack.plan.DEFAULT_PACKING_LENGTH` (4096), the same as ``varpack plan``.
        packing_strategy: ``bfd`` (best-fit decreasing) or ``sequential`` (order-preserving next-fit).
        overflow: samples longer than ``packing_length``: ``error`` (default: refuse, listing their ids and
            lengths), ``drop``, ``truncate`` or ``split``; whatever happens is in the packing report.
        packs_per_step: packs per micro-batch per device (all flattened into one row).
        grad_accum: gradient-accumulation micro-batches per optimizer step.
        epochs: passes over the packs (ignored when ``max_steps > 0``).
        max_steps: optimizer steps; ``-1``: run ``epochs``.
        lr: peak learning rate (AdamW); ``None`` (default): :func:`default_lr` of ``model``, i.e.
            :data:`DEFAULT_LR` ``["random-init"]`` (3e-3) for a built-in random-init model and
            ``["pretrained"]`` (1e-4) for loaded weights (a model directory or GGUF file).
        lr_scheduler: transformers scheduler name (``constant``, ``linear``, ``cosine``, ...).
        warmup_steps: linear warm-up steps.
        weight_decay: AdamW weight decay.
        loss_reduction: ``token`` (global token mean) or ``sample`` (global sample mean).
        loss_impl: ``auto`` (``linear_ce`` when the model allows it and runs unwrapped, else ``logits``),
            ``linear_ce`` (chunked, no ``[T, V]`` logits) or ``logits``.
        attn_backend: varpack attention backend (``auto``, ``reference``, ``flex``, ...).
        bf16: train in bfloat16 autocast (mixed precision; master weights stay float32).
        dtype: parameter dtype of built-in models (``float32`` default).
        seed: random-init seed of built-in models, plan seed and Trainer seed.
        logging_steps: log every N optimizer steps.
        num_proc: encoding worker processes.
        dataloader_num_workers: DataLoader workers.
        gradient_checkpointing: recompute activations in backward.
        use_liger_kernel: replace RMSNorm / RoPE / SwiGLU by Liger-Kernel's fused Triton kernels (CUDA; needs
            ``liger-kernel``): :func:`varpack.integrations.kernels.apply_liger_kernels`. The loss stays varpack's.
        torch_compile: ``torch.compile`` each decoder layer, varpack attention outside the graph
            (:func:`varpack.integrations.kernels.compile_layers`); compiles in the first step. Not together with
            ``use_liger_kernel`` (refused: :data:`varpack.integrations.kernels.LIGER_COMPILE_REFUSAL`).
        save: save model + tokenizer at the end.
        report_to: Trainer integrations (``none`` by default).
    """

    model: str = "tiny-qwen3"
    data: tuple[str, ...] = ()
    output_dir: str = "varpack-sft"
    packing_length: int = DEFAULT_PACKING_LENGTH
    packing_strategy: str = "bfd"
    overflow: str = "error"
    packs_per_step: int = 1
    grad_accum: int = 1
    epochs: float = 1.0
    max_steps: int = -1
    lr: float | None = None
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    loss_reduction: str = "token"
    loss_impl: str = "auto"
    attn_backend: str = "auto"
    bf16: bool = False
    dtype: str = "float32"
    seed: int = 0
    logging_steps: int = 1
    num_proc: int | None = None
    dataloader_num_workers: int = 0
    gradient_checkpointing: bool = False
    use_liger_kernel: bool = False
    torch_compile: bool = False
    save: bool = True
    report_to: str = "none"
    extra_training_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from varpack.plan import OVERFLOW_POLICIES, STRATEGIES

        if isinstance(self.data, str):
            object.__setattr__(self, "data", (self.data,))
        else:
            object.__setattr__(self, "data", tuple(self.data))
        checks = [
            ("packing_length", self.packing_length >= 1),
            ("packs_per_step", self.packs_per_step >= 1),
            ("grad_accum", self.grad_accum >= 1),
            ("epochs", self.epochs > 0 or self.max_steps > 0),
            ("max_steps", self.max_steps == -1 or self.max_steps >= 1),
            ("lr", self.lr is None or (self.lr > 0 and math.isfinite(self.lr))),
            ("logging_steps", self.logging_steps >= 1),
            ("packing_strategy", self.packing_strategy in STRATEGIES),
            ("overflow", self.overflow in OVERFLOW_POLICIES),
            ("loss_reduction", self.loss_reduction in ("token", "sample")),
            ("loss_impl", self.loss_impl in ("auto", "linear_ce", "logits")),
            ("dtype", self.dtype in ("float32", "bfloat16", "float16")),
            ("attn_backend", self.attn_backend == "auto" or self.attn_backend in _attn_backends()),
        ]
        for name, ok in checks:
            if not ok:
                hint = (
                    f"; choose 'auto' or one of {sorted(_attn_backends())}" if name == "attn_backend" else ""
                )
                raise ValueError(f"SFTConfig.{name} has an invalid value: {getattr(self, name)!r}{hint}")


def _attn_backends() -> tuple[str, ...]:
    from varpack.attn import BACKENDS

    return tuple(BACKENDS)
