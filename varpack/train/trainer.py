"""The Trainer side of a packed SFT run: :class:`PackedSFTTrainer` (loss from a training objective of
:mod:`varpack.train.objectives`, ``num_items_in_batch``, tokens/s and pack-fill logs), the collator wrapper
:class:`TrainCollator` and :class:`PackEpochCallback` (the plan's per-epoch pack order).

Host syncs. Boundaries are built and validated once on the CPU by the collator, as the batch's
:class:`varpack.varlen.VarlenMeta` (``varlen_meta``): Trainer / accelerate move tensors to the device and leave
that object alone, so its CPU offsets travel with the batch and every layer reads it (one host-to-device copy
per batch, kept on it); ``max_length_*`` are Python ints, the loss and the sample counts stay on the device: varpack adds no host sync per step; Trainer reads the loss at
logging steps only. See :mod:`varpack.train` for the whole pipeline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from transformers import Trainer, TrainerCallback

from varpack.train.objectives import get_objective

__all__ = ["PackEpochCallback", "PackedSFTTrainer", "TrainCollator"]


class PackEpochCallback(TrainerCallback):
    """Calls ``dataset.set_epoch(epoch)`` at the start of every epoch: the plan's per-epoch pack order."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        epoch = int(math.floor((state.epoch or 0.0) + 1e-6))
        self.dataset.set_epoch(epoch)


class PackedSFTTrainer(Trainer):
    """``Trainer`` whose loss comes from a training objective (``objective``, a name of
    :data:`varpack.train.objectives.OBJECTIVES` or an objective object; ``"sft"``: varpack's packed causal-LM
    loss, ``"dpo"``: :class:`varpack.train.objectives.dpo.DPOObjective`) with ``num_items_in_batch`` (the
    objective's own count when it has ``own_item_count``: DPO's pairs).

    Also logs ``tokens_per_second`` (real tokens of the packed rows, all ranks) and ``pack_fill``
    (real tokens / (packs x packing_length)) averaged since the previous log.
    """

    def __init__(
        self,
        *args: Any,
        loss_reduction: str = "token",
        loss_impl: str = "auto",
        packing_length: int | None = None,
        objective: Any = "sft",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.objective = get_objective(objective) if isinstance(objective, str) else objective
        self.loss_reduction = loss_reduction
        self.loss_impl = loss_impl
        self.packing_length = packing_length
        self.model_accepts_loss_kwargs = True  # our compute_loss divides by num_items_in_batch itself
        self._window_tokens = 0
        self._window_slots = 0
        self._window_start: float | None = None  # set by the first micro-batch of a logging window
        self.loss_impl_used: str | None = None

    # -- num_items_in_batch for the "sample" reduction --------------------------------------------
    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        own = getattr(self.objective, "own_item_count", False)  # DPO: pairs, whatever the reduction
        if (self.loss_reduction == "sample" or own) and batch_samples:
            n = sum(self.objective.count_items(b, reduction="sample") for b in batch_samples)
            n = n.to(device)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                n = self.accelerator.gather(n.reshape(1)).sum()
            num_items = n
        return batch_samples, num_items

    # -- loss --------------------------------------------------------------------------------------
    def _use_linear_ce(self, model: Any) -> bool:
        if self.loss_impl == "logits":
            return False
        unwrapped = self.accelerator.unwrap_model(model)
        if self.loss_impl == "linear_ce":
            if unwrapped is not model:
                raise ValueError(
                    "loss_impl='linear_ce' needs an unwrapped model (it calls the base model and the head "
                    "separately); under DDP/FSDP use loss_impl='logits' or loss_impl='auto'"
                )
            return True
        cfg = getattr(unwrapped, "config", None)
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        transformed = getattr(text_cfg, "final_logit_softcapping", None) or getattr(
            text_cfg, "logit_scale", None
        )
        from varpack.ops.linear_ce.causal_lm import head_has_adapter

        # a LoRA adapter on the head: the logits path (linear CE reads head.weight and would skip it)
        return unwrapped is model and not transformed and not head_has_adapter(unwrapped)

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        labels = inputs["labels"]
        num_packs = inputs.get("num_packs")
        if self._window_start is None:
            self._window_start = time.perf_counter()
        self._window_tokens += int(labels.shape[-1])
        if num_packs is not None and self.packing_length:
            self._window_slots += int(num_packs) * int(self.packing_length)
        result = self.objective.loss(
            model,
            inputs,
            reduction=self.loss_reduction,
            num_items_in_batch=num_items_in_batch,
            linear_ce=self._use_linear_ce(model),
        )
        loss, outputs, self.loss_impl_used = result.loss, result.outputs, result.impl
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # DDP averages gradients over ranks; the global count already divides by all ranks' items
            loss = loss * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss

    # -- logging -----------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        now = time.perf_counter()
        if "loss" in logs and self._window_tokens and self._window_start is not None:
            elapsed = max(now - self._window_start, 1e-9)
            world = max(1, self.args.world_size)
            logs["tokens_per_second"] = round(self._window_tokens * world / elapsed, 1)
            if self._window_slots:
                logs["pack_fill"] = round(self._window_tokens / self._window_slots, 4)
            self._window_tokens = self._window_slots = 0
            self._window_start = None
        super().log(logs, *args, **kwargs)


class TrainCollator:
    """``PaddingFreeCollator`` for the Trainer: adds ``num_packs`` (an int, for the pack-fill log; popped before
    the model sees the batch). The boundaries travel as the collator built them (``varlen_meta``)."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, features: Sequence[Any]) -> dict[str, Any]:
        batch = self.collator(features)
        packs = sum(1 for f in features if isinstance(f, (list, tuple)))
        batch["num_packs"] = packs or 1
        return batch
