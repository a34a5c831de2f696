"""Keep your TRL script: :class:`VarpackSFTTrainer` is TRL's ``SFTTrainer`` with varpack's packing.

Change one name in a TRL script::

    from trl import SFTConfig
    from varpack.train.trl import VarpackSFTTrainer   # instead of trl.SFTTrainer

    trainer = VarpackSFTTrainer(
        model=model,                                # a model object (any transformers causal LM)
        args=SFTConfig(output_dir="out", max_length=4096, per_device_train_batch_size=1,
                       gradient_checkpointing=False),   # both: CUDA graphs on one GPU ("Speed" below)
        train_dataset=dataset,                      # any dataset SFTTrainer takes: messages, prompt/completion, text,
        processing_class=tokenizer,                 # or already tokenized (input_ids, labels)
    )
    trainer.train()

What changes, and what TRL keeps:

- **Data** -- TRL prepares the dataset as it always does (chat template, ``assistant_only_loss``,
  ``completion_only_loss``, labels; ``_prepare_dataset``), but without truncation: ``max_length`` is the
  *packing length* (as with TRL's ``packing=True``), and a sample longer than it follows varpack's ``overflow``
  policy (``"error"`` by default: nothing is cut silently). A sample, or a piece of ``"truncate"`` /
  ``"split"``, with no supervised token is left out of the packs (it would train nothing: TRL drops such rows
  too); what was cut or left out is logged as a warning with the sample ids (the packing report), and is in
  ``trainer.plan.overflow``. varpack then plans packs of complete samples
  (:func:`varpack.train.sft.plan_samples`, best-fit decreasing) and the trainer trains on a
  :class:`varpack.data.dataset.PackedDataset` (one item = one pack; ``per_device_train_batch_size`` counts
  packs), visited in the plan's per-epoch order, dealt to the ranks by cost under several processes
  (:class:`varpack.data.sampler.BalancedPackSampler`, as ``varpack sft``). Of the prepared columns,
  ``input_ids``, ``labels`` and varpack's token fields (``loss_scale``, ``token_type_ids``, ...) are kept, the
  raw text columns dropped (TRL's collator reads no other column either); each sample's first label becomes
  -100 (it is never a target: the loss shifts it away, and TRL's own padding-free collator does the same); no
  ``labels`` column: labels are ``input_ids`` (TRL's rule).
- **Collation** -- :class:`varpack.collate.PaddingFreeCollator`: one token row per micro-batch with
  ``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx`` and the batch's ``VarlenMeta`` (``pad_to_multiple_of``
  of the ``SFTConfig`` is honoured).
- **Attention** -- the model is put on varpack attention (:func:`varpack.integrations.transformers.enable_varpack`,
  ``attn_backend``) before TRL wraps it (PEFT ``peft_config`` included); its packing guard refuses any call that
  could mix samples.
- **Loss** -- varpack's objective (:class:`varpack.train.trainer.PackedLossMixin`): the packed causal-LM loss
  (``loss_reduction`` ``"token"`` or ``"sample"``; chunked linear cross entropy with ``loss_impl="auto"`` on an
  unwrapped model) divided by transformers' ``num_items_in_batch``; TRL's fused LM head is not used, so TRL's
  ``entropy`` / ``mean_token_accuracy`` / ``num_tokens`` metrics are not logged; varpack logs
  ``tokens_per_second`` and ``pack_fill``.
- **Speed** -- the step ``varpack sft`` runs, chosen per run and printed once at train begin on the main
  process as a ``speed`` line (``trainer.speed_line``; :func:`varpack.train.trainer.describe_speed`), with the
  reason; where CUDA graphs are off it ends with ``CUDA graphs off (<why>; <the settings to change> for them)``,
  and a run with compiled layers ends with their compile count
  (:class:`varpack.train.trainer.CompileCountCallback`):

  1. ``cuda_graphs="auto"`` (default) on one CUDA GPU: every pack padded to one
     :class:`varpack.collate.StaticShape` (the tightest over the train and eval plans; ``trainer.static_shape``),
     each decoder layer compiled whole and replayed as a CUDA graph
     (:func:`varpack.integrations.cuda_graphs.compile_layers_as_graphs`), the chunked linear CE. It falls back
     (the reason on the ``speed`` line) with: a device other than CUDA, several processes, FSDP, DeepSpeed,
     ``gradient_accumulation_steps > 1``, ``per_device_train_batch_size > 1`` (a row of several packs),
     a PEFT model (``peft_config``), ``gradient_checkpointing`` (TRL's default is ``True``),
     ``use_liger_kernel``, a ``torch_compile_backend`` other than inductor, ``loss_impl="logits"``, an
     ``eval_dataset`` with ``per_device_eval_batch_size > 1``, an attention backend outside
     :data:`varpack.train.config.GRAPH_ATTN_BACKENDS`, and the models
     :func:`varpack.integrations.cuda_graphs.model_refusal` names (vision-language, Mamba-2, Gated DeltaNet
     layers whose rule does not resolve to ``fla_hybrid`` on the GPU, float32 weights without ``bf16`` /
     ``fp16``), and an attention that a captured layer would resolve to
     another backend than FlashAttention-4 / ``triton_short`` on this GPU and static shape
     (:func:`varpack.integrations.cuda_graphs.attention_refusal`: e.g. a head dim below 64 on an H200, or FA4
     not installed). ``cuda_graphs=True`` raises ``ValueError`` naming any of
     them; ``cuda_graphs=False`` turns graphs off. So a TRL ``SFTConfig`` gets graphs with
     ``gradient_checkpointing=False, per_device_train_batch_size=1`` (``max_length`` sets the tokens per step).
  2. Otherwise compiled decoder layers (regional ``torch.compile``,
     :func:`varpack.integrations.kernels.compile_layers`) where ``varpack sft --torch-compile auto`` compiles
     them (:func:`varpack.train.config.resolve_torch_compile` on TRL's settings: CUDA, one process or DDP or
     FSDP2, no Liger / PEFT / DeepSpeed / FSDP1), else eager layers. ``compile_layers=False`` keeps them eager, ``compile_layers=True``
     compiles them anyway (any device).
  3. TRL's ``torch_compile=True`` (or a ``torch_compile_backend``) means compiled layers: varpack compiles each
     layer (with that backend) and TRL's Trainer gets ``torch_compile=False``, so transformers never compiles
     the whole model around them (``trainer.args.torch_compile`` is ``False``, as run). ``SFTConfig``'s
     default ``torch_compile=False`` cannot be told from unset, so it does not turn compiled layers off:
     ``compile_layers=False`` does. ``torch_compile_mode`` is refused (varpack picks the mode).
  4. ``use_liger_kernel=True`` asks for fused layers. Liger-Kernel's layers are never compiled
     (:data:`varpack.integrations.kernels.LIGER_COMPILE_REFUSAL`), so where the step above compiles the
     layers (CUDA graphs, or regional compile: inductor fuses the same RMSNorm / RoPE / SwiGLU) they take the
     place of Liger's, neither TRL nor ``Trainer.train`` applies Liger (``trainer.args.use_liger_kernel`` and
     ``trainer.liger_applied`` are ``False``, as run), and the ``speed`` line says so; where the layers stay
     eager, ``Trainer.train`` applies Liger's (eager Liger layers + the linear CE). With ``torch_compile=True`` or ``compile_layers=True`` it is refused. ``bf16=True`` (float32 master weights
     under autocast) runs every step above.
  5. No host sync per step: ``logging_nan_inf_filter=True`` (TRL's default) runs on the device
     (:class:`varpack.train.trainer.PackedLossMixin`: the same logged loss, ``trainer.args.logging_nan_inf_filter``
     reads ``False`` and ``trainer.nan_inf_filter_on_device`` ``True``), and on CUDA the pinned batches are
     copied without blocking (:func:`varpack.train.trainer.non_blocking_copies`;
     ``trainer.args.accelerator_config.non_blocking`` is ``True``, as run). The user's ``args`` object is not
     changed.

Refused, with the setting named (each would mix samples, cut them, or train another loss): a model given by
name (load it first: TRL would load it on another attention), ``packing=True`` / ``eval_packing=True`` (TRL's
packer on top of varpack's), ``padding_free=True`` (TRL's collator), a ``data_collator`` that is not varpack's,
``compute_loss_func``, ``loss_type`` other than ``"nll"``, ``label_smoothing_factor``, a
``train_sampling_strategy`` that reorders by length (packs are already balanced), ``neftune_noise_alpha``
(transformers scales NEFTune's noise by the row length, a pack's), ``truncation_mode="keep_end"`` with
``overflow="truncate"`` (varpack keeps the start), ``use_liger_kernel=True`` off CUDA, vision datasets, iterable
datasets, context / sequence parallelism (they drop the boundaries), and ``evaluate(eval_dataset=...)`` with a
dataset not packed at construction. Refused as well: ``fp16=True`` on the CPU (accelerate runs no float16
autocast there, so it would train in float32 while set to fp16; ``bf16=True`` runs).

Source of the TRL behaviour: trl 1.16 ``trl/trainer/sft_trainer.py`` (``SFTTrainer.__init__``,
``_prepare_dataset``, ``compute_loss``, ``DataCollatorForLanguageModeling``).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Literal

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "varpack.train.trl needs TRL >= 1.16: pip install 'varpack[trl]' (or pip install trl)"
    ) from exc

from varpack.schema import IGNORE_INDEX, INPUT_IDS, LABELS, LENGTH, SAMPLE_ID, TOKEN_FIELDS
from varpack.train.config import CPU_FP16_REFUSAL, NEFTUNE_REFUSAL
from varpack.train.trainer import (
    CompileCountCallback,
    PackedLossMixin,
    PackEpochCallback,
    PackSamplingMixin,
    SpeedReportCallback,
    TrainCollator,
    describe_speed,
    make_pack_sampler,
    non_blocking_copies,
)

__all__ = ["VarpackSFTTrainer", "samples_from_trl"]

logger = logging.getLogger(__name__)

#: ``train_sampling_strategy`` values that reorder items by length (meaningless for packs, and they read
#: ``input_ids`` of a dataset row, which a pack is not).
_LENGTH_SAMPLERS = ("group_by_length", "batch_rebalance")


def _refuse(setting: str, why: str) -> ValueError:
    return ValueError(f"VarpackSFTTrainer: {setting} -- {why}")


def check_conversations(dataset: Any, name: str) -> None:
    """Refuse a chat that would train nothing useful, as ``varpack sft`` refuses it, before TRL prepares the
    rows: an assistant answer that is empty (TRL would train its end-of-turn token alone) and a chat without an
    assistant turn (TRL reports it as a chat-template problem). Roles and content types are left to TRL and the
    model's chat template (a ``developer`` role, list-of-parts content). Only a ``datasets.Dataset`` with a
    ``messages`` column is read (its ``messages`` column alone); other datasets are left to TRL.

    Raises:
        ValueError: ``"VarpackSFTTrainer: train_dataset, sample 3: messages[1].content is empty ..."`` or
            ``"... sample 3: no assistant message to supervise (roles: [...])"``, for the first such row.
    """
    import datasets

    from varpack.data.chat import require_answers

    if not isinstance(dataset, datasets.Dataset) or "messages" not in dataset.column_names:
        return
    for i, messages in enumerate(dataset.select_columns(["messages"])["messages"]):
        if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):  # else TRL's errors name it
            require_answers(messages, f"VarpackSFTTrainer: {name}, sample {i}")


def _check_args(args: Any, kwargs: dict[str, Any]) -> None:
    """Refuse TRL settings that would mix samples, cut them, or train another loss (module docstring)."""
    if args.packing:
        raise _refuse(
            "packing=True",
            "TRL's own packer (pack_dataset) would run on top of varpack's planner; set packing=False: varpack "
            "packs complete samples with max_length (or packing_length=) as the packing length",
        )
    if args.eval_packing:
        raise _refuse(
            "eval_packing=True", "TRL's own packer; set eval_packing=False (varpack packs eval data)"
        )
    if args.padding_free:
        raise _refuse(
            "padding_free=True",
            "that is TRL's padding-free collator; varpack's PaddingFreeCollator already collates every "
            "micro-batch into one row with its boundaries: set padding_free=False",
        )
    if args.loss_type != "nll":
        raise _refuse(
            f"loss_type={args.loss_type!r}", "varpack's loss is the causal-LM NLL; use loss_type='nll'"
        )
    if args.label_smoothing_factor:
        raise _refuse(
            f"label_smoothing_factor={args.label_smoothing_factor}",
            "varpack's packed loss has no label smoothing; set it to 0",
        )
    if args.train_sampling_strategy in _LENGTH_SAMPLERS:
        raise _refuse(
            f"train_sampling_strategy={args.train_sampling_strategy!r}",
            "items are packs already balanced by the planner; use 'random' or 'sequential'",
        )
    if args.neftune_noise_alpha is not None:
        raise _refuse(
            f"neftune_noise_alpha={args.neftune_noise_alpha}",
            NEFTUNE_REFUSAL + "; leave it unset",
        )
    if args.use_liger_kernel and _device_type(args) != "cuda":
        raise _refuse(
            "use_liger_kernel=True",
            f"Liger-Kernel's kernels are Triton GPU kernels; this run trains on {_device_type(args)}",
        )
    if args.fp16 and _device_type(args) == "cpu":
        raise _refuse("fp16=True", CPU_FP16_REFUSAL)
    if args.torch_compile_mode not in (None, "default"):
        raise _refuse(
            f"torch_compile_mode={args.torch_compile_mode!r}",
            "varpack compiles each decoder layer itself (default mode; with cuda_graphs, mode "
            "'reduce-overhead' on static-shape packs); leave torch_compile_mode unset",
        )
    if kwargs.get("compute_loss_func") is not None:
        raise _refuse(
            "compute_loss_func", "the loss is varpack's packed objective (loss_reduction=, loss_impl=)"
        )
    collator = kwargs.get("data_collator")
    if collator is not None:
        from varpack.collate import PaddingFreeCollator

        inner = collator.collator if isinstance(collator, TrainCollator) else collator
        if not isinstance(inner, PaddingFreeCollator):
            raise _refuse(
                f"data_collator={type(collator).__name__}",
                "a collator that is not varpack's PaddingFreeCollator would not carry the pack boundaries; "
                "leave data_collator unset",
            )


def _device_type(args: Any) -> str:
    """The device type the run trains on (``TrainingArguments.device.type``: ``"cuda"``, ``"cpu"``, ...)."""
    return args.device.type


def _checkpointing(args: Any, model: Any) -> bool:
    """Activation (gradient) checkpointing asked by ``args`` or already on ``model`` (transformers 5 names it
    ``activation_checkpointing``; ``gradient_checkpointing`` is its older alias)."""
    asked = getattr(args, "activation_checkpointing", None)
    if asked is None:
        asked = getattr(args, "gradient_checkpointing", False)
    on = getattr(model, "is_activation_checkpointing", None)
    if on is None:
        on = getattr(model, "is_gradient_checkpointing", False)
    return bool(asked or on)


def _base_model(model: Any) -> Any:
    """The transformers model inside a PEFT wrapper (``get_base_model``), else ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _joined_plans(plans: list[Any]) -> Any:
    """One plan-like object (``offsets`` ``[P+1]``, ``item_lengths`` ``[I]``) holding every pack of ``plans``:
    what :meth:`varpack.collate.StaticShape.from_plan` reads to fit them all."""
    import types

    import numpy as np

    if len(plans) == 1:
        return plans[0]
    offsets, lengths, items = [np.zeros(1, dtype=np.int64)], [], 0
    for plan in plans:
        item_lengths = np.asarray(plan.item_lengths, dtype=np.int64)
        offsets.append(np.asarray(plan.offsets, dtype=np.int64)[1:] + items)
        lengths.append(item_lengths)
        items += item_lengths.size
    return types.SimpleNamespace(offsets=np.concatenate(offsets), item_lengths=np.concatenate(lengths))


