"""Settings of a packed SFT run: :class:`SFTConfig` and its per-model-kind default learning rate.

This module imports neither torch nor transformers (only numpy, through :mod:`varpack.plan`), so the
``varpack sft`` / ``varpack demo`` parsers can read the fields and defaults without the seconds those imports
take. Every closed choice is a ``typing.Literal`` annotation (the parser's ``choices`` and the check in
``__post_init__`` both read it); every field carries its ``--help`` text in ``field(metadata={"help": ...})``
and the flags of ``varpack sft`` are generated from the fields (:mod:`varpack.train.cli_flags`), so no field
is unreachable from the command line.

Field metadata keys (read by :mod:`varpack.train.cli_flags`):

* ``help``: the flag's help text, or a callable ``defaults -> str`` (``defaults``: the parser's defaults).
* ``metavar``: the flag's metavar.
* ``cli_type``: the argparse value check, one of :data:`varpack.train.fields.CLI_TYPES`
  (``"dtype"``, ``"int>=0"``, ``"int>=1"``, ``"float>0"``, ``"max_steps"``, ``"json_object"``); default: from
  the annotation.
* ``aliases``: other names of the setting, as TRL / ms-swift spell them (``max_length`` for
  ``packing_length``): accepted as flags (``--max_length``, hidden from ``--help`` apart from a note in the
  flag's help) and as keys of a ``--config`` file. Only where the other tool's setting means the same thing;
  docs/usage.md "Flags for TRL / ms-swift users" says where the behaviour around it differs.

A field annotated :data:`AutoBool` (``bool | Literal["auto"]``, ``torch_compile``) is a tri-state switch:
``--flag`` (on), ``--flag false`` / ``--no-flag`` (off), ``--flag auto``; a ``--config`` file gives ``true``,
``false`` or ``auto``.

:data:`ALWAYS_ON` lists the TRL / ms-swift switches that varpack cannot turn off (``padding_free``,
``packing``): ``true`` is accepted and changes nothing, ``false`` is refused.
"""

from __future__ import annotations

import functools
import math
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from varpack._argtypes import DTYPE_SPELLINGS
from varpack.plan.plan import DEFAULT_PACKING_LENGTH
from varpack.plan.streaming import DEFAULT_BUFFER_SIZE

__all__ = [
    "ALWAYS_ON",
    "COMPILE_COLD_COST",
    "DEPENDENT_SETTINGS",
    "DEFAULT_LR",
    "EXTRA_ARGS_OF_FIELDS",
    "EXTRA_ARGS_REFUSED",
    "LINEAR_CE_HF_COMPILE_REFUSAL",
    "NEFTUNE_REFUSAL",
    "AttnBackendName",
    "AutoBool",
    "CompileChoice",
    "ContextParallelAttention",
    "DPOLossType",
    "DTypeName",
    "GatedDeltaBackendName",
    "LossImpl",
    "LossReduction",
    "ObjectiveName",
    "OverflowPolicy",
    "PackingStrategy",
    "SFTConfig",
    "check_context_parallel",
    "check_cuda_graphs",
    "check_extra_training_args",
    "check_fp16_device",
    "check_training_arguments",
    "resolve_cuda_graphs",
    "check_precision",
    "default_lr",
    "literal_choices",
    "resolve_torch_compile",
    "setting_text",
    "transformers_compile",
]

#: Default peak learning rate by model kind. A random-init built-in model (``tiny-qwen3``, ...) learns from
#: scratch: 30 steps of ``tiny-qwen3`` on the built-in chats (packing_length 1024, constant schedule, the last
#: 16 chats held back) take the held-out loss from 11.95 to 11.71 at 1e-4 and to 6.95 at 3e-3 (the demo's
#: rate), measured on a CPU. Loaded weights (a model directory or GGUF file) are fine-tuned: 1e-4, a
#: common full fine-tuning rate for small models, and the rate of the README's SmolLM2 example. Every built-in
#: name counts as random-init, also the benchmark shape ``qwen3-0.6b-shape`` (3e-3 was not tuned for it).
DEFAULT_LR: dict[str, float] = {"random-init": 3e-3, "pretrained": 1e-4}
#: the same for ``objective="dpo"``: pretrained as TRL 1.16's ``DPOConfig.learning_rate`` (1e-6); random-init
#: 1e-4, measured on the built-in pairs with tiny-qwen3 (per-epoch training loss 0.776 -> 0.725 -> 0.692 over
#: 3 epochs, where 3e-3 made it rise 0.69 -> 1.63 -> 2.22).
DEFAULT_DPO_LR: dict[str, float] = {"random-init": 1e-4, "pretrained": 1e-6}

#: TRL / ms-swift switches that are always on in varpack -> why ``false`` is refused (flags ``--padding_free``,
#: ``--packing`` and ``--config`` keys; ``true`` is accepted as a no-op).
ALWAYS_ON: dict[str, str] = {
    "padding_free": "varpack always trains padding-free (every micro-batch is one row with cu_seqlens); "
    "for padded batches use a plain HF Trainer",
    "packing": "varpack always packs (varpack plan shows the packs); for unpacked training use a plain HF "
    "Trainer",
}

#: Settings read only when another setting is on: field -> (the setting it needs, as :func:`setting_text` words it,
#: or as flag then field; whether ``config`` has it on). A field set to a value other than its default without
#: that setting is refused (``SFTConfig.lora_r has an invalid value: 8 (needs --lora (lora=True))``), never
#: ignored; at its default it is accepted, so a config file that lists every setting (``varpack_config.yaml``)
#: reads back.
DEPENDENT_SETTINGS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    **{
        name: ("--lora (lora=True)", lambda c: c.lora)
        for name in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_merge")
    },
    **{
        name: ("--objective dpo (objective='dpo')", lambda c: c.objective == "dpo")
        for name in ("beta", "loss_type", "label_smoothing")
    },
    "buffer_size": ("--streaming (streaming=True)", lambda c: c.streaming),
    "context_parallel_attention": (
        "--context-parallel N (context_parallel=N), N >= 2",
        lambda c: c.context_parallel > 1,
    ),
}

#: :data:`varpack.plan.STRATEGIES` (tests/train/test_config.py checks that they agree).
PackingStrategy = Literal["bfd", "sequential"]
#: :data:`varpack.plan.OVERFLOW_POLICIES` (checked to agree, as above).
OverflowPolicy = Literal["error", "drop", "truncate", "split"]
#: :data:`varpack.loss.Reduction`.
LossReduction = Literal["token", "sample"]
LossImpl = Literal["auto", "linear_ce", "logits"]
#: ``auto`` and the names of :data:`varpack.attn.BACKENDS` (== ``varpack.cli._common.ATTN_BACKENDS``; checked).
AttnBackendName = Literal[
    "auto",
    "reference",
    "sdpa",
    "torch_varlen",
    "flex",
    "flash_attn",
    "flash_attn_3",
    "flash_attn_4",
    "triton_short",
]
#: ``auto`` and the names of :data:`varpack.ops.gated_delta_rule.dispatch.BACKENDS`
#: (== ``varpack.cli._common.GATED_DELTA_BACKENDS``; checked).
GatedDeltaBackendName = Literal["auto", "fla", "fla_hybrid", "chunk", "chunk_compiled", "naive"]
#: :data:`varpack.train.objectives.OBJECTIVES` (checked to agree).
ObjectiveName = Literal["sft", "dpo"]
#: :data:`varpack.train.objectives.dpo.DPO_LOSS_TYPES` (checked to agree).
DPOLossType = Literal["sigmoid", "robust"]
#: torch dtype names of the parameters of a built-in model.
DTypeName = Literal["float32", "bfloat16", "float16"]
#: :data:`varpack.attn.context_parallel.CONTEXT_PARALLEL_ATTENTION` (checked to agree).
ContextParallelAttention = Literal["auto", "ulysses", "ring"]
#: a switch whose default is decided per run: ``True``, ``False`` or ``"auto"`` (``torch_compile``).
AutoBool = bool | Literal["auto"]

#: What regional compile costs before the first step, as benchmarks/RESULTS.md#sft-step measured it
#: (benchmarks/train.py, Qwen3-0.6B shape, one H200): 17.2 s with an empty compile cache, 4.2 s with a warm one,
#: vs 0.25-0.56 s for an eager first step.
COMPILE_COLD_COST = "the first step compiles every decoder layer (4-17 s for a 0.6B model on an H200)"


