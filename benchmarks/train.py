"""The SFT step, steady state and cold: varpack's configurations against the peers a user would configure.

Model: ``--model`` (default ``qwen3-0.6b-shape``: Qwen3-0.6B's published config, random init, the same seed
for every configuration), bf16 weights, fused AdamW (lr 1e-5), trained on the same packs by every
configuration (:func:`benchmarks._common.fullest_packs`: the ``--steps`` fullest best-fit-decreasing packs of
``--packing-length`` over the samples of ``--samples``; one pack = one optimizer step).

Peers (the best peer of a round is the fastest of those that ran in it):

* ``padded``: HF ``DataCollatorForSeq2Seq`` (right padding, labels padded with -100), ``sdpa`` with the
  attention mask; each step's samples in random order (HF's sampler) in micro-batches of ``--pad-batch``,
  gradient accumulation with HF's ``num_items_in_batch`` token mean;
* ``hf_fa4`` / ``hf_flex`` / ``hf_sdpa``: HF ``DataCollatorWithFlattening(return_flash_attn_kwargs=True,
  return_seq_idx=True)`` with HF's ``flash_attention_4`` / ``flex_attention`` / ``sdpa``;
* ``hf_fa4_liger``: ``hf_fa4`` plus Liger-Kernel as TRL's ``SFTConfig(use_liger_kernel=True)`` applies it
  (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy);
* ``trl_padding_free`` (needs TRL): TRL's ``SFTTrainer(padding_free=True)`` on the same packs as TRL packed
  rows, with the best attention that builds (``--trl-attn``).

varpack (``PaddingFreeCollator`` + ``enable_varpack``, attention ``--attn-backend``; a row may name its own:
``varpack_lce@triton_short``):

* ``varpack``: the plain loss on full logits (``varpack.loss.causal_lm_loss``); ``varpack_lce``: the chunked
  linear cross-entropy (no ``[T, V]`` logits; ``--lce-backend``), ``varpack_lce_chunked`` its PyTorch backend;
  both run the LM head on the supervised rows only, as ``varpack sft`` does (``--lm-head-rows all``: every row);
* suffixes: ``_liger`` (Liger RMSNorm / RoPE / SwiGLU), ``_compile`` (regional ``torch.compile`` of the
  decoder layers, attention a graph break), ``_ops`` (attention as the ``varpack::varlen_attention`` custom op
  inside each compiled layer), ``_static`` (every pack padded to one static shape, ``StaticShape.from_plan``,
  layers compiled with ``dynamic=False``), ``_graphs`` (static shapes plus CUDA graphs per layer, what
  ``varpack sft --cuda-graphs`` runs; a layer that cannot be captured is an error, never an eager fallback;
  CUDA only);
* ``trl_varpack`` (needs TRL): ``varpack.train.trl.VarpackSFTTrainer`` on the same packs.

Measurement (benchmarks/_common.py's rules): every configuration builds a fresh model and runs one untimed
cold pass over all its packs (every compile and autotune happens there; reported as seconds to the first step
and for the pass), then ``--timed-passes`` timed passes (the median is the steady figure); ``--rounds`` rounds
in rotated order (two: given, then reversed), the figures averaged over the rounds, each round's ratio to its
best peer reported, and a ratio on both sides of 1 flagged ORDER-DEPENDENT. TRL rows time whole
``trainer.train()`` passes (cold = the first). Reported: real tokens/s (the samples' tokens: pad tokens of a
static shape are not counted; their share is ``pad_fraction``), supervised tokens/s, MFU = 6 * N_params * real
tokens/s / 989e12 (attention FLOPs not counted; ``mfu_lm_head_rows_run`` counts the LM head's FLOPs only for the
rows it ran; ``mfu_with_attention`` adds each sample's causal attention FLOPs, :func:`attention_flops`), peak
memory, the first step's loss (same samples and weights everywhere: equal up to rounding).

    python benchmarks/train.py --samples .gpu/samples.npz --out train.json
    python benchmarks/train.py --samples .gpu/samples.npz --packing-length 16384 --steps 7 \\
        --configs hf_fa4,hf_fa4_liger,varpack_lce_compile,varpack_lce_static_graphs
    python benchmarks/train.py --samples .gpu/samples.npz --max-sample-length 128 \\
        --configs hf_fa4,varpack_lce@torch_varlen,varpack_lce_static_graphs@triton_short
    python benchmarks/train.py --device cpu --small            # smoke run
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import gc
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    H200_BF16_DENSE_PEAK_FLOPS,
    IGNORE,
    OPTIMIZER_IMPLS,
    Budget,
    add_common_args,
    apply_trl_liger,
    build_model,
    checked_device,
    cold_then_timed,
    error_text,
    fullest_packs,
    machine_info,
    make_optimizer,
    markdown_table,
    merge_rounds,
    missing_rounds,
    n_params,
    pad_tokenizer,
    restored_module,
    row_error,
    run_rounds,
    samples_for,
    sync,
    write_json,
)

ALL_CONFIGS = (
    "padded", "hf_fa4", "hf_flex", "hf_sdpa", "hf_fa4_liger", "varpack", "varpack_lce", "varpack_lce_chunked",
    "varpack_lce_liger", "varpack_compile", "varpack_lce_compile", "varpack_lce_compile_ops",
    "varpack_lce_static_compile_ops", "varpack_lce_static_graphs", "varpack_lce_chunked_static_graphs",
    "trl_varpack", "trl_padding_free",
)  # fmt: skip
DEFAULT_CONFIGS = "padded,hf_fa4,hf_flex,hf_fa4_liger,varpack,varpack_lce,varpack_lce_compile"
#: what a user of HF / TRL would configure: the best peer of a round is the fastest of these that ran in it
PEERS = ("padded", "hf_fa4", "hf_flex", "hf_sdpa", "hf_fa4_liger", "trl_padding_free")
TRL_CONFIGS = ("trl_varpack", "trl_padding_free")
#: attention implementations tried for ``trl_padding_free`` with ``--trl-attn auto``, best first
TRL_ATTN_ORDER = ("flash_attention_4", "flash_attention_2", "flex_attention", "sdpa")
HF_ATTN = {"hf_fa4": "flash_attention_4", "hf_flex": "flex_attention", "hf_sdpa": "sdpa",
           "hf_fa4_liger": "flash_attention_4"}  # fmt: skip
#: suffixes of a varpack config that switch on a step option (``_graphs`` implies compile, ops and static)
STEP_OPTIONS = ("_liger", "_compile", "_ops", "_static", "_graphs")
#: the fastest varpack row's targets, same run, steady state: tokens/s ratio to the best peer (in every
#: round), MFU
TARGET_VS_BEST_PEER, TARGET_MFU = 1.5, 0.40
#: keys varpack keeps on the CPU (validated there, copied to the device once per batch) unless the layers
#: are compiled with attention inside (``_ops``: the whole meta goes to the device); bookkeeping never
#: reaches the model
VARPACK_CPU_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")
BOOKKEEPING_KEYS = ("sample_ids",)


# ----------------------------------------------------------------------------------------------------------
# configurations
# ----------------------------------------------------------------------------------------------------------


def split_config(config: str) -> tuple[str, set[str]]:
    """``"varpack_lce_liger_compile"`` -> ``("varpack_lce", {"liger", "compile"})``;
    ``"varpack_lce_static_graphs"`` -> ``("varpack_lce", {"static", "graphs", "compile", "ops"})``."""
    options = set()
    for suffix in STEP_OPTIONS:
        if config.endswith(suffix) or f"{suffix}_" in config:
            options.add(suffix[1:])
            config = config.replace(suffix, "")
    if "graphs" in options:  # CUDA graphs replay compiled layers of one shape, attention inside the graph
        options |= {"compile", "ops", "static"}
    return config, options


def split_backend(config: str) -> tuple[str, str | None]:
    """``"varpack_lce@triton_short"`` -> ``("varpack_lce", "triton_short")``: a varpack / ``trl_varpack`` row
    with its own attention backend; ``("hf_fa4", None)`` without ``@``.

    Raises:
        ValueError: ``@`` on a row that does not use varpack's attention, or a backend that is not ``auto`` or
            a name of :data:`varpack.attn.BACKENDS` (refused before any row runs).
    """
    from varpack.attn import BACKENDS

    base, at, backend = config.partition("@")
    if not at:
        return config, None
    if not (base.startswith("varpack") or base == "trl_varpack"):
        raise ValueError(
            f"config {config!r}: '@backend' selects varpack's attention backend; only varpack* and "
            "trl_varpack rows use it"
        )
    if backend not in ("auto", *BACKENDS):
        raise ValueError(
            f"config {config!r}: unknown attention backend {backend!r} after '@'; choose 'auto' or one "
            f"of {sorted(BACKENDS)}"
        )
    return base, backend


def keep_cpu_keys(config: str) -> tuple[str, ...]:
    """The batch keys :func:`to_device` leaves on the CPU: the boundaries of varpack rows, except with
    ``_ops`` (compiled layers read the meta's offsets in their graphs; a CUDA graph cannot take a CPU
    input)."""
    if not config.startswith("varpack"):
        return ()
    return () if "ops" in split_config(config)[1] else VARPACK_CPU_KEYS


def to_device(mb: dict[str, Any], device, keep_cpu: tuple[str, ...] = ()) -> dict[str, Any]:
    """The model's input: tensors on ``device`` except ``keep_cpu``, bookkeeping dropped; a varpack batch
    whose boundaries go to the device gets its meta there once (``VarlenMeta.on_device``) and
    ``cu_seq_lens_q/k`` as its views."""
    from varpack.integrations.cuda_graphs import boundaries_on_device

    on_device = mb.get("varlen_meta") is not None and "cu_seq_lens_q" not in keep_cpu
    out = {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) and k not in keep_cpu else v
        for k, v in mb.items()
        if k not in BOOKKEEPING_KEYS and not (on_device and k in VARPACK_CPU_KEYS)
    }
    return boundaries_on_device(out, device) if on_device else out


@functools.lru_cache(maxsize=4)
def meta_model(name: str, vocab_size: int | None) -> torch.nn.Module:
    """``name`` built on the meta device (no memory, no weights), once per process: what the static shape and a
    ``_graphs`` row's attention are decided on, as ``varpack sft`` decides them on its model."""
    return build_model(name, device="meta", dtype=torch.float32, vocab_size=vocab_size)