def samples_from_trl(dataset: Any, *, name: str = "train") -> Any:
    """A TRL-prepared (tokenized) ``datasets.Dataset`` as varpack encoded samples.

    Keeps ``input_ids``, ``labels`` (``input_ids`` when absent, TRL's rule) and varpack's token fields
    (:data:`varpack.schema.TOKEN_FIELDS`), drops the other columns (raw ``messages`` / ``prompt`` /
    ``completion`` / ``text``, TRL's masks, already folded into ``labels``), sets each sample's first label to
    -100 (never a target of a causal LM) and adds ``length`` and ``sample_id`` (the row index).

    Returns:
        ``datasets.Dataset`` with ``input_ids`` / ``labels`` list[int] ``[L]``, ``length`` int, ``sample_id``
        int, and any token fields that were present.

    Raises:
        TypeError: ``dataset`` is not a ``datasets.Dataset`` (an ``IterableDataset`` cannot be planned: the
            planner needs every length first).
        ValueError: no ``input_ids`` column (naming ``name``), a sample with no tokens (naming it), or
            TRL's ``completion_mask`` / ``assistant_masks`` without ``labels`` (preparation skipped).
    """
    import datasets

    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(
            f"VarpackSFTTrainer: the {name} dataset is a {type(dataset).__name__}; varpack plans packs from "
            "every sample's length, so it needs a datasets.Dataset (not an IterableDataset)"
        )
    columns = dataset.column_names
    if INPUT_IDS not in columns:
        raise ValueError(
            f"VarpackSFTTrainer: the prepared {name} dataset has no 'input_ids' column: {columns}"
        )
    masks = [c for c in ("completion_mask", "assistant_masks") if c in columns]
    if LABELS not in columns and masks:
        # TRL folds these masks into labels while preparing; a dataset that skipped preparation
        # (dataset_kwargs={"skip_prepare_dataset": True}) would train on every token (TRL refuses it too)
        raise ValueError(
            f"VarpackSFTTrainer: the {name} dataset has mask columns {masks} but no 'labels', and TRL's "
            "preparation (which folds them into labels) was skipped: it would train on every token. Add a "
            "'labels' column (-100 for tokens without loss) or drop skip_prepare_dataset"
        )
    keep = [c for c in columns if c in TOKEN_FIELDS or c == SAMPLE_ID]
    dataset = dataset.select_columns(keep)
    has_labels = LABELS in keep
    has_ids = SAMPLE_ID in keep

    def _to_sample(row: dict[str, Any], idx: int) -> dict[str, Any]:
        ids = row[INPUT_IDS]
        if len(ids) == 0:
            raise ValueError(
                f"VarpackSFTTrainer: sample {idx} of the {name} dataset has no tokens ('input_ids')"
            )
        labels = list(row[LABELS] if has_labels else ids)
        labels[0] = IGNORE_INDEX
        out = {LABELS: labels, LENGTH: len(ids)}
        if not has_ids:
            out[SAMPLE_ID] = idx
        return out

    return dataset.map(_to_sample, with_indices=True, desc=f"varpack: {name} samples")


