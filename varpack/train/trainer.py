"""The Trainer side of a packed SFT run: :class:`PackedSFTTrainer` (loss from a training objective of
:mod:`varpack.train.objectives`, ``num_items_in_batch``, tokens/s and pack-fill logs), the collator wrapper
:class:`TrainCollator` and :class:`PackEpochCallback` (the plan's per-epoch pack order).

Host syncs. Boundaries are built on the CPU by the collator and stay there (:class:`HostBoundaries`: the
guard validates them for free, the attention copies them once per batch), ``max_length_*`` are Python ints, the
loss and the sample counts stay on the device: varpack adds no host sync per step; Trainer reads the loss at
logging steps only. See :mod:`varpack.train` for the whole pipeline.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from varpack.train.objectives import get_objective

__all__ = ["HostBoundaries", "PackEpochCallback", "PackedSFTTrainer", "TrainCollator"]


def _unwrap_boundaries(inputs: dict[str, Any]) -> dict[str, Any]:
    holder = inputs.get("host_boundaries")
    if holder is None:
        return inputs
    out = {k: v for k, v in inputs.items() if k != "host_boundaries"}
    out.update(holder.tensors)
    return out


class PackEpochCallback(TrainerCallback):
    """Calls ``dataset.set_epoch(epoch)`` at the start of every epoch: the plan's per-epoch pack order."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        epoch = int(math.floor((state.epoch or 0.0) + 1e-6))
        self.dataset.set_epoch(epoch)


class PackedSFTTrainer(Trainer):
    """``Trainer`` whose loss comes from a training objective (``objective``, a name of
    :data:`varpack.train.objectives.OBJECTIVES`; ``"sft"``: varpack's packed causal-LM loss) with
    ``num_items_in_batch``.

    Also logs ``tokens_per_second`` (real tokens of the packed rows, all ranks) and ``pack_fill``
    (real tokens / (packs x packing_length)) averaged since the previous log.
    """

    def __init__(
        self,
        *args: Any,
        loss_reduction: str = "token",
        loss_impl: str = "auto",
        packing_length: int | None = None,
        objective: str = "sft",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.objective = get_objective(objective)
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
        if self.loss_reduction == "sample" and batch_samples:
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
        return unwrapped is model and not transformed

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        inputs = _unwrap_boundaries(inputs)
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


class HostBoundaries:
    """Carries the collator's CPU ``cu_seq_lens_q/k`` past accelerate's / Trainer's device placement.

    ``send_to_device`` and ``Trainer._prepare_inputs`` move tensors (and objects with ``.to``) to the GPU; this
    holder has neither, so the boundaries stay on the CPU, where the packing guard validates them for free and
    :func:`varpack.attn.varlen_attention` copies them to the device once per batch (cached by tensor
    identity, reused by every layer). :meth:`PackedSFTTrainer.compute_loss` unwraps it.
    """

    __slots__ = ("tensors",)

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors


class TrainCollator:
    """``PaddingFreeCollator`` for the Trainer: adds ``num_packs`` (an int, for the pack-fill log) and wraps
    the boundaries in :class:`HostBoundaries` (both unwrapped / popped before the model sees the batch)."""

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, features: Sequence[Any]) -> dict[str, Any]:
        batch = self.collator(features)
        packs = sum(1 for f in features if isinstance(f, (list, tuple)))
        batch["num_packs"] = packs or 1
        cu = {k: batch.pop(k) for k in ("cu_seq_lens_q", "cu_seq_lens_k") if k in batch}
        if cu:
            batch["host_boundaries"] = HostBoundaries(cu)
        return batch