def static_shape_for(ds: Any, args: argparse.Namespace):
    """The static configs' :class:`varpack.collate.StaticShape`: varpack sft's
    :func:`varpack.integrations.cuda_graphs.static_shape_for` over the workload's plan, for the model built on
    the meta device (no memory, no weights): zero-length pad segments with ``--static-empty-pads on`` (an error
    where :func:`~varpack.integrations.cuda_graphs.empty_pads_ok` refuses them), never with ``off``, and with
    ``auto`` as ``varpack sft`` gives them."""
    from varpack.integrations import cuda_graphs

    model = meta_model(args.model, args.vocab_size)
    if args.static_empty_pads == "on" and not cuda_graphs.empty_pads_ok(model, args.attn_backend):
        raise ValueError(
            f"--static-empty-pads on: attention backend {args.attn_backend!r} with {args.model} is not known to "
            "take zero-length segments (empty_pads_ok: a named backend whose Capabilities have empty_segments, "
            "e.g. @triton_short, and no recurrent layer)"
        )
    return cuda_graphs.static_shape_for(
        ds.plan, model, args.attn_backend, multiple_of=args.static_multiple_of, segments=args.static_segments,
        empty_pads={"on": True, "off": False, "auto": None}[args.static_empty_pads],
    )  # fmt: skip