class VarpackSFTTrainer(PackSamplingMixin, PackedLossMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` with varpack's planning, padding-free collation, varlen attention and loss.

    Takes every argument of ``trl.SFTTrainer`` (``model`` must be a model object, ``args`` a
    ``trl.SFTConfig``), plus:

    Args:
        packing_length: tokens per pack (default: ``args.max_length``, TRL's packing length).
        packing_strategy: varpack's planner (``"bfd"`` best-fit decreasing, ``"sequential"``).
        overflow: a sample longer than ``packing_length``: ``"error"`` (default), ``"drop"``, ``"truncate"``,
            ``"split"`` (:func:`varpack.plan.plan_packs`).
        loss_reduction: ``"token"`` (global token mean) or ``"sample"`` (global mean of per-sample means).
        loss_impl: ``"auto"`` / ``"logits"`` / ``"linear_ce"`` (:class:`varpack.train.trainer.PackedSFTTrainer`).
        attn_backend: varpack attention backend for :func:`varpack.integrations.transformers.enable_varpack`.
        rank_balance: under several ranks, packs of near-equal cost per rank in every micro-batch
            (:class:`varpack.data.sampler.BalancedPackSampler`, as ``varpack sft``); every pack once per
            epoch either way.
        attention_cost_weight: the cost model's weight of ``sum L_i^2`` (default: from the model's config).
        cuda_graphs: ``"auto"`` (default): static shapes + CUDA-graph layers wherever they run exactly (module
            docstring, "Speed"); ``True``: those or an error; ``False``: never.
        compile_layers: ``"auto"`` (default): compiled decoder layers where ``varpack sft`` compiles them, or
            when ``args.torch_compile``; ``True`` / ``False``: always / never (``False`` also rules out graphs).

    Attributes (after construction): ``plan`` (the train ``PackPlan``), ``samples`` (the encoded train samples),
    ``train_dataset`` (a :class:`varpack.data.dataset.PackedDataset`), ``cuda_graphs`` (bool: the step runs
    as CUDA graphs), ``static_shape`` (the :class:`varpack.collate.StaticShape` every pack is padded to, or
    ``None``), ``graph_choice`` / ``step_choice`` (:class:`varpack.train.config.CompileChoice` s: static shapes
    + CUDA graphs / compiled layers, on or not, the reason, the hint), ``speed_line`` (str, the ``speed`` line).

    Raises:
        ValueError / TypeError: conflicting TRL settings (see the module docstring), naming the setting;
            ``cuda_graphs=True`` with a setting or model it does not run exactly, naming it;
            ``torch_compile=True`` / ``compile_layers=True`` with ``use_liger_kernel=True``;
            the planner's errors (an overlong sample with ``overflow="error"``, naming it); a model whose
            config sets attention dropout (naming its key:
            :func:`varpack.integrations.transformers.refuse_attention_dropout`).
    """

    def __init__(
        self,
        model: Any,
        args: Any = None,
        *,
        packing_length: int | None = None,
        packing_strategy: str = "bfd",
        overflow: str = "error",
        loss_reduction: str = "token",
        loss_impl: str = "auto",
        attn_backend: str = "auto",
        rank_balance: bool = True,
        attention_cost_weight: float | None = None,
        cuda_graphs: bool | Literal["auto"] = "auto",
        compile_layers: bool | Literal["auto"] = "auto",
        **kwargs: Any,
    ) -> None:
        from varpack.collate import PaddingFreeCollator
        from varpack.integrations.transformers import (
            enable_varpack,
            is_varpack_attention,
            refuse_attention_dropout,
        )

        if isinstance(model, str):
            raise _refuse(
                f"model={model!r}",
                "pass a model object (varpack.models.load_model(...) or AutoModelForCausalLM.from_pretrained(...)); "
                "TRL would load the name on an attention implementation that ignores pack boundaries",
            )
        if not isinstance(args, SFTConfig):
            raise TypeError(f"VarpackSFTTrainer needs args=trl.SFTConfig(...), got {type(args).__name__}")
        for name, value in (("cuda_graphs", cuda_graphs), ("compile_layers", compile_layers)):
            if not (value is True or value is False or value == "auto"):
                raise _refuse(f"{name}={value!r}", "give True, False or 'auto'")
        _check_args(args, kwargs)
        if overflow == "truncate" and getattr(args, "truncation_mode", "keep_start") == "keep_end":
            raise _refuse(
                "truncation_mode='keep_end' with overflow='truncate'",
                "varpack's truncate keeps the start of an overlong sample; use overflow='split' (every token "
                "trained, in pieces) or 'error', or truncation_mode='keep_start'",
            )
        if cuda_graphs is True and compile_layers is False:
            raise _refuse("cuda_graphs=True with compile_layers=False", "CUDA graphs replay the compiled layers")
        packing_length = packing_length if packing_length is not None else args.max_length
        if packing_length is None:
            raise _refuse(
                "max_length=None", "give SFTConfig(max_length=...) or packing_length= (tokens per pack)"
            )
        train = kwargs.get("train_dataset")
        first = next(iter(train), None) if train is not None else {}
        if first is None:
            raise _refuse("train_dataset", "it has no rows; there is nothing to pack")
        if "image" in first or "images" in first:
            raise _refuse(
                "a vision dataset", "TRL prepares images on the fly; varpack's TRL path is text-only"
            )
        check_conversations(train, "train_dataset")
        evals = kwargs.get("eval_dataset")
        for key, ds in (evals.items() if isinstance(evals, dict) else [("", evals)]):
            check_conversations(ds, f"eval_dataset[{key!r}]" if key else "eval_dataset")

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if not is_varpack_attention(getattr(base.config, "_attn_implementation", None)):
            enable_varpack(base, backend=attn_backend)
        refuse_attention_dropout(base, "VarpackSFTTrainer")
        base.config.use_cache = False

        # TRL prepares the data (tokenize, labels) but must not truncate: max_length is the packing length.
        trl_args = copy.copy(args)
        trl_args.max_length = None
        # TRL's torch_compile becomes varpack's compiled layers (below): transformers must not compile the
        # whole model around them
        trl_args.torch_compile, trl_args.torch_compile_backend = False, None
        # TRL's use_liger_kernel=True asks for fused layers: where the step compiles the layers (CUDA graphs or
        # regional compile, fused by inductor) they take the place of Liger-Kernel's, which are never compiled;
        # where it does not, Liger's are applied after the step is chosen (module docstring, "Speed")
        liger_mapped = bool(args.use_liger_kernel) and compile_layers == "auto" and not args.torch_compile
        if liger_mapped:
            trl_args.use_liger_kernel = False
        trl_args.accelerator_config = non_blocking_copies(args)
        self.packing_settings = dict(
            packing_length=int(packing_length), strategy=packing_strategy, overflow=overflow, seed=args.seed
        )
        pad_id = kwargs.pop("pad_token_id", None)
        processing_class = kwargs.get("processing_class")
        if pad_id is None and processing_class is not None:
            tok = getattr(processing_class, "tokenizer", processing_class)
            pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        kwargs["data_collator"] = kwargs.get("data_collator") or TrainCollator(
            PaddingFreeCollator(pad_token_id=pad_id or 0, pad_to_multiple_of=args.pad_to_multiple_of)
        )
        super().__init__(model, trl_args, **kwargs)
        # the user's settings (max_length as given) are what the run records, with transformers' whole-model
        # compile off as it ran (the user's torch_compile is in step_choice's reason)
        self.args = copy.copy(args)
        self.args.torch_compile, self.args.torch_compile_backend = False, None
        self.args.accelerator_config = trl_args.accelerator_config

        parallel = self.accelerator.parallelism_config
        if parallel is not None and (parallel.cp_enabled or getattr(parallel, "sp_enabled", False)):
            raise _refuse(
                "context / sequence parallelism",
                "it shards the packed row and drops the per-sample boundaries; varpack runs data parallel only",
            )

        # the pack sampler orders the packs (per epoch) and deals them to the ranks
        self.samples, self.plan, self.train_dataset = self._pack(self.train_dataset, "train", shuffle=False)
        sampler = make_pack_sampler(
            self.plan,
            model,
            args,
            packs_per_rank=args.per_device_train_batch_size,
            balance=rank_balance,
            attention_weight=attention_cost_weight,
        )
        self._init_pack_sampler(sampler)
        self.add_callback(PackEpochCallback(self.train_dataset, sampler))
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {k: self._pack(v, k, shuffle=False)[2] for k, v in self.eval_dataset.items()}
        elif self.eval_dataset is not None:
            self.eval_dataset = self._pack(self.eval_dataset, "eval", shuffle=False)[2]
        self.loss_impl = loss_impl  # read by the step choice (the fused linear CE of the graph step)
        self.static_shape = self.static_pad = None
        step_args = args
        if liger_mapped:
            step_args = copy.copy(args)
            step_args.use_liger_kernel = False
        self.graph_choice, self.step_choice = self._choose_step(step_args, cuda_graphs, compile_layers)
        # Trainer.train() applies Liger's layers when self.args.use_liger_kernel is set
        self.liger_applied = bool(args.use_liger_kernel)
        if liger_mapped and self.step_choice.on:
            note = "use_liger_kernel=True: varpack's compiled layers in place of Liger-Kernel's (never compiled)"
            self.step_choice = self.step_choice._replace(reason=f"{self.step_choice.reason}; {note}")
            self.args.use_liger_kernel = self.liger_applied = False  # as run
        self._init_packed_loss(
            loss_reduction=loss_reduction,
            loss_impl=loss_impl,
            packing_length=int(packing_length),
            cuda_graphs=self.graph_choice.on,
        )
        self._speed = SpeedReportCallback(
            self,
            self.step_choice,
            liger=self.liger_applied,
            static=self.static_shape.describe(self.static_pad) if self.graph_choice.on else None,
            graphs=self.graph_choice,
        )
        self.add_callback(self._speed)
        if self.step_choice.on:  # the graphs compiled in step 1 and after it, printed at the end
            self.add_callback(CompileCountCallback())

    # -- the step: CUDA graphs, compiled layers or eager (module docstring, "Speed") --------------------------
    def _graph_conflict(self, args: Any, compile_layers: Any) -> tuple[str, str, str | None] | None:
        """The first setting under which this run's layers cannot run as CUDA graphs, as ``(setting, why, fix)``
        (``fix``: the settings that would allow them, every conflicting one, or ``None``), or ``None`` when they
        can."""
        import torch

        from varpack.integrations import cuda_graphs
        from varpack.integrations.cuda_graphs import model_refusal
        from varpack.train.config import GRAPH_ATTN_BACKENDS

        base = _base_model(self.model)
        device = _device_type(args)
        state = getattr(base, "_varpack_state", None)
        backend = state.backend if state is not None else None
        evals = self.eval_dataset is not None
        checks: list[tuple[bool, str, str, str | None]] = [
            (compile_layers is False, "compile_layers=False", "CUDA graphs replay the compiled layers", None),
            (device != "cuda", f"a {device} run", "CUDA graphs need a CUDA GPU", None),
            (
                args.world_size > 1,
                f"{args.world_size} processes",
                "captured layers under DDP are neither tested nor measured",
                None,
            ),
            (self.is_fsdp_enabled, "FSDP", "sharded units around captured layers are not tested", None),
            (self.is_deepspeed_enabled, "DeepSpeed", "captured layers under it are not tested", None),
            (
                args.gradient_accumulation_steps != 1,
                f"gradient_accumulation_steps={args.gradient_accumulation_steps}",
                "a step's graph outputs may be overwritten by the next micro-batch's replay before the "
                "gradients are accumulated",
                "gradient_accumulation_steps=1",
            ),
            (
                args.per_device_train_batch_size != 1,
                f"per_device_train_batch_size={args.per_device_train_batch_size}",
                "the static shape is one pack's; a row of several packs would need another",
                "per_device_train_batch_size=1 (a larger max_length packs more tokens per step)",
            ),
            (
                hasattr(self.model, "get_base_model"),
                "a PEFT model (peft_config)",
                "peft adapters inside graph-captured layers are not tested",
                None,
            ),
            (
                _checkpointing(args, base),
                "gradient_checkpointing=True",
                "recomputation inside captured layers is not tested",
                "gradient_checkpointing=False",
            ),
            (
                bool(args.use_liger_kernel),
                "use_liger_kernel=True",
                "Liger-Kernel's layers are not compiled",
                "use_liger_kernel=False",
            ),
            (
                args.torch_compile_backend not in (None, "inductor"),
                f"torch_compile_backend={args.torch_compile_backend!r}",
                "CUDA-graph trees are inductor's",
                None,
            ),
            (
                self.loss_impl == "logits",
                "loss_impl='logits'",
                "the measured graph step runs the fused linear CE",
                "loss_impl='auto'",
            ),
            (
                evals and args.per_device_eval_batch_size != 1,
                f"an eval_dataset with per_device_eval_batch_size={args.per_device_eval_batch_size}",
                "an eval row of several packs does not fit the one-pack static shape",
                "per_device_eval_batch_size=1",
            ),
            (
                backend not in GRAPH_ATTN_BACKENDS,
                f"attention backend {backend!r}",
                "captured layers need one that launches without reading cu_seqlens on the host and has a "
                "backward through varpack's custom op: " + ", ".join(GRAPH_ATTN_BACKENDS),
                "attn_backend='auto'",
            ),
        ]
        failing = [(setting, why, fix) for bad, setting, why, fix in checks if bad]
        if failing:
            # the first conflict is named; the fix lists every setting to change (None: one has no fix)
            fixes = [fix for _, _, fix in failing]
            setting, why, _ = failing[0]
            return setting, why, None if None in fixes else ", ".join(fixes)
        reason = model_refusal(base, autocast=bool(args.bf16 or args.fp16), device=args.device)
        if reason is not None:
            return reason, "", "bf16=True" if reason.startswith("float32") else None
        # the backend a captured layer would resolve to, for this model on this GPU and the static shape
        shape = self._static_shape()[0]
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else next(base.parameters()).dtype
        attn, reason, note = cuda_graphs.graph_attention(
            base,
            backend=backend,
            device=self.args.device,
            dtype=dtype,
            max_seqlen=shape.max_seqlen,
        )
        if reason is not None:
            return reason, "", None
        self._graph_attention = (attn, note)  # triton_short in place of auto's choice: applied with the graphs
        return None

    def _choose_step(self, args: Any, cuda_graphs: Any, compile_layers: Any) -> tuple[Any, Any]:
        """``(graphs, layers)``: two :class:`varpack.train.config.CompileChoice` s of this run, static shapes +
        CUDA graphs and compiled decoder layers (``on``, the ``speed`` line's reason, its hint), as
        ``varpack sft`` decides them (:func:`varpack.train.config.resolve_cuda_graphs`, then
        :func:`~varpack.train.config.resolve_torch_compile`) on TRL's settings; applied to the model (static
        shapes + graph layers, regional compile, or nothing).

        Raises:
            ValueError: ``cuda_graphs=True`` with a conflicting setting (named); ``torch_compile=True`` or
                ``compile_layers=True`` with ``use_liger_kernel=True``.
        """
        from varpack.integrations.kernels import LIGER_COMPILE_REFUSAL
        from varpack.train.config import GRAPHS_AUTO_REASON, CompileChoice, resolve_torch_compile
        from varpack.train.config import SFTConfig as VarpackConfig

        base = _base_model(self.model)
        device = _device_type(args)
        hf_compile = bool(args.torch_compile)
        # TRL's torch_compile=True asks for compiled layers (SFTConfig's default False cannot be told from unset)
        compile_given = compile_layers if compile_layers != "auto" else (True if hf_compile else "auto")
        if compile_given is True and args.use_liger_kernel:
            setting = "compile_layers=True" if compile_layers is True else "torch_compile=True"
            raise _refuse(f"{setting} with use_liger_kernel=True", LIGER_COMPILE_REFUSAL)
        mapped = "torch_compile=True: varpack's compiled layers (transformers' whole-model compile off)"
        conflict = None if cuda_graphs is False else self._graph_conflict(args, compile_layers)
        if cuda_graphs is True and conflict is not None:
            setting, why, fix = conflict
            if not why:  # a model / attention reason, complete in itself
                why = f"set {fix}" if fix else "cuda_graphs='auto' runs the next fastest step"
            raise _refuse(f"cuda_graphs=True with {setting}", why)
        if cuda_graphs is not False and conflict is None:
            self._use_static_shape()
            from varpack.integrations import cuda_graphs as graphs_module

            attn, note = getattr(self, "_graph_attention", (None, None))
            if note is not None:  # the captured layers' attention in place of auto's (graph_attention)
                from varpack.integrations.transformers import enable_varpack
                from varpack.models.registry import is_gated_delta_layer

                # the Gated DeltaNet layers keep the rule they were patched with (refused above if mixed)
                rules = {getattr(m, "_varpack_gdn_backend", "auto") for m in base.modules() if is_gated_delta_layer(m)}
                enable_varpack(base, backend=attn, linear_backend=rules.pop() if len(rules) == 1 else "auto")
            graphs_module.compile_layers_as_graphs(
                base, device=self.args.device, what=f"VarpackSFTTrainer(cuda_graphs={cuda_graphs!r})"
            )
            also = f"; {note}" if note is not None else ""
            if cuda_graphs is True:
                graphs = CompileChoice(True, "cuda_graphs=True" + also)
            else:
                graphs = CompileChoice(True, GRAPHS_AUTO_REASON + also, "cuda_graphs=False for dynamic shapes")
            # the layers are compiled for the graphs: their reason is the graphs'
            return graphs, graphs._replace(reason=graphs.reason + (f"; {mapped}" if hf_compile else ""))

        if cuda_graphs is False:
            graphs = CompileChoice(False, "cuda_graphs=False")
        elif device != "cuda":  # first: nothing else matters on another device
            graphs = CompileChoice(False, f"auto: {device.upper()} run; CUDA graphs need a CUDA GPU")
        else:
            setting, why, fix = conflict
            reason = f"auto: {setting}: {why}" if why else f"auto: {setting}"
            graphs = CompileChoice(False, reason + (f"; {fix} for them" if fix else ""))
        if compile_given is True:
            why = "compile_layers=True" + (f"; {mapped}" if hf_compile else "")
            layers = CompileChoice(True, why if compile_layers is True else mapped)
        elif compile_given is False:
            layers = CompileChoice(False, "compile_layers=False")
        else:  # varpack sft's rule for its --torch-compile auto, on TRL's settings
            config = VarpackConfig(
                torch_compile="auto",
                cuda_graphs=False,
                use_liger_kernel=bool(args.use_liger_kernel),
                lora=hasattr(self.model, "get_base_model"),
                # TRL's FSDP / DeepSpeed settings (accelerate's environment is read by the rule itself)
                extra_training_args={
                    "fsdp": args.fsdp,
                    "fsdp_config": args.fsdp_config or {},
                    "deepspeed": args.deepspeed or self.is_deepspeed_enabled,
                },
            )
            auto = resolve_torch_compile(config, device=device, world_size=args.world_size)
            reason = auto.reason.replace("--use-liger-kernel", "use_liger_kernel=True")
            reason = reason.replace("--lora", "a PEFT model")
            hint = ""
            if auto.hint:  # the keyword that chooses otherwise (none on a CPU, or beside Liger)
                hint = "compile_layers=False to skip" if auto.on else "compile_layers=True to compile anyway"
            layers = CompileChoice(auto.on, reason, hint)
        if layers.on:
            from varpack.integrations.kernels import compile_layers as compile_each_layer

            compile_each_layer(base, backend=args.torch_compile_backend or "inductor")
        return graphs, layers

    def _static_shape(self, attn: str | None = None) -> tuple[Any, Any]:
        """``(StaticShape, collator)``: the tightest :class:`varpack.collate.StaticShape` that holds every train
        and eval pack (:meth:`StaticShape.from_plan`, rounded to ``pad_to_multiple_of`` when set; with the
        captured layers' attention ``attn``, zero-length pad segments where
        :func:`varpack.integrations.cuda_graphs.static_shape_for` gives them) and the
        :class:`varpack.collate.PaddingFreeCollator` that would pad to it."""
        from varpack.collate import PaddingFreeCollator, StaticShape
        from varpack.integrations.cuda_graphs import static_shape_for

        collator = self.data_collator
        inner = collator.collator if isinstance(collator, TrainCollator) else collator
        if not isinstance(inner, PaddingFreeCollator):  # pragma: no cover - refused by _check_args
            raise TypeError(f"static shapes need varpack's PaddingFreeCollator, not {type(inner).__name__}")
        evals = self.eval_dataset
        evals = list(evals.values()) if isinstance(evals, dict) else [] if evals is None else [evals]
        plans = [self.plan, *(d.plan for d in evals)]
        plan, multiple = _joined_plans(plans), inner.pad_to_multiple_of
        if attn is None:
            return StaticShape.from_plan(plan, multiple_of=multiple), inner
        return static_shape_for(plan, _base_model(self.model), attn, multiple_of=multiple), inner

    def _use_static_shape(self) -> None:
        """Pad every pack of the run to :meth:`_static_shape`'s shape; ``static_shape`` / ``static_pad`` (pad
        tokens / tokens over the train plan) are set. The graph step uses it; on its own it is the same training,
        padded (tests)."""
        attn = getattr(self, "_graph_attention", (None, None))[0]  # the captured layers' attention, once chosen
        self.static_shape, inner = self._static_shape(attn)
        self.static_pad = self.static_shape.pad_fraction(self.plan)
        inner.pad_to_multiple_of = None  # the static shape's token count is rounded to it already
        inner.static_shape = self.static_shape

    @property
    def speed_line(self) -> str:
        """The ``speed`` line (without its label) printed at train begin on the main process
        (:func:`varpack.train.trainer.describe_speed`): how the decoder layers run, the loss, and why. Before
        ``train()`` it is computed for the model as it is now (unwrapped)."""
        if self._speed.line is not None:
            return self._speed.line
        impl, why = self.planned_loss_impl(self.model_wrapped)
        return describe_speed(
            self.step_choice,
            loss_impl=impl,
            loss_why=why,
            liger=self._speed.liger,
            static=self._speed.static,
            graphs=self.graph_choice,
        )

    def _pack(self, dataset: Any, name: str, *, shuffle: bool) -> tuple[Any, Any, Any]:
        """``(samples, plan, PackedDataset)`` of a TRL-prepared dataset."""
        from varpack.data.dataset import PackedDataset
        from varpack.train.sft import plan_samples

        samples = samples_from_trl(dataset, name=name)
        lengths, plan = plan_samples(samples, data_label=f"the {name} dataset", **self.packing_settings)
        ov = plan.overflow
        if ov["overlong_ids"] or ov["empty_ids"] or ov["unsupervised_ids"] or ov["unsupervised_pieces"]:
            # what was cut or left out, by sample id (TRL drops fully masked rows too, and says so)
            from varpack.plan.report import plan_summary, summary_text

            logger.warning(summary_text(plan_summary(plan, lengths, data=f"the {name} dataset")))
        return samples, plan, PackedDataset(samples, plan, shuffle=shuffle)

    def evaluate(self, eval_dataset: Any = None, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``SFTTrainer.evaluate`` on the eval packs built at construction (``eval_dataset`` may name one of
        them, a key of the dict given at construction).

        Raises:
            ValueError: a dataset object not packed at construction (it would be prepared by TRL, unpacked).
        """
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            raise _refuse(
                "evaluate(eval_dataset=<dataset>)",
                "pass eval_dataset= at construction so varpack packs it, then evaluate() or evaluate('<name>')",
            )
        return super().evaluate(eval_dataset, *args, **kwargs)
