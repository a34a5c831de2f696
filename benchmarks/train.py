"""End-to-end SFT step throughput, steady state and cold: varpack vs the peers a user would configure.

A Qwen3-0.6B-shaped model (random init, same seed for every configuration; the config is built from the
published Qwen3-0.6B values (varpack.models "qwen3-0.6b-shape"): hidden 1024, 28 layers, 16 heads, 8 KV heads,
head_dim 128, intermediate 3072, vocab 151,936, tied embeddings, rope_theta 1e6, rms_norm_eps 1e-6), bf16
weights, fused AdamW (lr 1e-5), ``use_cache=False``, trained on the same samples by each configuration.

Peers (the best peer is the fastest of those run):

* ``padded``: HF ``DataCollatorForSeq2Seq`` padding (right padding, labels padded with -100) and
  ``attn_implementation="sdpa"`` with the attention mask; each optimizer step's samples, in random order
  (HF's random sampler; the packs list them by decreasing length), are split in micro-batches of
  ``--pad-batch`` (gradient accumulation, HF ``num_items_in_batch`` token mean).
* ``hf_fa4`` / ``hf_flex`` / ``hf_sdpa``: HF ``DataCollatorWithFlattening(return_flash_attn_kwargs=True,
  return_seq_idx=True)`` with HF's own attention ``flash_attention_4`` / ``flex_attention`` / ``sdpa``
  (position-id packed-sequence detection); sdpa is added when neither FA4 nor flex runs.
* ``hf_fa4_liger``: ``hf_fa4`` plus Liger-Kernel applied as transformers' Trainer does for
  ``use_liger_kernel=True`` (what TRL's ``SFTConfig(use_liger_kernel=True)`` turns on):
  ``_apply_liger_kernel_to_instance(model)`` with its defaults, i.e. RoPE, RMSNorm, SwiGLU and the fused
  linear cross-entropy loss.

varpack:

* ``varpack``: ``plan_packs`` (best-fit decreasing) + ``PackedDataset`` + ``PaddingFreeCollator`` +
  ``enable_varpack(model, backend="auto")`` and the plain loss (full logits, ``varpack.loss.causal_lm_loss``).
* ``varpack_lce``: the same with ``varpack.ops.linear_ce.causal_lm_forward_with_linear_ce`` (no ``[T, V]``
  logits; backend ``--lce-backend``, the resolved one is reported). ``varpack_lce_chunked`` forces the
  chunked PyTorch backend.
* ``*_liger`` / ``*_compile`` suffixes: the step options of ``varpack.integrations.kernels`` (Liger
  RMSNorm/RoPE/SwiGLU; regional ``torch.compile`` of the decoder layers, the attention call a graph break).
  They are exclusive.
* ``varpack_lce_compile_ops``: regional compile with ``compile_layers(custom_ops=True, fullgraph=True)``:
  attention is the ``varpack::varlen_attention`` custom op inside each layer's graph (no graph break; FA4's
  native backward), shapes dynamic as in ``varpack_lce_compile``. The batch's boundaries go to the device once
  per step (``VarlenMeta.on_device``) instead of a CPU -> device copy in every layer's graph.
* ``varpack_lce_static_compile_ops``: the same with static shapes (``PaddingFreeCollator(static_shape=...)``,
  ``varpack.collate.StaticShape.from_plan`` of the workload's plan, ``--static-multiple-of``,
  ``--static-segments``): every pack padded to the same ``T``, segment count and ``max_seqlen`` bucket, layers
  compiled with ``dynamic=False``. Costs the pad tokens; isolates that cost from the CUDA graphs below.
* ``varpack_lce_static_graphs``: ``varpack_lce_static_compile_ops`` plus ``mode="reduce-overhead"``: each
  decoder layer's forward and backward replayed as CUDA graphs (torch.compile's CUDA-graph trees; PyTorch docs,
  torch.compile ``mode="reduce-overhead"`` and "CUDA Graphs" in the CUDA semantics notes), with
  ``torch.compiler.cudagraph_mark_step_begin()`` at every step and inductor's ``triton.cudagraph_or_error``
  on, so a layer that cannot be captured is an error, never a silent eager fallback (``cudagraph_skips``
  counts them where the option is missing). Embedding, final norm, linear CE and AdamW stay eager. CUDA only
  (refused elsewhere, in the row's error).

TRL (``pip install 'varpack[trl]'``; not in the default list), two ``SFTTrainer`` runs on the same packs:

* ``trl_varpack``: ``varpack.train.trl.VarpackSFTTrainer`` (TRL's trainer with varpack's planner,
  collator, attention ``--attn-backend`` and loss ``loss_impl="auto"``).
* ``trl_padding_free``: TRL's own ``SFTTrainer(padding_free=True)`` (its ``DataCollatorForLanguageModeling``,
  boundaries from the rows' ``seq_lengths``, its fused LM head loss) given the same packs as rows in TRL's own
  packed format (``input_ids``, ``labels``, ``seq_lengths``), with the best attention implementation that
  builds (``--trl-attn``: ``flash_attention_4``, ``flash_attention_2``, ``flex_attention``, ``sdpa``).

Both plan the samples of the chosen packs again with varpack's best-fit decreasing (``plan_samples``, the
planner ``VarpackSFTTrainer`` runs) and visit those packs in the same order, one pack per optimizer step; the
Trainer loop (dataloader, collation on the fly, scheduler, ``Trainer.training_step``) is inside the timing.
Cold pass = the first ``trainer.train()`` (one epoch), timed passes = further ``trainer.train()`` calls,
each timed from ``on_train_begin`` to ``on_train_end`` (device synced); the optimizer is rebuilt by every
``train()`` (its state allocated at the first step of each pass). Same AdamW (fused, lr 1e-5, no weight
decay, no clipping, constant lr), bf16 weights, no gradient checkpointing, ``logging_first_step`` only.

Workload: the first samples of ``--samples`` (pre-encoded ../shared/data, see ``benchmarks/_common.py``)
are planned into packs of ``--packing-length`` tokens with best-fit decreasing; the ``--steps`` fullest packs
are the optimizer steps (one pack = one optimizer step), so every configuration trains on exactly those
samples, grouped the same way. Batches are collated before timing; host-to-device copies are timed.

Measurement (steady state first, cold reported separately): each configuration runs one whole **untimed cold
pass** over all its packs (every JIT kernel compile — FlashAttention-4's per-key CuTe compiles, Triton
autotuning, ``torch.compile`` — happens there), then a **timed pass** over the same packs. The cold pass is
reported as seconds to the first step and seconds for the whole pass; the steady figure is the median of
``--timed-passes`` (3) timed passes. With ``--rounds 2`` (default) every
configuration is run again in the reverse order; the steady figure is the mean of the rounds, each round's
ratio to the best peer of that round is reported, and a ratio that lands on different sides of 1 in the two
rounds is flagged (order-dependent: not a result).

Reported per configuration: real tokens/s (all tokens of the samples, no padding: a static config's pad
tokens are not counted, and its ``pad_fraction`` = pad tokens / all tokens run is reported), supervised tokens/s
(labels != -100), MFU = 6 * N_params * real tokens/s / 989e12 (H200 dense bf16 peak; N counts each
parameter once, tied embeddings once; attention FLOPs are not counted), peak memory
(``torch.cuda.max_memory_allocated``: weights + optimizer state + activations), the loss of the first step
(same samples and init everywhere: equal values say the paths compute the same loss), and the ratios to
``padded`` and to the best peer.

Run (GPU; carry the samples file, e.g. ``.gpu/samples.npz``)::

    python benchmarks/train.py --samples .gpu/samples.npz --out runs/train.json
    python benchmarks/train.py --samples .gpu/samples.npz --packing-length 16384 --configs hf_fa4_liger,varpack_lce
    python benchmarks/train.py --device cpu --small            # smoke test
    python benchmarks/train.py --samples .gpu/samples.npz --configs varpack_lce@sdpa,varpack_lce@triton_short
    python benchmarks/train.py --samples .gpu/samples.npz \\
        --configs varpack_lce_compile,varpack_lce_compile_ops,varpack_lce_static_compile_ops,varpack_lce_static_graphs
"""

