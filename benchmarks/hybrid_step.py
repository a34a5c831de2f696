"""End-to-end packed SFT step of a Qwen3.5-shaped hybrid model: varpack's gated-delta backends against the
HF / TRL peer (#16, #18 item 4).

``qwen3.5-hybrid-shape`` (18 Gated DeltaNet + 6 full-attention layers, hidden 1024; see
:func:`varpack.models.gated_delta.qwen3_5_hybrid_shape_config`), random init (seed 0, the same weights in
every row), bf16 on CUDA / fp32 on the CPU, fused AdamW (lr 1e-5, no weight decay). The workload: BFD packs
at ``--packing-length`` over the pre-encoded ../shared/data samples (``--samples``; else synthetic lognormal
lengths), the ``--steps`` fullest; one pack = one optimizer step, the SAME samples per step in every row.
Loss everywhere: token mean over the step's supervised predictions (labels != -100 after the shift inside
each sample). Each row runs one untimed cold pass over all steps (Triton autotune / compile, allocator;
reported), then the timed pass; ``--rounds`` rounds, every second one in reverse order, so a ratio that
depends on the order shows.

Rows (``--backends``, comma-separated; the first row is the baseline of "speed vs first"):

* a varpack gated-delta backend (``chunk``, ``fla_hybrid``, ``naive``, ``fla``, ``auto`` ...): the pack as
  one padding-free row (``PaddingFreeCollator``), varpack attention ``auto`` for the full-attention layers,
  :func:`varpack.integrations.gated_delta.patch_linear_attention` with that backend (short conv and
  recurrent state reset at every sample boundary), loss ``--loss-impl`` (default the chunked linear CE).
* ``hf_padded_torch``: the exact HF peer that trains on an H200 with Triton 3.6. HF ``Qwen3_5ForCausalLM``
  as is, ``attn_implementation=--hf-attn`` (default ``sdpa``), ``DataCollatorForSeq2Seq`` right padding
  (labels padded with -100, ``attention_mask``): each step's samples sorted by length (HF's
  ``group_by_length`` taken to its best case) and split into micro-batches of at most ``--pad-tokens``
  padded tokens (rows x longest; default the packing length), gradient accumulation, HF's loss
  (``ForCausalLMLoss``, full fp32 logits) with ``num_items_in_batch`` = the step's supervised count. The
  Gated DeltaNet layers run transformers' reference PyTorch functions (``torch_chunk_gated_delta_rule``,
  the ``F.conv1d`` ``causal_conv1d_fn``): what transformers binds when ``fla`` / ``causal_conv1d`` are not
  installed (here: the module globals are set to the decorated originals, ``__wrapped__``, for the row).
  Exact: right padding after each sample cannot reach its tokens (causal conv, causal recurrence, causal
  mask); the linear layers also zero padded hidden states (``apply_mask_to_padding_states``).
* ``hf_padded``: the same with transformers' kernels as installed: on CUDA with ``fla`` installed, fla's
  ``chunk_gated_delta_rule`` (bound at import by ``use_kernel_func_from_hub_with_fallback``, no fallback at
  call time). fla 0.6.0 refuses its backward on Hopper with Triton >= 3.4, < 3.7.1 (``RuntimeError ...
  gated chunk_bwd_dqkwg``): on the H200 machine (Triton 3.6) this row is an error row, i.e. HF crashes there.
* ``hf_flat``: HF padding-free, the keys TRL's ``SFTTrainer(padding_free=True)`` collator sends:
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)`` (``position_ids``,
  ``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx``), one row per step, HF's kernels as installed.
  NOT EXACT unless transformers bound both ``fla`` (its rule honours ``cu_seqlens``) and the
  ``causal_conv1d`` package (honours ``seq_idx``): the torch ``causal_conv1d_fn`` convolves the whole row
  and ``torch_chunk_gated_delta_rule`` ignores ``cu_seqlens``, so the conv taps / recurrent state leak
  across samples (transformers 5.17 silently; later releases raise ``ValueError`` on the torch path when
  given ``cu_seqlens`` / ``seq_idx``). The row's ``exact`` column says which leak applies.
* ``hf_flat_torch``: ``DataCollatorWithFlattening()`` (``position_ids`` only, HF's default) with the
  reference functions: both the conv and the recurrent state leak across samples (negative control).
* ``<peer>_liger``: the peer plus Liger-Kernel as ``SFTConfig(use_liger_kernel=True)`` applies it
  (``_apply_liger_kernel_to_instance``: RMSNorm, SwiGLU, fused linear CE; needs CUDA); the modeling
  module is restored after the row.

Columns: cold pass, ms/step per round, real tokens/s (the samples' tokens, padding excluded), peak GiB, the
first step's loss (before any update: same weights and samples, so every row agrees to the dtype's rounding;
a sanity check, not the exactness proof: at random init a leak moves it only in the 6th digit; the proof is
tests/test_benchmarks_hybrid_peer.py, fp32 CPU, varpack packed == ``hf_padded_torch`` in loss and every
gradient, ``hf_flat_torch`` not), the exactness, speed vs the first row and vs the fastest exact peer
(``hf_padded*`` rows that ran; ``peer ms / row ms``). The JSON lines also give ``hf_linear_impls``: the
implementation transformers bound for each Gated DeltaNet function (fla's / causal_conv1d's or the torch
reference), ``micro_batches_per_step`` and ``padding_fraction``.

    python benchmarks/hybrid_step.py --samples .gpu/samples.npz \\
        --backends chunk,fla_hybrid,hf_padded_torch,hf_padded_torch_liger,hf_padded,hf_flat_torch \\
        --steps 4 --rounds 1 --out hybrid.json                                            # GPU
    python benchmarks/hybrid_step.py --device cpu --small --backends chunk,hf_padded_torch,hf_flat_torch --rounds 1
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import load_samples, machine_info, markdown_table, sync, synthetic_samples  # noqa: E402
from varpack.collate import PaddingFreeCollator  # noqa: E402
from varpack.data.dataset import PackedDataset  # noqa: E402
from varpack.integrations.gated_delta import patch_linear_attention  # noqa: E402
from varpack.models import load_model  # noqa: E402
from varpack.plan import plan_packs  # noqa: E402
from varpack.train.objectives import get_objective  # noqa: E402
from varpack.train.trainer import TrainCollator  # noqa: E402

IGNORE = -100
#: the HF / TRL peers (a ``_liger`` suffix adds Liger-Kernel); every other row name is a varpack backend
PEERS = ("hf_padded", "hf_padded_torch", "hf_flat", "hf_flat_torch")
#: the padded peers: exact by construction (right padding); the "best exact peer" is the fastest of these
EXACT_PEERS = ("hf_padded", "hf_padded_torch")
#: module globals of transformers' Gated DeltaNet modeling files that ``use_kernel_func_from_hub_with_fallback``
#: binds to ``fla`` / ``causal_conv1d`` when importable (qwen3_5 and qwen3_next use the same names)
HF_LINEAR_FUNCS = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


@dataclass
class Workload:
    """The chosen packs: ``batches`` (varpack's collated rows, CPU tensors) and ``packs`` (each pack's samples:
    ``input_ids`` / ``labels`` int64 lists, unshifted, -100 = not supervised), in the same step order."""

    batches: list[dict[str, Any]]
    packs: list[list[dict[str, list[int]]]]

    @property
    def tokens(self) -> int:
        """Real tokens of all steps (no padding)."""
        return sum(len(s["input_ids"]) for p in self.packs for s in p)


def workload(samples: list[dict], packing_length: int, steps: int) -> Workload:
    """The ``steps`` fullest BFD packs of ``samples`` (those that fit): varpack's collated rows and the samples."""
    samples = [s for s in samples if s["length"] <= packing_length]
    lengths = np.asarray([s["length"] for s in samples], dtype=np.int64)
    plan = plan_packs(lengths, packing_length, strategy="bfd")
    fill = np.asarray([int(lengths[np.asarray(p)].sum()) for p in plan.packs])
    chosen = sorted(np.argsort(-fill, kind="stable")[:steps].tolist())
    dataset = PackedDataset(samples, plan, shuffle=False, check=False)
    collate = TrainCollator(PaddingFreeCollator(pad_token_id=0))
    batches, packs = [], []
    for i in chosen:
        rows = dataset[i]
        packs.append(
            [
                {"input_ids": np.asarray(r["input_ids"]).tolist(), "labels": np.asarray(r["labels"]).tolist()}
                for r in rows
            ]
        )
        batches.append(collate([dataset[i]]))
    return Workload(batches, packs)