def graph_attention_for(ds: Any, args: argparse.Namespace) -> tuple[str, str | None]:
    """A ``_graphs`` row's attention backend, as ``varpack sft`` chooses it
    (:func:`varpack.integrations.cuda_graphs.graph_attention` for the model built on the meta device at the
    plan's static ``max_seqlen``): ``--attn-backend`` itself, or ``triton_short`` where ``auto`` would resolve
    to a backend a captured layer cannot run (``sdpa`` on an H200 without FlashAttention-4); and the note saying
    so (``None`` when the backend is kept).

    Raises:
        ValueError: no captured layer can run the attention (the refusal's reason).
    """
    from varpack.collate import StaticShape
    from varpack.integrations.cuda_graphs import graph_attention

    model = meta_model(args.model, args.vocab_size)
    name, refusal, why = graph_attention(
        model, backend=args.attn_backend, device=args.device, dtype=getattr(torch, args.dtype),
        max_seqlen=StaticShape.from_plan(ds.plan).max_seqlen,
    )  # fmt: skip
    if refusal is not None:
        raise ValueError(f"CUDA graphs with {refusal}")
    return name, why


def collate_steps(
    config: str, ds: Any, chosen: list[int], args: argparse.Namespace
) -> list[list[dict[str, Any]]]:
    """Per optimizer step, the micro-batches (CPU tensors; pinned on CUDA) a configuration feeds the model."""
    if config == "padded":
        from transformers import DataCollatorForSeq2Seq

        collator = DataCollatorForSeq2Seq(
            pad_tokenizer(args.pad_token_id), padding=True, label_pad_token_id=IGNORE
        )
        rng, steps = np.random.default_rng(args.seed), []
        for i in chosen:
            pack = [{"input_ids": s["input_ids"].tolist(), "labels": s["labels"].tolist()} for s in ds[i]]
            pack = [pack[j] for j in rng.permutation(len(pack))]  # random batches, as HF's random sampler
            size = args.pad_batch or len(pack)
            steps.append([dict(collator(pack[j : j + size])) for j in range(0, len(pack), size)])
    elif config.startswith("hf_"):
        from transformers import DataCollatorWithFlattening

        collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
        steps = [
            [dict(collator([{"input_ids": s["input_ids"], "labels": s["labels"]} for s in ds[i]]))]
            for i in chosen
        ]
    else:
        from varpack.collate import PaddingFreeCollator

        static = static_shape_for(ds, args) if "static" in split_config(config)[1] else None
        collator = PaddingFreeCollator(static_shape=static, pad_token_id=args.pad_token_id)
        steps = [[dict(collator([ds[i]]))] for i in chosen]
    if torch.device(args.device).type == "cuda":
        steps = [
            [{k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in mb.items()} for mb in st]
            for st in steps
        ]
    return steps


def supervised_count(micro_batches: list[dict[str, Any]]) -> int:
    """Supervised predictions of a step: labels != -100 after the causal shift (what HF's loss divides by)."""
    return sum(int((mb["labels"][..., 1:] != IGNORE).sum()) for mb in micro_batches)


def labelled_count(mb: dict[str, Any]) -> int:
    """A micro-batch's labels != -100 before the shift, counted on the host: the bound ``varpack sft`` gives
    the linear cross entropy (``max_supervised``) so its LM head runs on the supervised rows only."""
    return int((mb["labels"] != IGNORE).sum())


def real_token_count(micro_batches: list[dict[str, Any]]) -> int:
    """Tokens of the samples, padding excluded: the attention mask's ones (padded), ``cu_seqlens[N]`` of a
    varpack batch (its pad segments come after its N samples), else all."""
    total = 0
    for mb in micro_batches:
        if "attention_mask" in mb:
            total += int(mb["attention_mask"].sum())
        elif "varlen_meta" in mb and "sample_ids" in mb:
            total += int(mb["varlen_meta"].cu_seqlens_q[len(mb["sample_ids"])])
        else:
            total += int(mb["input_ids"].numel())
    return total


def static_stats(steps: list[list[dict[str, Any]]], counts: list[tuple[int, int]]) -> dict[str, Any]:
    """A static config's shape (every batch has the first one's) and its pad share of the tokens run."""
    meta = steps[0][0]["varlen_meta"]
    run = sum(int(mb["input_ids"].shape[-1]) for st in steps for mb in st)
    return {
        "static_tokens": int(meta.total_q),
        "static_segments": int(meta.num_seqs),
        "static_max_seqlen": int(meta.max_seqlen_q),
        "pad_fraction": 1.0 - sum(c[0] for c in counts) / run,
    }