from __future__ import annotations

import argparse
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
    load_samples,
    machine_info,
    markdown_table,
    sync,
    synthetic_samples,
    write_json,
)

#: The model: varpack's built-in ``qwen3-0.6b-shape`` config (Qwen3-0.6B's published config.json values,
#: defined once in ``varpack.models``); random init here.
QWEN3_0_6B = {"name": "qwen3-0.6b-shape", "vocab_size": 151936}
#: Smoke-test model (CPU): varpack's ``tiny-qwen3`` with a small vocabulary.
TINY = {"name": "tiny-qwen3", "vocab_size": 1024}

ALL_CONFIGS = (
    "padded",
    "hf_fa4",
    "hf_flex",
    "hf_sdpa",
    "hf_fa4_liger",
    "varpack",
    "varpack_lce",
    "varpack_lce_chunked",
    "varpack_lce_liger",
    "varpack_compile",
    "varpack_lce_compile",
    "varpack_lce_compile_ops",
    "varpack_lce_static_compile_ops",
    "varpack_lce_static_graphs",
    "trl_varpack",
    "trl_padding_free",
)
#: configurations that need TRL (``varpack[trl]``); imported only when one of them runs
TRL_CONFIGS = ("trl_varpack", "trl_padding_free")
#: attention implementations tried for ``trl_padding_free`` with ``--trl-attn auto``, best first
TRL_ATTN_ORDER = ("flash_attention_4", "flash_attention_2", "flex_attention", "sdpa")
#: the peers: what a user of HF / TRL would configure; the best peer is the fastest of those run
PEERS = ("padded", "hf_fa4", "hf_flex", "hf_sdpa", "hf_fa4_liger", "trl_padding_free")
#: suffixes of a varpack config that switch on a step option: varpack.integrations.kernels' Liger layers and
#: regional compile, ``_ops`` (attention as the custom op inside the compiled layer), ``_static`` (static-shape
#: packs, ``dynamic=False``), ``_graphs`` (CUDA graphs: implies compile, ops and static)
STEP_OPTIONS = ("_liger", "_compile", "_ops", "_static", "_graphs")
DEFAULT_CONFIGS = "padded,hf_fa4,hf_flex,hf_fa4_liger,varpack,varpack_lce,varpack_lce_compile"
HF_ATTN = {
    "hf_fa4": "flash_attention_4",
    "hf_flex": "flex_attention",
    "hf_sdpa": "sdpa",
    "hf_fa4_liger": "flash_attention_4",
}
IGNORE = -100


# ----------------------------------------------------------------------------------------------------------
# model
# ----------------------------------------------------------------------------------------------------------


def qwen3_config(values: dict[str, Any]):
    """The ``Qwen3Config`` of ``values`` (``name`` of a varpack built-in config and ``vocab_size``)."""
    from varpack.models import model_config

    return model_config(values["name"], vocab_size=values["vocab_size"])


def build_model(values: dict[str, Any], *, device, dtype, attn_implementation: str, seed: int = 0):
    """Random-init ``Qwen3ForCausalLM`` on ``device`` in ``dtype``, same weights for the same seed.

    Raises:
        ValueError / ImportError: transformers refuses ``attn_implementation`` (e.g. flash-attn 4 missing).
    """
    from transformers import Qwen3ForCausalLM

    config = qwen3_config(values)
    config.use_cache = False
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model.to(dtype)
    model.set_attn_implementation(attn_implementation)
    model.train()
    return model


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


def make_optimizer(model: torch.nn.Module, device) -> torch.optim.Optimizer:
    fused = torch.device(device).type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=fused, foreach=not fused)


# ----------------------------------------------------------------------------------------------------------
# workload: the same samples, grouped into the same optimizer steps, for every configuration
# ----------------------------------------------------------------------------------------------------------


def build_workload(
    samples: list[dict[str, Any]], packing_length: int, steps: int, max_sample_length: int | None = None
) -> tuple[Any, list[int], dict[str, Any]]:
    """Plan packs over a prefix of ``samples`` with best-fit decreasing and pick the ``steps`` fullest.

    ``max_sample_length``: only samples of at most this many tokens are used (a short-document workload cut
    from the same data, e.g. 128 for issue 17's short class); the count left out is reported in ``info``.

    Returns:
        ``(PackedDataset over the prefix (plan order), indices of the chosen packs, info)``.

    Raises:
        ValueError: not enough tokens for ``steps`` packs.
    """
    from varpack.data.dataset import PackedDataset
    from varpack.plan import plan_packs

    usable = [s for s in samples if s["length"] <= packing_length]
    dropped = len(samples) - len(usable)
    longer = 0
    if max_sample_length is not None:
        kept = [s for s in usable if s["length"] <= max_sample_length]
        longer, usable = len(usable) - len(kept), kept
    need = int(steps * packing_length * 1.1)
    prefix, total = [], 0
    for s in usable:
        prefix.append(s)
        total += s["length"]
        if total >= need:
            break
    if total < steps * packing_length * 0.9:
        raise ValueError(
            f"{len(usable)} samples hold {total} tokens: not enough for {steps} packs of {packing_length}"
        )
    lengths = np.asarray([s["length"] for s in prefix], dtype=np.int64)
    plan = plan_packs(lengths, packing_length, strategy="bfd")
    ds = PackedDataset(prefix, plan, shuffle=False)
    fill = np.asarray([int(lengths[np.asarray(p)].sum()) for p in plan.packs])
    chosen = sorted(np.argsort(-fill, kind="stable")[:steps].tolist())
    used = lengths[np.concatenate([np.asarray(plan.packs[i]) for i in chosen])]
    info = {
        "samples_considered": len(prefix),
        "samples_longer_than_packing_length_skipped": dropped,
        **(
            {"max_sample_length": max_sample_length, "samples_longer_than_max_sample_length_skipped": longer}
            if max_sample_length is not None
            else {}
        ),
        "sample_length_mean": float(used.mean()),  # of the chosen packs' samples
        "sample_length_max": int(used.max()),
        "packs_planned": plan.num_packs,
        "steps": len(chosen),
        "tokens_per_step_mean": float(fill[chosen].mean()),
        "fill_mean": float(fill[chosen].mean() / packing_length),
        "samples_per_step_mean": float(np.mean([len(plan.packs[i]) for i in chosen])),
    }
    return ds, chosen, info