def literal_choices(annotation: Any) -> tuple[Any, ...] | None:
    """The values of a ``Literal[...]`` annotation (also inside ``Optional``), else ``None``."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    return None


def default_lr(model: str, objective: str = "sft") -> tuple[float, str]:
    """The default peak learning rate for ``model`` and the kind it was chosen for.

    Args:
        model: what :func:`varpack.models.load_model` takes: a built-in name (random init) or a model
            directory / ``.gguf`` file / package (loaded weights).
        objective: ``"sft"`` (:data:`DEFAULT_LR`) or ``"dpo"`` (:data:`DEFAULT_DPO_LR`).

    Returns:
        ``(lr, kind)`` with ``kind`` ``"random-init"`` or ``"pretrained"``.

    Raises:
        ValueError: ``model`` names nothing (:func:`varpack.models.resolve_model_source`).
    """
    from varpack.models import resolve_model_source

    source, _ = resolve_model_source(model)
    kind = "random-init" if source in ("builtin", "external") else "pretrained"
    return (DEFAULT_DPO_LR if objective == "dpo" else DEFAULT_LR)[kind], kind


def _truthy(value: Any) -> bool:
    """A ``TrainingArguments`` keyword or an accelerate environment variable that is set and not off."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "0", "false", "no", "off")
    return bool(value)


class CompileChoice(NamedTuple):
    """What :func:`resolve_torch_compile` (compile the decoder layers) or :func:`resolve_cuda_graphs` (static
    shapes + CUDA graphs) decided for a run."""

    #: the switch is on
    on: bool
    #: why, as the ``speed`` line shows it in parentheses
    reason: str
    #: how to choose otherwise (``"--torch-compile false to skip"``), or ``""``
    hint: str = ""


def resolve_torch_compile(
    config: SFTConfig, *, device: str, world_size: int = 1, environ: Mapping[str, str] | None = None
) -> CompileChoice:
    """Whether a run of ``config`` compiles its decoder layers (``SFTConfig.torch_compile``), and why.

    ``cuda_graphs=True`` (given, or :func:`resolve_cuda_graphs`' resolved choice; ``"auto"`` counts as off here:
    resolve it first) with ``True`` or ``"auto"``: ``True``, reason ``"--cuda-graphs"`` (``False`` beside a
    given ``cuda_graphs`` is refused by :func:`check_cuda_graphs`, and turns auto graphs off).
    ``True`` / ``False`` are the user's choice and returned as given. ``"auto"`` (the default) is ``True``
    exactly when the run is on CUDA and no setting of ``config`` is known to conflict with regional compile
    or is untested with it; benchmarks/RESULTS.md#sft-step (benchmarks/train.py, one H200,
    Qwen3-0.6B shape) measured compile + linear CE at 112-141 ms/step vs 160-165 ms without compile, after a cold
    first step (:data:`COMPILE_COLD_COST`); where static shapes + CUDA graphs run (:func:`resolve_cuda_graphs`),
    faster still, the layers are compiled for them.

    Several ranks compile too: under DDP (``world_size > 1``) and under FSDP2 (``fsdp``, or FSDP from
    ``extra_training_args`` / accelerate's environment with FSDP version 2) the compiled layers' step equals
    the one-process eager step over the same packs, loss and every parameter's update (2 gloo ranks, CPU,
    ``aot_eager`` backend: tests/train/test_ddp_compile_gloo.py; for FSDP2 the layers are compiled, then
    sharded by ``fully_shard`` per decoder layer and the root, as accelerate places the units); the pack
    shapes of 5 steps reuse one set of graphs on every rank (no recompilation). The speed-up under several
    GPUs is not measured yet (benchmarks/scaling.py ``--torch-compile``). ``"auto"`` is ``False`` with any of
    these, checked in this order:

    * ``device`` is not ``"cuda"``: the speed-up was measured on CUDA only, and inductor on a CPU builds C++
      for every layer before the first step;
    * ``use_liger_kernel``: refused together with compile
      (:data:`varpack.integrations.kernels.LIGER_COMPILE_REFUSAL`);
    * ``context_parallel > 1``: compiled layers are not tested with its collectives (``True`` is refused
      there by :func:`check_context_parallel`);
    * DeepSpeed (``extra_training_args["deepspeed"]``, ``ACCELERATE_USE_DEEPSPEED``): compiled layers under
      it are not tested;
    * FSDP1: FSDP from ``extra_training_args`` whose ``fsdp_config`` sets ``"version"`` other than 2 or is
      not a dict (a file, not read here), or accelerate's ``ACCELERATE_USE_FSDP`` without ``fsdp`` in the
      training arguments and ``FSDP_VERSION`` not 2 (accelerate's default is 1): compiled layers are tested
      inside FSDP2 units only;
    * ``lora``: peft's adapter layers inside compiled layers are not tested;
    * ``extra_training_args["torch_compile"]``: transformers would compile the whole model around the
      compiled layers.

    Not a conflict: ``gradient_checkpointing`` (compiled layers recompute with the same boundaries,
    tests/invariant/test_compile_and_liger.py::test_compiled_layers_with_gradient_checkpointing), the other
    model families (Llama, Gemma2-style, Qwen3.5, Qwen3-Next, Qwen3-VL: compiled and exact in the same
    file), ``streaming`` and ``objective="dpo"`` (the same packed forward; the DPO reference stays eager).

    Args:
        config: the run's settings.
        device: the device type the run trains on (``"cuda"``, ``"cpu"``, ``"mps"``, ...: the Trainer's
            ``TrainingArguments.device.type``).
        world_size: processes training together (``torchrun`` / ``accelerate launch``).
        environ: the environment accelerate reads (default: ``os.environ``).

    Returns:
        :class:`CompileChoice` ``(on, reason, hint)``: ``reason`` as ``varpack sft``'s ``speed`` line shows it
        (``"--torch-compile"``, ``"auto on CUDA: fastest measured, benchmarks/RESULTS.md"``, ``"auto on CUDA:
        fastest measured on one GPU, exact under DDP"``, ``"auto: CPU run; compiled by default on CUDA
        only"``, ``"auto: FSDP version 1; ..."``), ``hint`` the flag that chooses otherwise (``auto`` only;
        none on a CPU, or beside Liger or context parallelism, which refuse compile).
    """
    value = config.torch_compile
    if config.cuda_graphs is True and value is not False:  # check_cuda_graphs refuses the rest
        return CompileChoice(True, "--cuda-graphs")
    if value is True:
        return CompileChoice(True, "--torch-compile")
    if value is False:
        return CompileChoice(False, "--torch-compile false")
    env = os.environ if environ is None else environ
    extra = config.extra_training_args
    if device != "cuda":
        return CompileChoice(False, f"auto: {device.upper()} run; compiled by default on CUDA only")
    if config.use_liger_kernel:
        return CompileChoice(False, "auto: --use-liger-kernel, which is not combined with compile")
    if config.context_parallel > 1:
        return CompileChoice(False, "auto: --context-parallel; compiled layers are not tested with its collectives")
    anyway = "--torch-compile to compile anyway"
    if _truthy(extra.get("deepspeed")) or _truthy(env.get("ACCELERATE_USE_DEEPSPEED")):
        return CompileChoice(False, "auto: DeepSpeed; compiled layers under it are not tested", anyway)
    fsdp_version = None  # the FSDP version the Trainer will shard with (None: no FSDP)
    if config.fsdp or _truthy(extra.get("fsdp")):  # TrainingArguments' fsdp_config; its default version is 2
        fsdp_config = extra.get("fsdp_config", {})
        if isinstance(fsdp_config, dict):  # transformers strips a key's "fsdp_" prefix
            fsdp_version = str(fsdp_config.get("version", fsdp_config.get("fsdp_version", 2))).strip()
        else:
            fsdp_version = "of an fsdp_config file (not read)"
    elif _truthy(env.get("ACCELERATE_USE_FSDP")):
        fsdp_version = env.get("FSDP_VERSION", "1").strip()  # accelerate's default
    if fsdp_version is not None and fsdp_version != "2":
        why = f"auto: FSDP version {fsdp_version}; compiled layers are tested inside FSDP2 units only"
        return CompileChoice(False, why, anyway)
    if config.lora:
        return CompileChoice(False, "auto: --lora; compiled layers with peft adapters are not tested", anyway)
    if transformers_compile(extra):
        why = "auto: transformers' own torch_compile (extra_training_args) compiles the whole model"
        return CompileChoice(False, why, anyway)
    skip = "--torch-compile false to skip"
    if fsdp_version is not None or world_size > 1:
        engine = "FSDP2" if fsdp_version is not None else "DDP"
        return CompileChoice(True, f"auto on CUDA: fastest measured on one GPU, exact under {engine}", skip)
    return CompileChoice(True, "auto on CUDA: fastest measured, benchmarks/RESULTS.md", skip)