def inductor_options_arg(text: str) -> dict[str, Any]:
    """``--graphs-inductor-options``: ``"max_autotune=True,coordinate_descent_tuning=True"`` ->
    ``{"max_autotune": True, "coordinate_descent_tuning": True}`` (values as Python literals, else strings; an
    item without ``=`` continues the value before it: ``max_autotune_gemm_backends=ATEN,TRITON``); ``""`` ->
    ``{}``.

    Raises:
        argparse.ArgumentTypeError: a first item without ``=``, or an empty key; an option inductor does not
            have, or ``triton.cudagraphs=False`` (:func:`varpack.integrations.cuda_graphs.graph_compile_kw`).
    """
    from varpack.integrations.cuda_graphs import graph_compile_kw

    raw: dict[str, str] = {}
    key = None
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.partition("=")
        if eq and name.strip():
            key = name.strip()
            raw[key] = value.strip()
        elif not eq and key is not None:
            raw[key] += "," + item
        else:
            raise argparse.ArgumentTypeError(f"expected key=value items separated by commas, got {item!r}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    try:
        graph_compile_kw(out)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return out


def add_graphs_inductor_options(p: argparse.ArgumentParser) -> None:
    """``--graphs-inductor-options`` (train.py, profile_step.py)."""
    p.add_argument(
        "--graphs-inductor-options", type=inductor_options_arg, default={},
        help="_graphs configs: inductor options in place of mode='reduce-overhead', as key=value items separated "
        "by commas, e.g. max_autotune=True,coordinate_descent_tuning=True (what mode='max-autotune' sets); CUDA "
        "graphs stay on (varpack.integrations.cuda_graphs.graph_compile_kw)",
    )  # fmt: skip


def apply_step_options(
    model: torch.nn.Module, config: str, inductor_options: dict[str, Any] | None = None
) -> list[str]:
    """The ``_liger`` / ``_compile`` / ``_ops`` / ``_static`` / ``_graphs`` options of a varpack row (after
    ``enable_varpack``); what was applied, for the report. ``inductor_options``: the ``_graphs`` layers' inductor
    options in place of ``mode="reduce-overhead"`` (``--graphs-inductor-options``).

    Raises:
        ValueError: ``_graphs`` on a model that is not on a CUDA device; an unknown inductor option.
    """
    from varpack.integrations.cuda_graphs import compile_layers_as_graphs
    from varpack.integrations.kernels import apply_liger_kernels, compile_layers

    options, done = split_config(config)[1], []
    if "liger" in options:
        done.append("liger " + "+".join(apply_liger_kernels(model)))
    if "graphs" in options:  # the library's one implementation (varpack sft --cuda-graphs runs it too)
        layers = compile_layers_as_graphs(model, what=config, inductor_options=inductor_options)
        extra = f", inductor options {inductor_options}" if inductor_options else ""
        done.append(f"compile x{layers} (attention op in graph, static shapes, CUDA graphs per layer{extra})")
    elif "compile" in options:
        kw = {"custom_ops": True, "fullgraph": True} if "ops" in options else {}
        kw |= {"dynamic": False} if "static" in options else {}
        notes = ["attention op in graph"] * ("ops" in options) + ["static shapes"] * ("static" in options)
        done.append(f"compile x{compile_layers(model, **kw)}" + (f" ({', '.join(notes)})" if notes else ""))
    return done


def step_context(config: str):
    """``_graphs`` rows run under inductor's ``triton.cudagraph_or_error`` (a graph not captured raises)."""
    from varpack.integrations.cuda_graphs import capture_or_error

    return capture_or_error() if "graphs" in split_config(config)[1] else contextlib.nullcontext()


def make_loss_fn(config: str, args: argparse.Namespace) -> tuple[Callable[..., torch.Tensor], str]:
    """``loss_fn(model, micro_batch_on_device, num_items) -> loss`` of a configuration, and its
    description."""
    liger, (config, options) = config.endswith("_liger"), split_config(config)
    if config == "padded" or config.startswith("hf_"):
        desc = "Liger fused linear CE" if liger else "HF ForCausalLMLoss (full fp32 logits)"
        return (lambda model, mb, n, labelled=None: model(**mb, use_cache=False, num_items_in_batch=n).loss), desc
    if config == "varpack":
        from varpack.loss import causal_lm_loss

        def plain(model, mb, n, labelled=None):
            logits = model(**{k: v for k, v in mb.items() if k != "labels"}, use_cache=False).logits
            return causal_lm_loss(logits, mb["labels"], seq_idx=mb.get("seq_idx"), num_items_in_batch=n)

        return plain, "varpack.loss.causal_lm_loss (full fp32 logits)"
    from varpack.integrations.cuda_graphs import begin_step
    from varpack.ops.linear_ce import causal_lm_forward_with_linear_ce, resolve_linear_ce_backend

    backend = "chunked" if config == "varpack_lce_chunked" else args.lce_backend
    name, _ = resolve_linear_ce_backend(backend, args.device, uniform_weights=True)
    graphs = "graphs" in options

    supervised = args.lm_head_rows == "supervised"

    def fused(model, mb, n, labelled=None):
        if graphs:  # CUDA-graph trees: a new step begins (the last step's graph outputs may be overwritten)
            begin_step()
        return causal_lm_forward_with_linear_ce(model, dict(mb, use_cache=False), num_items_in_batch=n,
                                                backend=backend, chunk_size=args.chunk_size,
                                                max_supervised=labelled if supervised else None)  # fmt: skip

    rows = "LM head on the supervised rows" if supervised else "LM head on every row"
    return fused, f"linear_ce {name} (chunk {args.chunk_size}; {rows})"


def resolved_backend(model, mb, device, dtype, backend: str = "auto") -> str:
    """Which attention backend ``backend`` runs for this model's heads and the first pack's boundaries,
    eagerly."""
    try:
        from varpack.attn import resolve_backend

        cfg, t = model.config, int(mb["input_ids"].shape[-1])
        q = torch.empty(
            t, cfg.num_attention_heads, cfg.head_dim, device=device, dtype=dtype, requires_grad=True
        )
        k = torch.empty(t, cfg.num_key_value_heads, cfg.head_dim, device=device, dtype=dtype)
        return str(resolve_backend(backend, q, k, k, cu_seqlens_q=mb["cu_seq_lens_q"]))
    except Exception as exc:  # reported in the row's note
        return f"? ({error_text(exc)})"


# ----------------------------------------------------------------------------------------------------------
# one row
# ----------------------------------------------------------------------------------------------------------


def run_config(config: str, ds: Any, chosen: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """A fresh model for ``config``, one untimed cold pass over the packs, then the timed passes; the row."""
    config, backend = split_backend(config)
    if backend is not None:
        args = argparse.Namespace(**{**vars(args), "attn_backend": backend})
    if config in TRL_CONFIGS:
        return run_trl_config(config, ds, chosen, args)
    from transformers.models.qwen3 import modeling_qwen3

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    row: dict[str, Any] = {}
    model = opt = None
    try:  # Liger patches the modeling module itself: put back afterwards, or later rows would run Liger too
        if "graphs" in split_config(config)[1] and device.type == "cuda":
            backend, row["graph_attention"] = graph_attention_for(ds, args)
            args = argparse.Namespace(**{**vars(args), "attn_backend": backend})
        with restored_module(modeling_qwen3):
            steps = collate_steps(config, ds, chosen, args)
            model = build_model(
                args.model,
                device=device,
                dtype=dtype,
                seed=args.seed,
                vocab_size=args.vocab_size,
                hf_attn=HF_ATTN.get(config, "sdpa"),
            )
            # first: the compiled optimizer resets torch.compile's caches (make_optimizer)
            opt = make_optimizer(model, device, impl=args.optimizer)
            row["optimizer"] = args.optimizer
            row["attention"] = HF_ATTN.get(config, "sdpa")
            if config.startswith("varpack"):
                from varpack.integrations.transformers import enable_varpack

                enable_varpack(model, backend=args.attn_backend)
                row["attention"] = f"varpack {args.attn_backend}"
                row["attn_resolved"] = resolved_backend(model, steps[0][0], device, dtype, args.attn_backend)
                row["step_options"] = apply_step_options(model, config, args.graphs_inductor_options)
            elif config.endswith("_liger"):
                row["step_options"] = [apply_trl_liger(model)]
            loss_fn, row["loss"] = make_loss_fn(config, args)
            counts = [(real_token_count(st), supervised_count(st)) for st in steps]
            labelled = [[labelled_count(mb) for mb in st] for st in steps]
            keep_cpu = keep_cpu_keys(config)
            if "static" in split_config(config)[1]:
                row.update(static_stats(steps, counts))
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            from varpack.integrations.cuda_graphs import cudagraph_skips

            skips = cudagraph_skips()

            def step(i: int) -> torch.Tensor:
                total = torch.zeros((), device=device)
                for mb, bound in zip(steps[i], labelled[i]):
                    loss = loss_fn(model, to_device(mb, device, keep_cpu), counts[i][1], bound)
                    loss.backward()
                    total += loss.detach()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return total

            with step_context(config):
                timing = cold_then_timed(step, len(steps), device, args.timed_passes)
            if "graphs" in split_config(config)[1]:
                row["cudagraph_skips"] = cudagraph_skips() - skips
            row.update(figures(timing, counts, n_params(model), args, getattr(args, "attention_flops", None)))
            row.update(lm_head_figures(row, model, steps, labelled, config, args))
            row["micro_batches_per_step"] = float(np.mean([len(st) for st in steps]))
            if config == "padded":
                row["padding_fraction"] = 1.0 - sum(c[0] for c in counts) / sum(
                    int(mb["input_ids"].numel()) for st in steps for mb in st)  # fmt: skip
            if device.type == "cuda":
                row["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    except Exception as exc:  # OOM, a missing attention implementation: recorded, the run goes on
        row["error"] = row_error(exc)
    finally:
        model = opt = None  # noqa: F841 - the memory goes before the next row
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def attention_flops(config: Any, lengths: Any) -> float | None:
    """Training FLOPs of causal attention over samples of ``lengths`` tokens, each attending only within itself:
    ``12 * layers * heads * head_dim * sum(L * (L + 1) / 2)`` (forward ``QK^T`` and ``PV``, 2 FLOPs per
    multiply-add each, backward twice the forward: PaLM's attention term with each sample's causal pairs in
    place of ``T^2``). ``config``: a transformers config (``num_hidden_layers``, ``num_attention_heads``,
    ``head_dim`` or ``hidden_size / heads``; only ``"full_attention"`` layers where it has ``layer_types``).
    ``None`` where a layer attends over a sliding window (its pairs are not these)."""
    kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    if any(k == "sliding_attention" for k in kinds) or (
        getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None)
    ):
        return None
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    lengths = np.asarray(lengths, dtype=np.float64)
    pairs = float((lengths * (lengths + 1) / 2).sum())
    return 12.0 * sum(k == "full_attention" for k in kinds) * heads * head_dim * pairs


def workload_attention_flops(ds: Any, chosen: list[int], args: argparse.Namespace) -> float | None:
    """:func:`attention_flops` of one pass over the chosen packs (every row trains the same samples)."""
    lengths = np.asarray(ds.plan.item_lengths)
    used = np.concatenate([lengths[np.asarray(ds.plan.packs[i])] for i in chosen])
    return attention_flops(meta_model(args.model, args.vocab_size).config, used)


def figures(
    timing: dict[str, Any], counts: list[tuple[int, int]], params: int, args, attn_flops: float | None = None
) -> dict[str, Any]:
    """A row's steady and cold figures from :func:`benchmarks._common.cold_then_timed` and the steps' token
    counts; ``mfu_with_attention`` adds ``attn_flops`` (one pass's causal attention FLOPs,
    :func:`attention_flops`) to the 6 * N FLOPs per token."""
    real, sup, s = sum(c[0] for c in counts), sum(c[1] for c in counts), timing["seconds"]
    out = {"timed_steps": len(counts), "n_params": params, **timing, "step_ms": 1e3 * s / len(counts),
           "real_tokens_per_s": real / s, "supervised_tokens_per_s": sup / s,
           "mfu": 6.0 * params * real / s / args.peak_flops}  # fmt: skip
    if attn_flops is not None:
        out["mfu_with_attention"] = (6.0 * params * real + attn_flops) / s / args.peak_flops
    return out


def lm_head_figures(
    row: dict[str, Any], model: Any, steps: list[list[dict[str, Any]]], labelled: list[list[int]], config: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The share of the LM head's rows a configuration runs and the MFU that counts only those: ``mfu``
    counts 6 * N FLOPs per real token, the LM head's 6 * V * D included, while a varpack_lce row with
    ``--lm-head-rows supervised`` runs the head on :func:`varpack.ops.linear_ce.supervised_row_count` rows of
    each micro-batch only."""
    from varpack.ops.linear_ce import supervised_row_count

    head = model.get_output_embeddings().weight.numel()
    run = sum(int(mb["input_ids"].shape[-1]) for st in steps for mb in st)
    rows = run
    if config.startswith("varpack_lce") and args.lm_head_rows == "supervised":
        rows = sum(supervised_row_count(int(mb["input_ids"].shape[-1]), b)
                   for st, bounds in zip(steps, labelled) for mb, b in zip(st, bounds))  # fmt: skip
    real = row["real_tokens_per_s"] * row["seconds"]
    skipped = max(real - rows, 0.0)
    return {"lm_head_rows_fraction": rows / run,
            "mfu_lm_head_rows_run": row["mfu"] - 6.0 * head * skipped / row["seconds"] / args.peak_flops}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# TRL: SFTTrainer with the varpack drop-in, and TRL's own padding-free path, on the same packs
# ----------------------------------------------------------------------------------------------------------


def trl_workload(ds: Any, chosen: list[int], packing_length: int, seed: int) -> tuple[Any, Any, list]:
    """The chosen packs' samples as a ``datasets.Dataset``, varpack's plan of them (``plan_samples``: what
    ``VarpackSFTTrainer`` plans) and the packs in its visiting order as TRL packed rows (``seq_lengths``)."""
    import datasets

    from varpack.train.sft import plan_samples
    from varpack.train.trl import samples_from_trl

    data = datasets.Dataset.from_list(
        [
            {"input_ids": np.asarray(s["input_ids"]).tolist(), "labels": np.asarray(s["labels"]).tolist()}
            for i in chosen
            for s in ds[i]
        ]
    )
    samples = samples_from_trl(data)
    _, plan = plan_samples(samples, packing_length=packing_length, seed=seed)
    packed = []
    for k in plan.pack_order(0):
        ids = [int(i) for i in plan.packs[int(k)]]
        packed.append({"input_ids": [t for i in ids for t in samples[i]["input_ids"]],
                       "labels": [t for i in ids for t in samples[i]["labels"]],
                       "seq_lengths": [samples[i]["length"] for i in ids]})  # fmt: skip
    return data, plan, packed


def run_trl_config(config: str, ds: Any, chosen: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """``trl_varpack`` / ``trl_padding_free``: one untimed ``trainer.train()`` (cold), then ``--timed-passes``
    timed ones (each from ``on_train_begin`` to ``on_train_end``, device synced; the optimizer is rebuilt by
    each)."""
    from transformers import TrainerCallback

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    row: dict[str, Any] = {}
    model = trainer = None
    tmp = tempfile.TemporaryDirectory(prefix=f"varpack-bench-{config}-")

    class PassTimer(TrainerCallback):
        seconds: list[float] = []
        first_step: list[float] = []

        def on_train_begin(self, *a, **kw):
            sync(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **kw):
            if len(self.first_step) <= len(self.seconds):
                sync(device)
                self.first_step.append(time.perf_counter() - self.t0)

        def on_train_end(self, *a, **kw):
            sync(device)
            self.seconds.append(time.perf_counter() - self.t0)

    try:
        import datasets
        from trl import SFTConfig, SFTTrainer

        data, plan, packed = trl_workload(ds, chosen, args.packing_length, args.seed)
        order = (
            ("sdpa",) if config == "trl_varpack" or device.type != "cuda" else TRL_ATTN_ORDER
        )  # no CPU flex bwd
        errors = []
        for attn in order if args.trl_attn == "auto" or config == "trl_varpack" else (args.trl_attn,):
            try:
                model = build_model(
                    args.model,
                    device=device,
                    dtype=dtype,
                    seed=args.seed,
                    vocab_size=args.vocab_size,
                    hf_attn=attn,
                )
                row["attention"] = f"varpack {args.attn_backend}" if config == "trl_varpack" else attn
                break
            except (ImportError, ValueError) as exc:
                errors.append(f"{attn}: {type(exc).__name__}")
        if model is None:
            raise RuntimeError("no attention implementation builds: " + "; ".join(errors))
        row["step_options"] = ["not available: " + ", ".join(errors)] if errors else []
        timer = PassTimer()
        if args.optimizer != "fused":
            row["optimizer"] = "fused: Trainer's adamw_torch_fused (--optimizer sets the other rows')"
        # bf16=False: the weights are bf16 already, as in the hand-written loop
        common = dict(
            output_dir=tmp.name, per_device_train_batch_size=1, num_train_epochs=1, learning_rate=1e-5,
            lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
            optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch", logging_steps=10**6,
            logging_first_step=True, logging_nan_inf_filter=False, save_strategy="no", report_to=[],
            gradient_checkpointing=False, bf16=False, use_cpu=device.type == "cpu",
            train_sampling_strategy="sequential", disable_tqdm=True, seed=args.seed,
        )  # fmt: skip
        if config == "trl_varpack":
            from varpack.train.trl import VarpackSFTTrainer

            trainer = VarpackSFTTrainer(model=model, args=SFTConfig(max_length=args.packing_length, **common),
                                        train_dataset=data, processing_class=pad_tokenizer(args.pad_token_id),
                                        attn_backend=args.attn_backend, callbacks=[timer])  # fmt: skip
            if [p.tolist() for p in trainer.plan.packs] != [p.tolist() for p in plan.packs]:
                raise RuntimeError("VarpackSFTTrainer planned other packs than the benchmark's rows")
        else:
            trainer = SFTTrainer(
                model=model,
                args=SFTConfig(max_length=None, padding_free=True, **common),
                train_dataset=datasets.Dataset.from_list(packed),
                processing_class=pad_tokenizer(args.pad_token_id),
                callbacks=[timer],
            )
            row["loss"] = "TRL fused LM head (chunked log-probs)"
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(1 + args.timed_passes):
            trainer.train()
        if config == "trl_varpack":
            row["loss"] = f"varpack objective ({trainer.loss_impl_used})"
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        timing = {"cold_first_step_s": timer.first_step[0], "cold_pass_s": timer.seconds[0],
                  "loss_first": losses[0] if losses else float("nan"), "timed_pass_s": timer.seconds[1:],
                  "seconds": float(np.median(timer.seconds[1:]))}  # fmt: skip
        counts = [(sum(r["seq_lengths"]), sum(x != IGNORE for x in r["labels"])) for r in packed]
        row.update(figures(timing, counts, n_params(model), args, getattr(args, "attention_flops", None)),
                   micro_batches_per_step=1.0)
        if device.type == "cuda":
            row["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    except Exception as exc:  # TRL missing, OOM, an attention implementation failing: recorded
        row["error"] = row_error(exc)
    finally:
        del model, trainer
        tmp.cleanup()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------------


def target_line(rows: list[dict[str, Any]]) -> str | None:
    """The fastest varpack row (exact rows only: every non-peer row that measured) against
    :data:`TARGET_VS_BEST_PEER` in every round and :data:`TARGET_MFU`; ``None`` without such a row. A round
    where the row or every peer failed has no ratio, and the ratio target is then not met (nor the MFU's,
    where the row itself failed)."""
    ours = [
        r
        for r in rows
        if r["config"] not in PEERS and "real_tokens_per_s" in r and "vs_best_peer_rounds" in r
    ]
    if not ours:
        return None
    top = max(ours, key=lambda r: r["real_tokens_per_s"])
    per_round, runs = top["vs_best_peer_rounds"], top.get("rounds") or []
    missing = max(len(runs), len(per_round)) - len(per_round)
    ratio_met = not missing and all(x >= TARGET_VS_BEST_PEER for x in per_round)
    mfu_met = not any("error" in r for r in runs) and top.get("mfu", 0.0) >= TARGET_MFU
    rounds = " / ".join(f"{x:.2f}" for x in per_round)
    rounds += f" (no ratio in {missing} of {max(len(runs), len(per_round))} rounds)" if missing else ""
    return (
        f"targets (same run, steady state): fastest varpack config {top['config']}: {rounds}x the best peer "
        f"({', '.join(top['best_peer_rounds'])}) -- target {TARGET_VS_BEST_PEER:g}x: "
        f"{'MET' if ratio_met else 'not met'}; MFU {100 * top['mfu']:.1f}% -- target "
        f"{100 * TARGET_MFU:.0f}%: "
        f"{'MET' if mfu_met else 'not met'}"
    )


def note(r: dict[str, Any]) -> str:
    parts = [r["error"]] if "error" in r else []
    if not parts and "attn_resolved" in r:
        parts.append(f"{r['attention'].removeprefix('varpack ')} -> {r['attn_resolved']}")
    if r.get("graph_attention") and "error" not in r:
        parts.append(r["graph_attention"])
    parts += [] if "error" in r else r.get("step_options", [])
    if "pad_fraction" in r and "error" not in r:
        parts.append(
            f"static T={r['static_tokens']} N={r['static_segments']} max_seqlen={r['static_max_seqlen']}, "
            f"pad {100 * r['pad_fraction']:.1f}% of tokens run"
        )
    if r.get("lm_head_rows_fraction", 1.0) < 1.0 and "error" not in r:
        parts.append(
            f"LM head on {100 * r['lm_head_rows_fraction']:.0f}% of the rows (the supervised ones); MFU "
            f"counting only those {100 * r['mfu_lm_head_rows_run']:.1f}%"
        )
    if r.get("cudagraph_skips"):
        parts.append(f"{r['cudagraph_skips']} graphs NOT captured (cudagraph_skips)")
    if r.get("optimizer", "fused") != "fused" and "error" not in r:
        parts.append(f"AdamW {r['optimizer']}")
    if "padding_fraction" in r and not parts:
        parts.append(
            f"padding {100 * r['padding_fraction']:.0f}%, {r['micro_batches_per_step']:.1f} "
            "micro-batches/step"
        )
    return "; ".join(parts + (missing_rounds(r) if "real_tokens_per_s" in r else []))


def table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "config",
        "attention",
        "loss",
        "steady ms/step",
        "real tok/s",
        "sup. tok/s",
        "MFU",
        "MFU w/ attention",
        "peak GiB",
        "cold 1st step s",
        "cold pass s",
        "vs padded",
        "vs best peer (per round)",
        "loss@1st",
        "note",
    ]
    body = []
    for r in rows:
        vs = "-"
        if "vs_best_peer" in r:
            vs = f"{r['vs_best_peer']:.2f} (" + " / ".join(f"{x:.2f}" for x in r["vs_best_peer_rounds"]) + ")"
            vs += " ORDER-DEPENDENT" if r.get("order_dependent") else ""
        body.append([r["config"], r.get("attention", "-"), r.get("loss", "-"), r.get("step_ms"),
                     r.get("real_tokens_per_s"), r.get("supervised_tokens_per_s"),
                     f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-",
                     f"{100 * r['mfu_with_attention']:.1f}%" if "mfu_with_attention" in r else "-",
                     r.get("peak_mem_gb"),
                     r.get("cold_first_step_s"), r.get("cold_pass_s"), r.get("vs_padded"), vs,
                     f"{r['loss_first']:.4f}" if "loss_first" in r else "-", note(r)])  # fmt: skip
    return markdown_table(headers, body)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, small="smoke run: tiny-qwen3, packing at most 512, at most 4 steps")
    p.add_argument("--model", default="qwen3-0.6b-shape", help="a varpack built-in model (random init)")
    p.add_argument(
        "--samples", default=None, help="pre-encoded samples (.npz / .jsonl of benchmarks/_common.py)"
    )
    p.add_argument("--packing-length", type=int, default=8192)
    p.add_argument("--steps", type=int, default=14, help="packs (= optimizer steps) per pass")
    p.add_argument(
        "--timed-passes", type=int, default=3, help="timed passes after the cold one (their median)"
    )
    p.add_argument(
        "--rounds", type=int, default=2, help="rounds in rotated order (2: given order, then reversed)"
    )
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated, from {ALL_CONFIGS}")
    p.add_argument(
        "--pad-batch", type=int, default=8, help="padded micro-batch size (0: a whole step at once)"
    )
    p.add_argument(
        "--max-sample-length",
        type=int,
        default=None,
        help="use only samples of at most this many tokens (a short-document workload of the same data)",
    )
    p.add_argument("--pad-token-id", type=int, default=151643, help="Qwen3 <|endoftext|>")
    p.add_argument(
        "--attn-backend", default="auto", help="varpack attention backend of the varpack* / trl_varpack rows"
    )
    p.add_argument(
        "--trl-attn", default="auto", help=f"trl_padding_free attention: auto (first of {TRL_ATTN_ORDER})"
    )
    p.add_argument(
        "--lce-backend", default="auto", help="linear cross-entropy backend of the varpack_lce* rows"
    )
    p.add_argument("--chunk-size", type=int, default=4096, help="linear cross-entropy chunk (tokens)")
    p.add_argument(
        "--lm-head-rows", choices=("supervised", "all"), default="supervised",
        help="varpack_lce* rows: the LM head on the supervised rows only (what varpack sft runs: the host "
        "count of labels as max_supervised) or on every row",
    )  # fmt: skip
    p.add_argument("--static-multiple-of", type=int, default=64, help="static configs: T rounded up to this")
    p.add_argument(
        "--static-empty-pads",
        choices=("auto", "on", "off"),
        default="auto",
        help="static configs: zero-length pad segments (auto: as varpack sft gives them)",
    )
    p.add_argument(
        "--static-segments",
        type=int,
        default=None,
        help="static configs: segments per pack (default: the plan's most samples + 1)",
    )
    p.add_argument(
        "--optimizer", choices=OPTIMIZER_IMPLS, default="fused",
        help="AdamW's implementation (benchmarks/_common.py make_optimizer): fused (torch's fused kernel on "
        "CUDA) or compiled (its foreach step under torch.compile)",
    )  # fmt: skip
    add_graphs_inductor_options(p)
    p.add_argument("--peak-flops", type=float, default=H200_BF16_DENSE_PEAK_FLOPS)
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: a configuration not started within them is skipped (its row says so); --out is "
        "rewritten after every configuration (partial: true until the end)",
    )
    args = p.parse_args(argv)
    if args.time_budget is not None and not args.time_budget >= 0:  # NaN too
        p.error(f"--time-budget must be a number of seconds >= 0, got {args.time_budget:g}")
    device = checked_device(p, args)
    args.vocab_size = None
    if args.small:
        args.model, args.vocab_size = "tiny-qwen3", None if args.samples else 1024
        args.packing_length, args.steps, args.chunk_size = (
            min(args.packing_length, 512),
            min(args.steps, 4),
            128,
        )
    from varpack.attn import BACKENDS

    if args.attn_backend not in ("auto", *BACKENDS):
        p.error(f"--attn-backend: unknown attention backend {args.attn_backend!r}; choose 'auto' or one of "
                f"{sorted(BACKENDS)}")  # fmt: skip
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    configs = [c for c in args.configs.split(",") if c]
    runs: dict[
        tuple[str, str | None], str
    ] = {}  # what each row runs: varpack rows with their backend resolved
    for c in configs:
        try:
            base, backend = split_backend(c)
        except ValueError as exc:
            p.error(str(exc))
        if base not in ALL_CONFIGS:
            p.error(
                f"unknown config {c!r}; choose from {ALL_CONFIGS} (varpack rows may add @<attention backend>)"
            )
        run = (
            base,
            backend or args.attn_backend if base.startswith("varpack") or base == "trl_varpack" else None,
        )
        if run in runs:
            p.error(f"configs {runs[run]!r} and {c!r} run the same thing (attention backend {run[1]!r})")
        runs[run] = c
    vocab = args.vocab_size or 151936
    samples, source = samples_for(args.samples, vocab=vocab, tokens=args.steps * args.packing_length * 1.2,
                                  hi=args.packing_length, seed=args.seed)  # fmt: skip
    if args.pad_token_id >= vocab:
        args.pad_token_id = 0
    ds, chosen, info = fullest_packs(samples, args.packing_length, args.steps, args.max_sample_length)
    args.attention_flops = workload_attention_flops(ds, chosen, args)
    info["attention_flops_per_step"] = None if args.attention_flops is None else args.attention_flops / len(chosen)
    print(f"# SFT step, {args.model}, {args.device} {args.dtype}, packing_length {args.packing_length}\n"
          f"- samples: {source}; workload: {info}")  # fmt: skip
    budget = Budget(args.time_budget)

    def save(rounds: list[list[dict]], partial: bool = True) -> None:
        write_json(args.out, {"machine": machine_info(device), "args": vars(args), "workload": info,
                              "partial": partial, "rows": merge_rounds(rounds, "real_tokens_per_s", PEERS,
                                                                      baseline="padded")})  # fmt: skip
        if (
            partial and len(rounds[-1]) == len(configs) and len(rounds) < args.rounds
        ):  # a limit may cut the next
            rows = merge_rounds(rounds, "real_tokens_per_s", PEERS, baseline="padded")
            print(f"\n(after round {len(rounds)})\n{table(rows)}\n", flush=True)

    rounds = run_rounds(configs, lambda c: run_config(c, ds, chosen, args), args.rounds, budget=budget,
                        after_each=save)  # fmt: skip
    rows = merge_rounds(rounds, "real_tokens_per_s", PEERS, baseline="padded")
    best = next((r["best_peer_rounds"] for r in rows if "best_peer_rounds" in r), None)
    print(
        f"\n{table(rows)}\n\nMFU = 6 * N * real tokens/s / {args.peak_flops:.3g} (attention FLOPs not "
        "counted; the targets use it). MFU w/ attention adds each sample's causal attention FLOPs "
        "(12 * layers * heads * head_dim * sum L(L+1)/2). "
        f"Each config: one untimed cold pass over its {len(chosen)} packs, then {args.timed_passes} timed "
        "passes "
        f"(median); {args.rounds} round(s) in rotated order; best peer per round: {best}."
    )
    line = target_line(rows)
    if line:
        print(line)
    save(rounds, partial=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