def _pad_tokenizer(pad_token_id: int):
    """A minimal HF fast tokenizer whose only job is ``tokenizer.pad`` (the GPU machine has no tokenizer files):
    ``DataCollatorForSeq2Seq`` pads ``input_ids`` with its ``pad_token_id`` and builds the attention mask."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({"<pad>": pad_token_id, "<unk>": 0 if pad_token_id else 1}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


def collate_steps(
    config: str, ds: Any, chosen: list[int], args: argparse.Namespace
) -> list[list[dict[str, Any]]]:
    """Per optimizer step, the list of micro-batches (CPU tensors) a configuration feeds the model."""
    steps: list[list[dict[str, Any]]] = []
    if config == "padded":
        from transformers import DataCollatorForSeq2Seq

        collator = DataCollatorForSeq2Seq(
            _pad_tokenizer(args.pad_token_id), padding=True, label_pad_token_id=IGNORE
        )
        rng = np.random.default_rng(args.seed)
        for i in chosen:
            pack = [{"input_ids": s["input_ids"].tolist(), "labels": s["labels"].tolist()} for s in ds[i]]
            pack = [pack[j] for j in rng.permutation(len(pack))]  # random batches, as HF's random sampler
            size = args.pad_batch or len(pack)
            steps.append([dict(collator(pack[j : j + size])) for j in range(0, len(pack), size)])
    elif config.startswith("hf_"):
        from transformers import DataCollatorWithFlattening

        collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
        for i in chosen:
            pack = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in ds[i]]
            steps.append([dict(collator(pack))])
    else:
        from varpack.collate import PaddingFreeCollator

        static = "static" in split_config(config)[1]
        collator = PaddingFreeCollator(
            static_shape=static_shape_for(ds, args) if static else None, pad_token_id=args.pad_token_id
        )
        # sample_ids stays for real_token_count; to_device leaves it out of the model's input
        for i in chosen:
            steps.append([dict(collator([ds[i]]))])
    if torch.cuda.is_available() and torch.device(args.device).type == "cuda":
        steps = [
            [{k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in mb.items()} for mb in st]
            for st in steps
        ]
    return steps


def supervised_count(micro_batches: list[dict[str, Any]]) -> int:
    """Supervised predictions of a step: labels != -100 after the causal shift (what HF's loss divides by)."""
    return sum(int((mb["labels"][..., 1:] != IGNORE).sum()) for mb in micro_batches)


def real_token_count(micro_batches: list[dict[str, Any]]) -> int:
    """Tokens of the samples, padding excluded: the attention mask's ones (padded), ``cu_seqlens[N]`` of a
    varpack batch (its pad segments, static or ``pad_to_multiple_of``, come after its N samples), else all."""
    total = 0
    for mb in micro_batches:
        if "attention_mask" in mb:
            total += int(mb["attention_mask"].sum())
        elif "varlen_meta" in mb and "sample_ids" in mb:
            total += int(mb["varlen_meta"].cu_seqlens_q[len(mb["sample_ids"])])
        else:
            total += int(mb["input_ids"].numel())
    return total


# ----------------------------------------------------------------------------------------------------------
# steps
# ----------------------------------------------------------------------------------------------------------


#: Keys varpack keeps on the CPU: enable_varpack's guard validates them there and varlen_attention copies them
#: to the device once per batch (cached by tensor identity, reused by every layer).
VARPACK_CPU_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")


#: collated keys that are bookkeeping, never a model input
BOOKKEEPING_KEYS = ("sample_ids",)


def to_device(mb: dict[str, Any], device, keep_cpu: tuple[str, ...] = ()) -> dict[str, Any]:
    """The model's input: tensors on ``device`` except ``keep_cpu``, bookkeeping keys dropped. A varpack batch
    whose boundaries are not kept on the CPU gets its meta on the device (``VarlenMeta.on_device``: one copy
    of the offsets, kept by the batch's meta) and ``cu_seq_lens_q/k`` as the views of that meta."""
    meta = mb.get("varlen_meta")
    from varpack.integrations.cuda_graphs import boundaries_on_device

    on_device = meta is not None and "cu_seq_lens_q" not in keep_cpu
    out = {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) and k not in keep_cpu else v
        for k, v in mb.items()
        if k not in BOOKKEEPING_KEYS and not (on_device and k in VARPACK_CPU_KEYS)
    }
    return boundaries_on_device(out, device) if on_device else out


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


def keep_cpu_keys(config: str) -> tuple[str, ...]:
    """The batch keys :func:`to_device` leaves on the CPU for ``config``: the boundaries for the varpack configs
    (varlen attention copies them to the device once per batch), except with ``_ops``, whose compiled layers
    read the meta's offsets in their graphs: there the whole meta goes to the device
    (``VarlenMeta.on_device``; a CUDA graph cannot take a CPU input)."""
    if not config.startswith("varpack"):
        return ()
    return () if "ops" in split_config(config)[1] else VARPACK_CPU_KEYS


def static_shape_for(ds: Any, args: argparse.Namespace):
    """The :class:`varpack.collate.StaticShape` of the static configs: ``StaticShape.from_plan`` over the
    workload's whole plan (every pack a run of it would meet), ``--static-multiple-of``, ``--static-segments``."""
    from varpack.collate import StaticShape

    return StaticShape.from_plan(ds.plan, multiple_of=args.static_multiple_of, segments=args.static_segments)