#: settings ``--cuda-graphs`` is refused with: (field, value test, why). Each needs what CUDA-graph trees cannot
#: be shown to do with it (module docstring of :mod:`varpack.integrations.cuda_graphs`).
#: attention backends ``--cuda-graphs`` accepts (``auto`` resolves to flash_attn_4 on the measured shapes, else the
#: captured layers take triton_short: :func:`varpack.integrations.cuda_graphs.graph_attention`)
GRAPH_ATTN_BACKENDS: tuple[str, ...] = ("auto", "flash_attn_4", "triton_short")

_GRAPH_CONFLICTS: tuple[tuple[str, Any, str], ...] = (
    ("torch_compile", lambda v: v is False, "CUDA graphs replay the compiled layers"),
    ("streaming", bool, "the static shape is read from the whole plan, which a stream does not have"),
    (
        "packs_per_step",
        lambda v: v != 1,
        "the static shape is one pack's; a row of several packs would need another",
    ),
    (
        "grad_accum",
        lambda v: v != 1,
        "a step's graph outputs may be overwritten by the next micro-batch's replay before the gradients "
        "are accumulated",
    ),
    (
        "lora_dropout",
        lambda v: v > 0,
        "dropout on the LoRA path inside graph-captured layers is not tested (LoRA without dropout is)",
    ),
    ("use_liger_kernel", bool, "Liger-Kernel's layers are not compiled"),
    ("gradient_checkpointing", bool, "recomputation inside captured layers is not tested"),
    ("fsdp", bool, "sharded units around captured layers are not tested"),
    ("loss_impl", lambda v: v == "logits", "the measured step runs the fused linear CE (loss_impl auto)"),
    ("objective", lambda v: v != "sft", "only the SFT objective is tested with CUDA graphs"),
    (
        "attn_backend",
        lambda v: v not in GRAPH_ATTN_BACKENDS,
        "captured layers need an attention backend that launches without reading cu_seqlens on the host and "
        "has a backward through varpack's custom op: auto (-> flash_attn_4, else triton_short), flash_attn_4 or "
        "triton_short",
    ),
)


#: Why NEFTune (``neftune_noise_alpha``) is refused: transformers scales its embedding noise by
#: ``alpha / sqrt(sequence length * hidden size)`` (NEFTune, arXiv:2310.05914), and a packed row's length is
#: the pack's.
NEFTUNE_REFUSAL = (
    "NEFTune scales its embedding noise by alpha / sqrt(sequence length * hidden size), and the length of a "
    "packed row is the whole pack's: a sample's noise would depend on what it is packed with"
)

#: ``TrainingArguments`` keywords that :func:`varpack.train.sft.training_arguments` sets from an
#: :class:`SFTConfig` field: in ``extra_training_args`` they are refused, naming the field (applied last,
#: they would override the field behind the run's reports, or be read nowhere: a batch size is packs).
EXTRA_ARGS_OF_FIELDS: dict[str, str] = {
    "output_dir": "output_dir",
    "per_device_train_batch_size": "packs_per_step",
    "gradient_accumulation_steps": "grad_accum",
    "num_train_epochs": "epochs",
    "max_steps": "max_steps",
    "learning_rate": "lr",
    "lr_scheduler_type": "lr_scheduler",
    "warmup_steps": "warmup_steps",
    "weight_decay": "weight_decay",
    "logging_steps": "logging_steps",
    "report_to": "report_to",
    "dataloader_num_workers": "dataloader_num_workers",
    "bf16": "bf16",
    "seed": "seed",
    "gradient_checkpointing": "gradient_checkpointing",
    "activation_checkpointing": "gradient_checkpointing",  # transformers 5's name of the same setting
}

#: ``TrainingArguments`` keywords refused in ``extra_training_args`` whatever their value: (why).
EXTRA_ARGS_REFUSED: dict[str, str] = {
    "neftune_noise_alpha": NEFTUNE_REFUSAL,
    "remove_unused_columns": "the Trainer must keep the packed batch's boundary fields (varpack sets False)",
    "train_sampling_strategy": "the packs run in the plan's order (varpack sets 'sequential')",
    "use_liger_kernel": "varpack applies Liger-Kernel's layers itself, with its checks: use --use-liger-kernel "
    "(use_liger_kernel=True)",
    "label_smoothing_factor": "varpack's packed loss replaces the Trainer's and has no label smoothing",
}


#: Why ``loss_impl="linear_ce"`` is refused with transformers' own ``torch_compile``.
LINEAR_CE_HF_COMPILE_REFUSAL = (
    "the chunked linear CE calls the base model and the LM head outside the model's forward, which "
    "TrainingArguments.torch_compile compiles, so that compile would never run: use varpack's compiled layers "
    "(torch_compile) instead, or loss_impl='logits'"
)


def transformers_compile(extra: Mapping[str, Any]) -> bool:
    """Whether ``extra_training_args`` turns on transformers' own ``torch_compile``: set truthy, or implied by a
    ``torch_compile_backend`` / ``torch_compile_mode`` (``TrainingArguments`` then sets ``torch_compile=True``)."""
    return _truthy(extra.get("torch_compile")) or any(
        extra.get(key) is not None for key in ("torch_compile_backend", "torch_compile_mode")
    )


def check_extra_training_args(extra: Mapping[str, Any]) -> None:
    """Refuse ``extra_training_args`` keys that an :class:`SFTConfig` field sets
    (:data:`EXTRA_ARGS_OF_FIELDS`) or that varpack cannot run exactly (:data:`EXTRA_ARGS_REFUSED`).

    Raises:
        ValueError: naming the key, and the flag and field to use instead (or why it is refused).
    """
    for key in extra:
        if key in EXTRA_ARGS_OF_FIELDS:
            name = EXTRA_ARGS_OF_FIELDS[key]
            raise ValueError(
                f"SFTConfig.extra_training_args sets TrainingArguments.{key}, which varpack sets from its own setting "
                f"--{name.replace('_', '-')} ({name}=...): give it there"
            )
        if key in EXTRA_ARGS_REFUSED:
            raise ValueError(f"SFTConfig.extra_training_args sets TrainingArguments.{key}: {EXTRA_ARGS_REFUSED[key]}")


def check_training_arguments(config: SFTConfig) -> None:
    """Check, by transformers' own definitions, what ``TrainingArguments`` would refuse only when the Trainer is
    built (after the data is encoded): ``lr_scheduler`` a value of ``transformers.SchedulerType``, and every
    ``extra_training_args`` key a keyword of ``transformers.TrainingArguments``. Imports transformers.

    Raises:
        ValueError: ``SFTConfig.lr_scheduler has an invalid value: 'foo'; choose one of linear, cosine, ...``;
            ``SFTConfig.extra_training_args sets 'max_grad_nrom', which transformers' TrainingArguments does not
            take (did you mean 'max_grad_norm'?)``.
    """
    import dataclasses
    import difflib

    from transformers import SchedulerType, TrainingArguments

    schedulers = [s.value for s in SchedulerType]
    if config.lr_scheduler not in schedulers:
        raise ValueError(
            f"SFTConfig.lr_scheduler has an invalid value: {config.lr_scheduler!r}; choose one of "
            f"{', '.join(schedulers)} (transformers' SchedulerType)"
        )
    keywords = [f.name for f in dataclasses.fields(TrainingArguments) if f.init]
    unknown = [key for key in config.extra_training_args if key not in keywords]
    if unknown:
        guesses = {key: difflib.get_close_matches(key, keywords, n=1) for key in unknown}
        named = ", ".join(
            repr(key) + (f" (did you mean {close[0]!r}?)" if close else "") for key, close in guesses.items()
        )
        raise ValueError(
            f"SFTConfig.extra_training_args sets {named}, which transformers' TrainingArguments does not take"
        )