def supervised_count(pack: list[dict[str, list[int]]]) -> int:
    """Supervised predictions of a step: labels != -100 after the shift inside each sample."""
    return sum(sum(1 for y in s["labels"][1:] if y != IGNORE) for s in pack)


def _pad_collator(pad_token_id: int):
    from transformers import DataCollatorForSeq2Seq

    from benchmarks.train import _pad_tokenizer

    return DataCollatorForSeq2Seq(_pad_tokenizer(pad_token_id), padding=True, label_pad_token_id=IGNORE)


def padded_steps(packs: list[list[dict]], pad_tokens: int, pad_token_id: int = 0) -> list[list[dict]]:
    """HF padded micro-batches per step: the step's samples by decreasing length, greedily grouped while
    ``rows x longest <= pad_tokens`` (a sample longer than ``pad_tokens`` gets a micro-batch of its own),
    each right-padded by ``DataCollatorForSeq2Seq`` (``input_ids`` / ``attention_mask`` / ``labels`` [B, L])."""
    collator = _pad_collator(pad_token_id)
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


def _modeling_module(model: torch.nn.Module):
    return sys.modules[type(model).__module__]


def _linear_funcs(module: Any) -> Iterator[tuple[str, Any, Any]]:
    """``(name, function, its __wrapped__ reference or None)`` of each of :data:`HF_LINEAR_FUNCS` ``module`` has."""
    for name in HF_LINEAR_FUNCS:
        fn = getattr(module, name, None)
        if fn is not None:
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


