"""Build and run a packed SFT job (``varpack sft``): :func:`build_sft`, :func:`run_sft`.

Pipeline (ARCHITECTURE.md): chat data -> :func:`varpack.data.chat.encode_dataset` (cached) ->
:func:`varpack.plan.plan_packs` -> :class:`varpack.data.dataset.PackedDataset` (one item = one pack) ->
:class:`varpack.collate.PaddingFreeCollator` (the packs of one micro-batch become ONE row with
``cu_seq_lens_q/k``) -> a model on varpack attention (:func:`varpack.integrations.transformers.enable_varpack`)
-> the objective's loss (:mod:`varpack.train.objectives`; SFT: :func:`varpack.loss.causal_lm_loss`, or the chunked linear cross entropy of :mod:`varpack.ops.linear_ce`, which
never builds the ``[T, V]`` logits).

Sampling. Each rank's micro-batches come from :class:`varpack.data.sampler.BalancedPackSampler` (built by
:func:`pack_sampler`): the plan's per-epoch permutation (``PackPlan.pack_order(epoch)``, switched every epoch
by :class:`varpack.train.trainer.PackEpochCallback` and Trainer), and under ``torchrun`` / ``accelerate
launch`` every micro-batch slot's packs dealt to the ranks by cost (:mod:`varpack.plan.balance`: tokens +
attention's sum of squared lengths), every pack once per epoch; when the packs do not fill the last slot, a
rank without a pack runs a masked filler pack (no loss, no gradient). Every rank builds the plan and checks
its fingerprint against the others' before training. A planned run's checkpoints carry the sampler's state
(``varpack_sampler.json``). A streamed run (no plan) is sharded by accelerate (rank r takes micro-batches
r, r + W, ...).

Loss. ``loss_reduction="token"``: the global token mean of the optimizer step, with transformers'
``num_items_in_batch`` (supervised tokens of all accumulation micro-batches, summed over ranks when
``average_tokens_across_devices``); ``"sample"``: the global sample mean, ``num_items_in_batch`` then counting
samples with a supervised token (see :mod:`varpack.loss`). Either way a step with gradient accumulation has
the gradient of one big batch.

CUDA graphs. ``cuda_graphs`` (``auto`` by default: on where it runs exactly on one CUDA GPU,
:func:`varpack.train.config.resolve_cuda_graphs`) pads every pack to the static shape of the whole plan
(:meth:`varpack.collate.StaticShape.from_plan`), compiles each decoder layer whole for it and replays it as a CUDA
graph (:mod:`varpack.integrations.cuda_graphs`), with the fused linear CE: on one H200 (Qwen3-0.6B shape,
packing_length 8192, benchmarks/RESULTS.md) 75 ms/step vs 141 ms for dynamic shapes + regional compile (1.9x) and
187 ms for the best HF peer; at 16,384 142 vs 165 vs 224 ms. ``auto`` falls back with the reason where it is not
shown to work; ``True`` is refused there (:func:`varpack.train.config.check_cuda_graphs`).

Host syncs. Boundaries are built and validated once on the CPU by the collator, as the batch's
:class:`varpack.varlen.VarlenMeta`, which Trainer's device placement leaves alone (one host-to-device copy per
batch, kept on it, read by every layer), ``max_length_*`` are Python ints, the loss and the sample counts stay on the device, and
``logging_nan_inf_filter`` is off (it reads the loss every step; given as an extra training argument it runs
on the device, :class:`varpack.train.trainer.PackedLossMixin`), and on CUDA the pinned batches are copied to
the device without blocking (:func:`varpack.train.trainer.non_blocking_copies`): varpack adds no host sync per
step; Trainer reads the loss at logging steps only (measure it: benchmarks/profile_sft.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from varpack.data.load import load_and_encode
from varpack.plan.report import plan_summary, summary_text
from varpack.train.config import (
    DEFAULT_DPO_LR,
    DEFAULT_LR,
    CompileChoice,
    SFTConfig,
    check_context_parallel,
    check_cuda_graphs,
    check_fp16_device,
    check_precision,
    check_training_arguments,
    default_lr,
    resolve_cuda_graphs,
    resolve_torch_compile,
)
from varpack.train.config_file import CONFIG_FILE_NAME, write_config_file
from varpack.train.reporting import RunReportCallback
from varpack.train.trainer import (
    CompileCountCallback,
    EngineReportCallback,
    PackedSFTTrainer,
    PackEpochCallback,
    SpeedReportCallback,
    TrainCollator,
    non_blocking_copies,
)

__all__ = [
    "ContextParallelRun",
    "SFTRun",
    "build_sft",
    "config_dict",
    "encode_chat_data",
    "plan_samples",
    "run_sft",
    "training_arguments",
]


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
    #: :func:`varpack.train.config.resolve_torch_compile`'s decision (``config.torch_compile`` then holds
    #: its ``on``), with the reason ``varpack sft``'s ``speed`` line prints
    compile_choice: Any = None
    #: :func:`varpack.train.config.resolve_cuda_graphs`' decision, turned off with the model's reason where
    #: :func:`varpack.integrations.cuda_graphs.model_refusal` refuses it (``config.cuda_graphs`` holds its ``on``)
    graph_choice: Any = None
    #: ``(backend, why)`` of the Gated DeltaNet layers on the training device
    #: (:func:`varpack.integrations.gated_delta.linear_attention_backend`; ``varpack sft``'s ``linear`` line),
    #: ``None`` for a model without them
    gated_delta: tuple[str, str] | None = None
    #: the :class:`varpack.collate.StaticShape` every pack is padded to (``cuda_graphs`` / ``static_shapes``),
    #: else ``None``
    static_shape: Any = None
    #: pad tokens / tokens run over the whole plan in ``static_shape`` (:meth:`StaticShape.pad_fraction`)
    static_pad: float | None = None
    #: the run's :class:`ContextParallelRun` (``context_parallel > 1``), else ``None``
    context_parallel: Any = None


#: how ``varpack sft`` names fp16 mixed precision (it comes only through ``--extra-training-args``)
FP16_SETTING = "--extra-training-args '{\"fp16\": true}' (TrainingArguments.fp16=True)"


def _accelerator_available() -> bool:
    """Whether torch sees an accelerator that ``TrainingArguments`` would train on (``torch.accelerator``, torch
    2.6 and later; CUDA before)."""
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator.is_available() if accelerator is not None else torch.cuda.is_available())


def build_sft(
    config: SFTConfig,
    *,
    model: Any = None,
    tokenizer: Any = None,
    encoded: Any = None,
    static_shapes: bool = False,
) -> SFTRun:
    """Encode, plan, and build the model, dataset, collator and Trainer of a packed SFT run.

    Args:
        config: the run settings.
        model, tokenizer, encoded: optional pre-built objects (tests, notebooks); default: loaded from
            ``config.model`` / ``config.data``.
        static_shapes: pad every pack to ``StaticShape.from_plan(plan)`` (``run.static_shape``) without CUDA
            graphs: the collation ``config.cuda_graphs`` implies, on its own (any device; the CPU tests check it
            against the dynamic-shape run). Not with ``streaming`` (no plan).

    ``config.lr=None`` is resolved here to :func:`varpack.train.config.default_lr` of ``config.model`` (the
    returned ``run.config`` holds the rate used, ``run.lr_default_kind`` the model kind it was chosen for).
    ``config.torch_compile="auto"`` likewise to :func:`varpack.train.config.resolve_torch_compile` of the
    Trainer's device and world size (``run.config.torch_compile`` holds ``True`` / ``False``,
    ``run.compile_choice`` the reason).
    ``Trainer`` creates ``config.output_dir`` (``run.created_output_dir`` says whether it was new).
    ``config.cuda_graphs`` is resolved by :func:`varpack.train.config.resolve_cuda_graphs` on the Trainer's device
    and world size, then against the model (:func:`varpack.integrations.cuda_graphs.model_refusal`): ``"auto"``
    falls back with the reason (``run.graph_choice``), ``True`` is refused (also checked before the data is
    encoded, :func:`varpack.train.config.check_cuda_graphs`); ``run.config.cuda_graphs`` holds the resolved
    ``True`` / ``False``. On, it pads every pack to ``StaticShape.from_plan(plan)``
    (``run.static_shape``, ``run.static_pad``), compiles the layers for CUDA graphs
    (:func:`varpack.integrations.cuda_graphs.compile_layers_as_graphs`) and has the Trainer run each step as
    CUDA-graph replays (:class:`varpack.train.trainer.PackedLossMixin`).
    ``config.gated_delta_backend`` is checked on the Trainer's device (``run.gated_delta`` holds the backend of
    a Qwen3.5 / Qwen3-Next model's linear-attention layers and why); a forced one is checked before the data
    is encoded too, against the model (loaded early then) and this machine's device.

    Steps: refuse impossible kernel settings (before minutes of encoding), resolve the learning rate, load
    and encode the data, plan the packs, prepare the model, then the Trainer.

    Raises:
        ValueError: bad settings, data, or overlong samples with ``overflow="error"``; ``cuda_graphs`` where
            it is refused (``--cuda-graphs ...``, naming the setting); a forced
            ``gated_delta_backend`` for a model without Gated DeltaNet layers, or one that cannot run on the
            training device (``gated_delta_backend='fla_hybrid': gated delta rule backend 'fla_hybrid' cannot
            run on cpu: ...``); ``bf16`` with a ``dtype`` other than float32
            (:func:`varpack.train.config.check_precision`); fp16 mixed precision (``extra_training_args``
            ``fp16``) on the CPU, where accelerate does not run it (:func:`varpack.train.config.check_fp16_device`);
            an ``lr_scheduler`` or ``extra_training_args`` key transformers does not know
            (:func:`varpack.train.config.check_training_arguments`).
    """
    from varpack.collate import PaddingFreeCollator
    from varpack.data.dataset import PackedDataset
    from varpack.models import load_tokenizer_for

    _refuse_kernel_settings(config)
    check_precision(config)  # --bf16 with --dtype bfloat16 / float16
    extra = config.extra_training_args
    if extra.get("fp16"):  # the device TrainingArguments will pick; checked again below on the Trainer's device
        on_cpu = bool(extra.get("use_cpu")) or not _accelerator_available()
        check_fp16_device(True, "cpu" if on_cpu else "accelerator", setting=FP16_SETTING)
    # before minutes of encoding; checked again below on the Trainer's device and world size
    check_cuda_graphs(
        config,
        device="cuda" if torch.cuda.is_available() else "cpu",
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
    )
    if config.cuda_graphs is True and model is None and config.dtype == "float32" and not config.bf16:
        # the model is loaded in config.dtype: float32 training, refused before minutes of encoding (a model
        # object passed in is checked by its parameters' dtype in _prepare_model)
        raise ValueError(_GRAPHS_FLOAT32)
    check_context_parallel(config, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    if static_shapes and config.streaming:
        raise ValueError(
            "static_shapes: the static shape is read from the whole plan, which --streaming lacks"
        )
    if config.objective == "dpo" and (config.loss_impl == "linear_ce" or config.loss_reduction == "sample"):
        bad = "loss_impl" if config.loss_impl == "linear_ce" else "loss_reduction"
        raise ValueError(
            f"{bad}={getattr(config, bad)!r} does not apply to objective='dpo': it reads the log-probabilities from "
            "the logits and averages over pairs (leave loss_impl / loss_reduction at their defaults)"
        )
    _report_to(config.report_to)  # a bad name or a missing package before minutes of encoding
    check_training_arguments(config)  # --lr-scheduler, --extra-training-args keys: before encoding too
    _refuse_attention_dropout_early(config, model)
    if config.lora:  # before minutes of encoding
        from varpack.train.lora import require_peft

        require_peft()
    lr_default_kind = None
    if config.lr is None:
        lr, lr_default_kind = default_lr(config.model, config.objective)
        config = replace(config, lr=lr)
    load = _model_loader(config)
    # a mistaken forced gated delta rule backend is refused before minutes of encoding
    if config.gated_delta_backend != "auto":
        if model is None:
            model = load()  # refuses a model without Gated DeltaNet layers (loaded once: it is kept)
        else:
            _require_gated_delta(config, model)
        _gated_delta_choice(config, model, "cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer_for(config.model)
    dpo = config.objective == "dpo"
    if encoded is not None:  # samples passed in: neither config.data nor the built-in data
        data_label = "given samples"
    else:
        data_label = ", ".join(config.data) if config.data else ("built-in pairs" if dpo else "built-in chats")
    if config.streaming:
        if dpo:
            raise ValueError("--streaming reads chats; --objective dpo plans whole preference pairs up front")
        model, encoded, dataset, report = _streaming_dataset(config, model, tokenizer, encoded, load)
        plan = summary = None
    else:
        files: tuple[str, ...] = ()  # the files sample i is row i of (not for given samples or pairs)
        if encoded is None and dpo:
            from varpack.data.preference import encode_pairs, load_pairs

            encoded = encode_pairs(load_pairs(config.data), tokenizer)
        elif encoded is None:
            model, encoded, data_label, config = _load_samples(config, model, tokenizer, load)
            files = tuple(config.data or ())
        if dpo:
            data_label += f" ({len(encoded) // 2:,} preference pairs, each in one pack)"
        lengths, plan = _plan_packs(config, encoded, data_label, files)
        dataset = PackedDataset(encoded, plan, shuffle=False)  # the pack sampler orders the packs
        summary = plan_summary(plan, lengths, data=data_label, **_locations(plan, files))
        if summary["overflow"].get("split_ids"):
            summary["overflow"]["split_targets_at_cuts"] = split_targets_at_cuts(plan, encoded)
        report = summary_text(summary)
    objective: Any = "sft"
    if dpo:
        objective = _dpo_objective(config, model, load)
    training_args = training_arguments(config)
    check_fp16_device(training_args.fp16, training_args.device.type, setting=FP16_SETTING)
    created_output_dir = not os.path.exists(training_args.output_dir)
    # the captured layers' attention backend: config.attn_backend, or triton_short in place of auto's (the run's
    # config keeps what the user chose: a saved config reruns auto)
    graph_choice, model, attn_backend = _resolve_graphs(config, model, load, training_args, plan)
    config = replace(config, cuda_graphs=graph_choice.on)
    compile_choice = resolve_torch_compile(
        config, device=training_args.device.type, world_size=training_args.world_size
    )
    if graph_choice.on:  # the reason the layers are compiled is the graphs'
        compile_choice = CompileChoice(True, graph_choice.reason, graph_choice.hint)
    config = replace(config, torch_compile=compile_choice.on)
    model = _prepare_model(config, model, load, training_args.device, attn_backend=attn_backend)
    context = _context_parallel(config, model, training_args)
    gated_delta = _gated_delta_choice(config, model, training_args.device)
    static_shape = static_pad = None
    if config.cuda_graphs or static_shapes:
        from varpack.integrations.cuda_graphs import static_shape_for

        # zero-length pad segments where wanted and the layers' attention and mixers take them
        static_shape = static_shape_for(plan, model, attn_backend)
        static_pad = static_shape.pad_fraction(plan)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    collator = TrainCollator(
        PaddingFreeCollator(pad_token_id=pad_id, static_shape=static_shape),
        context_parallel=None if context is None else (context.cp_rank, context.cp_size),
    )
    sampler = None if plan is None else pack_sampler(config, plan, model, training_args, context=context)
    trainer = PackedSFTTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=[] if config.streaming else [PackEpochCallback(dataset, sampler)],
        pack_sampler=sampler,
        loss_reduction=config.loss_reduction,
        loss_impl=config.loss_impl,
        packing_length=config.packing_length,
        objective=objective,
        cuda_graphs=config.cuda_graphs,
    )
    if plan is not None:  # a stream has no plan up front; it prints its own report as it packs
        trainer.add_callback(
            RunReportCallback(
                trainer,
                summary=summary,
                text=report,
                plan=plan,
                backend=attn_backend,
                write_file=config.save or bool(training_args.report_to),
                reason=None if attn_backend == config.attn_backend else graph_choice.reason,
            )
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
        compile_choice=compile_choice,
        graph_choice=graph_choice,
        gated_delta=gated_delta,
        static_shape=static_shape,
        static_pad=static_pad,
        context_parallel=context,
    )


def _resolve_graphs(
    config: SFTConfig, model: Any, load: Callable[[], Any], args: Any, plan: Any = None
) -> tuple[CompileChoice, Any, str]:
    """``(choice, model, attn_backend)``: :func:`varpack.train.config.resolve_cuda_graphs` on the Trainer's
    device and world size (``args``: ``TrainingArguments``); where ``cuda_graphs="auto"`` turns it on, the model
    is loaded (if not yet) and its :func:`varpack.integrations.cuda_graphs.model_refusal` (autocast: ``args.bf16``
    / ``args.fp16``), then :func:`varpack.integrations.cuda_graphs.graph_attention` (the backend a captured
    layer would resolve to for the model at the ``plan``'s static shape: FA4 refuses a head dim below 64 on an
    H200) turn it off again, reason ``"auto: <the reason>"``. A forced ``cuda_graphs=True`` asks the same two
    and is refused by either: never a captured layer that reads ``cu_seqlens`` on the host.

    ``attn_backend`` is ``config.attn_backend``, or ``"triton_short"`` where ``auto`` resolves outside the
    captured layers' backends and triton_short runs the model's attention (named on the ``speed`` line).

    Raises:
        ValueError: ``cuda_graphs=True`` with a conflicting setting, a model it refuses (``"--cuda-graphs with
            <the reason, naming the model class>"``), or attention that resolves to a backend outside
            :data:`varpack.integrations.cuda_graphs.GRAPH_BACKENDS` (``"--cuda-graphs with attention 'auto'
            resolves to sdpa here ..."``).
    """
    choice = resolve_cuda_graphs(config, device=args.device.type, world_size=args.world_size)
    if not choice.on:
        return choice, model, config.attn_backend
    from varpack.integrations.cuda_graphs import graph_attention, model_refusal

    model = model if model is not None else load()
    attn, note = config.attn_backend, None
    refusal = model_refusal(
        model, autocast=bool(args.bf16 or args.fp16), device=args.device,
        gated_delta_backend=config.gated_delta_backend,
    )  # fmt: skip
    if refusal is None and plan is not None:
        from varpack.collate import StaticShape

        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else next(model.parameters()).dtype
        attn, refusal, note = graph_attention(
            model,
            backend=config.attn_backend,
            device=args.device,
            dtype=dtype,
            max_seqlen=StaticShape.from_plan(plan).max_seqlen,
        )
    if refusal is not None:
        if config.cuda_graphs is True:
            raise ValueError(f"--cuda-graphs with {refusal}")
        return CompileChoice(False, f"auto: {refusal}"), model, config.attn_backend
    if note is not None:
        choice = choice._replace(reason=f"{choice.reason}; {note}")
    return choice, model, attn


@dataclass(frozen=True)
class ContextParallelRun:
    """How a run splits its world (``context_parallel > 1``): ``dp_size`` data-parallel replicas of ``cp_size``
    ranks sharing a row; this rank's indices; the 2-D ``DeviceMesh`` ``("dp", "cp")``; what each layer kind runs
    (:func:`varpack.integrations.context_parallel.context_parallel_plan`)."""

    cp_size: int
    cp_rank: int
    dp_size: int
    dp_rank: int
    mesh: Any
    plan: dict[str, str]

    def describe(self) -> str:
        """``2 ranks share each row (zigzag split; attention: ulysses (...)), 1 data-parallel replica``."""
        layers = "; ".join(f"{k}: {v}" for k, v in self.plan.items())
        replicas = f"{self.dp_size} data-parallel replica{'s' if self.dp_size != 1 else ''}"
        return f"{self.cp_size} ranks share each row (zigzag split; {layers}), {replicas}"


def _context_parallel(config: SFTConfig, model: Any, training_args: Any) -> ContextParallelRun | None:
    """The run's context-parallel split (``None`` for ``context_parallel == 1``): the ``("dp", "cp")`` mesh
    over the Trainer's process group and the model enabled for shards of its ``cp`` groups.

    Raises:
        ValueError: ``average_tokens_across_devices`` off (the loss needs the global token count); the errors
            of :func:`varpack.integrations.context_parallel.enable_context_parallel`.
    """
    cp = config.context_parallel
    if cp == 1:
        return None
    if not training_args.average_tokens_across_devices:
        raise ValueError(
            f"context_parallel={cp} needs average_tokens_across_devices (the loss divides by the supervised tokens "
            "of every rank); leave it on in --extra-training-args"
        )
    from varpack.integrations.context_parallel import context_parallel_mesh, enable_context_parallel

    world = training_args.world_size  # reading it sets up the Trainer's process group
    if world % cp:
        raise ValueError(f"context_parallel={cp} does not divide the world size {world}")
    mesh = context_parallel_mesh(cp, training_args.device.type)
    enable_context_parallel(model, mesh, attention=config.context_parallel_attention)
    from varpack.integrations.context_parallel import model_context_parallel

    state = model_context_parallel(model)
    return ContextParallelRun(
        cp_size=cp,
        cp_rank=mesh["cp"].get_local_rank(),
        dp_size=world // cp,
        dp_rank=mesh["dp"].get_local_rank(),
        mesh=mesh,
        plan=dict(state.plan),
    )


def _require_gated_delta(config: SFTConfig, model: Any) -> None:
    """A forced ``config.gated_delta_backend`` for a given model without Gated DeltaNet layers: refused."""
    from varpack.models.registry import require_gated_delta_layers

    require_gated_delta_layers(model, config.gated_delta_backend, model_name=config.model)


def _gated_delta_choice(config: SFTConfig, model: Any, device: Any) -> tuple[str, str] | None:
    """``(backend, why)`` of the model's Gated DeltaNet layers on ``device`` (``None`` without any); a forced
    backend says so (``"forced: --gated-delta-backend"``).

    Raises:
        ValueError: a forced ``config.gated_delta_backend`` that cannot run on ``device``, with the reason.
    """
    from varpack.integrations.gated_delta import linear_attention_backend

    try:
        choice = linear_attention_backend(model, device, needs_grad=True)
    except RuntimeError as exc:  # resolve_backend's refusal of a forced backend, with its reason
        raise ValueError(f"gated_delta_backend={config.gated_delta_backend!r}: {exc}") from exc
    if choice is not None and choice[1] == "forced":
        choice = (choice[0], "forced: --gated-delta-backend")
    return choice


def pack_sampler(config: SFTConfig, plan: Any, model: Any, training_args: Any, *, context: Any = None) -> Any:
    """This rank's :class:`varpack.data.sampler.BalancedPackSampler` with ``config``'s ``packs_per_step``,
    ``rank_balance`` and ``attention_cost_weight`` (:func:`varpack.train.trainer.make_pack_sampler`, which
    checks the plan's fingerprint across ranks). With context parallelism (``context``, a
    :class:`ContextParallelRun`) the packs are dealt to the data-parallel replicas: the ranks of a
    context-parallel group get the same packs."""
    from varpack.train.trainer import make_pack_sampler

    return make_pack_sampler(
        plan,
        model,
        training_args,
        packs_per_rank=config.packs_per_step,
        balance=config.rank_balance,
        attention_weight=config.attention_cost_weight,
        rank=None if context is None else context.dp_rank,
        world_size=None if context is None else context.dp_size,
    )


#: ``varpack sft --streaming`` prints the stream's packing report every this many packs (and at its end).
STREAM_REPORT_EVERY = 1000


def _streaming_dataset(
    config: SFTConfig, model: Any, tokenizer: Any, encoded: Any, load: Callable[[], Any]
) -> tuple[Any, Any, Any, str]:
    """``(model or None, ChatStream, StreamingPackedDataset, report)`` of ``sft --streaming``: the chats are
    read lazily and encoded / packed when the Trainer iterates (:mod:`varpack.data.stream`).

    Ranks: the dataset does not shard by rank itself (``world_size=1``): under several processes the HF
    Trainer (accelerate's ``IterableDatasetShard``) hands each rank its own micro-batches of the one packed
    stream, so every rank reads and encodes the stream (the packs are deterministic, so all ranks agree).
    The dataset repeats the stream itself (``repeat=True``): the Trainer sees one endless epoch, so an
    optimizer step is never cut by a pass end (with gradient accumulation HF would carry the cut step's
    gradient into the next one), and an empty stream is an error instead of a run of 0 steps.

    Raises:
        ValueError: a vision-language model (streaming reads text chats); while training, a stream that
            plans no pack (no rows, or every sample empty, dropped or without a supervised token).
    """
    from varpack.data.stream import ChatStream, StreamingPackedDataset
    from varpack.models import is_vl_model

    if model is None:
        model = load()
    if is_vl_model(model):
        raise ValueError("--streaming reads text chats; a vision-language model trains without --streaming")
    if encoded is None:
        encoded = load_and_encode(config.data, tokenizer, streaming=True).samples
    stream = encoded if isinstance(encoded, ChatStream) else ChatStream(encoded, label="given samples")
    main = int(os.environ.get("RANK", "0")) == 0

    def report(summary: dict[str, Any]) -> None:
        if main:
            print(summary_text(summary), flush=True)

    dataset = StreamingPackedDataset(
        stream,
        tokenizer,
        packing_length=config.packing_length,
        buffer_size=config.buffer_size,
        strategy=config.packing_strategy,
        overflow=config.overflow,
        rank=0,
        world_size=1,
        report_every=STREAM_REPORT_EVERY,
        report_fn=report,
        repeat=True,  # the Trainer never sees a pass end (it would cut an accumulated step there)
    )
    text = "\n".join(
        [
            f"packing report (streaming: {config.packing_strategy} over a buffer of {config.buffer_size:,} "
            f"samples, packing_length={config.packing_length:,}, overflow={config.overflow})",
            f"  data      {stream.label}",
            f"  packs     planned while the stream is read; the report (fill, overflow) is printed every "
            f"{STREAM_REPORT_EVERY:,} packs and at the end of the stream, pack_fill in the training logs",
            f"  steps     {config.max_steps:,} (max_steps; a stream shorter than that is read again)",
        ]
    )
    return model, stream, dataset, text


def _dpo_objective(config: SFTConfig, model: Any, load: Callable[[], Any]) -> Any:
    """The run's :class:`varpack.train.objectives.dpo.DPOObjective`: the reference is a frozen copy of the
    starting model (``model`` deep-copied when one was given, else ``config.model`` loaded again: the same
    weights, the same seed), on varpack attention without Liger / compile; with ``lora`` none (the model with
    its adapters disabled)."""
    from varpack.integrations.transformers import enable_varpack
    from varpack.train.objectives.dpo import DPOObjective

    ref = None
    if not config.lora:
        if model is not None:
            import copy

            ref = enable_varpack(
                copy.deepcopy(model), backend=config.attn_backend, linear_backend=config.gated_delta_backend
            )
        else:
            ref = load()
        ref.config.use_cache = False
    return DPOObjective(
        beta=config.beta, label_smoothing=config.label_smoothing, loss_type=config.loss_type, ref_model=ref
    )


def _refuse_kernel_settings(config: SFTConfig) -> None:
    """Liger-Kernel and FSDP without a GPU refused before minutes of encoding, not at the first forward."""
    if config.fsdp and not torch.cuda.is_available():
        raise ValueError(
            "--fsdp needs CUDA GPUs: accelerate shards a model only on GPUs (on CPUs it would silently run plain "
            "DDP); on CPUs run torchrun without --fsdp"
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true") and not torch.cuda.is_available():
        raise ValueError(
            "accelerate launch --use_fsdp (ACCELERATE_USE_FSDP) needs CUDA GPUs: accelerate shards a model only "
            "on GPUs (on CPUs it would silently run plain DDP); on CPUs launch without --use_fsdp"
        )
    if config.fsdp and config.loss_impl == "linear_ce":
        raise ValueError(
            "fsdp with loss_impl='linear_ce': the chunked linear cross entropy reads the LM head outside the "
            "sharded forward; use loss_impl='logits' or 'auto'"
        )
    if config.use_liger_kernel:
        from varpack.integrations.kernels import LIGER_COMPILE_REFUSAL, liger_available

        if config.torch_compile is True:  # "auto" resolves to off beside Liger
            raise ValueError(LIGER_COMPILE_REFUSAL)

        if not liger_available():
            raise ValueError("use_liger_kernel needs Liger-Kernel: pip install liger-kernel")
        if not torch.cuda.is_available():
            raise ValueError(
                "use_liger_kernel needs a CUDA GPU (Liger-Kernel's kernels are Triton GPU kernels); "
                "this machine has none"
            )


def _model_loader(config: SFTConfig) -> Callable[[], Any]:
    """``config.model`` loaded on varpack attention (``config.dtype``, ``config.seed``, ``config.attn_backend``,
    ``config.gated_delta_backend``)."""
    from varpack.models import load_model

    def load() -> Any:
        return load_model(
            config.model,
            dtype=getattr(torch, config.dtype),
            seed=config.seed,
            attn_backend=config.attn_backend,
            gated_delta_backend=config.gated_delta_backend,
        )

    return load


def _load_samples(
    config: SFTConfig, model: Any, tokenizer: Any, load: Callable[[], Any]
) -> tuple[Any, Any, str, SFTConfig]:
    """Load and encode ``config.data`` (the built-in chats when empty: the image-caption chats for a
    vision-language model). The model is loaded here only when the data needs it (image/video chats: mRoPE
    positions and the patch grid; no data: to tell a VL model). Returns ``(model or None, samples, data label,
    config with the built-in data paths)``."""
    from varpack.models import is_vl_model

    if not config.data:  # a vision-language model without --data: the built-in image-caption chats
        model = model if model is not None else load()
    loaded = [model]

    def _rope_model() -> Any:  # loaded only for image/video chats (mRoPE positions, patch grid)
        if loaded[0] is None:
            loaded[0] = load()
        return loaded[0]

    source = load_and_encode(
        config.data,
        tokenizer,
        vl=not config.data and is_vl_model(model),
        rope_model=_rope_model,
        num_proc=config.num_proc,
    )
    if not config.data and source.paths:
        config = replace(config, data=source.paths)
    return loaded[0], source.samples, source.source, config


def _locate(files: tuple[str, ...]) -> Callable[[Any], dict[int, str]] | None:
    """``locate(sample_ids) -> {sample_id: "FILE:LINE"}`` over the data files sample ``i`` is row ``i`` of
    (:func:`varpack.data.chat.locate_samples`); None without files."""
    if not files:
        return None
    from varpack.data.chat import locate_samples

    return lambda ids: locate_samples(files, ids)


def _refuse_attention_dropout_early(config: SFTConfig, model: Any) -> None:
    """Attention dropout refused before the data is encoded: on a model passed in, or on the config of a model
    directory (``config.json`` read alone, no weights); checked again on the loaded model (``_prepare_model``).
    Built-in models set none."""
    from varpack.integrations.transformers import refuse_attention_dropout

    if model is not None:
        refuse_attention_dropout(model, "varpack sft")
    elif config.model and os.path.isfile(os.path.join(os.path.expanduser(str(config.model)), "config.json")):
        from transformers import AutoConfig

        refuse_attention_dropout(AutoConfig.from_pretrained(os.path.expanduser(str(config.model))), "varpack sft")


def split_targets_at_cuts(plan: Any, samples: Any) -> int:
    """The supervised tokens of split samples that sit first in a piece other than the first (``plan.pieces``
    starting past 0, kept in a pack): a packed item's first label is never a target (no token before it in its
    sequence), so each of these is not trained; the packing report counts them. A ``datasets.Dataset`` is read
    through its ``labels`` column in Arrow form (not row by row as Python objects)."""
    items = np.asarray(plan.items, dtype=np.int64)
    k = items[items >= plan.num_samples] - plan.num_samples  # the kept pieces
    k = k[np.asarray(plan.piece_start)[k] > 0]
    cuts = zip(np.asarray(plan.piece_sample)[k].tolist(), np.asarray(plan.piece_start)[k].tolist())
    if hasattr(samples, "select_columns") and hasattr(samples, "with_format"):
        labels = samples.select_columns(["labels"]).with_format("arrow")
        return sum(labels[s]["labels"][0][a].as_py() != -100 for s, a in cuts)
    return sum(int(samples[s]["labels"][a]) != -100 for s, a in cuts)


def _locations(plan: Any, files: tuple[str, ...]) -> dict[str, Any]:
    """``{"locations": {"sample_id": "FILE:LINE"}}`` of the overlong and left-out samples of ``plan`` (the
    packing report names them with it), or ``{}``."""
    ov = plan.overflow
    named = ov["overlong_ids"] + ov["unsupervised_ids"] + [s for s, _, _ in ov["unsupervised_pieces"]]
    locate = _locate(files)
    if locate is None or not named:
        return {}
    return {"locations": {str(i): w for i, w in sorted(locate(named).items())}}


def _plan_packs(
    config: SFTConfig, encoded: Any, data_label: str, files: tuple[str, ...] = ()
) -> tuple[np.ndarray, Any]:
    """``(lengths [N] int64, PackPlan)`` of the encoded samples, with ``config``'s packing settings
    (:func:`plan_samples`); with ``objective="dpo"`` a preference pair (samples 2k, 2k + 1) stays in one pack.
    ``files``: the data files sample ``i`` is row ``i`` of (an overlong sample's error names its FILE:LINE)."""
    groups = None
    if config.objective == "dpo":
        from varpack.data.preference import pair_groups

        groups = pair_groups(len(encoded))
    return plan_samples(
        encoded,
        packing_length=config.packing_length,
        strategy=config.packing_strategy,
        overflow=config.overflow,
        seed=config.seed,
        data_label=data_label,
        groups=groups,
        group_noun="pair",
        locate=None if groups is not None else _locate(files),
    )


def plan_samples(
    encoded: Any,
    *,
    packing_length: int,
    strategy: str = "bfd",
    overflow: str = "error",
    seed: int = 0,
    data_label: str = "the data",
    groups: Any = None,
    group_noun: str = "group",
    locate: Callable[[Any], dict[int, str]] | None = None,
) -> tuple[np.ndarray, Any]:
    """``(lengths [N] int64, PackPlan)`` of encoded samples (a ``datasets.Dataset`` with a ``length`` column,
    or a sequence of dicts): :func:`varpack.plan.plan_packs` (``groups``: its group constraint, e.g. preference
    pairs; ``group_noun`` names a group in its errors and report, ``"pair"``), refusing a plan that leaves nothing
    to train on. Without ``groups``, a sample or a piece of ``truncate`` / ``split`` with no supervised token is
    left out of the packs and reported by id (``plan.overflow["unsupervised_ids"]`` / ``["unsupervised_pieces"]``,
    :func:`varpack.data.dataset.supervised_ranges`): no pack, so no optimizer step, is made of them.
    Shared by :func:`build_sft` and :class:`varpack.train.trl.VarpackSFTTrainer`. ``locate``: where samples come
    from (``locate(sample_ids) -> {sample_id: "FILE:LINE"}``), named in the error of overlong samples
    (:func:`varpack.plan.plan_packs`).

    Raises:
        ValueError: no pack left to train on (every sample dropped or empty), or a split / truncated piece
            that would cut through an image or video placeholder span.
    """
    from varpack.data.dataset import supervised_ranges
    from varpack.plan import plan_packs

    if hasattr(encoded, "with_format"):
        lengths = np.asarray(encoded.with_format("numpy")["length"], dtype=np.int64)
    else:
        lengths = np.asarray([s.get("length", len(s["input_ids"])) for s in encoded], dtype=np.int64)
    supervised = supervised_ranges(encoded) if groups is None else None
    plan = plan_packs(
        lengths,
        packing_length,
        strategy=strategy,
        overflow=overflow,
        seed=seed,
        groups=groups,
        supervised=supervised,
        group_noun=group_noun,
        locate=locate,
    )
    if plan.num_packs == 0:  # training would do nothing and save the untrained model as if it had trained
        ov = plan.overflow
        out = ov["dropped_ids"] + ov["empty_ids"] + ov["unsupervised_ids"]
        out += sorted({s for s, _, _ in ov["unsupervised_pieces"]})
        gone = ", ".join(str(i) for i in out[:20])
        raise ValueError(
            f"no pack to train on: all {plan.num_samples} samples of {data_label} were dropped, empty or "
            f"without a supervised token (sample ids {gone}{', ...' if len(out) > 20 else ''}); "
            f"raise packing_length={packing_length} or use overflow='split' or overflow='truncate'"
        )
    if plan.pieces and not hasattr(encoded, "with_format"):
        # image/video chats: refuse before training (not when the bad pack is reached) any split/truncate
        # piece that would cut through a placeholder span; the same check as `varpack plan`
        from varpack.data.multimodal import check_plan_cuts

        bad = check_plan_cuts(encoded, plan.pieces)
        if bad:
            shown = "; ".join(
                f"piece {b['piece_id']} = sample {b['sample_id']} [{b['start']}, {b['stop']})"
                for b in bad[:20]
            )
            raise ValueError(
                f"{len(bad)} piece(s) of overlong samples would cut through an image or video ({shown}); "
                "use overflow='drop' or a larger packing_length"
            )
    return lengths, plan


_GRAPHS_FLOAT32 = (
    "--cuda-graphs with float32 training: the captured layers need bf16 / fp16 attention "
    "(FlashAttention-4); pass --bf16 (mixed precision) or --dtype bfloat16"
)


def _prepare_model(
    config: SFTConfig, model: Any, load: Callable[[], Any], device: Any = None, attn_backend: str | None = None
) -> Any:
    """The model on varpack attention (loaded now if not yet), without a KV cache, with the requested
    Liger-Kernel / per-layer compile applied (with ``config.cuda_graphs``: compiled for CUDA graphs on ``device``,
    the training device, after :func:`_refuse_graph_model`), then wrapped in a LoRA ``PeftModel`` with ``config.lora``
    (:func:`varpack.train.lora.apply_lora`). ``attn_backend``: the attention backend the run chose in place of
    ``config.attn_backend`` (:func:`_resolve_graphs`); default ``config.attn_backend``.

    Raises:
        ValueError: ``config.torch_compile`` still ``"auto"`` (:func:`varpack.train.config.resolve_torch_compile`
            first: the choice needs the Trainer's device); the model's config sets attention dropout
            (:func:`varpack.integrations.transformers.refuse_attention_dropout`, naming its key).
    """
    from varpack.integrations.transformers import enable_varpack, refuse_attention_dropout

    if not isinstance(config.torch_compile, bool):
        raise ValueError(f"torch_compile={config.torch_compile!r} must be resolved to True / False first")

    backend = attn_backend or config.attn_backend
    if model is None:
        model = load()
        if backend != config.attn_backend:
            enable_varpack(model, backend=backend, linear_backend=config.gated_delta_backend)
    else:
        _require_gated_delta(config, model)
        enable_varpack(model, backend=backend, linear_backend=config.gated_delta_backend)
    refuse_attention_dropout(model, "varpack sft")
    model.config.use_cache = False
    if config.cuda_graphs:
        _refuse_graph_model(model, autocast=config.bf16, device=device)
        from varpack.integrations.cuda_graphs import compile_layers_as_graphs

        compile_layers_as_graphs(model, device=device, what="--cuda-graphs")
    elif config.use_liger_kernel or config.torch_compile:
        from varpack.integrations.kernels import apply_liger_kernels, compile_layers

        if config.use_liger_kernel:
            apply_liger_kernels(model)
        if config.torch_compile:
            # attention and Gated DeltaNet mixers stay graph breaks: tracing the mixers whole through the custom
            # ops (custom_ops=True) measured 207.0 vs 185.9 ms/step on an H200 with FA4 (benchmarks/RESULTS.md)
            compile_layers(model)
    if config.lora:  # last: peft wraps the finished model (boundaries and patches run inside it)
        from varpack.train.lora import apply_lora

        model = apply_lora(model, config)
    return model


def _refuse_graph_model(model: Any, *, autocast: bool = False, device: Any = None) -> None:
    """``--cuda-graphs`` for a model it is not shown to run exactly
    (:func:`varpack.integrations.cuda_graphs.model_refusal`).

    Raises:
        ValueError: ``"--cuda-graphs with <the reason, naming the model class>"``.
    """
    from varpack.integrations.cuda_graphs import model_refusal

    reason = model_refusal(model, autocast=autocast, device=device)
    if reason is not None:
        raise ValueError(f"--cuda-graphs with {reason}")


def training_arguments(config: SFTConfig) -> Any:
    """``transformers.TrainingArguments`` of a packed run: sequential sampling (the plan orders the packs),
    nothing saved by the Trainer, no per-step NaN filter (it reads the loss), with ``streaming`` no batch
    dispatching (``dispatch_batches=False``), ``config.extra_training_args`` applied last."""
    from transformers import TrainingArguments

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
        report_to=_report_to(config.report_to),
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
    if config.streaming:
        # accelerate would dispatch an IterableDataset's batches from rank 0 and slice every tensor along its
        # first dimension (cu_seq_lens too); each rank fetches its own micro-batches instead
        args_kw["accelerator_config"] = {"dispatch_batches": False}
    if config.fsdp:  # FSDP2, one unit per decoder layer (accelerate reads the model's _no_split_modules)
        args_kw.update(fsdp=True, fsdp_config={"version": 2, "reshard_after_forward": True})
    if config.gradient_checkpointing:  # the flag is renamed in newer transformers; pass it only when used
        args_kw["gradient_checkpointing"] = True
    args_kw.update(config.extra_training_args)
    args = TrainingArguments(**args_kw)
    args.accelerator_config = non_blocking_copies(args)  # pinned batches: no stream sync per copy
    return args


def _report_to(text: str) -> str | list[str]:
    """``SFTConfig.report_to`` for ``TrainingArguments``, checked: ``"tensorboard,wandb"`` -> a list
    (transformers takes a list, or one name / ``all`` / ``none`` as a string).

    Raises:
        ValueError: ``none`` or ``all`` beside other names, a name transformers has no integration for, or
            an integration whose package is not installed (transformers' own errors come when the Trainer
            is built, after the data is encoded, without the setting's name), naming ``report_to``.
    """
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError(f"report_to={text!r} names no integration; give none, all or names like tensorboard")
    if len(names) == 1 and names[0] in ("none", "all"):
        return names[0]
    for special in ("none", "all"):
        if special in names:
            raise ValueError(f"report_to={text!r}: {special!r} stands alone, not in a list with other names")
    available = set(get_available_reporting_integrations())
    for name in names:
        if name not in INTEGRATION_TO_CALLBACK:
            raise ValueError(
                f"report_to={text!r}: no transformers integration {name!r}; choose none, all or among "
                f"{', '.join(INTEGRATION_TO_CALLBACK)}"
            )
        if name not in available:
            raise ValueError(
                f"report_to={text!r}: the {name!r} integration's package is not installed (pip install "
                f"{name}; docs/usage.md, 'Logging')"
            )
    return names


def run_sft(config: SFTConfig, *, print_fn: Any = print, **build_kw: Any) -> SFTRun:
    """Build and train a packed SFT run; print the packing report first and a summary at the end.

    The report names the learning rate and, when ``config.lr`` was left to the default, the model kind it
    was chosen for (:data:`varpack.train.config.DEFAULT_LR`); the ``model`` line the training precision
    (``precision bf16 autocast over float32 master weights``, ``precision float32 weights``). When training begins it prints the engine
    (:class:`varpack.train.trainer.EngineReportCallback`) and the step configuration with its reason
    (:class:`varpack.train.trainer.SpeedReportCallback`: ``speed     regional torch.compile + chunked linear
    CE (auto on CUDA: ...)``). A model with Gated DeltaNet layers (Qwen3.5, Qwen3-Next) gets a ``linear`` line
    after the ``model`` line: the gated delta rule backend on the training device and why (``linear    gated
    delta rule: chunk (auto on cpu: varpack's chunked PyTorch path)``). A saved run also writes its resolved settings (``lr`` and ``torch_compile``
    resolved) to ``output_dir/varpack_config.yaml``, which ``varpack sft --config`` reads back to the same
    run. A saved
    or logged run (``save``, or ``report_to`` other than ``none``) writes the packing report to
    ``output_dir/packing_report.json`` when training starts (:mod:`varpack.train.reporting`). An output directory this run created is removed
    again when nothing was saved into it (``save=False``, or training failed).

    Returns:
        The :class:`SFTRun`; ``run.history`` holds the Trainer's log entries (``loss``, ``tokens_per_second``,
        ``supervised_tokens_per_step``, ``pack_fill``, ...: :func:`varpack.train.trainer.step_metrics`);
        ``run.config`` the settings used (``lr`` resolved).
    """
    run = build_sft(config, **build_kw)
    config = run.config
    finished = False
    try:
        if run.trainer.is_world_process_zero():
            print_fn(run.report)
            n_params = sum(p.numel() for p in run.model.parameters())
            print_fn(
                f"model     {config.model} ({type(run.model).__name__}, {n_params / 1e6:.1f}M params, "
                f"precision {_describe_precision(run)}, attention {run.model.config._attn_implementation}, "
                + (
                    f"loss dpo {config.loss_type}, beta {config.beta:g}, reference: "
                    + ("the model without its adapters" if config.lora else "a frozen copy of the start")
                    + ")"
                    if config.objective == "dpo"
                    else f"loss {config.loss_reduction} mean)"
                )
            )
            if run.gated_delta is not None:
                print_fn(f"linear    gated delta rule: {run.gated_delta[0]} ({run.gated_delta[1]})")
            if run.context_parallel is not None:
                print_fn(f"context   {run.context_parallel.describe()}")
            if config.lora:
                trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
                print_fn(
                    f"lora      r={config.lora_r}, alpha={config.lora_alpha}, dropout={config.lora_dropout:g}, "
                    f"target modules {config.lora_target_modules}: {trainable / 1e6:.3f}M trainable params"
                )
            print_fn(f"optimizer {_describe_lr(run)}")
        run.trainer.add_callback(EngineReportCallback(print_fn))  # prints once the model is wrapped
        run.trainer.add_callback(
            SpeedReportCallback(
                run.trainer,
                run.compile_choice,
                liger=config.use_liger_kernel,
                print_fn=print_fn,
                static=run.static_shape.describe(run.static_pad) if config.cuda_graphs else None,
                graphs=run.graph_choice,
            )
        )
        if config.torch_compile:
            run.trainer.add_callback(CompileCountCallback(print_fn))
        run.trainer.train()
        run.history = [h for h in run.trainer.state.log_history if "loss" in h]
        if config.save:
            run.trainer.save_model(config.output_dir)  # a PeftModel saves its adapter only
            if run.trainer.is_world_process_zero():
                run.tokenizer.save_pretrained(config.output_dir)
                write_config_file(_rerunnable(config), os.path.join(config.output_dir, CONFIG_FILE_NAME))
                if config.lora:
                    from varpack.train.lora import save_lora

                    merged_dir = save_lora(
                        run.trainer.accelerator.unwrap_model(run.model), run.tokenizer, config
                    )
                    if merged_dir is not None:
                        print_fn(f"merged model (base + adapter) saved to {os.path.abspath(merged_dir)}")
        finished = True
    finally:
        if run.created_output_dir:
            if finished:  # every rank past Trainer.train(), whose end still reads output_dir (seen under
                run.trainer.accelerator.wait_for_everyone()  # accelerate launch: [Errno 2] on 'varpack-sft')
            _remove_if_empty(config.output_dir)
    if run.trainer.is_world_process_zero() and run.history:
        first, last = run.history[0]["loss"], run.history[-1]["loss"]
        print_fn(
            f"done: {run.trainer.state.global_step} steps, loss {first:.4f} -> {last:.4f}"
            + (f"; saved to {os.path.abspath(config.output_dir)}" if config.save else "")
        )
    return run


def _rerunnable(config: SFTConfig) -> SFTConfig:
    """``config`` with its local paths (data files, a model directory or file, ``output_dir``) made absolute:
    the saved ``varpack_config.yaml`` then reruns from any working directory, as its first line says."""

    def local(p: Any) -> Any:
        return os.path.abspath(p) if isinstance(p, str) and os.path.exists(p) else p

    data = config.data
    if data is not None:
        data = local(data) if isinstance(data, str) else tuple(local(p) for p in data)
    return dataclasses.replace(
        config, data=data, model=local(config.model), output_dir=os.path.abspath(config.output_dir)
    )


#: said on the ``model`` line of a CPU run with float16 weights (fp16 autocast is refused there): PyTorch's CPU
#: float16 matmuls have no fast path on most x86 CPUs -- a 1024 x 1024 matmul took 2.83 s in float16, 40 ms in
#: bfloat16 and 10.7 ms in float32 on the 2-core x86 machine CI runs on (torch 2.13.0 CPU build)
CPU_FLOAT16_NOTE = "float16 on the CPU: slow matmuls, ~265x float32's time measured on x86; train in float32 here"


def _describe_precision(run: SFTRun) -> str:
    """The training precision on the ``model`` line: the Trainer's autocast (``TrainingArguments.bf16`` /
    ``fp16``: ``--bf16`` or ``--extra-training-args``) over the dtype of the trained parameters, e.g. ``float32
    weights``, ``bf16 autocast over float32 master weights``, ``bfloat16 weights``; frozen parameters of
    another dtype (a LoRA run's base) are named after it (``float32 weights (frozen: bfloat16)``). A CPU run in
    float16 says it will be slow (:data:`CPU_FLOAT16_NOTE`)."""
    args = run.trainer.args
    amp = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    trained: dict[str, None] = {}
    frozen: dict[str, None] = {}
    for p in run.model.parameters():
        (trained if p.requires_grad else frozen)[str(p.dtype).removeprefix("torch.")] = None
    names = " / ".join(trained) or "no trained"
    if amp is None:
        text = f"{names} weights"
    elif list(trained) == ["float32"]:
        text = f"{amp} autocast over float32 master weights"
    else:
        text = f"{amp} autocast over {names} weights"
    other = [d for d in frozen if d not in trained]
    text += f" (frozen: {' / '.join(other)})" if other else ""
    if args.device.type == "cpu" and ("float16" in trained or "float16" in frozen):
        text += f" ({CPU_FLOAT16_NOTE})"
    return text


def _describe_optimizer(run: SFTRun) -> str:
    """The optimizer the Trainer builds, e.g. ``AdamW (optim adamw_torch_fused)``, ``SGD (optim sgd)``: its class
    from transformers' own choice for the run's ``TrainingArguments`` (``optim``, which ``--extra-training-args``
    may set; ``Trainer.get_optimizer_cls_and_kwargs`` asked without the model, so nothing is built or hooked for
    it: the layer-wise GaLore / APOLLO optims register per-parameter hooks when given one), or of an optimizer the
    trainer was given. An ``optim`` that cannot be told without the model, or whose package is missing, is named
    alone (the Trainer raises its error when it builds it)."""
    trainer, args = run.trainer, run.trainer.args
    if getattr(trainer, "optimizer", None) is not None:
        return type(trainer.optimizer).__name__
    if getattr(trainer, "optimizer_cls_and_kwargs", None) is not None:
        return trainer.optimizer_cls_and_kwargs[0].__name__
    optim = getattr(args.optim, "value", args.optim)
    try:
        cls, _ = type(trainer).get_optimizer_cls_and_kwargs(args, None)
    except Exception:  # noqa: BLE001 -- an optim needing the model or a missing package: named alone
        return f"optim {optim}"
    return f"{cls.__name__} (optim {optim})"


def _describe_lr(run: SFTRun) -> str:
    """``AdamW (optim adamw_torch_fused), peak lr 0.003 (default for a random-init model), constant schedule, 0
    warm-up steps, weight decay 0``: the optimizer (:func:`_describe_optimizer`) and schedule of the run's
    ``TrainingArguments``."""
    c, args = run.config, run.trainer.args
    if run.lr_default_kind is None:
        source = "set"
    else:
        other = "pretrained" if run.lr_default_kind == "random-init" else "random-init"
        table = DEFAULT_DPO_LR if c.objective == "dpo" else DEFAULT_LR
        source = f"default for a {run.lr_default_kind} model; {other}: {table[other]:g}"
    schedule = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    return (
        f"{_describe_optimizer(run)}, peak lr {args.learning_rate:g} ({source}), {schedule} schedule, "
        f"{args.warmup_steps:g} warm-up steps, weight decay {args.weight_decay:g}"
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