def setting_text(name: str, value: Any) -> str:
    """A setting as both audiences spell it: the ``varpack sft`` flag, then the :class:`SFTConfig` field
    (``--lora (lora=True)``, ``--packs-per-step 2 (packs_per_step=2)``, ``--torch-compile false
    (torch_compile=False)``). On the command line :func:`varpack.cli._common.flag_wording` leaves the field in
    the parentheses as it is (a ``--config`` file's key)."""
    flag = "--" + name.replace("_", "-")
    if value is True:
        shown = flag
    elif value is False:
        shown = f"{flag} false" if _hints().get(name) == AutoBool else "--no-" + flag[2:]
    else:
        shown = f"{flag} {value}"
    return f"{shown} ({name}={value!r})"


def check_precision(config: SFTConfig) -> None:
    """Refuse ``bf16`` with a ``dtype`` other than ``float32``. ``bf16`` is mixed precision: transformers'
    ``TrainingArguments.bf16``, bfloat16 autocast over float32 master weights (the optimizer updates float32
    weights); ``dtype`` is the weights' own dtype. With ``dtype="bfloat16"`` there is no float32 master copy,
    so ``bf16`` would not be what runs; with ``dtype="float16"`` the float16 weights are cast to bfloat16 in every
    autocast op and get float16 gradients without loss scaling. Either way one of the two settings is not what
    the user asked for, so neither is picked silently.

    Raises:
        ValueError: naming both settings (:func:`setting_text`) and the two ways out.
    """
    if not config.bf16 or config.dtype == "float32":
        return
    what = {
        "bfloat16": "--dtype bfloat16 makes the weights themselves bfloat16, so there would be no float32 master copy",
        "float16": "float16 weights would be cast to bfloat16 in every autocast op and get float16 gradients "
        "without loss scaling",
    }[config.dtype]
    raise ValueError(
        f"{setting_text('dtype', config.dtype)} with {setting_text('bf16', True)}: --bf16 is bfloat16 autocast "
        f"over float32 master weights, and {what}. Pass one of them: --bf16 alone (mixed precision, float32 "
        f"master weights) or --dtype {config.dtype} alone ({config.dtype} weights and optimizer state, less memory)"
    )


#: Why fp16 mixed precision is refused on the CPU: accelerate (``Accelerator.__init__``) enables float16 autocast
#: and its GradScaler only on a device other than the CPU, so ``TrainingArguments.fp16`` there trains in plain
#: float32 (the same losses as without it)
CPU_FP16_REFUSAL = (
    "fp16 mixed precision does not run on the CPU under accelerate: it turns float16 autocast (and its loss "
    "scaling) off there, so the run would train in plain float32. Use bf16 mixed precision instead (--bf16, "
    "bf16=True: bfloat16 autocast over float32 master weights, which runs on the CPU) or leave fp16 off (float32)"
)


def check_fp16_device(fp16: bool, device: str, *, setting: str = "fp16=True") -> None:
    """Refuse fp16 mixed precision (``TrainingArguments.fp16``) on the CPU, where it would not run
    (:data:`CPU_FP16_REFUSAL`); float16 *weights* (``dtype="float16"``) are not autocast and are not refused.

    Args:
        fp16: whether fp16 mixed precision is asked for.
        device: the device type the run trains on (``"cpu"``, ``"cuda"``, ...).
        setting: how the caller names the setting in the message.

    Raises:
        ValueError: ``fp16`` on ``device == "cpu"``, naming ``setting``.
    """
    if fp16 and device == "cpu":
        raise ValueError(f"{setting}: {CPU_FP16_REFUSAL}")


def check_context_parallel(config: SFTConfig, *, world_size: int | None = None) -> None:
    """Refuse what ``context_parallel > 1`` does not implement, before any data is encoded: the sample-mean
    loss (a sample's tokens are spread over the ranks), the chunked linear CE, DPO, streaming (the ranks of a
    group must read the same packs), CUDA graphs (one process), a forced ``torch_compile``; and a
    ``world_size`` it does not divide (world = data parallel x context parallel).

    Raises:
        ValueError: naming both settings (:func:`setting_text`) and why.
    """
    cp = config.context_parallel
    if cp == 1:
        return
    refused = [
        ("loss_reduction", "sample", "a sample's tokens are spread over the ranks of a group; use --loss-reduction token"),
        ("loss_impl", "linear_ce", "not implemented; use --loss-impl logits or auto"),
        ("objective", "dpo", "not implemented (a pair's log-probabilities would span the ranks)"),
        ("streaming", True, "the ranks of a group must read the same packs: plan the data (no --streaming)"),
        ("cuda_graphs", True, "CUDA graphs run one process"),
        ("torch_compile", True, "compiled layers are not tested with the collectives; leave --torch-compile auto"),
    ]  # fmt: skip
    for name, value, why in refused:
        given = getattr(config, name)
        if (given is value) if isinstance(value, bool) else (given == value):
            raise ValueError(
                f"{setting_text('context_parallel', cp)} with {setting_text(name, value)}: {why}"
            )
    if world_size is not None and world_size % cp:
        raise ValueError(
            f"{setting_text('context_parallel', cp)} needs a world size that it divides (data parallel x context "
            f"parallel), got {world_size} process{'es' if world_size != 1 else ''}: launch with torchrun "
            f"--nproc-per-node {cp} (or a multiple)"
        )


def _graph_settings_conflict(
    config: SFTConfig, *, device: str, world_size: int, environ: Mapping[str, str] | None
) -> tuple[str, str] | None:
    """The first setting of ``config`` (or its environment) that CUDA graphs cannot be shown to run exactly
    with: ``(setting as the user wrote it, why)``, or ``None`` (:func:`check_cuda_graphs` lists the order)."""
    for name, bad, why in _GRAPH_CONFLICTS:
        value = getattr(config, name)
        if bad(value):
            return setting_text(name, value), why
    env = os.environ if environ is None else environ
    extra = config.extra_training_args
    if _truthy(extra.get("fsdp")) or _truthy(env.get("ACCELERATE_USE_FSDP")):
        return "FSDP", "sharded units around captured layers are not tested"
    if _truthy(extra.get("deepspeed")) or _truthy(env.get("ACCELERATE_USE_DEEPSPEED")):
        return "DeepSpeed", "captured layers under it are not tested"
    if transformers_compile(extra):
        return (
            "transformers' own torch_compile (extra_training_args)",
            "it would compile the whole model around the captured layers",
        )
    if world_size > 1:
        return f"{world_size} ranks", "captured layers under DDP are neither tested nor measured; run one process"
    if device != "cuda":
        return _device_setting(device), "CUDA graphs need a CUDA GPU"
    return None


def _device_setting(device: str) -> str:
    return f"a {device.upper()} run"


#: the reason on the ``speed`` line when ``cuda_graphs="auto"`` turns the static-shape CUDA-graph step on
#: (benchmarks/RESULTS.md#sft-step: 75.3 ms/step vs 140.8 ms of dynamic shapes + regional compile, Qwen3-0.6B
#: shape, packing_length 8192, one H200)
GRAPHS_AUTO_REASON = "auto on one CUDA GPU: fastest measured, benchmarks/RESULTS.md"


def resolve_cuda_graphs(
    config: SFTConfig, *, device: str, world_size: int = 1, environ: Mapping[str, str] | None = None
) -> CompileChoice:
    """Whether a run of ``config`` takes the static-shape CUDA-graph step (``SFTConfig.cuda_graphs``), and why,
    from its settings; the model's own refusal (:func:`varpack.integrations.cuda_graphs.model_refusal`:
    vision-language, recurrent mixers, float32 without autocast) is :func:`varpack.train.sft.build_sft`'s, once
    the model is loaded.

    ``True``: :func:`check_cuda_graphs` (raises on a conflict), then on, reason ``"--cuda-graphs"``. ``False``:
    off, reason ``"--cuda-graphs false"``. ``"auto"`` (the default): on, reason :data:`GRAPHS_AUTO_REASON`,
    unless the device is not CUDA (``"auto: CPU run; CUDA graphs need a CUDA GPU"``) or a setting conflicts (the
    order of :func:`check_cuda_graphs`): then off, reason ``"auto: <setting>: <why>"`` (``"auto: --grad-accum 4
    (grad_accum=4): a step's graph outputs may be overwritten ..."``), so the run takes the next
    fastest step and the ``speed`` line says why.

    Args:
        config: the run's settings.
        device: the device type the run trains on (the Trainer's ``TrainingArguments.device.type``).
        world_size: processes training together.
        environ: the environment accelerate reads (default: ``os.environ``).

    Returns:
        :class:`CompileChoice` ``(on, reason, hint)``; ``hint`` ``"--cuda-graphs false for dynamic shapes"``
        when auto turned it on.

    Raises:
        ValueError: ``cuda_graphs=True`` with a conflicting setting (:func:`check_cuda_graphs`).
    """
    value = config.cuda_graphs
    if value is True:
        check_cuda_graphs(config, device=device, world_size=world_size, environ=environ)
        return CompileChoice(True, "--cuda-graphs")
    if value is False:
        return CompileChoice(False, "--cuda-graphs false")
    if device != "cuda":  # first: nothing else matters on another device
        return CompileChoice(False, f"auto: {device.upper()} run; CUDA graphs need a CUDA GPU")
    conflict = _graph_settings_conflict(config, device=device, world_size=world_size, environ=environ)
    if conflict is not None:
        return CompileChoice(False, f"auto: {conflict[0]}: {conflict[1]}")
    return CompileChoice(True, GRAPHS_AUTO_REASON, "--cuda-graphs false for dynamic shapes")