@contextlib.contextmanager
def restored_module(module: Any) -> Iterator[None]:
    """Put every global of ``module`` back on exit (Liger and :func:`hf_reference_functions` rebind them)."""
    saved = dict(vars(module))
    try:
        yield
    finally:
        for name, value in saved.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)


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


def peer_base(config: str) -> tuple[str, bool]:
    """``"hf_padded_torch_liger"`` -> ``("hf_padded_torch", True)``."""
    liger = config.endswith("_liger")
    return (config[: -len("_liger")] if liger else config), liger


def build_row(
    config: str, args: argparse.Namespace, wl: Workload, device, dtype, stack: contextlib.ExitStack
) -> Row:
    """The model (seed 0), micro-batches and loss of a row. A peer row may rebind globals of the modeling
    file (reference functions, Liger): they are put back when ``stack`` closes.

    Raises:
        ValueError: an unknown peer name.
        ImportError / RuntimeError: Liger or the attention implementation is unavailable.
    """
    base, liger = peer_base(config)
    common = dict(dtype=dtype, device=device, vocab_size=args.vocab_size, config_overrides=args.overrides)
    if base not in PEERS:  # a varpack gated-delta backend
        model = load_model(args.model, attn_backend="auto", **common)
        model.config.use_cache = False
        patch_linear_attention(model, backend=config)
        model.train()
        objective = get_objective("sft")
        linear_ce = args.loss_impl == "linear_ce"

        def varpack_loss(model, mb, num_items):
            return objective.loss(model, mb, linear_ce=linear_ce, num_items_in_batch=num_items).loss

        info = {"exact": "yes (boundaries)", "loss_impl": args.loss_impl, "attention": "varpack auto"}
        return Row(model, [[b] for b in wl.batches], varpack_loss, info)

    model = load_model(args.model, attn_backend=None, **common)
    model.set_attn_implementation(args.hf_attn)
    model.config.use_cache = False
    model.train()
    module = _modeling_module(model)
    stack.enter_context(restored_module(module))
    if base.endswith("_torch"):
        hf_reference_functions(module)
    impls = hf_linear_impls(module)
    if base.startswith("hf_padded"):
        steps = padded_steps(wl.packs, args.pad_tokens, int(model.config.pad_token_id or 0))
        exact = "yes (right padding)"
    else:
        boundary_kwargs = base == "hf_flat"
        steps = flat_steps(wl.packs, boundary_kwargs=boundary_kwargs)
        exact = flat_exactness(impls, boundary_kwargs)
    loss_impl = "HF ForCausalLMLoss (full fp32 logits)"
    if liger:
        from benchmarks.train import _apply_trl_liger

        loss_impl = _apply_trl_liger(model)

    def hf_loss(model, mb, num_items):
        return model(**mb, use_cache=False, num_items_in_batch=num_items).loss

    info = {
        "exact": exact,
        "loss_impl": loss_impl,
        "attention": args.hf_attn,
        "hf_linear_impls": impls,
        "micro_batches_per_step": float(np.mean([len(st) for st in steps])),
    }
    if base.startswith("hf_padded"):
        padded = sum(int(mb["input_ids"].numel()) for st in steps for mb in st)
        info["padding_fraction"] = 1.0 - wl.tokens / padded
    return Row(model, steps, hf_loss, info)


