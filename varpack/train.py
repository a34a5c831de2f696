"""Supervised fine-tuning with padding-free packing through Hugging Face ``Trainer`` (``varpack sft``).

Pipeline (ARCHITECTURE.md): chat data -> :func:`varpack.data.chat.encode_dataset` (cached) ->
:func:`varpack.plan.plan_packs` -> :class:`varpack.data.dataset.PackedDataset` (one item = one pack) ->
:class:`varpack.collate.PaddingFreeCollator` (the packs of one micro-batch become ONE row with
``cu_seq_lens_q/k``) -> a model on varpack attention (:func:`varpack.integrations.transformers.enable_varpack`)
-> :func:`varpack.loss.causal_lm_loss` (or the chunked linear cross entropy of :mod:`varpack.ops.linear_ce`, which
never builds the ``[T, V]`` logits).

Sampling. The Trainer visits the dataset sequentially (``train_sampling_strategy="sequential"``); the order
of the packs is the plan's per-epoch permutation (``PackPlan.pack_order(epoch)``), switched every epoch by
:class:`PackEpochCallback` (and by accelerate's ``DataLoaderShard.set_epoch``, which forwards to the dataset).
Under ``torchrun`` / ``accelerate launch`` accelerate shards the batches of packs across ranks (rank r takes
micro-batches r, r + W, ...), so every rank trains on its own share of packs; with ``even_batches`` (the
default) the last step of an epoch may repeat up to W - 1 packs so that all ranks step together.

Loss. ``loss_reduction="token"``: the global token mean of the optimizer step, with transformers'
``num_items_in_batch`` (supervised tokens of all accumulation micro-batches, summed over ranks when
``average_tokens_across_devices``); ``"sample"``: the global sample mean, ``num_items_in_batch`` then counting
samples with a supervised token (see :mod:`varpack.loss`). Either way a step with gradient accumulation has
the gradient of one big batch.

Host syncs. Boundaries are built on the CPU by the collator and stay there (:class:`HostBoundaries`: the
guard validates them for free, the attention copies them once per batch), ``max_length_*`` are Python ints, the loss and
the sample counts stay on the device, and ``logging_nan_inf_filter`` is off (it reads the loss every step):
varpack adds no host sync per step; Trainer reads the loss at logging steps only.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback

from varpack.data.load import load_and_encode

# format_packing_report: the packing report now lives in varpack.plan.report; re-exported here for callers
from varpack.plan.report import format_packing_report, plan_summary, summary_text
from varpack.schema import BOOKKEEPING_BATCH_KEYS, IGNORE_INDEX, NOT_MODEL_INPUTS
from varpack.train_config import SFTConfig, default_lr

__all__ = [
    "HostBoundaries",
    "PackEpochCallback",
    "PackedSFTTrainer",
    "SFTConfig",
    "TrainCollator",
    "build_sft",
    "encode_chat_data",
    "format_packing_report",
    "run_sft",
]


def _unwrap_boundaries(inputs: dict[str, Any]) -> dict[str, Any]:
    holder = inputs.get("host_boundaries")
    if holder is None:
        return inputs
    out = {k: v for k, v in inputs.items() if k != "host_boundaries"}
    out.update(holder.tensors)
    return out


def encode_chat_data(data: Sequence[str] | str | None, tokenizer: Any, *, num_proc: int | None = None) -> Any:
    """Encode chat data files (or the built-in chats when ``data`` is empty / None) with ``tokenizer``.

    Kept for users' code: the samples of :func:`varpack.data.load_and_encode` (the loader ``varpack sft``
    uses).

    Returns:
        ``datasets.Dataset`` with ``input_ids``, ``labels``, ``length``, ``sample_id`` (cached as Arrow); for
        files of image/video chats, the list of dicts of :func:`varpack.data.multimodal.encode_any`.

    Raises:
        ValueError / TypeError / FileNotFoundError: bad paths or rows (naming the sample and field).
    """
    return load_and_encode(data, tokenizer, num_proc=num_proc).samples


# ---------------------------------------------------------------------------------------------------------
# Trainer pieces
# ---------------------------------------------------------------------------------------------------------
class PackEpochCallback(TrainerCallback):
    """Calls ``dataset.set_epoch(epoch)`` at the start of every epoch: the plan's per-epoch pack order."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        epoch = int(math.floor((state.epoch or 0.0) + 1e-6))
        self.dataset.set_epoch(epoch)