def check_cuda_graphs(
    config: SFTConfig, *, device: str, world_size: int = 1, environ: Mapping[str, str] | None = None
) -> None:
    """Refuse ``cuda_graphs=True`` where it cannot be shown to run exactly (never a silent fallback to the
    default step). Nothing happens when ``cuda_graphs`` is off or ``"auto"`` (:func:`resolve_cuda_graphs`
    falls back instead, saying why).

    Checked in this order: the settings of :data:`_GRAPH_CONFLICTS` (``torch_compile=False``, ``streaming``,
    ``packs_per_step != 1``, ``grad_accum != 1``, ``lora_dropout > 0``, ``use_liger_kernel``, ``gradient_checkpointing``,
    ``fsdp``, ``loss_impl="logits"``, ``objective="dpo"``, an ``attn_backend`` outside
    :data:`GRAPH_ATTN_BACKENDS`), FSDP / DeepSpeed / transformers' own
    ``torch_compile`` from ``extra_training_args`` or accelerate's environment, ``world_size > 1``, then
    ``device != "cuda"``. (The model's own refusals -- vision-language, Gated DeltaNet layers -- are
    :func:`varpack.train.sft.build_sft`'s, once the model is loaded.)

    Raises:
        ValueError: ``"--cuda-graphs ..."`` naming the conflicting setting as flag and field
            (:func:`setting_text`: ``--cuda-graphs with --grad-accum 4 (grad_accum=4): ...``) and why.
    """
    if config.cuda_graphs is not True:
        return
    conflict = _graph_settings_conflict(config, device=device, world_size=world_size, environ=environ)
    if conflict is None:
        return
    setting, why = conflict
    if setting == _device_setting(device):
        raise ValueError(f"--cuda-graphs needs a CUDA GPU; this run trains on {device}")
    raise ValueError(f"--cuda-graphs with {setting}: {why}")


def _lr_help(defaults: dict[str, Any]) -> str:
    if defaults.get("lr") is not None:
        return "peak learning rate (AdamW) (default: %(default)s)"
    return (
        f"peak learning rate (AdamW) (default: {DEFAULT_LR['random-init']:g} for a random-init built-in "
        f"model, {DEFAULT_LR['pretrained']:g} for a model directory or GGUF file; with --objective dpo "
        f"{DEFAULT_DPO_LR['random-init']:g} and {DEFAULT_DPO_LR['pretrained']:g})"
    )


def _strategy_help(defaults: dict[str, Any]) -> str:
    from varpack.plan import strategies_help

    return f"{strategies_help()} (default: %(default)s)"


