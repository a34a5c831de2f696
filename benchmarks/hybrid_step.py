"""The packed SFT step of a Qwen3.5-shaped hybrid model: varpack's gated-delta backends against the HF peers.

``--model`` (default ``qwen3.5-hybrid-shape``: 18 Gated DeltaNet + 6 full-attention layers, hidden 1024),
random init (the same weights in every row), bf16 on CUDA / fp32 on the CPU, fused AdamW. The workload: the
``--steps`` fullest best-fit-decreasing packs of ``--packing-length``
(:func:`benchmarks._common.fullest_packs`), one pack per optimizer step, the same samples per step in every
row. Loss everywhere: the token mean over the step's supervised predictions. Each row: one untimed cold pass
(Triton autotuning, compiles, allocator; reported), then the timed pass (per step waited for); ``--rounds``
rounds in rotated order (:func:`benchmarks._common.round_order`).

Rows (``--backends``; the first is the baseline of "speed vs first"):

* a varpack gated-delta backend (``chunk``, ``fla_hybrid``, ``naive``, ``fla``, ``auto`` ...): the pack as one
  padding-free row, varpack attention ``auto`` for the full-attention layers,
  :func:`varpack.integrations.gated_delta.patch_linear_attention` with that backend (short conv and recurrent
  state reset at every sample boundary), loss ``--loss-impl`` (default the chunked linear CE);
* ``<backend>_compiled_layers`` (``chunk_compiled_layers``, ``fla_hybrid_compiled_layers`` ...): the same varpack
  row with every decoder layer compiled whole,
  ``compile_layers(model, custom_ops=True, fullgraph=True, backend=--compile-backend)``: the Gated DeltaNet
  mixer traced in the layer's graph (short conv, gates, norms fused by inductor; the rule as the
  ``varpack::gated_delta_rule`` custom op), varpack attention as its custom op; one graph for every pack
  (dynamic shapes). The cold pass includes the compiles;
* ``<backend>_compiled_breaks``: every decoder layer compiled with the Gated DeltaNet mixer and varpack attention
  as graph breaks (``compile_layers(model)``, the step of ``varpack sft --cuda-graphs false`` on CUDA): the mixer
  runs eagerly between compiled regions;
* ``<backend>_graphs`` (``fla_hybrid_graphs``; CUDA): ``varpack sft``'s default step on one GPU. Every pack
  collated to one static shape (``StaticShape.from_plan`` over the workload's plan: pad segments at the end),
  the boundaries on the device, every decoder layer compiled whole for CUDA-graph replay
  (:func:`varpack.integrations.cuda_graphs.compile_layers_as_graphs`, a graph not captured raises); the cold
  pass includes the compiles and captures;
* ``hf_padded_torch``: the exact HF peer. ``Qwen3_5ForCausalLM`` as is, ``--hf-attn`` (sdpa), right-padded
  micro-batches of at most ``--pad-tokens`` padded tokens (each step's samples by length: HF's
  ``group_by_length`` at its best), gradient accumulation, HF's loss with ``num_items_in_batch``; the Gated
  DeltaNet layers run transformers' PyTorch functions (what it binds without ``fla`` / ``causal_conv1d``).
  Exact: right padding after a sample cannot reach its tokens;
* ``hf_padded``: the same with the kernels transformers binds where installed (fla's rule on CUDA; fla refuses
  its own backward on Hopper with Triton >= 3.4, < 3.7.1, so there this row is an error row: HF cannot train
  there);
* ``hf_flat``: HF padding-free, the keys TRL's ``SFTTrainer(padding_free=True)`` sends
  (``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)``), kernels as installed:
  NOT exact unless both fla (honours ``cu_seqlens``) and ``causal_conv1d`` (honours ``seq_idx``) are bound --
  the ``exact`` column says which state leaks;
* ``hf_flat_torch``: ``DataCollatorWithFlattening()`` (``position_ids`` only) with the PyTorch functions: the
  conv and the recurrent state leak across samples (a negative control, not a peer);
* ``<peer>_liger``: the peer plus Liger-Kernel as ``SFTConfig(use_liger_kernel=True)`` applies it (CUDA).

Columns: cold pass, ms/step per round, real tokens/s, peak GiB, the first step's loss (same weights and
samples: agrees to rounding; at random init a leak moves it only in the 6th digit -- the exactness proof is
tests/benchmarks/test_hybrid_step.py: packed == ``hf_padded_torch`` in loss and every gradient,
``hf_flat_torch`` not), exactness, speed vs the first row and vs the fastest exact peer (``hf_padded*``).

    python benchmarks/hybrid_step.py --samples .gpu/samples.npz --steps 4 --rounds 1 \\
        --backends chunk,fla_hybrid,hf_padded_torch,hf_flat_torch --out hybrid.json      # GPU
    python benchmarks/hybrid_step.py --samples .gpu/samples.npz --steps 8 --rounds 2 \
        --backends fla_hybrid,fla_hybrid_compiled_layers,chunk_compiled_layers --out hybrid_compiled.json  # GPU
    python benchmarks/hybrid_step.py --samples .gpu/samples.npz --steps 4 --rounds 2 \
        --backends fla_hybrid_graphs,fla_hybrid_compiled_breaks,hf_padded_torch --out hybrid_graphs.json  # GPU
    python benchmarks/hybrid_step.py --device cpu --small --backends chunk,hf_padded_torch,hf_flat_torch
    python benchmarks/hybrid_step.py --device cpu --small --backends chunk,chunk_compiled_layers \
        --compile-backend aot_eager
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    IGNORE,
    add_common_args,
    apply_trl_liger,
    build_model,
    checked_device,
    cold_then_timed,
    fullest_packs,
    load_samples,
    machine_info,
    make_optimizer,
    markdown_table,
    merge_rounds,
    n_params,
    pad_tokenizer,
    restored_module,
    run_rounds,
    synthetic_samples,
    write_json,
)
from varpack.collate import PaddingFreeCollator  # noqa: E402
from varpack.integrations.gated_delta import patch_linear_attention  # noqa: E402
from varpack.integrations.kernels import compile_layers  # noqa: E402
from varpack.train.objectives import get_objective  # noqa: E402
from varpack.train.trainer import TrainCollator  # noqa: E402

#: the HF / TRL peers (a ``_liger`` suffix adds Liger-Kernel); every other row name is a varpack backend
PEERS = ("hf_padded", "hf_padded_torch", "hf_flat", "hf_flat_torch")
#: the padded peers: exact by construction (right padding); the "best exact peer" is the fastest of these
EXACT_PEERS = ("hf_padded", "hf_padded_torch")
#: module globals of transformers' Gated DeltaNet modeling files that
#: ``use_kernel_func_from_hub_with_fallback`` binds to ``fla`` / ``causal_conv1d`` when importable (qwen3_5
#: and qwen3_next use the same names)
HF_LINEAR_FUNCS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


@dataclass
class Workload:
    """The chosen packs: ``batches`` (varpack's collated rows, CPU tensors), ``static_batches`` (the same rows
    collated to the plan's one static shape, pad segments at the end) and ``packs`` (each pack's samples:
    ``input_ids`` / ``labels`` int64 lists, unshifted, -100 = not supervised), in the same step order."""

    batches: list[dict[str, Any]]
    packs: list[list[dict[str, list[int]]]]
    static_batches: list[dict[str, Any]]

    @property
    def tokens(self) -> int:
        """Real tokens of all steps (no padding)."""
        return sum(len(s["input_ids"]) for p in self.packs for s in p)


def workload(samples: list[dict], packing_length: int, steps: int) -> Workload:
    """The ``steps`` fullest BFD packs of ``samples``: varpack's collated rows and the packs' samples."""
    from varpack.collate import StaticShape

    dataset, chosen, _ = fullest_packs(samples, packing_length, steps)
    collate = TrainCollator(PaddingFreeCollator(pad_token_id=0))
    static = TrainCollator(PaddingFreeCollator(static_shape=StaticShape.from_plan(dataset.plan), pad_token_id=0))
    packs = [[{"input_ids": np.asarray(r["input_ids"]).tolist(), "labels": np.asarray(r["labels"]).tolist()}
              for r in dataset[i]] for i in chosen]  # fmt: skip
    return Workload(
        [collate([dataset[i]]) for i in chosen], packs, [static([dataset[i]]) for i in chosen]
    )


def supervised_count(pack: list[dict[str, list[int]]]) -> int:
    """Supervised predictions of a step: labels != -100 after the shift inside each sample."""
    return sum(sum(1 for y in s["labels"][1:] if y != IGNORE) for s in pack)


def padded_steps(packs: list[list[dict]], pad_tokens: int, pad_token_id: int = 0) -> list[list[dict]]:
    """HF padded micro-batches per step: the step's samples by decreasing length, greedily grouped while
    ``rows x longest <= pad_tokens`` (a sample longer than ``pad_tokens`` gets a micro-batch of its own), each
    right-padded by ``DataCollatorForSeq2Seq`` (``input_ids`` / ``attention_mask`` / ``labels`` [B, L])."""
    from transformers import DataCollatorForSeq2Seq

    collator = DataCollatorForSeq2Seq(pad_tokenizer(pad_token_id), padding=True, label_pad_token_id=IGNORE)
    steps = []
    for pack in packs:
        feats = sorted(pack, key=lambda s: -len(s["input_ids"]))
        groups: list[list[dict]] = []
        for f in feats:
            if groups and (len(groups[-1]) + 1) * len(groups[-1][0]["input_ids"]) <= pad_tokens:
                groups[-1].append(f)
            else:
                groups.append([f])
        steps.append([dict(collator([dict(f) for f in g])) for g in groups])
    return steps


def flat_steps(packs: list[list[dict]], *, boundary_kwargs: bool) -> list[list[dict]]:
    """HF padding-free rows per step (``DataCollatorWithFlattening``, one row [1, T]); ``boundary_kwargs``
    adds ``cu_seq_lens_q/k``, ``max_length_q/k`` and ``seq_idx`` (what TRL's padding-free collator sends)."""
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(
        return_flash_attn_kwargs=boundary_kwargs, return_seq_idx=boundary_kwargs
    )
    return [[dict(collator([dict(s) for s in pack]))] for pack in packs]


# ----------------------------------------------------------------------------------------------------------
# what transformers runs in the Gated DeltaNet layers
# ----------------------------------------------------------------------------------------------------------


def transformers_wrapper(fn: Any) -> Any:
    """The function inside a ``kernels`` ``Func`` module, else ``fn``. With the ``kernels`` package installed (a
    dependency of transformers 5.25), ``use_kernel_forward_from_hub`` turns each decorated function into an
    ``nn.Module`` whose ``forward`` calls the decorated function (transformers' fallback wrapper) from its
    closure (kernels 0.19 ``_create_func_module``)."""
    forward = getattr(type(fn), "forward", None)
    if forward is None or not callable(fn) or getattr(fn, "__wrapped__", None) is not None:
        return fn
    try:
        inner = inspect.getclosurevars(forward).nonlocals.get("func")
    except (TypeError, ValueError):
        return fn
    return inner if callable(inner) else fn


def _linear_funcs(module: Any) -> Iterator[tuple[str, Any, Any]]:
    """``(name, function, its __wrapped__ reference or None)`` of each of :data:`HF_LINEAR_FUNCS` ``module``
    has (``function``: transformers' wrapper, taken out of a ``kernels`` ``Func`` module where there is one)."""
    for name in HF_LINEAR_FUNCS:
        fn = getattr(module, name, None)
        if fn is not None:
            fn = transformers_wrapper(fn)
            yield name, fn, getattr(fn, "__wrapped__", None)


def hf_linear_impls(module: Any) -> dict[str, str]:
    """Which implementation each of transformers' Gated DeltaNet functions calls: ``"torch reference"`` or
    the ``module.name`` of the package function ``use_kernel_func_from_hub_with_fallback`` bound at import
    (read from its wrapper's closure; ``"unknown"`` when the wrapper has another shape)."""
    out = {}
    for name, fn, reference in _linear_funcs(module):
        # not a transformers wrapper: the reference itself (set by hf_reference_functions)
        if reference is None:
            out[name] = "torch reference"
            continue
        try:
            impl = inspect.getclosurevars(fn).nonlocals.get("implementation")
        except (TypeError, ValueError):
            impl = None
        if impl is None:
            out[name] = "unknown"
        elif impl is reference:
            out[name] = "torch reference"
        else:
            out[name] = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', '?')}"
    return out


def flat_exactness(impls: dict[str, str], boundary_kwargs: bool) -> str:
    """Whether HF's padding-free row keeps the samples apart in the Gated DeltaNet layers, from the bound
    implementations: the rule needs fla (honours ``cu_seqlens``), the conv needs ``causal_conv1d``
    (honours ``seq_idx``), and both need the boundary kwargs."""
    conv_ok = boundary_kwargs and impls.get("causal_conv1d_fn", "torch reference") != "torch reference"
    rule_ok = (
        boundary_kwargs and impls.get("torch_chunk_gated_delta_rule", "torch reference") != "torch reference"
    )
    if conv_ok and rule_ok:
        return "yes (fla + causal_conv1d with the boundary kwargs)"
    leaks = [what for what, ok in (("short conv", conv_ok), ("recurrent state", rule_ok)) if not ok]
    return f"NO: {' and '.join(leaks)} leak across samples"


def hf_reference_functions(module: Any) -> None:
    """Rebind transformers' Gated DeltaNet functions of ``module`` to their PyTorch references (the functions
    the decorator wrapped, ``__wrapped__``): what transformers runs without ``fla`` / ``causal_conv1d``.
    Use inside :func:`restored_module`.

    Raises:
        RuntimeError: a function is not a transformers wrapper (another transformers release).
    """
    for name, _, reference in _linear_funcs(module):
        if reference is None:
            raise RuntimeError(
                f"{module.__name__}.{name} is not a transformers kernel wrapper (no __wrapped__)"
            )
        setattr(module, name, reference)


# ----------------------------------------------------------------------------------------------------------
# rows
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One configuration, built: the model, its micro-batches per step, its loss and what it runs."""

    model: torch.nn.Module
    steps: list[list[dict[str, Any]]]
    loss_fn: Callable[[torch.nn.Module, dict[str, Any], int], torch.Tensor]
    info: dict[str, Any]


#: suffix of a varpack row whose decoder layers are compiled whole (custom ops, fullgraph)
COMPILED_LAYERS = "_compiled_layers"
#: suffix of a varpack row whose decoder layers are compiled with the mixers as graph breaks
COMPILED_BREAKS = "_compiled_breaks"
#: suffix of a varpack row on static shapes + CUDA graphs per layer (varpack sft's default on one GPU)
GRAPHS = "_graphs"


def varpack_base(config: str) -> tuple[str, str | None]:
    """``"fla_hybrid_compiled_layers"`` -> ``("fla_hybrid", "custom_ops")``, ``"fla_hybrid_compiled_breaks"`` ->
    ``("fla_hybrid", "graph_breaks")``, ``"fla_hybrid_graphs"`` -> ``("fla_hybrid", "graphs")``,
    ``"fla_hybrid"`` -> ``("fla_hybrid", None)``: the gated-delta backend of a varpack row and how its decoder
    layers are compiled."""
    for suffix, mode in ((COMPILED_LAYERS, "custom_ops"), (COMPILED_BREAKS, "graph_breaks"), (GRAPHS, "graphs")):
        if config.endswith(suffix):
            return config[: -len(suffix)], mode
    return config, None


def peer_base(config: str) -> tuple[str, bool]:
    """``"hf_padded_torch_liger"`` -> ``("hf_padded_torch", True)``."""
    liger = config.endswith("_liger")
    return (config[: -len("_liger")] if liger else config), liger


def build_row(
    config: str, args: argparse.Namespace, wl: Workload, device, dtype, stack: contextlib.ExitStack
) -> Row:
    """The model (seed 0), micro-batches and loss of a row. A peer row may rebind globals of the modeling
    module (reference functions, Liger): they are put back when ``stack`` closes.

    Raises:
        ImportError / RuntimeError / ValueError: Liger or the attention implementation is unavailable.
    """
    base, liger = peer_base(config)
    common = dict(device=device, dtype=dtype, vocab_size=args.vocab_size, overrides=args.overrides)
    if base not in PEERS:  # a varpack gated-delta backend
        linear, compiled = varpack_base(config)
        model = build_model(args.model, backend="auto", **common)
        patch_linear_attention(model, backend=linear)
        objective, linear_ce = get_objective("sft"), args.loss_impl == "linear_ce"

        def varpack_loss(model, mb, num_items):
            return objective.loss(model, mb, linear_ce=linear_ce, num_items_in_batch=num_items).loss

        info = {"exact": "yes (boundaries)", "loss_impl": args.loss_impl, "attention": "varpack auto"}
        if compiled == "graphs":
            from varpack.integrations.cuda_graphs import (
                begin_step,
                boundaries_on_device,
                capture_or_error,
                compile_layers_as_graphs,
                graph_attention,
            )
            from varpack.integrations.transformers import enable_varpack

            meta = wl.static_batches[0]["varlen_meta"]
            if torch.device(device).type == "cuda":  # elsewhere compile_layers_as_graphs refuses the device
                # the captured layers' attention as varpack sft picks it (triton_short where auto's is not capturable)
                attn, refusal, note = graph_attention(
                    model, backend="auto", device=device, dtype=dtype, max_seqlen=int(meta.max_seqlen_q)
                )
                if refusal is not None:
                    raise RuntimeError(f"{config}: {refusal}")
                if attn != "auto":
                    enable_varpack(model, backend=attn, linear_backend=linear)
                    info["attention"] = f"varpack {attn} ({note})"
            torch._dynamo.reset()
            layers = compile_layers_as_graphs(model, device=device, what=config)
            stack.enter_context(capture_or_error())

            def graphs_loss(model, mb, num_items):
                begin_step()
                return varpack_loss(model, boundaries_on_device(mb, device), num_items)

            info["compiled_layers"] = f"inductor x{layers}, static shapes, CUDA graphs per layer"
            info["static_shape"] = f"T={int(meta.total_q)} N={int(meta.num_seqs)} max_seqlen={int(meta.max_seqlen_q)}"
            return Row(model, [[b] for b in wl.static_batches], graphs_loss, info)
        if compiled:
            torch._dynamo.reset()  # every compiled row compiles in its own cold pass
            compile_backend = getattr(args, "compile_backend", "inductor")
            whole = compiled == "custom_ops"
            compile_layers(model, backend=compile_backend, custom_ops=whole, fullgraph=whole)
            info["compiled_layers"] = (
                f"{compile_backend}, custom_ops, fullgraph" if whole else f"{compile_backend}, mixers as graph breaks"
            )
        return Row(model, [[b] for b in wl.batches], varpack_loss, info)
    model = build_model(args.model, hf_attn=args.hf_attn, **common)
    module = sys.modules[type(model).__module__]
    stack.enter_context(restored_module(module))
    if base.endswith("_torch"):
        hf_reference_functions(module)
    impls = hf_linear_impls(module)
    if base.startswith("hf_padded"):
        steps, exact = (
            padded_steps(wl.packs, args.pad_tokens, int(model.config.pad_token_id or 0)),
            "yes (right padding)",
        )
    else:
        steps = flat_steps(wl.packs, boundary_kwargs=base == "hf_flat")
        exact = flat_exactness(impls, base == "hf_flat")
    info = {
        "exact": exact,
        "loss_impl": apply_trl_liger(model) if liger else "HF ForCausalLMLoss (full fp32 logits)",
        "attention": args.hf_attn,
        "hf_linear_impls": impls,
        "micro_batches_per_step": float(np.mean([len(st) for st in steps])),
    }
    if base.startswith("hf_padded"):
        info["padding_fraction"] = 1.0 - wl.tokens / sum(
            int(mb["input_ids"].numel()) for st in steps for mb in st
        )
    return Row(model, steps, lambda m, mb, n: m(**mb, use_cache=False, num_items_in_batch=n).loss, info)


def step_loss(row: Row, step: int, counts: list[int], device) -> torch.Tensor:
    """Forward + backward of one step's micro-batches (gradients accumulate); the step's loss (detached)."""
    total = torch.zeros((), device=device)
    for mb in row.steps[step]:
        loss = row.loss_fn(
            row.model,
            {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()},
            counts[step],
        )
        loss.backward()
        total += loss.detach()
    return total


def run_backend(config: str, args, wl: Workload, device, dtype) -> dict[str, Any]:
    """Build the row, one untimed cold pass, one timed pass (each step waited for); the row's figures."""
    cuda, counts = device.type == "cuda", [supervised_count(p) for p in wl.packs]
    with contextlib.ExitStack() as stack:
        row = build_row(config, args, wl, device, dtype, stack)
        opt = make_optimizer(row.model, device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)

        def step(i: int) -> torch.Tensor:
            loss = step_loss(row, i, counts, device)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        t = cold_then_timed(step, len(row.steps), device, 1, per_step=True)
        out = {
            "steps": len(row.steps),
            "cold_pass_s": t["cold_pass_s"],
            "ms_per_step": 1e3 * t["seconds"] / len(row.steps),
            "ms_per_step_median": 1e3 * float(np.median(t["step_s"])),
            "tokens_per_s": wl.tokens / t["seconds"],
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
            "params": n_params(row.model),
            "loss_first": t["loss_first"],
            **row.info,
        }
        row = opt = None  # noqa: F841 - the memory goes before the next row
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def summary(backends: list[str], rounds: list[list[dict]]) -> list[dict[str, Any]]:
    """One row per backend (``backends`` order): the rounds' ms/step, their mean, tokens/s, and the speed (ms
    ratio) vs the first row and vs the fastest exact peer (``hf_padded*`` rows that ran)."""
    by = {
        r["config"]: r
        for r in merge_rounds(rounds, "tokens_per_s", [b for b in backends if peer_base(b)[0] in EXACT_PEERS])
    }
    out = [by[b] for b in backends]
    for r in out:
        if "error" not in r:
            r["ms_rounds"] = [x["ms_per_step"] for x in r["rounds"] if "ms_per_step" in x]
            r["ms_mean"] = float(np.mean(r["ms_rounds"]))
    first = out[0].get("ms_mean") if out else None
    for r in out:
        if "error" not in r:
            r["speed_vs_first"] = None if first is None else first / r["ms_mean"]
            r["speed_vs_best_exact_peer"] = r.get("vs_best_peer")
            r["best_exact_peer"] = (r.get("best_peer_rounds") or [None])[0]
    return out


def table(rows: list[dict[str, Any]]) -> str:
    def x(v):
        return "-" if v is None else f"{v:.2f}x"

    body = [
        [r["config"], "-", "-", "-", "-", "-", "-", "-", "-", r["error"]]
        if "error" in r
        else [
            r["config"],
            r["exact"],
            f"{r['cold_pass_s']:.1f}",
            " / ".join(f"{m:.1f}" for m in r["ms_rounds"]),
            f"{r['tokens_per_s']:,.0f}",
            "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}",
            f"{r['loss_first']:.6f}",
            x(r["speed_vs_first"]),
            x(r["speed_vs_best_exact_peer"]),
            "",
        ]
        for r in rows
    ]
    return markdown_table(
        [
            "row",
            "exact",
            "cold pass s",
            "ms/step by round",
            "tokens/s",
            "peak GiB",
            "first-step loss",
            "speed vs first",
            "speed vs best exact peer",
            "error",
        ],
        body,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(
        ap,
        device="cuda" if torch.cuda.is_available() else "cpu",
        small="smoke run: tiny-qwen3.5, vocabulary 512, packing_length 256, 2 steps of short samples",
    )
    ap.add_argument("--model", default="qwen3.5-hybrid-shape")
    ap.add_argument(
        "--backends",
        default="chunk,fla_hybrid,hf_padded_torch",
        help=f"rows: varpack gated-delta backends (+ '{COMPILED_LAYERS}', '{COMPILED_BREAKS}' or '{GRAPHS}') and "
        f"peers {PEERS} (+ '_liger'); the first is the baseline",
    )
    ap.add_argument(
        "--samples", default=None, help="pre-encoded samples (.npz, benchmarks/_common.py encode)"
    )
    ap.add_argument("--packing-length", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="rounds in rotated order (2: given, then reversed)")
    ap.add_argument("--loss-impl", choices=("logits", "linear_ce"), default="linear_ce", help="varpack rows")
    ap.add_argument(
        "--hf-attn", default="sdpa", help="attn_implementation of the HF peers' full-attention layers"
    )
    ap.add_argument(
        "--pad-tokens",
        type=int,
        default=None,
        help="padded tokens per HF micro-batch (default: packing length)",
    )
    ap.add_argument("--vocab-size", type=int, default=None, help="embedding rows (default: the model's)")
    ap.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of the *_compiled_layers rows (aot_eager: no code generation, CPU smoke)",
    )
    args = ap.parse_args(argv)
    device = checked_device(ap, args)
    dtype = getattr(torch, args.dtype)
    args.overrides = None
    if args.small:
        args.model, args.packing_length, args.steps = "tiny-qwen3.5", 256, min(args.steps, 2)
        args.vocab_size = args.vocab_size or 512
    args.pad_tokens = args.pad_tokens or args.packing_length
    vocab = min(args.vocab_size or 150000, 150000)
    if args.samples:
        samples = load_samples(args.samples)
    else:  # --small: ~8 samples per pack of 256
        mu, sigma = (3.4, 0.5) if args.small else (5.0, 1.0)
        samples = synthetic_samples(
            2000, vocab=vocab, mu=mu, sigma=sigma, hi=args.packing_length, seed=args.seed
        )
    wl = workload(samples, args.packing_length, args.steps)
    backends = [b for b in args.backends.split(",") if b]
    rounds = run_rounds(backends, lambda b: run_backend(b, args, wl, device, dtype), args.rounds)
    rows = summary(backends, rounds)
    print(
        f"{args.model}, {len(wl.packs)} packs of packing_length {args.packing_length:,} ({wl.tokens:,} "
        "tokens, "
        f"{sum(len(p) for p in wl.packs)} samples), {device.type}, {dtype}, varpack loss {args.loss_impl}, "
        f"HF attention {args.hf_attn}, HF micro-batches <= {args.pad_tokens:,} padded tokens, {args.rounds} "
        "rounds"
    )
    print(table(rows))
    write_json(
        args.out, {"machine": machine_info(device), "args": vars(args), "rounds": rounds, "summary": rows}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
