"""The Trainer side of a packed SFT run: :class:`PackedSFTTrainer` (loss from a training objective of
:mod:`varpack.train.objectives`, ``num_items_in_batch``, tokens/s and pack-fill logs), the collator wrapper
:class:`TrainCollator`, :class:`PackEpochCallback` (the plan's per-epoch pack order) and
:class:`PackSamplingMixin` (each rank's packs from :class:`varpack.data.sampler.BalancedPackSampler`,
checkpointed and checked on resume).

Host syncs. Boundaries are built and validated once on the CPU by the collator, as the batch's
:class:`varpack.varlen.VarlenMeta` (``varlen_meta``): Trainer / accelerate move tensors to the device and leave
that object alone, so its CPU offsets travel with the batch and every layer reads it (one host-to-device copy
per batch, kept on it); ``max_length_*`` are Python ints, the loss and the sample counts stay on the device: varpack adds no host sync per step; Trainer reads the loss at
logging steps only. See :mod:`varpack.train` for the whole pipeline.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

from transformers import Trainer, TrainerCallback

from varpack.schema import BATCH_STATS, CP_SHARD, IGNORE_INDEX, LABELS, SAMPLE_IDS, VARLEN_META
from varpack.train.objectives import get_objective

__all__ = [
    "STAT_KEYS",
    "CompileCountCallback",
    "EngineReportCallback",
    "PackEpochCallback",
    "PackSamplingMixin",
    "PackedLossMixin",
    "PackedSFTTrainer",
    "SpeedReportCallback",
    "TrainCollator",
    "batch_stats",
    "check_sampler_checkpoint",
    "compiled_graphs",
    "describe_engine",
    "describe_speed",
    "nan_inf_filtered_loss",
    "make_pack_sampler",
    "non_blocking_copies",
    "step_metrics",
]

#: the counts of :data:`varpack.schema.BATCH_STATS`, in this order
STAT_KEYS: tuple[str, ...] = ("packs", "samples", "tokens", "supervised_tokens")


class PackEpochCallback(TrainerCallback):
    """Calls ``set_epoch(epoch)`` of the dataset (and of the pack sampler, when given) at the start of every
    epoch: the plan's per-epoch pack order. (Trainer / accelerate set the sampler's epoch as well, reaching
    it through their wrappers; this does not depend on how they reach it, e.g. in a resumed epoch.)"""

    def __init__(self, dataset: Any, sampler: Any = None) -> None:
        self.dataset = dataset
        self.sampler = sampler

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        epoch = int(math.floor((state.epoch or 0.0) + 1e-6))
        self.dataset.set_epoch(epoch)
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)


def _trainer_keeps_window_on_self() -> bool:
    """Whether this transformers' training loop keeps the logging window's loss sum in ``Trainer._tr_loss``
    and its first step in ``_globalstep_last_logged``, and filters a non-finite step's loss with them
    (what :func:`nan_inf_filtered_loss` reproduces)."""
    import inspect

    try:
        source = inspect.getsource(Trainer)
    except (OSError, TypeError):
        return False
    return all(
        name in source
        for name in (
            "self._tr_loss += self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)",
            "self._tr_loss += tr_loss_step",
        )
    )


#: Trainer's ``logging_nan_inf_filter`` can run on the device with this transformers
#: (:func:`_trainer_keeps_window_on_self`).
FILTER_ON_DEVICE: bool = _trainer_keeps_window_on_self()


def nan_inf_filtered_loss(loss: Any, window_sum: Any, steps: int) -> Any:
    """Trainer's ``logging_nan_inf_filter`` without a host read: ``loss`` where it is finite, else
    ``window_sum / steps`` (``steps`` = 1 + optimizer steps since the last log), exactly what ``Trainer`` adds in
    place of a NaN or inf micro-batch loss (not a mean of the window's losses: it under-reports, as Trainer's).
    Turn the filter off with ``trainer.nan_inf_filter_on_device = False`` (``trainer.args.logging_nan_inf_filter``
    reads ``False`` once the filter runs on the device).

    Args:
        loss: one micro-batch's detached loss, a 0-d float tensor.
        window_sum: Trainer's running loss sum of the window (``Trainer._tr_loss``), 0-d, same device.
        steps: a Python int >= 1.

    Returns:
        A 0-d tensor on ``loss``'s device, ``window_sum``'s dtype where ``loss`` is not finite.

    Source: transformers ``Trainer._run_epoch`` (the ``logging_nan_inf_filter`` branch), 5.x.
    """
    import torch

    return torch.where(torch.isfinite(loss), loss, window_sum / steps)


def non_blocking_copies(args: Any) -> Any:
    """``args.accelerator_config`` with ``non_blocking=True`` where a CUDA run pins its batches
    (``dataloader_pin_memory``): accelerate then copies each batch to the device without waiting for the device
    (``send_to_device(..., non_blocking=True)``), so the host prepares the next step while the device still runs
    this one. A blocking copy synchronises the stream once per tensor and step. Returns the config as given
    otherwise (CPU runs, unpinned batches, a config that is not transformers' ``AcceleratorConfig``); never
    changes ``args``. Measured: benchmarks/RESULTS.md#user-level-sft (``benchmarks/profile_sft.py
    --blocking-copies``).

    Source: accelerate ``DataLoaderConfiguration.non_blocking`` / ``send_to_device``; transformers
    ``AcceleratorConfig``."""
    import dataclasses

    import torch

    cfg = getattr(args, "accelerator_config", None)
    if (
        not dataclasses.is_dataclass(cfg)
        or getattr(cfg, "non_blocking", True)
        or not torch.cuda.is_available()
        or getattr(args, "use_cpu", False)
        or not args.dataloader_pin_memory
    ):
        return cfg
    return dataclasses.replace(cfg, non_blocking=True)


class PackedLossMixin:
    """The packed-loss side of a ``Trainer`` subclass: the loss from a training objective
    (:data:`varpack.train.objectives.OBJECTIVES`) divided by ``num_items_in_batch`` (overridden for the
    ``"sample"`` reduction), the logits / linear-CE choice, and the ``tokens_per_second`` / ``pack_fill`` logs.

    Mixed in before a ``transformers.Trainer`` class (:class:`PackedSFTTrainer`; TRL's ``SFTTrainer`` in
    :class:`varpack.train.trl.VarpackSFTTrainer`); the subclass calls :meth:`_init_packed_loss` after
    ``Trainer.__init__``. Its ``compute_loss`` never calls the base class's (the objective runs the model).

    Every training log entry also gets varpack's metrics of the logging window (:func:`step_metrics`, from
    the collator's ``batch_stats``, all ranks): ``tokens_per_second``, ``tokens_per_step``,
    ``supervised_tokens_per_step``, ``packs_per_step``, ``samples_per_step`` and ``pack_fill``. They go
    through ``Trainer.log``, so every ``report_to`` integration (tensorboard, wandb, ...) records them.

    ``cuda_graphs`` (``varpack sft --cuda-graphs``; the layers compiled by
    :func:`varpack.integrations.cuda_graphs.compile_layers_as_graphs`, static-shape packs): every
    ``training_step`` runs inside :func:`varpack.integrations.cuda_graphs.capture_or_error` (a layer that is
    not captured raises), and ``compute_loss`` moves the batch's boundaries to the device
    (:func:`~varpack.integrations.cuda_graphs.boundaries_on_device`) and begins a CUDA-graph step
    (:func:`~varpack.integrations.cuda_graphs.begin_step`) before the forward.

    ``logging_nan_inf_filter=True`` (Trainer's default, kept by TRL's ``SFTConfig``) makes Trainer read every
    micro-batch's loss on the host (a device sync per step, which leaves the GPU idle while the host prepares
    the next step). :meth:`_init_packed_loss` turns Trainer's check off and :meth:`training_step` applies the
    same filter on the device (:func:`nan_inf_filtered_loss`): the logged loss is the same, without the sync.
    Where this transformers keeps its logging window elsewhere (:data:`FILTER_ON_DEVICE` false) Trainer's own
    check stays.
    """

    def _init_packed_loss(
        self,
        *,
        loss_reduction: str = "token",
        loss_impl: str = "auto",
        packing_length: int | None = None,
        objective: Any = "sft",
        cuda_graphs: bool = False,
    ) -> None:
        self.objective = get_objective(objective) if isinstance(objective, str) else objective
        self.cuda_graphs = bool(cuda_graphs)
        self.loss_reduction = loss_reduction
        self.loss_impl = loss_impl
        self.packing_length = packing_length
        self.model_accepts_loss_kwargs = True  # our compute_loss divides by num_items_in_batch itself
        # Trainer's NaN / inf filter of the logged loss, on the device (class docstring)
        self.nan_inf_filter_on_device = bool(getattr(self.args, "logging_nan_inf_filter", False)) and (
            FILTER_ON_DEVICE
        )
        if self.nan_inf_filter_on_device:
            self.args.logging_nan_inf_filter = False
        self._window = dict.fromkeys(STAT_KEYS, 0)  # batch_stats summed since the previous log (this rank)
        self._window_start: float | None = None  # set by the first micro-batch of a logging window
        self._last_logged_step = 0
        self.loss_impl_used: str | None = None
        self._eval_totals: Any = None  # [loss sum, items] of the evaluation loop running now

    # -- num_items_in_batch for the "sample" reduction --------------------------------------------
    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        own = getattr(self.objective, "own_item_count", False)  # DPO: pairs, whatever the reduction
        if batch_samples and batch_samples[0].get(CP_SHARD) is not None:
            # context-parallel shards: their supervised shifted targets, summed over every rank (each target
            # lies on exactly one rank of its group); Trainer's own count reads `labels`, which shards lack
            if not self.args.average_tokens_across_devices:
                raise ValueError("context parallelism needs average_tokens_across_devices (the global token count)")
            n = sum(self.objective.count_items(b, reduction=self.loss_reduction) for b in batch_samples).to(device)
            if self.args.world_size > 1:
                n = self.accelerator.gather(n.reshape(1)).sum()
            return batch_samples, n
        if (self.loss_reduction == "sample" or own) and batch_samples:
            n = sum(self.objective.count_items(b, reduction="sample") for b in batch_samples)
            n = n.to(device)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                n = self.accelerator.gather(n.reshape(1)).sum()
            num_items = n
        return batch_samples, num_items

    # -- loss --------------------------------------------------------------------------------------
    def _use_linear_ce(self, model: Any) -> bool:
        return self._linear_ce_choice(model)[0]

    def _linear_ce_choice(self, model: Any) -> tuple[bool, str]:
        """``(run the chunked linear CE, why)`` for ``model`` as ``compute_loss`` receives it (Trainer's
        ``model_wrapped``); ``why`` names the setting or the reason ``loss_impl="auto"`` took the logits."""
        if self.loss_impl == "logits":
            return False, "--loss-impl logits"
        unwrapped = self.accelerator.unwrap_model(model)
        if _is_fully_sharded(unwrapped):
            # FSDP2 shards in place: the head's weight is gathered only inside the root module's forward
            if self.loss_impl == "linear_ce":
                raise ValueError(
                    "loss_impl='linear_ce' reads the LM head weight outside the forward, which FSDP2 has "
                    "sharded; use loss_impl='logits' or loss_impl='auto'"
                )
            return False, "loss_impl auto: FSDP2 shards the LM head"
        if getattr(getattr(self, "args", None), "torch_compile", False):
            # transformers compiles the model's forward; the linear CE calls the base model and the head
            # itself, outside that compiled forward, so the compile would never run
            if self.loss_impl == "linear_ce":
                from varpack.train.config import LINEAR_CE_HF_COMPILE_REFUSAL

                raise ValueError(
                    f"loss_impl='linear_ce' with TrainingArguments.torch_compile: {LINEAR_CE_HF_COMPILE_REFUSAL}"
                )
            return False, "loss_impl auto: transformers' own torch_compile compiles the model's forward"
        if self.loss_impl == "linear_ce":
            if unwrapped is not model:
                raise ValueError(
                    "loss_impl='linear_ce' needs an unwrapped model (it calls the base model and the head "
                    "separately); under DDP/FSDP use loss_impl='logits' or loss_impl='auto'"
                )
            return True, "--loss-impl linear_ce"
        if unwrapped is not model:
            return False, f"loss_impl auto: the model is wrapped ({type(model).__name__})"
        from varpack.ops.linear_ce.causal_lm import head_has_adapter, logit_transform

        transform = logit_transform(unwrapped)
        if transform is not None:
            return False, f"loss_impl auto: the model transforms its logits ({transform[0]}={transform[1]})"

        # a LoRA adapter on the head: the logits path (linear CE reads head.weight and would skip it)
        if head_has_adapter(unwrapped):
            return False, "loss_impl auto: a LoRA adapter on the LM head"
        return True, "loss_impl auto"

    def planned_loss_impl(self, model: Any) -> tuple[str, str]:
        """``(impl, why)``: the loss implementation ``compute_loss`` runs for ``model`` (pass Trainer's
        ``model_wrapped``, what ``training_step`` gets once ``train()`` has wrapped it): ``"linear_ce"`` or
        ``"logits"``, from the same decision as every step (an objective with ``supports_linear_ce = False``,
        DPO, always reads the logits). After a step, ``loss_impl_used`` holds what ran."""
        linear, why = self._linear_ce_choice(model)
        if linear and not getattr(self.objective, "supports_linear_ce", True):
            return "logits", f"the {self.objective.name} objective reads the logits"
        return ("linear_ce" if linear else "logits"), why

    def _run_objective(
        self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any, *, linear_ce: bool
    ) -> Any:
        """The objective's :class:`~varpack.train.objectives.base.ObjectiveLoss` of one micro-batch (CUDA-graph
        steps: boundaries on the device and a new graph step first)."""
        if getattr(self, "cuda_graphs", False):
            from varpack.integrations.cuda_graphs import begin_step, boundaries_on_device

            inputs = boundaries_on_device(inputs, self.args.device)
            begin_step()  # the previous micro-batch's graph outputs are consumed (backward and loss done)
        # the linear CE runs the base model itself, past the autocast that accelerate wraps around
        # model.forward under --bf16 / --fp16: without this context that path trained in float32
        with self.accelerator.autocast() if linear_ce else contextlib.nullcontext():
            return self.objective.loss(
                model,
                inputs,
                reduction=self.loss_reduction,
                num_items_in_batch=num_items_in_batch,
                linear_ce=linear_ce,
            )

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        result = self._run_objective(model, inputs, num_items_in_batch, linear_ce=self._use_linear_ce(model))
        loss, outputs, self.loss_impl_used = result.loss, result.outputs, result.impl
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # DDP averages gradients over ranks; the global count already divides by all ranks' items
            loss = loss * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss

    # -- evaluation: one mean over the whole eval set ----------------------------------------------
    def _count_items(self, batch: dict[str, Any]) -> Any:
        """The items ``batch``'s loss averages over (what ``get_batch_samples`` counts for a training step)."""
        own = getattr(self.objective, "own_item_count", False)  # DPO: pairs, whatever the reduction
        return self.objective.count_items(batch, reduction="sample" if own else self.loss_reduction)

    def prediction_step(
        self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: Any = None
    ) -> tuple[Any, Any, Any]:
        """One eval micro-batch: the objective's loss *sum* and item count are added to the eval totals (read by
        :meth:`evaluation_loop`); returns ``(this batch's mean loss, logits, labels)`` as ``Trainer`` expects
        (logits and labels ``None`` with ``prediction_loss_only``; otherwise the loss runs on the logits).

        Trainer's own ``eval_loss`` is the mean of these per-batch means, which weighs a batch of few tokens as
        much as one of many and so depends on how the eval set was packed; :meth:`evaluation_loop` replaces it.
        """
        import torch

        count = self._count_items(inputs)  # CPU batch: no device read
        inputs = self._prepare_inputs(inputs)
        linear_ce = bool(prediction_loss_only) and self._use_linear_ce(model)
        with torch.no_grad(), self.compute_loss_context_manager():
            result = self._run_objective(model, inputs, 1, linear_ce=linear_ce)  # 1: the batch's loss sum
        total = result.loss.detach().to(torch.float64)
        count = torch.as_tensor(count).to(total.device, torch.float64)
        if self._eval_totals is not None:
            self._eval_totals += torch.stack([total, count]).to(self._eval_totals.device)
        mean = (total / count.clamp(min=1.0)).to(torch.float32)
        if prediction_loss_only:
            return mean, None, None
        logits = getattr(result.outputs, "logits", None)
        labels = inputs.get(LABELS)
        return mean, (logits.detach() if logits is not None else None), labels

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: Any = None,
        metric_key_prefix: str = "eval",
    ) -> Any:
        """``Trainer.evaluation_loop``; its ``<prefix>_loss`` becomes the mean over the whole eval set: the sum of
        every batch's loss sum over the sum of their item counts, over all ranks (supervised tokens for
        ``loss_reduction="token"``, samples with a supervised token for ``"sample"``, pairs for DPO), so the
        value does not depend on how the eval set was packed or batched. NaN when the eval set has no item."""
        import torch

        self._eval_totals = torch.zeros(2, dtype=torch.float64, device=self.args.device)
        try:
            output = super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
            totals = self._eval_totals
        finally:
            self._eval_totals = None
        if self.args.world_size > 1:
            totals = self.accelerator.reduce(totals, reduction="sum")
        loss_sum, count = (float(x) for x in totals.tolist())
        output.metrics[f"{metric_key_prefix}_loss"] = loss_sum / count if count > 0 else float("nan")
        return output

    # -- per-step metrics ----------------------------------------------------------------------------
    def training_step(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """Adds the micro-batch's ``batch_stats`` (Python ints from the collator) to the logging window,
        then Trainer's step."""
        if self._window_start is None:
            self._window_start = time.perf_counter()
            self._last_logged_step = self.state.global_step  # the window's steps start here (also on resume)
        stats = inputs.get(BATCH_STATS)
        if stats is not None:
            for key in STAT_KEYS:
                self._window[key] += int(stats[key])
        if getattr(self, "cuda_graphs", False):  # forward and backward: a graph not captured raises
            from varpack.integrations.cuda_graphs import capture_or_error

            with capture_or_error():
                loss = super().training_step(model, inputs, *args, **kwargs)
        else:
            loss = super().training_step(model, inputs, *args, **kwargs)
        if getattr(self, "nan_inf_filter_on_device", False):
            steps = 1 + self.state.global_step - self._globalstep_last_logged
            loss = nan_inf_filtered_loss(loss, self._tr_loss, steps)
        return loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Adds varpack's metrics to a training log entry (one with ``loss``); see :func:`step_metrics`.

        Under several ranks the window counts are summed over ranks here (one all-reduce of 4 integers at a
        logging step, as Trainer's own loss gather; Trainer calls ``log`` on every rank)."""
        now = time.perf_counter()
        if "loss" in logs and self._window_start is not None:
            counts = [self._window[k] for k in STAT_KEYS]
            if self.args.world_size > 1:
                import torch

                total = torch.tensor(counts, dtype=torch.int64, device=self.args.device)
                counts = [int(c) for c in self.accelerator.reduce(total, reduction="sum").tolist()]
            steps = self.state.global_step - self._last_logged_step
            logs.update(
                step_metrics(
                    dict(zip(STAT_KEYS, counts)),
                    steps=steps,
                    seconds=now - self._window_start,
                    packing_length=self.packing_length,
                )
            )
            self._window = dict.fromkeys(STAT_KEYS, 0)
            self._window_start = None
            self._last_logged_step = self.state.global_step
        super().log(logs, *args, **kwargs)


def describe_engine(model: Any, world_size: int, distributed_type: str | None = None) -> str:
    """The data-parallel engine a training run actually uses, in words, e.g. ``"FSDP2 (fully_shard, 29 units)
    on 2 ranks"``, ``"DDP on 2 ranks"``, ``"single process"``.

    Read from the model after the Trainer wrapped it: FSDP2 units are the modules that ``fully_shard`` turned
    into ``FSDPModule`` instances (whoever applied it: ``--fsdp``, ``accelerate launch --use_fsdp --fsdp_version 2``,
    or by hand); otherwise, with several ranks, accelerate's ``distributed_type`` (``MULTI_GPU`` /
    ``MULTI_CPU``: DDP; ``FSDP``: FSDP1) names it (``None``: read from ``accelerate.PartialState``).
    """
    try:
        from torch.distributed.fsdp import FSDPModule

        units = sum(isinstance(m, FSDPModule) for m in model.modules())
    except ImportError:  # pragma: no cover - torch without distributed
        units = 0
    ranks = f"on {world_size} rank{'s' if world_size != 1 else ''}"
    if units:
        return f"FSDP2 (fully_shard, {units} units) {ranks}"
    if world_size <= 1:
        return "single process"
    if distributed_type is None:
        try:
            from accelerate import PartialState

            distributed_type = str(PartialState().distributed_type).rsplit(".", 1)[-1]
        except Exception:  # noqa: BLE001 - accelerate absent or not initialised: say what is known
            distributed_type = "unknown"
    name = {"MULTI_GPU": "DDP", "MULTI_CPU": "DDP", "FSDP": "FSDP1 (accelerate)"}.get(distributed_type)
    return f"{name or distributed_type + ' data parallel'} {ranks}"


def _bar_safe(print_fn: Any) -> Any:
    """``print_fn`` for lines printed while the Trainer's progress bar is drawn: the built-in ``print`` becomes
    ``tqdm.write`` (the line goes above the bar instead of being glued to its end); any other function is kept."""
    if print_fn is not print:
        return print_fn
    from tqdm.auto import tqdm

    return lambda line: tqdm.write(str(line))


class EngineReportCallback(TrainerCallback):
    """Prints :func:`describe_engine` once, on the main process, when training begins (after the Trainer
    and accelerate have wrapped the model), so a run launched with ``torchrun`` or ``accelerate launch``
    says which engine it got."""

    def __init__(self, print_fn: Any = print) -> None:
        self.print_fn = _bar_safe(print_fn)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and model is not None:
            self.print_fn(f"engine    {describe_engine(model, int(args.world_size))}")


def describe_speed(
    choice: Any,
    *,
    loss_impl: str,
    loss_why: str,
    liger: bool = False,
    hf_compile: bool = False,
    static: str | None = None,
    graphs: Any = None,
) -> str:
    """The step configuration of a run in one line (``varpack sft``'s ``speed`` line, without the label):
    how the decoder layers run, which loss implementation, and why, e.g.
    ``"regional torch.compile + chunked linear CE (auto on CUDA: fastest measured, benchmarks/RESULTS.md);
    the first step compiles ...; --torch-compile false to skip"`` or ``"eager + chunked linear CE (auto: CPU
    run; compiled by default on CUDA only)"``.

    Args:
        choice: :class:`varpack.train.config.CompileChoice` (:func:`varpack.train.config.resolve_torch_compile`).
        loss_impl: ``"linear_ce"`` or ``"logits"``, what the loss runs (:meth:`PackedLossMixin.planned_loss_impl`).
        loss_why: its reason (:meth:`PackedLossMixin.planned_loss_impl`); named when the loss runs on the
            logits, and when it is the user's flag (``"--loss-impl linear_ce"``: ``...; loss forced by --loss-impl
            linear_ce``), so a forced implementation never reads as auto's choice.
        liger: Liger-Kernel's layers are on the model.
        hf_compile: transformers' own ``TrainingArguments.torch_compile`` is on (through
            ``extra_training_args``): Trainer compiles the whole model, so the layers are never called eager.
        static: the CUDA-graph step's static shape and its pad cost (``"T=8192 N=207 max_seqlen=504, pad
            segments may be empty (pad 0.6%)"``): the line reads ``"static shapes T=... (pad ...), CUDA graphs
            per layer + chunked linear CE
            (<graphs.reason>); the first steps compile and capture every decoder layer; <graphs.hint>"``.
        graphs: :func:`varpack.train.config.resolve_cuda_graphs`' :class:`~varpack.train.config.CompileChoice`;
            when off, the line ends with ``"; CUDA graphs off (<its reason>)"`` (why this run takes another step).
    """
    from varpack.train.config import COMPILE_COLD_COST

    loss = {"linear_ce": "chunked linear CE", "logits": "CE on the logits"}.get(loss_impl, loss_impl)
    if loss_why.startswith("--loss-impl"):  # the user's flag, not loss_impl auto's choice
        why = f"{choice.reason}; loss forced by {loss_why}"
    else:
        why = choice.reason if loss_impl == "linear_ce" else f"{choice.reason}; logits: {loss_why}"
    if static is not None:
        hint = f"; {graphs.hint}" if graphs is not None and graphs.hint else ""
        return (
            f"static shapes {static}, CUDA graphs per layer + {loss} ({why}); the first steps compile and "
            f"capture every decoder layer{hint}"
        )
    layers = "regional torch.compile" if choice.on else "Liger-Kernel layers" if liger else "eager"
    if hf_compile:
        hf = "transformers' whole-model torch.compile"
        layers = f"regional torch.compile inside {hf}" if choice.on else hf
    tail = [COMPILE_COLD_COST] if choice.on else []
    if choice.hint:
        tail.append(choice.hint)
    if graphs is not None and not graphs.on:
        tail.append(f"CUDA graphs off ({graphs.reason})")
    return f"{layers} + {loss} ({why})" + "".join("; " + t for t in tail)


class SpeedReportCallback(TrainerCallback):
    """Prints ``speed     <describe_speed(...)>`` once, on the main process, when training begins (after the
    engine line): the resolved ``torch_compile`` (:func:`varpack.train.config.resolve_torch_compile`) and the
    loss implementation the steps will run (:meth:`PackedLossMixin.planned_loss_impl` of the wrapped model).
    After the first optimizer step it compares that with the implementation that ran (``loss_impl_used``)
    and prints a ``speed     note: ...`` line if they differ, so a report is never silently wrong."""

    def __init__(
        self,
        trainer: Any,
        choice: Any,
        *,
        liger: bool = False,
        print_fn: Any = print,
        static: str | None = None,
        graphs: Any = None,
    ) -> None:
        self.trainer = trainer
        self.choice = choice
        self.liger = liger
        self.static = static
        self.graphs = graphs
        self.print_fn = _bar_safe(print_fn)
        self.reported: str | None = None
        self.line: str | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        impl, why = self.trainer.planned_loss_impl(self.trainer.model_wrapped)
        self.reported = impl
        hf_compile = bool(getattr(args, "torch_compile", False))
        self.line = describe_speed(
            self.choice,
            loss_impl=impl,
            loss_why=why,
            liger=self.liger,
            hf_compile=hf_compile,
            static=self.static,
            graphs=self.graphs,
        )
        if state.is_world_process_zero:
            self.print_fn(f"speed     {self.line}")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        used = getattr(self.trainer, "loss_impl_used", None)
        if self.reported is None or used is None:
            return
        if used != self.reported and state.is_world_process_zero:
            self.print_fn(f"speed     note: the loss ran as {used}, not {self.reported} as reported above")
        self.reported = None  # checked once


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` (dynamo) has compiled so far in this process (``counters["stats"]
    ["unique_graphs"]``; a recompilation of a layer for a new shape counts once more)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compile_records() -> list[Any]:
    """dynamo's records of its latest frame compilations (``torch._dynamo.utils.get_compilation_metrics``, the
    newest last; each has ``recompile_reason``: the first guard that failed, or None for a first compilation);
    an empty list where this torch has none."""
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:  # pragma: no cover - a torch without compilation metrics
        return []
    return list(get_compilation_metrics())


class CompileCountCallback(TrainerCallback):
    """Counts the graphs ``torch.compile`` compiles while training (:func:`compiled_graphs`, per optimizer step)
    and prints, on the main process when training ends, ``compile   <n> graphs compiled in step 1, <m> after
    it (last in step <s>)``: a step whose shapes were not seen before recompiles, and a steady run compiles
    nothing after its first steps. A recompilation after step 1 is named by the guard that failed (dynamo's
    ``recompile_reason``, e.g. ``tensor 'L['args'][0]' size mismatch at index 1``), up to
    :attr:`MAX_REASONS` distinct ones on a second line ``compile   recompiled (step <s>): <reason>``.
    ``after_first`` / ``last_step`` / ``reasons`` (``[(step, reason)]``) hold the figures."""

    #: distinct recompilation reasons kept (the first ones seen) and printed
    MAX_REASONS = 4
    #: characters of one printed reason
    REASON_CHARS = 300

    def __init__(self, print_fn: Any = print) -> None:
        self.print_fn = _bar_safe(print_fn)
        self.first = 0
        self.after_first = 0
        self.last_step = 0
        self.reasons: list[tuple[int, str]] = []
        self._seen = 0
        self._last_record: Any = None

    def _new_records(self) -> list[Any]:
        """The compilation records appended since the last call (all of them the first time)."""
        records = _compile_records()
        start = 0
        for i in range(len(records) - 1, -1, -1):
            if records[i] is self._last_record:
                start = i + 1
                break
        self._last_record = records[-1] if records else None
        return records[start:]

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._seen = compiled_graphs()
        self.first = self.after_first = self.last_step = 0
        self.reasons = []
        self._new_records()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = compiled_graphs()
        new, self._seen = now - self._seen, now
        records = self._new_records()
        if not new:
            return
        if state.global_step <= 1:
            self.first += new
        else:
            self.after_first += new
            known = {reason for _, reason in self.reasons}
            for record in records:
                reason = getattr(record, "recompile_reason", None)
                if reason and reason not in known and len(self.reasons) < self.MAX_REASONS:
                    self.reasons.append((state.global_step, str(reason)))
                    known.add(reason)
        self.last_step = state.global_step

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        tail = f" (last in step {self.last_step})" if self.after_first else ""
        self.print_fn(
            f"compile   {self.first} graph{'' if self.first == 1 else 's'} compiled in step 1, {self.after_first} "
            f"after it{tail}"
        )
        for step, reason in self.reasons:
            text = " ".join(reason.split())
            if len(text) > self.REASON_CHARS:
                text = text[: self.REASON_CHARS - 3] + "..."
            self.print_fn(f"compile   recompiled (step {step}): {text}")


def _is_fully_sharded(model: Any) -> bool:
    """Whether ``fully_shard`` (FSDP2) has been applied to ``model`` (it changes the module's class in place)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(model, FSDPModule)


class PackSamplingMixin:
    """The training DataLoader of a ``Trainer`` subclass on a :class:`varpack.data.sampler.BalancedPackSampler`
    (``pack_sampler``; the train dataset a ``PackedDataset(..., shuffle=False)``): the DataLoader takes the
    sampler's micro-batches as they are (accelerate's per-rank sharding is switched off, as transformers does
    for its own rank-aware ``BatchRebalanceSampler``), and every checkpoint gets the sampler's state
    (:data:`SAMPLER_STATE_FILE`). ``train(resume_from_checkpoint=...)`` continues through Trainer's own
    fast-forward (it skips the micro-batches of the steps done; the layout is deterministic, so these are
    exactly the packs trained; nothing else skips): the checkpoint's sampler state is checked against this
    run first, and a checkpoint of another world size / packs per step / accumulation is refused, as
    Trainer's step arithmetic would then skip the wrong packs (``BalancedPackSampler.load_state_dict``
    continues such an epoch outside Trainer). Without a sampler, Trainer's own DataLoader.

    Mixed in first (``PackedSFTTrainer``, ``VarpackSFTTrainer``); the subclass calls
    :meth:`_init_pack_sampler` after ``Trainer.__init__``.
    """

    pack_sampler: Any = None

    def _init_pack_sampler(self, sampler: Any) -> None:
        self.pack_sampler = sampler
        if sampler is not None and getattr(self.train_dataset, "shuffle", False):
            raise ValueError(
                "pack_sampler yields plan pack ids and orders the packs itself: build the dataset with "
                "PackedDataset(..., shuffle=False)"
            )

    def get_train_dataloader(self) -> Any:
        """The training DataLoader; with ``pack_sampler`` its micro-batches as this rank's batches."""
        if self.pack_sampler is None:
            return super().get_train_dataloader()
        from functools import partial

        from torch.utils.data import DataLoader
        from transformers.trainer_utils import seed_worker

        a = self.args
        params: dict[str, Any] = dict(
            batch_sampler=self.pack_sampler,
            collate_fn=self.data_collator,
            num_workers=a.dataloader_num_workers,
            pin_memory=a.dataloader_pin_memory,
            persistent_workers=a.dataloader_persistent_workers,
            worker_init_fn=partial(seed_worker, num_workers=a.dataloader_num_workers, rank=a.process_index),
        )
        if a.dataloader_num_workers:
            params.update(prefetch_factor=a.dataloader_prefetch_factor)
        loader = self.accelerator.prepare(DataLoader(self.train_dataset, **params))
        shard = getattr(loader, "batch_sampler", None)  # accelerate's BatchSamplerShard: pass through
        if shard is not None and getattr(shard, "batch_sampler", None) is self.pack_sampler:
            shard.num_processes, shard.process_index = 1, 0
        return loader

    def _packed_eval_loader(self, dataset: Any) -> Any:
        """Under several ranks, the DataLoader of an eval / test :class:`varpack.data.dataset.PackedDataset`:
        its packs dealt to the ranks by a :class:`varpack.data.sampler.BalancedPackSampler` (round-robin,
        ``per_device_eval_batch_size`` packs per rank per batch), every pack on exactly one rank and a rank
        without a pack left given a masked filler pack (it counts nothing), where accelerate's own sharding
        would repeat packs to even the ranks out and so count them twice in the eval loss. The ranks are the
        training pack sampler's (under context parallelism the data-parallel replicas: the ranks of a group get
        the same packs, which the collator shards). ``None``: one process, or not a PackedDataset (Trainer's own
        loader)."""
        from varpack.data.dataset import PackedDataset

        if self.args.world_size <= 1 or not isinstance(dataset, PackedDataset):
            return None
        from torch.utils.data import DataLoader

        from varpack.data.sampler import BalancedPackSampler

        a = self.args
        rank, world = a.process_index, a.world_size
        if self.pack_sampler is not None:
            # the training sampler's ranks: under context parallelism the data-parallel replicas (the ranks of a
            # group get the same packs)
            rank, world = self.pack_sampler.rank, self.pack_sampler.world_size
        sampler = BalancedPackSampler(
            dataset.plan, rank=rank, world_size=world, packs_per_rank=a.per_device_eval_batch_size, balance=False
        )
        loader = self.accelerator.prepare(
            DataLoader(
                dataset,
                batch_sampler=sampler,
                collate_fn=self.data_collator,
                num_workers=a.dataloader_num_workers,
                pin_memory=a.dataloader_pin_memory,
            )
        )
        shard = getattr(loader, "batch_sampler", None)  # accelerate's BatchSamplerShard: pass through
        if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
            shard.num_processes, shard.process_index = 1, 0
        return loader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """Trainer's eval DataLoader; under several ranks a PackedDataset's through
        :meth:`_packed_eval_loader`."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if isinstance(dataset, str):
            dataset = self.eval_dataset[dataset]
        loader = self._packed_eval_loader(dataset)
        return loader if loader is not None else super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """Trainer's test DataLoader (``predict``); under several ranks a PackedDataset's through
        :meth:`_packed_eval_loader`."""
        loader = self._packed_eval_loader(test_dataset)
        return loader if loader is not None else super().get_test_dataloader(test_dataset)

    def _sampler_state(self) -> dict[str, Any]:
        """The sampler's state at Trainer's ``global_step`` (Trainer's own epoch / step arithmetic)."""
        per_epoch = max(1, math.ceil(len(self.pack_sampler) / self.args.gradient_accumulation_steps))
        state = self.pack_sampler.state_dict(consumed_steps=self.state.global_step % per_epoch)
        state["epoch"] = self.state.global_step // per_epoch
        state["global_step"] = self.state.global_step
        return state

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.pack_sampler is not None and self.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            with open(os.path.join(folder, SAMPLER_STATE_FILE), "w") as f:
                json.dump(self._sampler_state(), f)

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; a checkpoint's sampler state is checked first (class docstring)."""
        if self.pack_sampler is not None and resume_from_checkpoint:
            path = resume_from_checkpoint
            if path is True:
                from transformers.trainer_utils import get_last_checkpoint

                path = get_last_checkpoint(self.args.output_dir)
            if isinstance(path, str):
                check_sampler_checkpoint(self.pack_sampler, path)
        return super().train(resume_from_checkpoint, *args, **kwargs)




def make_pack_sampler(
    plan: Any,
    model: Any,
    args: Any,
    *,
    packs_per_rank: int,
    balance: bool = True,
    attention_weight: float | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> Any:
    """This rank's :class:`varpack.data.sampler.BalancedPackSampler` for a Trainer run, after checking that
    every rank planned the same packs with the same layout settings
    (:func:`varpack.train.distributed.check_same_on_all_ranks`).

    Args:
        plan: the train ``PackPlan``.
        model: the model (its config gives the cost model's attention weight when ``attention_weight`` is
            None; a peft model is read through its base model).
        args: the ``TrainingArguments`` (``process_index``, ``world_size``, ``gradient_accumulation_steps``;
            reading them sets up the process group).
        packs_per_rank: packs per rank per micro-batch.
        balance: cost-balanced slots (``False``: round-robin).
        attention_weight: the cost model's weight (default: :func:`varpack.plan.balance.attention_cost_weight`
            of the model's config; 0 where the config does not give it and no slot is balanced by cost:
            one rank, or ``balance`` off).
        rank, world_size: the sampler's rank and rank count (default: the Trainer's process index and world
            size; under context parallelism the data-parallel replica and their count).

    Raises:
        RuntimeError: the ranks' plan / layout fingerprints differ (naming the ranks).
        ValueError: the model's config does not give the attention cost, none was set and the balanced layout
            of several ranks needs it.
    """
    from varpack.data.sampler import BalancedPackSampler
    from varpack.plan.balance import attention_cost_weight
    from varpack.train.distributed import check_same_on_all_ranks

    rank = args.process_index if rank is None else rank
    world_size = args.world_size if world_size is None else world_size
    if attention_weight is None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        try:
            attention_weight = attention_cost_weight(base.config)
        except ValueError:
            if balance and world_size > 1:
                raise
            attention_weight = 0.0  # one rank or round-robin: no slot is balanced by cost
    sampler = BalancedPackSampler(
        plan,
        rank=rank,
        world_size=world_size,
        packs_per_rank=packs_per_rank,
        grad_accum=args.gradient_accumulation_steps,
        attention_weight=attention_weight,
        balance=balance,
    )
    check_same_on_all_ranks(sampler.fingerprint(), what="pack plan and its per-rank layout")
    return sampler


class PackedSFTTrainer(PackSamplingMixin, PackedLossMixin, Trainer):
    """``Trainer`` whose loss comes from a training objective (``objective``, a name of
    :data:`varpack.train.objectives.OBJECTIVES` or an objective object; ``"sft"``: varpack's packed causal-LM
    loss, ``"dpo"``: :class:`varpack.train.objectives.dpo.DPOObjective`) with ``num_items_in_batch``
    (:class:`PackedLossMixin`; the objective's own count when it has ``own_item_count``: DPO's pairs).

    Every training log entry carries varpack's per-step metrics (:func:`step_metrics`).

    ``pack_sampler``: this rank's :class:`varpack.data.sampler.BalancedPackSampler` (:class:`PackSamplingMixin`).
    ``cuda_graphs``: each step as CUDA-graph replays (:class:`PackedLossMixin`; ``varpack sft --cuda-graphs``).
    """

    def __init__(
        self,
        *args: Any,
        loss_reduction: str = "token",
        loss_impl: str = "auto",
        packing_length: int | None = None,
        objective: Any = "sft",
        pack_sampler: Any = None,
        cuda_graphs: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._init_packed_loss(
            loss_reduction=loss_reduction,
            loss_impl=loss_impl,
            packing_length=packing_length,
            objective=objective,
            cuda_graphs=cuda_graphs,
        )
        self._init_pack_sampler(pack_sampler)


#: the file in a Trainer checkpoint folder that holds the pack sampler's state (JSON)
SAMPLER_STATE_FILE = "varpack_sampler.json"


def check_sampler_checkpoint(sampler: Any, checkpoint: str) -> None:
    """Refuse to resume ``checkpoint`` with ``sampler`` unless Trainer's fast-forward will skip exactly the
    packs the checkpoint's steps trained: same plan and cost model (``load_state_dict``'s checks) and the same
    layout (world size, packs per rank, accumulation) for the whole interrupted epoch.

    Raises:
        ValueError: naming the setting that differs.
    """
    path = os.path.join(checkpoint, SAMPLER_STATE_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint {checkpoint} has no {SAMPLER_STATE_FILE}: it was not saved with a pack sampler")
    with open(path) as f:
        state = json.load(f)
    import copy

    copy.copy(sampler).load_state_dict(state)  # plan / cost model / seed checks, on a throwaway copy
    now = [sampler.world_size, sampler.packs_per_rank, sampler.grad_accum]
    other = [s[:3] for s in state["segments"] if s[:3] != now]
    if other:
        W, P, G = other[0]
        raise ValueError(
            f"checkpoint {checkpoint} trained its epoch {state['epoch']} with world_size={W}, packs_per_step={P}, "
            f"grad_accum={G}; this run has world_size={now[0]}, packs_per_step={now[1]}, grad_accum={now[2]}. "
            "Trainer's resume counts steps of the checkpoint's layout: resume with the same settings (or continue "
            "the epoch with BalancedPackSampler.load_state_dict outside Trainer)"
        )


def step_metrics(
    counts: dict[str, int], *, steps: int, seconds: float, packing_length: int | None
) -> dict[str, float]:
    """varpack's metrics of one logging window (the keys a log entry gets; Trainer's integrations show
    them as ``train/<key>``).

    Args:
        counts: the window's summed ``batch_stats`` of all ranks (:data:`STAT_KEYS`: ``packs``, ``samples``,
            ``tokens`` (real tokens, padding excluded), ``supervised_tokens`` (labels != -100)).
        steps: optimizer steps in the window (``>= 1``; 0 is treated as 1).
        seconds: wall-clock time of the window, from its first micro-batch to the log.
        packing_length: tokens per pack; ``None``: no ``pack_fill``.

    Returns:
        ``tokens_per_second`` (``tokens / seconds``), per optimizer step (window mean):
        ``tokens_per_step``, ``supervised_tokens_per_step``, ``packs_per_step``, ``samples_per_step``, and
        ``pack_fill`` = ``tokens / (packs * packing_length)`` (the plan's fill over the window's packs).
    """
    steps = max(1, int(steps))
    out: dict[str, float] = {"tokens_per_second": round(counts["tokens"] / max(seconds, 1e-9), 1)}
    for key in STAT_KEYS:
        out[f"{key}_per_step"] = counts[key] / steps
    if packing_length and counts["packs"]:
        out["pack_fill"] = counts["tokens"] / (counts["packs"] * int(packing_length))
    return out


class TrainCollator:
    """``PaddingFreeCollator`` for the Trainer: adds ``num_packs`` (an int) and ``batch_stats`` (the batch's
    counts as Python ints, :data:`varpack.schema.BATCH_STATS`, read by the per-step logs), both popped before
    the model sees the batch. With ``context_parallel=(cp_rank, cp_size)`` the row is cut to this rank's share
    (:func:`varpack.collate.shard_batch`) after it was counted. The counts are taken here, on the CPU, from the collated row (``varlen_meta``
    offsets and the CPU ``labels``): no device read later. The boundaries travel as the collator built them
    (``varlen_meta``)."""

    def __init__(self, collator: Any, *, context_parallel: tuple[int, int] | None = None) -> None:
        self.collator = collator
        self.context_parallel = context_parallel

    def __call__(self, features: Sequence[Any]) -> dict[str, Any]:
        batch = self.collator(features)
        packs = sum(1 for f in features if isinstance(f, (list, tuple)))
        stats = batch_stats(batch, packs=packs or 1)
        if self.context_parallel is not None:
            # this rank's share of the row (varpack.collate.shard_batch); the row's counts are logged by the
            # group's rank 0 only, so that the counts summed over every rank are the step's
            from varpack.collate import shard_batch

            cp_rank, cp_size = self.context_parallel
            batch = shard_batch(batch, cp_rank, cp_size)
            if cp_rank:
                stats = dict.fromkeys(STAT_KEYS, 0)
        batch["num_packs"] = packs or 1
        batch[BATCH_STATS] = stats
        return batch


def batch_stats(batch: dict[str, Any], *, packs: int) -> dict[str, int]:
    """The counts of one collated padding-free batch (CPU tensors, as the collator returns them).

    Args:
        batch: a :class:`varpack.collate.PaddingFreeCollator` batch: ``sample_ids`` (one entry per sample),
            ``varlen_meta`` (CPU offsets; a trailing padding segment when ``pad_to_multiple_of`` padded the
            row), ``labels`` ``[1, T]`` int64.
        packs: packs in the batch.

    Returns:
        ``{"packs", "samples", "tokens", "supervised_tokens"}`` as ints: ``tokens`` = the samples' tokens
        (``cu_seqlens[num_samples]``, padding excluded), ``supervised_tokens`` = ``labels != -100``; all 0
        for a masked filler pack (samples without ``sample_id``, every label -100).
    """
    samples = len(batch[SAMPLE_IDS])
    if samples and all(s is None for s in batch[SAMPLE_IDS]) and (
        LABELS not in batch or bool((batch[LABELS] == IGNORE_INDEX).all())
    ):
        # a masked filler pack (varpack.data.sampler.MaskedPack): trains nothing, counts nothing
        return dict.fromkeys(STAT_KEYS, 0)
    meta = batch[VARLEN_META]
    tokens = int(meta.cu_seqlens_q[samples])
    supervised = int((batch[LABELS] != IGNORE_INDEX).sum()) if LABELS in batch else 0
    return {"packs": int(packs), "samples": samples, "tokens": tokens, "supervised_tokens": supervised}