class PackedSFTTrainer(Trainer):
    """``Trainer`` whose loss is varpack's packed causal-LM loss with ``num_items_in_batch``.

    Also logs ``tokens_per_second`` (real tokens of the packed rows, all ranks) and ``pack_fill``
    (real tokens / (packs x packing_length)) averaged since the previous log.
    """

    def __init__(
        self,
        *args: Any,
        loss_reduction: str = "token",
        loss_impl: str = "auto",
        packing_length: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
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
            from varpack.loss import count_loss_items_tensor

            n = sum(
                count_loss_items_tensor(b["labels"], reduction="sample", seq_idx=b["seq_idx"])
                for b in batch_samples
            )
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
        from varpack.loss import causal_lm_loss

        inputs = _unwrap_boundaries(inputs)
        labels = inputs["labels"]
        num_packs = inputs.get("num_packs")
        if self._window_start is None:
            self._window_start = time.perf_counter()
        self._window_tokens += int(labels.shape[-1])
        if num_packs is not None and self.packing_length:
            self._window_slots += int(num_packs) * int(self.packing_length)
        outputs = None
        if self._use_linear_ce(model):
            from varpack.ops.linear_ce import causal_lm_forward_with_linear_ce

            batch = {k: v for k, v in inputs.items() if k not in BOOKKEEPING_BATCH_KEYS}
            loss = causal_lm_forward_with_linear_ce(
                model, batch, reduction=self.loss_reduction, num_items_in_batch=num_items_in_batch
            )
            self.loss_impl_used = "linear_ce"
        else:
            model_inputs = {k: v for k, v in inputs.items() if k not in NOT_MODEL_INPUTS}
            outputs = model(**model_inputs)
            loss = causal_lm_loss(
                outputs.logits,
                labels,
                reduction=self.loss_reduction,
                seq_idx=inputs.get("seq_idx"),
                num_items_in_batch=num_items_in_batch,
                loss_scale=inputs.get("loss_scale"),
            )
            self.loss_impl_used = "logits"
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


# ---------------------------------------------------------------------------------------------------------
# building a run
# ---------------------------------------------------------------------------------------------------------
def unsupervised_pieces(
    encoded: Any, plan: Any, *, ignore_index: int = IGNORE_INDEX
) -> list[tuple[int, int, int, int]]:
    """Pieces of truncated / split samples that keep no supervised token (e.g. a long prompt cut away from
    its answer): ``[(piece_id, sample_id, start, stop), ...]``. They train nothing, so the packing report
    names them. A piece's first label becomes ``ignore_index`` when it is cut, so it is not counted."""
    out: list[tuple[int, int, int, int]] = []
    for pid, (sid, start, stop) in sorted(plan.pieces.items()):
        labels = np.asarray(encoded[int(sid)]["labels"][int(start) : int(stop)])
        if not (labels[1:] != ignore_index).any():
            out.append((int(pid), int(sid), int(start), int(stop)))
    return out


@dataclass
class SFTRun:
    """What :func:`build_sft` assembled: ready to ``trainer.train()``."""

    config: SFTConfig
    model: Any
    tokenizer: Any
    encoded: Any
    plan: Any
    dataset: Any
    trainer: Any
    report: str
    history: list[dict[str, float]] = field(default_factory=list)
    #: ``"random-init"`` / ``"pretrained"`` when ``config.lr`` was left to :func:`default_lr` (``config.lr``
    #: then holds the rate chosen), ``None`` when it was given.
    lr_default_kind: str | None = None
    #: whether ``config.output_dir`` did not exist before this run (``Trainer`` creates it)
    created_output_dir: bool = False


def build_sft(config: SFTConfig, *, model: Any = None, tokenizer: Any = None, encoded: Any = None) -> SFTRun:
    """Encode, plan, and build the model, dataset, collator and Trainer of a packed SFT run.

    Args:
        config: the run settings.
        model, tokenizer, encoded: optional pre-built objects (tests, notebooks); default: loaded from
            ``config.model`` / ``config.data``.

    ``config.lr=None`` is resolved here to :func:`varpack.train_config.default_lr` of ``config.model`` (the
    returned ``run.config`` holds the rate used, ``run.lr_default_kind`` the model kind it was chosen for).
    ``Trainer`` creates ``config.output_dir`` (``run.created_output_dir`` says whether it was new).

    Raises:
        ValueError: bad settings, data, or overlong samples with ``overflow="error"``.
    """
    from transformers import TrainingArguments

    from varpack.collate import PaddingFreeCollator
    from varpack.data.dataset import PackedDataset
    from varpack.integrations.transformers import enable_varpack
    from varpack.models import load_model, load_tokenizer_for
    from varpack.plan import plan_packs

    def _load() -> Any:
        return load_model(
            config.model,
            dtype=getattr(torch, config.dtype),
            seed=config.seed,
            attn_backend=config.attn_backend,
        )

    if config.use_liger_kernel:  # refused before minutes of encoding, not at the first forward
        from varpack.integrations.kernels import LIGER_COMPILE_REFUSAL, liger_available

        if config.torch_compile:
            raise ValueError(LIGER_COMPILE_REFUSAL)

        if not liger_available():
            raise ValueError("use_liger_kernel needs Liger-Kernel: pip install liger-kernel")
        if not torch.cuda.is_available():
            raise ValueError(
                "use_liger_kernel needs a CUDA GPU (Liger-Kernel's kernels are Triton GPU kernels); "
                "this machine has none"
            )
    lr_default_kind = None
    if config.lr is None:
        lr, lr_default_kind = default_lr(config.model)
        config = replace(config, lr=lr)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer_for(config.model)
    data_label = ", ".join(config.data) if config.data else "built-in chats"
    if encoded is None:
        from varpack.integrations.vision import is_vl_model

        if not config.data:  # a vision-language model without --data: the built-in image-caption chats
            model = model if model is not None else _load()
        loaded = [model]

        def _rope_model() -> Any:  # loaded only for image/video chats (mRoPE positions, patch grid)
            if loaded[0] is None:
                loaded[0] = _load()
            return loaded[0]

        source = load_and_encode(
            config.data,
            tokenizer,
            vl=not config.data and is_vl_model(model),
            rope_model=_rope_model,
            num_proc=config.num_proc,
        )
        model, encoded, data_label = loaded[0], source.samples, source.source
        if not config.data and source.paths:
            config = replace(config, data=source.paths)
    if hasattr(encoded, "with_format"):
        lengths = np.asarray(encoded.with_format("numpy")["length"], dtype=np.int64)
    else:
        lengths = np.asarray([s.get("length", len(s["input_ids"])) for s in encoded], dtype=np.int64)
    plan = plan_packs(
        lengths,
        config.packing_length,
        strategy=config.packing_strategy,
        overflow=config.overflow,
        seed=config.seed,
    )
    if plan.num_packs == 0:  # training would do nothing and save the untrained model as if it had trained
        ov = plan.overflow
        gone = ", ".join(str(i) for i in (ov["dropped_ids"] + ov["empty_ids"])[:20])
        raise ValueError(
            f"no pack to train on: all {plan.num_samples} samples of {data_label} were dropped or empty "
            f"(sample ids {gone}{', ...' if len(ov['dropped_ids']) + len(ov['empty_ids']) > 20 else ''}); "
            f"raise packing_length={config.packing_length} or use overflow='split' or overflow='truncate'"
        )
    if plan.pieces and not hasattr(encoded, "with_format"):
        # image/video chats: refuse before training (not when the bad pack is reached) any split/truncate
        # piece that would cut through a placeholder span; the same check as `varpack plan`
        from varpack.data.multimodal import check_plan_cuts

        bad = check_plan_cuts(encoded, plan.pieces)
        if bad:
            shown = "; ".join(
                f"piece {b['piece_id']} = sample {b['sample_id']} [{b['start']}, {b['stop']})" for b in bad[:20]
            )
            raise ValueError(
                f"{len(bad)} piece(s) of overlong samples would cut through an image or video ({shown}); "
                "use overflow='drop' or a larger packing_length"
            )
    dataset = PackedDataset(encoded, plan)
    report = summary_text(
        plan_summary(plan, lengths, data=data_label),
        unsupervised=unsupervised_pieces(encoded, plan) if plan.pieces else None,
    )
    if model is None:
        model = _load()
    else:
        enable_varpack(model, backend=config.attn_backend)
    model.config.use_cache = False
    if config.use_liger_kernel or config.torch_compile:
        from varpack.integrations.kernels import apply_liger_kernels, compile_layers

        if config.use_liger_kernel:
            apply_liger_kernels(model)
        if config.torch_compile:
            compile_layers(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    collator = TrainCollator(PaddingFreeCollator(pad_token_id=pad_id))
    args_kw: dict[str, Any] = dict(
        output_dir=config.output_dir,
        per_device_train_batch_size=config.packs_per_step,
        gradient_accumulation_steps=config.grad_accum,
        num_train_epochs=config.epochs,
        max_steps=config.max_steps,
        learning_rate=config.lr,
        lr_scheduler_type=config.lr_scheduler,
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        logging_steps=config.logging_steps,
        logging_first_step=True,
        logging_nan_inf_filter=False,
        save_strategy="no",
        report_to=config.report_to,
        remove_unused_columns=False,
        train_sampling_strategy="sequential",
        dataloader_num_workers=config.dataloader_num_workers,
        bf16=config.bf16,
        seed=config.seed,
        dataloader_pin_memory=torch.cuda.is_available(),
        disable_tqdm=False,
    )
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun / accelerate launch on CPUs: transformers needs use_cpu to set up a (gloo) process group
        args_kw.update(use_cpu=True, ddp_backend="gloo")
    elif not torch.cuda.is_available() and config.bf16:
        args_kw.update(use_cpu=True)  # transformers refuses bf16 without a GPU unless told to run on the CPU
    if config.gradient_checkpointing:  # the flag is renamed in newer transformers; pass it only when used
        args_kw["gradient_checkpointing"] = True
    args_kw.update(config.extra_training_args)
    training_args = TrainingArguments(**args_kw)
    created_output_dir = not os.path.exists(training_args.output_dir)
    trainer = PackedSFTTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=[PackEpochCallback(dataset)],
        loss_reduction=config.loss_reduction,
        loss_impl=config.loss_impl,
        packing_length=config.packing_length,
    )
    return SFTRun(
        config=config,
        model=model,
        tokenizer=tokenizer,
        encoded=encoded,
        plan=plan,
        dataset=dataset,
        trainer=trainer,
        report=report,
        lr_default_kind=lr_default_kind,
        created_output_dir=created_output_dir,
    )


def run_sft(config: SFTConfig, *, print_fn: Any = print, **build_kw: Any) -> SFTRun:
    """Build and train a packed SFT run; print the packing report first and a summary at the end.

    The report names the learning rate and, when ``config.lr`` was left to the default, the model kind it
    was chosen for (:data:`varpack.train_config.DEFAULT_LR`). An output directory this run created is removed
    again when nothing was saved into it (``save=False``, or training failed).

    Returns:
        The :class:`SFTRun`; ``run.history`` holds the Trainer's log entries (``loss``, ``tokens_per_second``,
        ``pack_fill``, ...); ``run.config`` the settings used (``lr`` resolved).
    """
    run = build_sft(config, **build_kw)
    config = run.config
    try:
        if run.trainer.is_world_process_zero():
            print_fn(run.report)
            n_params = sum(p.numel() for p in run.model.parameters())
            print_fn(
                f"model     {config.model} ({type(run.model).__name__}, {n_params / 1e6:.1f}M params, "
                f"attention {run.model.config._attn_implementation}, loss {config.loss_reduction} mean)"
            )
            print_fn(f"optimizer {_describe_lr(run)}")
        run.trainer.train()
        run.history = [h for h in run.trainer.state.log_history if "loss" in h]
        if config.save:
            run.trainer.save_model(config.output_dir)
            if run.trainer.is_world_process_zero():
                run.tokenizer.save_pretrained(config.output_dir)
    finally:
        if run.created_output_dir:
            _remove_if_empty(config.output_dir)
    if run.trainer.is_world_process_zero() and run.history:
        first, last = run.history[0]["loss"], run.history[-1]["loss"]
        print_fn(
            f"done: {run.trainer.state.global_step} steps, loss {first:.4f} -> {last:.4f}"
            + (f"; saved to {os.path.abspath(config.output_dir)}" if config.save else "")
        )
    return run


def _describe_lr(run: SFTRun) -> str:
    """``AdamW, peak lr 0.003 (default for a random-init model), constant schedule, 0 warm-up steps``."""
    from varpack.train_config import DEFAULT_LR

    c = run.config
    if run.lr_default_kind is None:
        source = "set"
    else:
        other = "pretrained" if run.lr_default_kind == "random-init" else "random-init"
        source = f"default for a {run.lr_default_kind} model; {other}: {DEFAULT_LR[other]:g}"
    return (
        f"AdamW, peak lr {c.lr:g} ({source}), {c.lr_scheduler} schedule, {c.warmup_steps} warm-up steps, "
        f"weight decay {c.weight_decay:g}"
    )


def _remove_if_empty(path: str) -> None:
    """Remove the directory ``path`` if it exists and holds nothing (never deletes a file)."""
    try:
        os.rmdir(path)
    except OSError:  # not empty, already gone, or not ours to remove
        pass


def config_dict(config: SFTConfig) -> dict[str, Any]:
    """``SFTConfig`` as a JSON-ready dict."""
    return asdict(config)