def apply_step_options(model: torch.nn.Module, config: str) -> list[str]:
    """Liger-Kernel layers and/or regional torch.compile (varpack.integrations.kernels) for ``*_liger`` /
    ``*_compile`` configs, after enable_varpack: with ``_ops`` attention is the custom op inside each layer's
    graph (``fullgraph=True``: a graph break is an error), with ``_static`` the layers are compiled for the one
    static shape (``dynamic=False``), with ``_graphs`` as CUDA graphs (``mode="reduce-overhead"``:
    :func:`varpack.integrations.cuda_graphs.compile_layers_as_graphs`, what ``varpack sft --cuda-graphs`` runs).
    Returns what was applied, for the report.

    Raises:
        ValueError: ``_graphs`` on a model that is not on a CUDA device (CUDA graphs need CUDA).
    """
    from varpack.integrations.cuda_graphs import compile_layers_as_graphs
    from varpack.integrations.kernels import apply_liger_kernels, compile_layers

    _, options = split_config(config)
    done = []
    if "liger" in options:
        done.append("liger " + "+".join(apply_liger_kernels(model)))
    if "graphs" in options:  # the library's one implementation (varpack sft --cuda-graphs runs it too)
        n = compile_layers_as_graphs(model, what=config)
        done.append(f"compile x{n} (attention op in graph, static shapes, CUDA graphs per layer)")
    elif "compile" in options:
        kw: dict[str, Any] = {}
        notes = []
        if "ops" in options:
            kw.update(custom_ops=True, fullgraph=True)
            notes.append("attention op in graph")
        if "static" in options:
            kw["dynamic"] = False
            notes.append("static shapes")
        done.append(f"compile x{compile_layers(model, **kw)}" + (f" ({', '.join(notes)})" if notes else ""))
    return done


def step_context(config: str):
    """The context a configuration's passes run in: for ``_graphs``, inductor's ``triton.cudagraph_or_error``
    (a graph inductor would run eagerly instead of capturing it raises), where this torch has the option."""
    import contextlib

    from varpack.integrations.cuda_graphs import capture_or_error

    if "graphs" not in split_config(config)[1]:
        return contextlib.nullcontext()
    return capture_or_error()  # where torch lacks the option, the row's cudagraph_skips still counts skips


def cudagraph_skips() -> int:
    """Graphs inductor ran without a CUDA graph so far in this process
    (:func:`varpack.integrations.cuda_graphs.cudagraph_skips`)."""
    from varpack.integrations.cuda_graphs import cudagraph_skips as skips

    return skips()


def make_loss_fn(config: str, args: argparse.Namespace) -> tuple[Callable[..., torch.Tensor], str]:
    """``loss_fn(model, micro_batch_on_device, num_items) -> loss`` for a configuration, and a note."""
    config, options = split_config(config)
    if config == "padded" or config.startswith("hf_"):

        def hf_loss(model, mb, num_items):
            return model(**mb, use_cache=False, num_items_in_batch=num_items).loss

        return hf_loss, "HF ForCausalLMLoss (full fp32 logits)"
    if config == "varpack":
        from varpack.loss import causal_lm_loss

        def plain(model, mb, num_items):
            inputs = {k: v for k, v in mb.items() if k != "labels"}
            logits = model(**inputs, use_cache=False).logits
            return causal_lm_loss(
                logits, mb["labels"], seq_idx=mb.get("seq_idx"), num_items_in_batch=num_items
            )

        return plain, "varpack.loss.causal_lm_loss (full fp32 logits)"
    from varpack.ops.linear_ce import causal_lm_forward_with_linear_ce, resolve_linear_ce_backend

    backend = "chunked" if config == "varpack_lce_chunked" else args.lce_backend
    name, reason = resolve_linear_ce_backend(backend, args.device, uniform_weights=True)

    def fused(model, mb, num_items):
        return causal_lm_forward_with_linear_ce(
            model,
            dict(mb, use_cache=False),
            num_items_in_batch=num_items,
            backend=backend,
            chunk_size=args.chunk_size,
        )

    fused.reason = reason  # type: ignore[attr-defined]
    if "graphs" in options:
        # CUDA-graph trees: a new step begins here (the previous step's graph outputs may be overwritten)
        from varpack.integrations.cuda_graphs import begin_step

        def graphed(model, mb, num_items):
            begin_step()
            return fused(model, mb, num_items)

        graphed.reason = reason  # type: ignore[attr-defined]
        return graphed, f"linear_ce {name} (chunk {args.chunk_size})"
    return fused, f"linear_ce {name} (chunk {args.chunk_size})"


def _train_pass(model, opt, steps, counts, loss_fn, device, keep_cpu) -> tuple[float, float, list[float]]:
    """One pass over ``steps`` (one optimizer step each): ``(seconds to the first step, seconds, losses)``."""
    losses: list[float] = []
    sync(device)
    t0 = time.perf_counter()
    first = None
    for i, st in enumerate(steps):
        step_loss = torch.zeros((), device=device)
        for mb in st:
            loss = loss_fn(model, to_device(mb, device, keep_cpu), counts[i][1])
            loss.backward()
            step_loss += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i == 0:
            losses.append(float(step_loss))  # a sync: the first step's wall time
            first = time.perf_counter() - t0
    if len(steps) > 1:
        losses.append(float(step_loss))
    sync(device)
    return first, time.perf_counter() - t0, losses


def _static_stats(steps: list[list[dict[str, Any]]], counts: list[tuple[int, int]]) -> dict[str, Any]:
    """A static config's shape (the first batch's: every batch has it) and its pad overhead: tokens run vs
    real tokens (tokens/s counts the real ones only)."""
    meta = steps[0][0]["varlen_meta"]
    run = sum(int(mb["input_ids"].shape[-1]) for st in steps for mb in st)
    real = sum(c[0] for c in counts)
    return {
        "static_tokens": int(meta.total_q),
        "static_segments": int(meta.num_seqs),
        "static_max_seqlen": int(meta.max_seqlen_q),
        "pad_fraction": 1.0 - real / run,
    }