def _to_device(mb: dict[str, Any], device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}


def step_loss(row: Row, step: int, counts: list[int], device) -> torch.Tensor:
    """Forward + backward of one step's micro-batches (gradients accumulate); the step's loss (detached)."""
    total = torch.zeros((), device=device)
    for mb in row.steps[step]:
        loss = row.loss_fn(row.model, _to_device(mb, device), counts[step])
        loss.backward()
        total += loss.detach()
    return total


def _pass(row: Row, opt, counts: list[int], device) -> tuple[float, list[float], torch.Tensor]:
    """One pass over the steps: ``(seconds, per-step seconds, the first step's loss, not yet read)``."""
    times: list[float] = []
    first = None
    sync(device)
    t0 = time.perf_counter()
    for i in range(len(row.steps)):
        s0 = time.perf_counter()
        loss = step_loss(row, i, counts, device)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - s0)
        if first is None:
            first = loss
    return time.perf_counter() - t0, times, first


def run_backend(config: str, args, wl: Workload, device, dtype) -> dict[str, Any]:
    """Build the row, one untimed cold pass, one timed pass; the row's figures."""
    cuda = device.type == "cuda"
    counts = [supervised_count(p) for p in wl.packs]
    with contextlib.ExitStack() as stack:
        row = build_row(config, args, wl, device, dtype, stack)
        opt = torch.optim.AdamW(
            row.model.parameters(), lr=1e-5, weight_decay=0.0, fused=cuda, foreach=not cuda
        )
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        cold_s, _, first = _pass(row, opt, counts, device)
        warm_s, per_step, _ = _pass(row, opt, counts, device)
        out = {
            "backend": config,
            "steps": len(row.steps),
            "cold_pass_s": cold_s,
            "ms_per_step": 1e3 * warm_s / len(row.steps),
            "ms_per_step_median": 1e3 * float(np.median(per_step)),
            "tokens_per_s": wl.tokens / warm_s,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
            "params": sum(p.numel() for p in row.model.parameters()),
            "loss_first": float(first),
            **row.info,
        }
        del row, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------------