def _opt(text: Any, **more: Any) -> dict[str, Any]:
    """A field's metadata: ``help`` text and the other keys of the module docstring."""
    return {"help": text, **more}


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """Settings of a packed SFT run (the ``varpack sft`` flags carry the same names, ``_`` -> ``-``).

    Attributes:
        model: model directory, ``.gguf`` file / package, or a built-in name (``tiny-qwen3``, ``tiny-llama``,
            ``qwen3-0.6b-shape``, ...).
        data: chat data files (JSON / JSONL / parquet with ``messages``); empty: the built-in chats.
        output_dir: where the final model + tokenizer (and the Trainer's files) are written.
        packing_length: tokens per pack (the row length budget of one pack); default
            :data:`varpack.plan.DEFAULT_PACKING_LENGTH` (4096), the same as ``varpack plan``.
        packing_strategy: ``bfd`` (best-fit decreasing) or ``sequential`` (order-preserving next-fit).
        overflow: samples longer than ``packing_length``: ``error`` (default: refuse, listing their ids and
            lengths), ``drop``, ``truncate`` or ``split`` (pieces of ``packing_length`` tokens, each trained as a
            sequence of its own: a supervised token that starts a piece is not a target, and the planned run's
            packing report counts them); whatever happens is in the packing report.
        streaming: read ``data`` lazily (JSON Lines, line by line; the built-in chats without ``data``),
            encode every chat when it is read and pack online over a buffer of ``buffer_size`` samples
            (:class:`varpack.data.stream.StreamingPackedDataset`); needs ``max_steps``.
        buffer_size: with ``streaming``: samples packed together (``>= 2``); default
            :data:`varpack.plan.streaming.DEFAULT_BUFFER_SIZE`, chosen by ``benchmarks/streaming.py``.
        packs_per_step: packs per micro-batch per device (all flattened into one row).
        grad_accum: gradient-accumulation micro-batches per optimizer step.
        epochs: passes over the packs (ignored when ``max_steps > 0``).
        max_steps: optimizer steps; ``-1``: run ``epochs``.
        lr: peak learning rate (AdamW); ``None`` (default): :func:`default_lr` of ``model``, i.e.
            :data:`DEFAULT_LR` ``["random-init"]`` (3e-3) for a built-in random-init model and
            ``["pretrained"]`` (1e-4) for loaded weights (a model directory or GGUF file).
        lr_scheduler: transformers scheduler name (``constant``, ``linear``, ``cosine``, ...); an open set
            (it grows with transformers), checked against ``transformers.SchedulerType`` before the data is
            encoded (:func:`check_training_arguments`).
        warmup_steps: linear warm-up steps.
        weight_decay: AdamW weight decay (``>= 0``).
        loss_reduction: ``token`` (global token mean) or ``sample`` (global sample mean).
        loss_impl: ``auto`` (``linear_ce`` when the model allows it and runs unwrapped, else ``logits``),
            ``linear_ce`` (chunked, no ``[T, V]`` logits) or ``logits``.
        attn_backend: varpack attention backend (``auto``, ``reference``, ``flex``, ...).
        gated_delta_backend: gated delta rule backend of the linear-attention (Gated DeltaNet) layers of a
            Qwen3.5 / Qwen3-Next model: ``auto`` (fla when it runs forward and backward on the device, else
            ``fla_hybrid`` on CUDA when its probe passes, else ``chunk``: :mod:`varpack.ops.gated_delta_rule.dispatch`)
            or a forced ``fla``, ``fla_hybrid``, ``chunk``, ``chunk_compiled``, ``naive``.
            :func:`varpack.train.sft.build_sft` refuses, before the data is encoded where it can, a forced name for a
            model without Gated DeltaNet layers and one that cannot run on the training device (with its
            reason; never a silent fallback); ``varpack sft`` prints the backend and why on its ``linear`` line.
        rank_balance: under several ranks, balance every micro-batch's packs across the ranks by cost
            (:class:`varpack.data.sampler.BalancedPackSampler`, :mod:`varpack.plan.balance`); ``False``: the
            plan's per-epoch order dealt round-robin. Either way every sample once per epoch, no repeats.
        attention_cost_weight: ``>= 0``, the weight of ``sum L_i^2`` in a pack's cost (tokens);
            ``None``: :func:`varpack.plan.balance.attention_cost_weight` of the model's config.
        fsdp: FSDP2 (``torch.distributed.fsdp.fully_shard``) through transformers' ``fsdp=True``,
            ``fsdp_config={"version": 2}`` (accelerate wraps each decoder layer, ``_no_split_modules``); CUDA
            only (accelerate shards on GPUs and would run plain DDP on CPUs: refused there). The loss then
            runs through the model's logits (``loss_impl="auto"``), as the chunked linear CE reads the LM head
            outside the sharded forward.
        context_parallel: ranks that share one packed row (``>= 1``; ``1``: off). The world (torchrun) is
            ``data parallel x context parallel`` on a 2-D ``DeviceMesh``; each context-parallel group trains
            the same packs, every rank a zigzag share of each row's tokens
            (:mod:`varpack.integrations.context_parallel`, docs/context_parallel.md). Exact: the step equals
            the one-process step. Refused with ``loss_reduction="sample"``, ``loss_impl="linear_ce"``,
            ``objective="dpo"``, ``streaming``, ``cuda_graphs``, ``torch_compile=True``, a world size it does
            not divide, and (by the model) Gated DeltaNet value heads it does not divide.
        context_parallel_attention: how full-attention layers attend over a split row: ``auto`` (Ulysses
            all-to-all where the attention heads divide ``context_parallel``, else ring attention),
            ``ulysses`` or ``ring``.
        bf16: train in bfloat16 autocast (mixed precision; master weights stay float32): needs ``dtype="float32"``
            (:func:`check_precision`).
        dtype: parameter dtype of the model (``float32`` default; a loaded model is cast to it); ``bf16`` /
            ``fp16`` / ``fp32`` are taken as ``bfloat16`` / ``float16`` / ``float32``
            (:data:`varpack._argtypes.DTYPE_SPELLINGS`). With ``bf16`` only ``float32`` (:func:`check_precision`).
        seed: random-init seed of built-in models, plan seed and Trainer seed.
        logging_steps: log every N optimizer steps.
        num_proc: encoding worker processes.
        dataloader_num_workers: DataLoader workers.
        gradient_checkpointing: recompute activations in backward.
        use_liger_kernel: replace RMSNorm / RoPE / SwiGLU by Liger-Kernel's fused Triton kernels (CUDA; needs
            ``liger-kernel``): :func:`varpack.integrations.kernels.apply_liger_kernels`. The loss stays varpack's.
        torch_compile: ``torch.compile`` each decoder layer, varpack attention outside the graph
            (:func:`varpack.integrations.kernels.compile_layers`); ``True``, ``False`` or ``"auto"`` (default):
            :func:`resolve_torch_compile` decides per run (on for a CUDA run, one process, DDP or FSDP2,
            without Liger, LoRA, context parallelism, FSDP1 or DeepSpeed; off on a CPU);
            :func:`varpack.train.sft.build_sft` returns the config with
            the resolved ``True`` / ``False``, and ``varpack sft`` prints it on its ``speed`` line. Cost: the first
            step compiles (:data:`COMPILE_COLD_COST`). ``True`` with ``use_liger_kernel`` is refused
            (:data:`varpack.integrations.kernels.LIGER_COMPILE_REFUSAL`).
        cuda_graphs: the static-shape CUDA-graph step (:mod:`varpack.integrations.cuda_graphs`): the collator
            pads every pack to ``StaticShape.from_plan(plan)``, the layers are compiled with
            :data:`varpack.integrations.cuda_graphs.GRAPH_COMPILE_KW` and replayed as CUDA graphs, the loss is
            the fused linear CE; ``torch_compile="auto"`` resolves to on. ``"auto"`` (default): on where it runs
            exactly (:func:`resolve_cuda_graphs`, then the model's
            :func:`varpack.integrations.cuda_graphs.model_refusal`), else off with the reason on the ``speed``
            line; ``True``: refused by :func:`check_cuda_graphs` / the model where auto would fall back;
            :func:`varpack.train.sft.build_sft` returns the config with the resolved ``True`` / ``False``.
        save: save model + tokenizer at the end (with ``lora``: the adapter, peft's ``save_pretrained``).
        lora: wrap the model in a peft LoRA adapter (:func:`varpack.train.sft.apply_lora`) and train only the
            adapter weights; needs ``peft`` (``pip install 'varpack[lora]'``).
        lora_r: LoRA rank (``>= 1``).
        lora_alpha: LoRA alpha (``>= 1``); the adapter's output is scaled by ``lora_alpha / lora_r``.
        lora_dropout: dropout on the LoRA path (``[0, 1)``).
        lora_target_modules: peft's ``target_modules``: ``all-linear`` (every linear layer except the LM
            head) or comma-separated module names (``q_proj,k_proj,v_proj,o_proj``).
        lora_merge: with ``lora`` and ``save``: also save the merged model (base weights + adapter, peft's
            ``merge_and_unload``) to ``<output_dir>/merged``.
        objective: ``sft`` (next-token loss on chats) or ``dpo`` (DPO on preference pairs,
            :mod:`varpack.train.objectives.dpo`; ``data`` then holds ``{prompt, chosen, rejected}`` rows, empty:
            the built-in pairs; the reference is a frozen copy of the starting model, or with ``lora`` the model
            with its adapters disabled).
        beta: DPO ``beta`` (TRL's name), ``> 0``.
        label_smoothing: DPO label smoothing in ``[0, 0.5)`` (TRL's name), only with ``loss_type="robust"``.
        loss_type: DPO loss, ``sigmoid`` or ``robust`` (TRL's names and formulas).
        report_to: Trainer integrations (``none`` by default; several comma-separated); transformers' open
            set (``all``, ``tensorboard``, ``wandb``, ...), checked by ``TrainingArguments``. They get
            varpack's per-step metrics and the packing report (docs/usage.md "Logging",
            :mod:`varpack.train.reporting`).
        extra_training_args: more ``transformers.TrainingArguments`` keywords (applied last); a key
            ``TrainingArguments`` does not take is refused before the data is encoded
            (:func:`check_training_arguments`).

    Raises:
        ValueError: a field with an invalid value, as ``SFTConfig.<field> has an invalid value: <value>``
            (a ``Literal`` field also lists its choices); also a field of :data:`DEPENDENT_SETTINGS` set away from
            its default without the setting it needs (``... (needs --lora (lora=True))``).
    """

    model: str = field(
        default="tiny-qwen3",
        metadata=_opt(
            "model directory, .gguf file / package, or a built-in name (default: %(default)s)",
            metavar="DIR|NAME",
            aliases=("model_name_or_path",),
        ),
    )
    data: tuple[str, ...] = field(
        default=(),
        metadata=_opt(
            "chat data files (JSON/JSONL/parquet) (default: the built-in chats)",
            metavar="PATH",
            aliases=("dataset",),
        ),
    )
    output_dir: str = field(
        default="varpack-sft",
        metadata=_opt("where the model and tokenizer are saved (default: %(default)s)", metavar="DIR"),
    )
    packing_length: int = field(
        default=DEFAULT_PACKING_LENGTH,
        metadata=_opt(
            "tokens per pack (default: %(default)s)",
            metavar="N",
            cli_type="int>=1",
            aliases=("max_length", "max_seq_length"),
        ),
    )
    packing_strategy: PackingStrategy = field(default="bfd", metadata=_opt(_strategy_help))
    overflow: OverflowPolicy = field(
        default="error", metadata=_opt("samples longer than --packing-length (default: %(default)s)")
    )
    streaming: bool = field(
        default=False,
        metadata=_opt(
            "read --data lazily (JSONL), encode chats on the fly and pack online over a buffer of "
            "--buffer-size samples; needs --max-steps (a stream's length is not known before it is read)"
        ),
    )
    buffer_size: int = field(
        default=DEFAULT_BUFFER_SIZE,
        metadata=_opt(
            "with --streaming: samples packed together (best-fit decreasing over a bounded buffer); "
            "a larger buffer fills packs closer to the global plan (default: %(default)s)",
            metavar="K",
            cli_type="int>=2",
        ),
    )
    packs_per_step: int = field(
        default=1,
        metadata=_opt(
            "packs per micro-batch per device, flattened into one row (default: %(default)s)",
            metavar="P",
            cli_type="int>=1",
            aliases=("per_device_train_batch_size",),
        ),
    )
    grad_accum: int = field(
        default=1,
        metadata=_opt(
            "gradient-accumulation micro-batches per optimizer step (default: %(default)s)",
            metavar="K",
            cli_type="int>=1",
            aliases=("gradient_accumulation_steps",),
        ),
    )
    epochs: float = field(
        default=1.0,
        metadata=_opt(
            "passes over the packs, ignored with --max-steps (default: %(default)s)",
            metavar="E",
            cli_type="float>0",
            aliases=("num_train_epochs",),
        ),
    )
    max_steps: int = field(
        default=-1,
        metadata=_opt(
            "optimizer steps; -1: run --epochs (default: %(default)s)", metavar="N", cli_type="max_steps"
        ),
    )
    lr: float | None = field(
        default=None, metadata=_opt(_lr_help, metavar="LR", cli_type="float>0", aliases=("learning_rate",))
    )
    lr_scheduler: str = field(
        default="constant",
        metadata=_opt(
            "transformers scheduler name: constant, linear, cosine, ... (default: %(default)s)",
            metavar="NAME",
            aliases=("lr_scheduler_type",),
        ),
    )
    warmup_steps: int = field(
        default=0,
        metadata=_opt("linear warm-up steps (default: %(default)s)", metavar="N", cli_type="int>=0"),
    )
    weight_decay: float = field(
        default=0.0, metadata=_opt("AdamW weight decay, >= 0 (default: %(default)s)", metavar="WD")
    )
    loss_reduction: LossReduction = field(
        default="token",
        metadata=_opt("token: global token mean; sample: global sample mean (default: %(default)s)"),
    )
    loss_impl: LossImpl = field(
        default="auto",
        metadata=_opt("linear_ce: chunked LM head + CE without [T, V] logits (default: %(default)s)"),
    )
    attn_backend: AttnBackendName = field(
        default="auto",
        metadata=_opt("varpack attention backend (default: %(default)s)", aliases=("attn_impl",)),
    )
    gated_delta_backend: GatedDeltaBackendName = field(
        default="auto",
        metadata=_opt(
            "gated delta rule backend of the linear-attention layers of Qwen3.5 / Qwen3-Next models. auto: fla "
            "if it runs forward and backward on the device, else fla_hybrid on CUDA when its probe passes, else "
            "chunk (varpack's PyTorch path); the run's 'linear' line says which and why. A forced one that "
            "cannot run on the training device is an error with its reason; refused for a model without such "
            "layers (default: %(default)s)"
        ),
    )
    rank_balance: bool = field(
        default=True,
        metadata=_opt(
            "under several ranks (torchrun): give the ranks packs of near-equal cost in every micro-batch "
            "(tokens + attention_cost_weight x sum of squared sample lengths); off: the plan's order dealt "
            "round-robin"
        ),
    )
    attention_cost_weight: float | None = field(
        default=None,
        metadata=_opt(
            "weight of the sum of squared sample lengths in a pack's cost, in tokens (default: attention vs "
            "linear-layer FLOPs of the model's config)",
            metavar="A",
        ),
    )
    fsdp: bool = field(
        default=False,
        metadata=_opt(
            "under torchrun on GPUs: shard parameters, gradients and optimizer state over the ranks with FSDP2 "
            "(torch.distributed.fsdp.fully_shard through transformers / accelerate, one unit per decoder layer)"
        ),
    )
    context_parallel: int = field(
        default=1,
        metadata=_opt(
            "ranks that share one packed row (context parallelism, for packs too long for one GPU's "
            "activations): under torchrun the world is data parallel x context parallel; every rank holds a "
            "zigzag share of each row; exact (equal to the one-process step). 1: off (default: %(default)s)",
            metavar="N",
            cli_type="int>=1",
        ),
    )
    context_parallel_attention: ContextParallelAttention = field(
        default="auto",
        metadata=_opt(
            "with --context-parallel: ulysses (all-to-all to head shards, any attention backend; the heads must "
            "divide N), ring (key/value blocks passed round the ring, log-sum-exp merge; any head count) or "
            "auto (ulysses where the heads divide, else ring) (default: %(default)s)"
        ),
    )
    bf16: bool = field(
        default=False,
        metadata=_opt(
            "bfloat16 mixed precision: bfloat16 autocast over float32 master weights (--dtype float32)"
        ),
    )
    dtype: DTypeName = field(
        default="float32",
        metadata=_opt(
            "parameter dtype of the model; also bf16, fp16, fp32, as varpack check spells them. --bf16 is "
            "autocast over float32 weights: refused beside bfloat16 / float16 (default: %(default)s)",
            cli_type="dtype",
        ),
    )
    seed: int = field(
        default=0,
        metadata=_opt(
            "random-init seed of built-in models, plan and Trainer seed (default: %(default)s)",
            metavar="S",
            cli_type="int>=0",
        ),
    )
    logging_steps: int = field(
        default=1,
        metadata=_opt("log every N optimizer steps (default: %(default)s)", metavar="N", cli_type="int>=1"),
    )
    num_proc: int | None = field(
        default=None,
        metadata=_opt(
            "encoding worker processes", metavar="N", cli_type="int>=1", aliases=("dataset_num_proc",)
        ),
    )
    dataloader_num_workers: int = field(
        default=0,
        metadata=_opt("DataLoader worker processes (default: %(default)s)", metavar="N", cli_type="int>=0"),
    )
    gradient_checkpointing: bool = field(
        default=False, metadata=_opt("recompute activations in the backward pass")
    )
    use_liger_kernel: bool = field(
        default=False,
        metadata=_opt(
            "Liger-Kernel's fused RMSNorm / RoPE / SwiGLU (CUDA, pip install liger-kernel); the loss stays "
            "varpack's"
        ),
    )
    torch_compile: AutoBool = field(
        default="auto",
        metadata=_opt(
            "torch.compile each decoder layer (varpack attention stays outside the graph). auto: on for a "
            "CUDA run (one process, DDP or FSDP2) without --use-liger-kernel, --lora, --context-parallel, FSDP1, "
            "DeepSpeed or transformers' own torch_compile in --extra-training-args (compile + chunked linear CE "
            "is the fastest exact setup measured on one GPU, benchmarks/RESULTS.md), off on any other device "
            "(CPU, MPS, ...); the run's "
            "'speed' line says which and why. The first step compiles (~14 s for a 0.6B model on an H200). "
            "--torch-compile: on; --torch-compile false or --no-torch-compile: off (default: %(default)s)",
            metavar="auto|true|false",
        ),
    )
    cuda_graphs: AutoBool = field(
        default="auto",
        metadata=_opt(
            "static shapes + CUDA graphs, the fastest exact step measured: every pack padded to one static shape "
            "(StaticShape.from_plan over the whole plan; the pad cost is on the 'speed' line), each decoder layer "
            "compiled whole with attention inside (custom ops, fullgraph, dynamic=False) and replayed as CUDA "
            "graphs (mode=reduce-overhead), fused linear CE: 75 vs 141 ms/step of dynamic shapes (1.9x) for a "
            "0.6B model at packing length 8192 on an H200 (benchmarks/RESULTS.md). auto: on where it runs "
            "exactly -- CUDA, one process, a planned run (no --streaming), --packs-per-step 1, --grad-accum 1, "
            "bf16 (--bf16 or --dtype bfloat16), --attn-backend auto / flash_attn_4 / triton_short (--lora "
            "included, without --lora-dropout), no --use-liger-kernel, --gradient-checkpointing, FSDP, DeepSpeed, --loss-impl logits, --objective dpo, "
            "vision-language or recurrent (Gated DeltaNet, Mamba-2) models; elsewhere the next fastest step, the "
            "'speed' line says why. --cuda-graphs: on, refused (never ignored) where auto would fall back; "
            "--cuda-graphs false or --no-cuda-graphs: off (default: %(default)s)",
            metavar="auto|true|false",
        ),
    )
    save: bool = field(default=True, metadata=_opt("save the model and tokenizer to --output-dir at the end"))
    lora: bool = field(
        default=False,
        metadata=_opt(
            "train a LoRA adapter (peft, pip install 'varpack[lora]') instead of all weights; saves the adapter"
        ),
    )
    lora_r: int = field(
        default=16, metadata=_opt("LoRA rank (default: %(default)s)", metavar="R", cli_type="int>=1")
    )
    lora_alpha: int = field(
        default=32,
        metadata=_opt(
            "LoRA scaling alpha (scale alpha / r) (default: %(default)s)", metavar="A", cli_type="int>=1"
        ),
    )
    lora_dropout: float = field(
        default=0.0,
        metadata=_opt("dropout on the LoRA path, in [0, 1) (default: %(default)s)", metavar="P"),
    )
    lora_target_modules: str = field(
        default="all-linear",
        metadata=_opt(
            "modules that get an adapter: comma-separated module names (q_proj,v_proj) or all-linear "
            "(every linear layer but the LM head) (default: %(default)s)",
            metavar="NAMES",
        ),
    )
    lora_merge: bool = field(
        default=False,
        metadata=_opt("with --lora: also save the merged model (base + adapter) to OUTPUT_DIR/merged"),
    )
    # -- preference training (objective dpo) ------------------------------------------------------------
    objective: ObjectiveName = field(
        default="sft",
        metadata=_opt(
            "sft: next-token loss on chats; dpo: DPO on preference pairs {prompt, chosen, rejected} (a pair stays in "
            "one pack; reference = a frozen copy of the starting model) (default: %(default)s)"
        ),
    )
    beta: float = field(
        default=0.1,
        metadata=_opt("DPO beta, as TRL names it (default: %(default)s)", metavar="B", cli_type="float>0"),
    )
    label_smoothing: float = field(
        default=0.0,
        metadata=_opt(
            "DPO label smoothing in [0, 0.5), with --loss-type robust (TRL's robust DPO) (default: %(default)s)",
            metavar="EPS",
        ),
    )
    loss_type: DPOLossType = field(
        default="sigmoid", metadata=_opt("DPO loss, as TRL names it (default: %(default)s)")
    )
    report_to: str = field(
        default="none",
        metadata=_opt(
            "Trainer logging integrations, comma-separated: none, all, tensorboard, wandb, ... "
            "(default: %(default)s)",
            metavar="NAME",
        ),
    )
    extra_training_args: dict[str, Any] = field(
        default_factory=dict,
        metadata=_opt(
            "more transformers TrainingArguments keywords as a JSON object, applied last, e.g. "
            "'{\"max_grad_norm\": 0.5}'",
            metavar="JSON",
            cli_type="json_object",
        ),
    )

    def __post_init__(self) -> None:
        # bf16 -> bfloat16, ... (``varpack check``'s spellings; a --config file may use either)
        object.__setattr__(self, "dtype", DTYPE_SPELLINGS.get(self.dtype, self.dtype))
        if isinstance(self.data, str):
            object.__setattr__(self, "data", (self.data,))
        else:
            object.__setattr__(self, "data", tuple(self.data))
        self._read_switches()
        checks = [
            ("packing_length", self.packing_length >= 1, "must be >= 1"),
            ("packs_per_step", self.packs_per_step >= 1, "must be >= 1"),
            ("grad_accum", self.grad_accum >= 1, "must be >= 1"),
            ("epochs", self.epochs > 0 or self.max_steps > 0, "must be > 0 (or max_steps >= 1)"),
            ("max_steps", self.max_steps == -1 or self.max_steps >= 1, "must be -1 (use epochs) or >= 1"),
            ("lr", self.lr is None or (self.lr > 0 and math.isfinite(self.lr)), "must be finite, > 0"),
            ("warmup_steps", self.warmup_steps >= 0, "must be >= 0"),
            ("weight_decay", self.weight_decay >= 0 and math.isfinite(self.weight_decay), "must be finite, >= 0"),
            ("logging_steps", self.logging_steps >= 1, "must be >= 1"),
            ("num_proc", self.num_proc is None or self.num_proc >= 1, "must be >= 1"),
            ("dataloader_num_workers", self.dataloader_num_workers >= 0, "must be >= 0"),
            ("extra_training_args", isinstance(self.extra_training_args, dict), "must be a JSON object"),
            ("lora_r", self.lora_r >= 1, "must be >= 1"),
            ("lora_alpha", self.lora_alpha >= 1, "must be >= 1"),
            ("lora_dropout", 0.0 <= self.lora_dropout < 1.0, "must be in [0, 1)"),
            ("lora_target_modules", bool(self.lora_target_module_list()), "names no module"),
            ("buffer_size", self.buffer_size >= 2, "must be >= 2"),
            ("context_parallel", self.context_parallel >= 1, "must be >= 1"),
            ("beta", self.beta > 0 and math.isfinite(self.beta), "must be finite, > 0"),
            ("label_smoothing", 0.0 <= self.label_smoothing < 0.5, "must be in [0, 0.5)"),
            (
                "attention_cost_weight",
                self.attention_cost_weight is None
                or (self.attention_cost_weight >= 0 and math.isfinite(self.attention_cost_weight)),
                "must be finite, >= 0",
            ),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"SFTConfig.{name} has an invalid value: {getattr(self, name)!r} ({rule})")
        check_extra_training_args(self.extra_training_args)
        if self.loss_impl == "linear_ce" and transformers_compile(self.extra_training_args):
            raise ValueError(
                f"SFTConfig.loss_impl='linear_ce' with extra_training_args turning on transformers' compile: "
                f"{LINEAR_CE_HF_COMPILE_REFUSAL}"
            )
        if self.streaming and self.max_steps < 1:
            raise ValueError(
                "SFTConfig.max_steps has an invalid value: -1; streaming needs max_steps >= 1: the number of "
                "packs of a stream is not known before it is read, and the Trainer needs the number of steps "
                "for its loop and learning-rate schedule (a stream shorter than max_steps is read again, "
                "pass after pass)"
            )
        for name, annotation in _hints().items():
            choices = literal_choices(annotation)
            if choices is not None and getattr(self, name) not in choices:
                shown = ", ".join(repr(c) for c in choices)
                raise ValueError(
                    f"SFTConfig.{name} has an invalid value: {getattr(self, name)!r}; choose one of {shown}"
                )
        defaults = _defaults()
        for name, (needed, on) in DEPENDENT_SETTINGS.items():
            if getattr(self, name) != defaults[name] and not on(self):
                raise ValueError(f"SFTConfig.{name} has an invalid value: {getattr(self, name)!r} (needs {needed})")
        if self.loss_type == "sigmoid" and self.label_smoothing != 0:
            raise ValueError(
                f"SFTConfig.label_smoothing has an invalid value: {self.label_smoothing!r}; it has no effect on "
                "loss_type='sigmoid' (TRL 1.16's sigmoid DPO loss does not read it): use loss_type='robust'"
            )
        if self.objective == "dpo" and self.overflow in ("truncate", "split"):
            raise ValueError(
                f"SFTConfig.overflow={self.overflow!r} cannot be used with objective='dpo': a preference pair "
                "stays whole in one pack, and cutting an overlong pair would cut its chosen or rejected sequence; "
                "use overflow='drop' or overflow='error', or raise packing_length"
            )

    def _read_switches(self) -> None:
        """A ``bool`` / :data:`AutoBool` field given as text is read as the flags and ``--config`` files read it
        (:func:`varpack._argtypes.parse_bool` / :func:`~varpack._argtypes.parse_auto_bool`: ``"false"``,
        ``"0"``, ``"no"`` are off, ``"auto"`` for ``torch_compile``); any other value but a bool is refused
        (a non-empty string is truthy: ``"false"`` would otherwise switch it on)."""
        import argparse

        from varpack._argtypes import parse_auto_bool, parse_bool

        for name, annotation in _hints().items():
            if annotation is not bool and annotation != AutoBool:
                continue
            value = getattr(self, name)
            auto = annotation is not bool
            if isinstance(value, str):
                try:
                    value = parse_auto_bool(value) if auto else parse_bool(value)
                except argparse.ArgumentTypeError as exc:
                    raise ValueError(f"SFTConfig.{name} has an invalid value: {value!r} ({exc})") from None
                object.__setattr__(self, name, value)
            elif not isinstance(value, bool):
                rule = "True, False or 'auto'" if auto else "True or False"
                raise ValueError(f"SFTConfig.{name} has an invalid value: {value!r} (must be {rule})")

    def lora_target_module_list(self) -> str | list[str]:
        """``lora_target_modules`` as peft's ``LoraConfig.target_modules``: ``"all-linear"`` as is, else the
        comma-separated names as a list (blanks dropped; empty when none is named)."""
        text = self.lora_target_modules.strip()
        if text == "all-linear":
            return text
        return [name.strip() for name in text.split(",") if name.strip()]


@functools.cache
def _defaults() -> dict[str, Any]:
    """``SFTConfig``'s field defaults (``default_factory`` ones called)."""
    import dataclasses

    return {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(SFTConfig)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }


@functools.cache
def _hints() -> dict[str, Any]:
    """``SFTConfig``'s resolved field annotations (``from __future__ import annotations`` keeps them strings)."""
    return typing.get_type_hints(SFTConfig)