def _apply_trl_liger(model) -> str:
    """Liger-Kernel on an HF model the way transformers' Trainer applies ``use_liger_kernel=True`` (TRL's
    ``SFTConfig(use_liger_kernel=True)``): ``_apply_liger_kernel_to_instance(model=model)`` with its defaults."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model)
    return "liger defaults (rope, rms_norm, swiglu, fused linear CE)"


def split_backend(config: str) -> tuple[str, str | None]:
    """``"varpack_lce@triton_short"`` -> ``("varpack_lce", "triton_short")``: a varpack / ``trl_varpack`` row
    with its own attention backend (``--attn-backend`` for the others), so one run times several backends
    side by side; ``("hf_fa4", None)`` without ``@``.

    Raises:
        ValueError: ``@`` on a config that does not use varpack's attention, an empty backend, or one that is
            not ``auto`` or a name of :data:`varpack.attn.BACKENDS` (refused before any row runs, not in a
            row's error after the others have run).
    """
    from varpack.attn import BACKENDS

    base, at, backend = config.partition("@")
    if not at:
        return config, None
    if not (base.startswith("varpack") or base == "trl_varpack"):
        raise ValueError(
            f"config {config!r}: '@backend' selects varpack's attention backend; only varpack* and trl_varpack "
            "rows use it"
        )
    if backend not in ("auto", *BACKENDS):
        raise ValueError(
            f"config {config!r}: unknown attention backend {backend!r} after '@'; choose 'auto' or one of "
            f"{sorted(BACKENDS)}"
        )
    return base, backend


def run_config(
    config: str, ds: Any, chosen: list[int], args: argparse.Namespace, values: dict[str, Any]
) -> dict[str, Any]:
    """Build a fresh model for ``config``, run the untimed cold pass over all packs, then the timed pass."""
    full = config
    config, backend = split_backend(config)
    if backend is not None:  # this row's own attention backend (``varpack_lce@triton_short``)
        args = argparse.Namespace(**{**vars(args), "attn_backend": backend})
    if config in TRL_CONFIGS:
        row = run_trl_config(config, ds, chosen, args, values)
        row["config"] = full
        return row
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    row: dict[str, Any] = {"config": full}
    model = opt = None
    # Liger patches the modeling module itself (RoPE function, RMSNorm / MLP classes, the forward): restore it
    # afterwards, or every configuration run after a Liger one would silently use Liger's layers too
    from transformers.models.qwen3 import modeling_qwen3

    module_state = dict(vars(modeling_qwen3))
    try:
        steps = collate_steps(config, ds, chosen, args)
        attn = "sdpa" if config == "padded" else HF_ATTN.get(config, "sdpa")
        model = build_model(values, device=device, dtype=dtype, attn_implementation=attn, seed=args.seed)
        if config.startswith("varpack"):
            from varpack.integrations.transformers import enable_varpack

            enable_varpack(model, backend=args.attn_backend)
            attn = f"varpack {args.attn_backend}"
            row["attn_resolved"] = _resolved_varpack_backend(
                model, steps[0][0], device, dtype, args.attn_backend
            )
            row["step_options"] = apply_step_options(model, config)
        elif config.endswith("_liger"):
            row["step_options"] = [_apply_trl_liger(model)]
        row["attention"] = attn
        loss_fn, row["loss"] = make_loss_fn(config, args)
        if config == "hf_fa4_liger":
            row["loss"] = "Liger fused linear CE (HF forward patched by Liger)"
        if hasattr(loss_fn, "reason"):
            row["loss_backend_reason"] = loss_fn.reason
        opt = make_optimizer(model, device)
        n_params = count_params(model)
        row["n_params"] = n_params
        counts = [(real_token_count(st), supervised_count(st)) for st in steps]
        keep_cpu = keep_cpu_keys(config)
        if "static" in split_config(config)[1]:
            row.update(_static_stats(steps, counts))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start_mem = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        skips = cudagraph_skips()
        with step_context(config):
            # cold pass: every JIT compile / autotune of this configuration's shapes happens here (and every CUDA
            # graph is recorded), untimed for the steady figure and reported on its own (what a user waits for
            # before the first steps)
            cold_first, cold_s, losses = _train_pass(model, opt, steps, counts, loss_fn, device, keep_cpu)
            passes = [
                _train_pass(model, opt, steps, counts, loss_fn, device, keep_cpu)[1]
                for _ in range(args.timed_passes)
            ]
        if "graphs" in split_config(config)[1]:
            row["cudagraph_skips"] = cudagraph_skips() - skips
        elapsed = float(np.median(passes))
        row["timed_pass_s"] = passes
        real = sum(c[0] for c in counts)
        sup = sum(c[1] for c in counts)
        row.update(
            timed_steps=len(steps),
            seconds=elapsed,
            step_ms=1e3 * elapsed / len(steps),
            real_tokens_per_s=real / elapsed,
            supervised_tokens_per_s=sup / elapsed,
            mfu=6.0 * n_params * real / elapsed / args.peak_flops,
            cold_first_step_s=cold_first,
            cold_pass_s=cold_s,
            loss_first=losses[0],
            loss_last_cold=losses[-1],
            micro_batches_per_step=float(np.mean([len(st) for st in steps])),
        )
        if config == "padded":
            padded = sum(int(mb["input_ids"].numel()) for st in steps for mb in st)
            row["padding_fraction"] = 1.0 - real / padded
        if device.type == "cuda":
            row["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
            row["peak_over_start_gb"] = (torch.cuda.max_memory_allocated(device) - start_mem) / 2**30
    except Exception as exc:  # OOM, a missing attention implementation: recorded, the run goes on
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    finally:
        del model, opt
        for name, value in module_state.items():
            if vars(modeling_qwen3).get(name) is not value:
                setattr(modeling_qwen3, name, value)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


# ----------------------------------------------------------------------------------------------------------
# TRL: SFTTrainer with the varpack drop-in, and TRL's own padding-free path, on the same packs
# ----------------------------------------------------------------------------------------------------------


def trl_workload(ds: Any, chosen: list[int], packing_length: int, seed: int) -> tuple[Any, Any, list]:
    """The samples of the chosen packs as a ``datasets.Dataset`` (``input_ids``, ``labels``), their varpack
    samples and plan (``plan_samples``: what ``VarpackSFTTrainer`` plans) and the packs in its visiting order
    (``plan.pack_order(0)``) as TRL packed rows (``input_ids``, ``labels`` concatenated, ``seq_lengths``)."""
    import datasets

    from varpack.train.sft import plan_samples
    from varpack.train.trl import samples_from_trl

    rows = [
        {"input_ids": np.asarray(s["input_ids"]).tolist(), "labels": np.asarray(s["labels"]).tolist()}
        for i in chosen
        for s in ds[i]
    ]
    data = datasets.Dataset.from_list(rows)
    samples = samples_from_trl(data)
    _, plan = plan_samples(samples, packing_length=packing_length, seed=seed)
    packed = []
    for k in plan.pack_order(0):
        ids = [int(i) for i in plan.packs[int(k)]]
        packed.append(
            {
                "input_ids": [t for i in ids for t in samples[i]["input_ids"]],
                "labels": [t for i in ids for t in samples[i]["labels"]],
                "seq_lengths": [samples[i]["length"] for i in ids],
            }
        )
    return data, plan, packed


def _trl_timer(device):
    from transformers import TrainerCallback

    class PassTimer(TrainerCallback):
        """Seconds from ``on_train_begin`` to ``on_train_end`` of each ``train()`` (device synced)."""

        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.first_step: list[float] = []
            self._t0 = 0.0

        def on_train_begin(self, args, state, control, **kw):
            sync(device)
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if len(self.first_step) < len(self.seconds) + 1:
                sync(device)
                self.first_step.append(time.perf_counter() - self._t0)

        def on_train_end(self, args, state, control, **kw):
            sync(device)
            self.seconds.append(time.perf_counter() - self._t0)

    return PassTimer()


def run_trl_config(
    config: str, ds: Any, chosen: list[int], args: argparse.Namespace, values: dict[str, Any]
) -> dict[str, Any]:
    """``trl_varpack`` / ``trl_padding_free``: an ``SFTTrainer`` trained one epoch untimed (cold), then
    ``--timed-passes`` more epochs, each timed; tokens/s over the real tokens of the samples."""
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    row: dict[str, Any] = {"config": config}
    model = trainer = None
    tmp = tempfile.TemporaryDirectory(prefix=f"varpack-bench-{config}-")
    try:
        import datasets
        from trl import SFTConfig, SFTTrainer

        data, plan, packed = trl_workload(ds, chosen, args.packing_length, args.seed)
        if config == "trl_varpack":
            model = build_model(
                values, device=device, dtype=dtype, attn_implementation="sdpa", seed=args.seed
            )
            row["attention"] = f"varpack {args.attn_backend}"
        else:
            errors = []
            order = TRL_ATTN_ORDER if device.type == "cuda" else ("sdpa",)  # flex has no CPU backward
            for attn in order if args.trl_attn == "auto" else (args.trl_attn,):
                try:
                    model = build_model(
                        values, device=device, dtype=dtype, attn_implementation=attn, seed=args.seed
                    )
                    row["attention"] = attn
                    break
                except (ImportError, ValueError) as exc:
                    errors.append(f"{attn}: {type(exc).__name__}")
            if model is None:
                raise RuntimeError("no attention implementation builds: " + "; ".join(errors))
            if len(errors):
                row["step_options"] = ["not available: " + ", ".join(errors)]
        timer = _trl_timer(device)
        common = dict(
            output_dir=tmp.name,  # Trainer creates it; nothing is saved there
            per_device_train_batch_size=1,
            num_train_epochs=1,
            learning_rate=1e-5,
            lr_scheduler_type="constant",
            weight_decay=0.0,
            max_grad_norm=0.0,
            optim="adamw_torch_fused" if device.type == "cuda" else "adamw_torch",
            logging_steps=10**6,
            logging_first_step=True,
            logging_nan_inf_filter=False,
            save_strategy="no",
            report_to=[],
            gradient_checkpointing=False,
            bf16=False,  # the weights are bf16 already, as in the hand-written loop
            use_cpu=device.type == "cpu",
            train_sampling_strategy="sequential",
            disable_tqdm=True,
            seed=args.seed,
        )
        tokenizer = _pad_tokenizer(args.pad_token_id)
        if config == "trl_varpack":
            from varpack.train.trl import VarpackSFTTrainer

            trainer = VarpackSFTTrainer(
                model=model,
                args=SFTConfig(max_length=args.packing_length, **common),
                train_dataset=data,
                processing_class=tokenizer,
                attn_backend=args.attn_backend,
                callbacks=[timer],
            )
            if [p.tolist() for p in trainer.plan.packs] != [p.tolist() for p in plan.packs]:
                raise RuntimeError("VarpackSFTTrainer planned other packs than the benchmark's rows")
        else:
            trainer = SFTTrainer(
                model=model,
                args=SFTConfig(max_length=None, padding_free=True, **common),
                train_dataset=datasets.Dataset.from_list(packed),
                processing_class=tokenizer,
                callbacks=[timer],
            )
            row["loss"] = "TRL fused LM head (chunked log-probs)"
        n_params = count_params(model)
        row["n_params"] = n_params
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        trainer.train()  # cold pass
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        for _ in range(args.timed_passes):
            trainer.train()
        if config == "trl_varpack":
            row["loss"] = f"varpack objective ({trainer.loss_impl_used})"
        elapsed = float(np.median(timer.seconds[1:]))
        real = int(sum(sum(r["seq_lengths"]) for r in packed))  # the same packs for both configs
        sup = sum(sum(x != IGNORE for x in r["labels"]) for r in packed)
        row.update(
            timed_steps=len(packed),
            timed_pass_s=timer.seconds[1:],
            seconds=elapsed,
            step_ms=1e3 * elapsed / len(packed),
            real_tokens_per_s=real / elapsed,
            supervised_tokens_per_s=sup / elapsed,
            mfu=6.0 * n_params * real / elapsed / args.peak_flops,
            cold_first_step_s=timer.first_step[0],
            cold_pass_s=timer.seconds[0],
            loss_first=losses[0] if losses else float("nan"),
            micro_batches_per_step=1.0,
        )
        if device.type == "cuda":
            row["peak_mem_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    except (
        Exception
    ) as exc:  # TRL missing, OOM, an attention implementation failing: recorded, the run goes on
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    finally:
        del model, trainer
        tmp.cleanup()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _resolved_varpack_backend(model, mb, device, dtype, backend: str = "auto") -> str:
    """Which varpack attention backend ``backend`` (``auto`` or a forced name, checked against the call) runs for
    this model's attention shape and the first pack's boundaries, eagerly (for the report)."""
    try:
        from varpack.attn import resolve_backend

        cfg = model.config
        t = int(mb["input_ids"].shape[-1])
        q = torch.empty(
            t, cfg.num_attention_heads, cfg.head_dim, device=device, dtype=dtype, requires_grad=True
        )
        k = torch.empty(t, cfg.num_key_value_heads, cfg.head_dim, device=device, dtype=dtype)
        return str(resolve_backend(backend, q, k, k, cu_seqlens_q=mb["cu_seq_lens_q"]))
    except Exception as exc:
        return f"? ({type(exc).__name__}: {exc})"


class Budget:
    """Wall-clock budget of a run (``--time-budget``): ``spent()`` once ``seconds`` have passed since it was
    made (never, for ``None``)."""

    def __init__(self, seconds: float | None, clock=time.perf_counter) -> None:
        self.seconds, self.clock, self.start = seconds, clock, clock()

    def spent(self) -> bool:
        return self.seconds is not None and self.clock() - self.start >= self.seconds

    def reason(self) -> str:
        return f"skipped: --time-budget {self.seconds:g} s spent before it started"


def add_ratios(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Merge the rounds into one row per configuration: steady tokens/s = the mean over rounds; each round's
    ratio to ``padded`` and to that round's best peer; ``order_dependent`` when the ratios to the best peer
    fall on both sides of 1."""
    merged: dict[str, dict[str, Any]] = {}
    per_round_best: list[dict[str, Any] | None] = []
    for rows in rounds:
        ok = {r["config"]: r for r in rows if "real_tokens_per_s" in r}
        peers = [r for c, r in ok.items() if c in PEERS]
        best = max(peers, key=lambda r: r["real_tokens_per_s"]) if peers else None
        per_round_best.append(best)
        for r in rows:
            m = merged.setdefault(r["config"], {"config": r["config"], "rounds": []})
            m["rounds"].append(r)
            if best is not None and "real_tokens_per_s" in r:
                m.setdefault("vs_best_peer_rounds", []).append(
                    r["real_tokens_per_s"] / best["real_tokens_per_s"]
                )
                m.setdefault("best_peer_rounds", []).append(best["config"])
            if "padded" in ok and "real_tokens_per_s" in r:
                m.setdefault("vs_padded_rounds", []).append(
                    r["real_tokens_per_s"] / ok["padded"]["real_tokens_per_s"]
                )
    out = []
    for m in merged.values():
        good = [r for r in m["rounds"] if "real_tokens_per_s" in r]
        first = m["rounds"][0]
        row = {k: v for k, v in first.items() if k not in ("seconds", "step_ms", "real_tokens_per_s")}
        row["rounds"] = m["rounds"]
        if not good:
            out.append(row)
            continue
        row.pop("error", None)
        for key in ("step_ms", "real_tokens_per_s", "supervised_tokens_per_s", "mfu"):
            row[key] = float(np.mean([r[key] for r in good]))
        row["peak_mem_gb"] = max((r.get("peak_mem_gb", float("nan")) for r in good), default=float("nan"))
        row["cold_first_step_s"] = good[0]["cold_first_step_s"]  # the first round: nothing compiled before
        row["cold_pass_s"] = good[0]["cold_pass_s"]
        for key in ("vs_best_peer_rounds", "vs_padded_rounds", "best_peer_rounds"):
            if key in m:
                row[key] = m[key]
        if "vs_best_peer_rounds" in row:
            v = row["vs_best_peer_rounds"]
            row["vs_best_peer"] = float(np.mean(v))
            row["order_dependent"] = min(v) < 1.0 < max(v)
        if "vs_padded_rounds" in row:
            row["vs_padded"] = float(np.mean(row["vs_padded_rounds"]))
        out.append(row)
    return out


#: issue 18's goals, steady state, same run: tokens/s ratio to the best peer, and MFU
GOAL_VS_BEST_PEER, GOAL_MFU = 1.5, 0.40


def goal_line(rows: list[dict[str, Any]]) -> str | None:
    """Issue 18's verdict from the merged rows: the fastest varpack configuration (exact ones only: every
    ``varpack*`` / ``trl_varpack`` row that measured), its ratio to the best peer in every round and its MFU,
    against :data:`GOAL_VS_BEST_PEER` and :data:`GOAL_MFU`. ``None`` when no varpack row or no peer measured.
    A goal counts as met only when every round's ratio meets it (an order-dependent ratio does not) and
    every round has one (a round where every peer failed fails the ratio goal; one where the config failed, both)."""
    ours = [
        r
        for r in rows
        if r["config"] not in PEERS and "real_tokens_per_s" in r and "vs_best_peer_rounds" in r
    ]
    if not ours:
        return None
    top = max(ours, key=lambda r: r["real_tokens_per_s"])
    per_round = top["vs_best_peer_rounds"]
    # a round where the config or every peer failed has no ratio: the ratio goal is then not met; a round where
    # the config itself failed: nor the MFU goal
    runs = top.get("rounds") or []
    total = max(len(runs), len(per_round))
    missing = total - len(per_round)
    failed = sum("real_tokens_per_s" not in r for r in runs)
    ratio_met = not missing and all(x >= GOAL_VS_BEST_PEER for x in per_round)
    mfu_met = not failed and top.get("mfu", 0.0) >= GOAL_MFU
    rounds = " / ".join(f"{x:.2f}" for x in per_round)
    if missing:
        rounds += f" (no ratio in {missing} of {total} rounds)"
    return (
        f"issue 18 goals (same run, steady state): fastest varpack config {top['config']}: {rounds}x the best peer "
        f"({', '.join(top['best_peer_rounds'])}) -- goal {GOAL_VS_BEST_PEER:g}x: {'MET' if ratio_met else 'not met'}; "
        f"MFU {100 * top['mfu']:.1f}% -- goal {100 * GOAL_MFU:.0f}%: {'MET' if mfu_met else 'not met'}"
    )


def table(rows: list[dict[str, Any]]) -> str:
    nan = float("nan")
    headers = [
        "config",
        "attention",
        "loss",
        "steady ms/step",
        "real tok/s",
        "sup. tok/s",
        "MFU",
        "peak GiB",
        "cold 1st step s",
        "cold pass s",
        "vs padded",
        "vs best peer (per round)",
        "loss@1st",
        "note",
    ]
    out = []
    for r in rows:
        note = r.get("error", "")
        if not note and "attn_resolved" in r:
            backend = r.get("attention", "varpack auto").removeprefix("varpack ")
            note = "; ".join([f"{backend} -> {r['attn_resolved']}", *r.get("step_options", [])])
        elif not note and r.get("step_options"):
            note = "; ".join(r["step_options"])
        if "pad_fraction" in r and "error" not in r:
            static = (
                f"static T={r['static_tokens']} N={r['static_segments']} max_seqlen={r['static_max_seqlen']}, "
                f"pad {100 * r['pad_fraction']:.1f}% of tokens run"
            )
            note = f"{note}; {static}" if note else static
        if r.get("cudagraph_skips"):
            note += f"; {r['cudagraph_skips']} graphs NOT captured (cudagraph_skips)"
        if not note and "padding_fraction" in r:
            note = f"padding {100 * r['padding_fraction']:.0f}%, {r['micro_batches_per_step']:.1f} micro-batches/step"
        if "real_tokens_per_s" in r:  # measured, but not in every round (e.g. --time-budget spent): say which
            missing = [
                f"round {i + 1} not measured ({x.get('error', 'no result')})"
                for i, x in enumerate(r.get("rounds", []))
                if "real_tokens_per_s" not in x
            ]
            note = "; ".join([note, *missing]) if note and missing else (note or "; ".join(missing))
        vs = "-"
        if "vs_best_peer" in r:
            vs = f"{r['vs_best_peer']:.2f} (" + " / ".join(f"{x:.2f}" for x in r["vs_best_peer_rounds"]) + ")"
            if r.get("order_dependent"):
                vs += " ORDER-DEPENDENT"
        out.append(
            [
                r["config"],
                r.get("attention", "-"),
                r.get("loss", "-"),
                r.get("step_ms", nan),
                r.get("real_tokens_per_s", nan),
                r.get("supervised_tokens_per_s", nan),
                f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-",
                r.get("peak_mem_gb", nan),
                r.get("cold_first_step_s", nan),
                r.get("cold_pass_s", nan),
                r.get("vs_padded", nan),
                vs,
                f"{r['loss_first']:.4f}" if "loss_first" in r else "-",
                note,
            ]
        )
    return markdown_table(headers, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="bfloat16 (cuda default) / float32 (cpu default)")
    p.add_argument(
        "--samples", default=None, help="pre-encoded samples (.npz / .jsonl from benchmarks/_common.py)"
    )
    p.add_argument("--packing-length", type=int, default=8192)
    p.add_argument(
        "--steps",
        type=int,
        default=14,
        help="packs (= optimizer steps) per pass; each config runs one cold pass + --timed-passes",
    )
    p.add_argument(
        "--timed-passes", type=int, default=3, help="timed passes after the cold one; the median is reported"
    )
    p.add_argument(
        "--rounds", type=int, default=2, help="1: configs once in the given order; 2: then again reversed"
    )
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated, from {ALL_CONFIGS}")
    p.add_argument(
        "--pad-batch", type=int, default=8, help="padded micro-batch size (0: a whole step at once)"
    )
    p.add_argument(
        "--max-sample-length",
        type=int,
        default=None,
        help="use only samples of at most this many tokens (a short-document workload from the same data)",
    )
    p.add_argument("--pad-token-id", type=int, default=151643, help="Qwen3 <|endoftext|>")
    p.add_argument(
        "--attn-backend",
        default="auto",
        help="varpack attention backend of the varpack* and trl_varpack rows; one row may name its own: "
        "varpack_lce@triton_short",
    )
    p.add_argument(
        "--trl-attn",
        default="auto",
        help=f"trl_padding_free attention: auto (first that builds of {TRL_ATTN_ORDER}; sdpa on CPU) or one",
    )
    p.add_argument(
        "--lce-backend", default="auto", help="linear cross-entropy backend of the varpack_lce* rows"
    )
    p.add_argument("--chunk-size", type=int, default=4096, help="linear cross-entropy chunk (tokens)")
    p.add_argument(
        "--static-multiple-of",
        type=int,
        default=64,
        help="static configs: T_static (packing length + pad budget) rounded up to this",
    )
    p.add_argument(
        "--static-segments",
        type=int,
        default=None,
        help="static configs: segments per pack (samples + pad segments); default: the plan's most samples + 1",
    )
    p.add_argument("--peak-flops", type=float, default=H200_BF16_DENSE_PEAK_FLOPS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--small", action="store_true", help="smoke mode: tiny model, packing at most 512, at most 4 steps"
    )
    p.add_argument("--out", default=None, help="write rows + machine facts as JSON here")
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: a configuration not started within them is skipped (its row says so); the table so far "
        "is printed after every round and --out rewritten after every configuration (partial: true until the "
        "end), so a run cut by a wall-clock limit still leaves its finished rows; 0 skips every configuration",
    )
    args = p.parse_args(argv)
    if args.time_budget is not None and not args.time_budget >= 0:  # NaN too
        p.error(f"--time-budget must be a number of seconds >= 0, got {args.time_budget:g}")

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; use --device cpu --small for a smoke run")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    values = dict(QWEN3_0_6B)
    if args.small:
        values = dict(TINY)
        args.packing_length, args.steps = min(args.packing_length, 512), min(args.steps, 4)
        args.chunk_size = min(args.chunk_size, 128)
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        try:
            base, _ = split_backend(c)
        except ValueError as exc:
            p.error(str(exc))
        if base not in ALL_CONFIGS:
            p.error(
                f"unknown config {c!r}; choose from {ALL_CONFIGS} (varpack rows may add @<attention backend>)"
            )
    from varpack.attn import BACKENDS

    if args.attn_backend not in ("auto", *BACKENDS):
        p.error(
            f"--attn-backend: unknown attention backend {args.attn_backend!r}; choose 'auto' or one of "
            f"{sorted(BACKENDS)}"
        )
    if len(set(configs)) != len(configs):
        p.error(f"a config is listed twice: {args.configs}")
    runs: dict[tuple[str, str | None], str] = {}  # what each row runs: varpack rows with their backend resolved
    for c in configs:
        base, backend = split_backend(c)
        uses_backend = base.startswith("varpack") or base == "trl_varpack"
        run = (base, (backend or args.attn_backend) if uses_backend else None)
        if run in runs:
            p.error(f"configs {runs[run]!r} and {c!r} run the same thing (attention backend {run[1]!r})")
        runs[run] = c
    if args.rounds not in (1, 2):
        p.error("--rounds must be 1 or 2")

    if args.samples:
        samples = load_samples(args.samples)
        source = args.samples
        if args.small:
            values["vocab_size"] = QWEN3_0_6B["vocab_size"]
    else:
        from benchmarks.attention import DEFAULT_MU, DEFAULT_SIGMA

        n = int(args.steps * args.packing_length * 1.2 / np.exp(DEFAULT_MU + DEFAULT_SIGMA**2 / 2)) + 16
        samples = synthetic_samples(
            n,
            vocab=values["vocab_size"],
            mu=DEFAULT_MU,
            sigma=DEFAULT_SIGMA,
            hi=args.packing_length,
            seed=args.seed,
        )
        source = f"synthetic lognormal({DEFAULT_MU}, {DEFAULT_SIGMA}) random tokens"
    if args.pad_token_id >= values["vocab_size"]:
        args.pad_token_id = 0  # tiny smoke vocabulary
    ds, chosen, info = build_workload(samples, args.packing_length, args.steps, args.max_sample_length)

    print(f"# SFT step throughput, {args.device} {args.dtype}, packing_length {args.packing_length}")
    print(f"- samples: {source}; workload: {info}")
    rounds: list[list[dict[str, Any]]] = []
    budget = Budget(args.time_budget)

    def save(partial: bool) -> None:
        write_json(
            args.out,
            {"machine": machine_info(device), "args": vars(args), "workload": info, "partial": partial,
             "rows": add_ratios(rounds)},
        )  # fmt: skip

    for rnd in range(args.rounds):
        order = configs if rnd == 0 else configs[::-1]
        rows: list[dict[str, Any]] = []
        rounds.append(rows)
        for c in order:
            if budget.spent():
                rows.append({"config": c, "error": budget.reason()})
                print(f"  round {rnd + 1}: {c} {budget.reason()}", file=sys.stderr, flush=True)
                continue
            print(f"  round {rnd + 1}: running {c} ...", file=sys.stderr, flush=True)
            rows.append(run_config(c, ds, chosen, args, values))
            if "error" in rows[-1]:
                print(f"  {c}: {rows[-1]['error']}", file=sys.stderr, flush=True)
            save(partial=True)
        hf_ok = [r for r in rows if r["config"].startswith("hf_") and "error" not in r]
        if (
            not hf_ok
            and any(c.startswith("hf_") for c in configs)
            and "hf_sdpa" not in configs
            and not budget.spent()
        ):
            print("  running hf_sdpa (no HF flattening config ran) ...", file=sys.stderr, flush=True)
            rows.append(run_config("hf_sdpa", ds, chosen, args, values))
        if rnd + 1 < args.rounds:  # the finished round's table, in case a wall-clock limit cuts the next one
            print(f"\n(after round {rnd + 1})\n{table(add_ratios(rounds))}\n", flush=True)
    rows = add_ratios(rounds)
    print()
    print(table(rows))
    print()
    n_params = next((r["n_params"] for r in rows if "n_params" in r), None)
    best = next((r["best_peer_rounds"] for r in rows if "best_peer_rounds" in r), None)
    print(
        f"MFU = 6 * N * real tokens/s / {args.peak_flops:.3g} (N = {n_params}, attention FLOPs not counted). "
        f"Each config: one untimed cold pass over its {args.steps} packs, then {args.timed_passes} timed pass{'es' if args.timed_passes != 1 else ''} "
        f"over the same packs (median); "
        f"{args.rounds} round(s) ({'given order, then reversed' if args.rounds == 2 else 'given order'}); "
        f"best peer per round: {best}."
    )
    verdict = goal_line(rows)
    if verdict:
        print(verdict)
    save(partial=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