def summary(backends: list[str], rounds: list[list[dict]]) -> list[dict[str, Any]]:
    """Per row (in ``backends`` order): the rounds' figures, mean ms/step, and the ratios: speed vs the first
    row and vs the fastest exact peer (``hf_padded*`` rows that ran): ``peer ms / row ms``."""
    out = []
    for backend in backends:
        ok = [row for rows in rounds for row in rows if row["backend"] == backend and "error" not in row]
        if not ok:
            err = next(row["error"] for rows in rounds for row in rows if row["backend"] == backend)
            out.append({"backend": backend, "error": err})
            continue
        out.append(
            {
                **ok[0],
                "ms_rounds": [row["ms_per_step"] for row in ok],
                "ms_mean": float(np.mean([row["ms_per_step"] for row in ok])),
                "tokens_per_s": float(np.mean([row["tokens_per_s"] for row in ok])),
                "peak_gib": None if ok[0]["peak_gib"] is None else max(row["peak_gib"] for row in ok),
            }
        )
    ran = [r for r in out if "error" not in r]
    base = ran[0]["ms_mean"] if ran and "error" not in out[0] else None
    peers = [r for r in ran if peer_base(r["backend"])[0] in EXACT_PEERS]
    best = min(peers, key=lambda r: r["ms_mean"]) if peers else None
    for r in ran:
        r["speed_vs_first"] = None if base is None else base / r["ms_mean"]
        r["best_exact_peer"] = None if best is None else best["backend"]
        r["speed_vs_best_exact_peer"] = None if best is None else best["ms_mean"] / r["ms_mean"]
    return out


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([r["backend"], "-", "-", "-", "-", "-", "-", "-", "-", r["error"]])
            continue
        lines.append(
            [r["backend"], r["exact"], f"{r['cold_pass_s']:.1f}", " / ".join(f"{m:.1f}" for m in r["ms_rounds"]),
             f"{r['tokens_per_s']:,.0f}", "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}",
             f"{r['loss_first']:.6f}", _x(r["speed_vs_first"]), _x(r["speed_vs_best_exact_peer"]), ""]
        )  # fmt: skip
    headers = ["row", "exact", "cold pass s", "ms/step by round", "tokens/s", "peak GiB", "first-step loss",
               "speed vs first", "speed vs best exact peer", "error"]  # fmt: skip
    return markdown_table(headers, lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3.5-hybrid-shape")
    ap.add_argument(
        "--backends",
        default="chunk,fla_hybrid,hf_padded_torch",
        help=f"rows: varpack gated-delta backends and peers {PEERS} (+ '_liger'); the first is the baseline",
    )
    ap.add_argument(
        "--samples", default=None, help="pre-encoded samples (.npz, benchmarks/_common.py encode)"
    )
    ap.add_argument("--packing-length", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="rounds; every second one in reverse order")
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
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--small",
        action="store_true",
        help="4 layers, vocab 8192, packing_length 512, 2 steps, short samples (smoke run)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.overrides = None
    if args.small:
        args.overrides, args.packing_length, args.steps = {"num_hidden_layers": 4}, 512, 2
        args.vocab_size = args.vocab_size or 8192
    args.pad_tokens = args.pad_tokens or args.packing_length
    if args.samples:
        samples = load_samples(args.samples)
    else:
        vocab = min(args.vocab_size or 150000, 150000)
        mu, sigma = (3.5, 0.8) if args.small else (5.0, 1.0)  # small: ~10+ samples per pack of 512
        samples = synthetic_samples(2000, vocab=vocab, mu=mu, sigma=sigma, hi=args.packing_length)
    wl = workload(samples, args.packing_length, args.steps)
    backends = [b for b in args.backends.split(",") if b]
    rounds: list[list[dict]] = []
    for r in range(args.rounds):
        order = backends if r % 2 == 0 else backends[::-1]
        rows = []
        for backend in order:
            try:
                rows.append(run_backend(backend, args, wl, device, dtype))
            except Exception as exc:  # noqa: BLE001 - a row that cannot run here is reported, not fatal
                msg = str(exc).splitlines()[0][:200] if str(exc) else ""
                rows.append({"backend": backend, "error": f"{type(exc).__name__}: {msg}"})
            print(json.dumps(rows[-1]), flush=True)
        rounds.append(rows)
    rows = summary(backends, rounds)
    print(
        f"{args.model}, {len(wl.packs)} packs of packing_length {args.packing_length:,} ({wl.tokens:,} tokens, "
        f"{sum(len(p) for p in wl.packs)} samples), {device.type}, {dtype}, varpack loss {args.loss_impl}, "
        f"HF attention {args.hf_attn}, HF micro-batches <= {args.pad_tokens:,} padded tokens, "
        f"{args.rounds} rounds (odd rounds reversed)"
    )
    print(table(rows))
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"rounds": rounds, "summary": rows, "machine": machine_info(device)}, indent=1, default=str
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
