"""End-to-end packed SFT step of a Qwen3.5-shaped hybrid model by gated-delta backend (#16, #18's hybrid row).

``qwen3.5-hybrid-shape`` (18 Gated DeltaNet + 6 full-attention layers, hidden 1024; see
:func:`varpack.models.gated_delta.qwen3_5_hybrid_shape_config`), bf16, varpack attention ``auto``, fused
AdamW, the chunked linear CE loss; the same packs (BFD at ``--packing-length`` over the pre-encoded
../shared/data samples, the ``--steps`` fullest) for every gated-delta backend in the same run. Each
backend runs one untimed pass over the packs first (Triton autotune / compile, allocator; reported as the
cold pass), then the timed pass; two rounds, the second in reverse order, so a ratio that depends on the
order shows. The first backend is the baseline of the ratio column.

    python benchmarks/hybrid_step.py --samples .gpu/samples.npz --backends chunk,fla_hybrid --out hybrid.json
    python benchmarks/hybrid_step.py --device cpu --small --backends chunk,naive     # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
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


def workload(samples: list[dict], packing_length: int, steps: int) -> list[dict[str, Any]]:
    """The ``steps`` fullest BFD packs of ``samples`` (those that fit), collated (CPU tensors)."""
    samples = [s for s in samples if s["length"] <= packing_length]
    lengths = np.asarray([s["length"] for s in samples], dtype=np.int64)
    plan = plan_packs(lengths, packing_length, strategy="bfd")
    fill = np.asarray([int(lengths[np.asarray(p)].sum()) for p in plan.packs])
    chosen = sorted(np.argsort(-fill, kind="stable")[:steps].tolist())
    dataset = PackedDataset(samples, plan, shuffle=False, check=False)
    collate = TrainCollator(PaddingFreeCollator(pad_token_id=0))
    return [collate([dataset[i]]) for i in chosen]


def _pass(model, opt, batches, device, linear_ce: bool) -> tuple[float, list[float]]:
    objective = get_objective("sft")
    times = []
    sync(device)
    t0 = time.perf_counter()
    for batch in batches:
        s0 = time.perf_counter()
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        loss = objective.loss(model, batch, linear_ce=linear_ce).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - s0)
    return time.perf_counter() - t0, times


def run_backend(backend: str, args, batches, device, dtype) -> dict[str, Any]:
    model = load_model(
        args.model, dtype=dtype, device=device, attn_backend="auto", config_overrides=args.overrides
    )
    model.config.use_cache = False
    patch_linear_attention(model, backend=backend)
    model.train()
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=cuda, foreach=not cuda)
    linear_ce = args.loss_impl == "linear_ce"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    cold_s, _ = _pass(model, opt, batches, device, linear_ce)
    warm_s, per_step = _pass(model, opt, batches, device, linear_ce)
    tokens = sum(int(b["input_ids"].numel()) for b in batches)
    row = {
        "backend": backend,
        "steps": len(batches),
        "cold_pass_s": cold_s,
        "ms_per_step": 1e3 * warm_s / len(batches),
        "ms_per_step_median": 1e3 * float(np.median(per_step)),
        "tokens_per_s": tokens / warm_s,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "params": sum(p.numel() for p in model.parameters()),
    }
    del model, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3.5-hybrid-shape")
    ap.add_argument(
        "--backends", default="chunk,fla_hybrid", help="gated-delta backends, the first is the baseline"
    )
    ap.add_argument(
        "--samples", default=None, help="pre-encoded samples (.npz, benchmarks/_common.py encode)"
    )
    ap.add_argument("--packing-length", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="rounds; every second one in reverse order")
    ap.add_argument("--loss-impl", choices=("logits", "linear_ce"), default="linear_ce")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="4 layers, packing_length 512, 2 steps (smoke run)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.overrides = None
    if args.small:
        args.overrides, args.packing_length, args.steps = {"num_hidden_layers": 4}, 512, 2
    if args.samples:
        samples = load_samples(args.samples)
    else:
        samples = synthetic_samples(2000, vocab=150000, mu=5.0, sigma=1.0, hi=args.packing_length)
    batches = workload(samples, args.packing_length, args.steps)
    backends = [b for b in args.backends.split(",") if b]
    rounds: list[list[dict]] = []
    for r in range(args.rounds):
        order = backends if r % 2 == 0 else backends[::-1]
        rows = []
        for backend in order:
            try:
                rows.append(run_backend(backend, args, batches, device, dtype))
            except Exception as exc:  # noqa: BLE001 - a backend that cannot run here is reported, not fatal
                rows.append({"backend": backend, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            print(json.dumps(rows[-1]), flush=True)
        rounds.append(rows)
    table = []
    for backend in backends:
        ok = [row for rows in rounds for row in rows if row["backend"] == backend and "error" not in row]
        if not ok:
            err = next(row["error"] for rows in rounds for row in rows if row["backend"] == backend)
            table.append([backend, "-", "-", "-", "-", "-", err])
            continue
        ms = [row["ms_per_step"] for row in ok]
        table.append(
            [backend, f"{ok[0]['cold_pass_s']:.1f}", " / ".join(f"{m:.1f}" for m in ms),
             f"{np.mean([row['tokens_per_s'] for row in ok]):,.0f}",
             "-" if ok[0]["peak_gib"] is None else f"{max(row['peak_gib'] for row in ok):.1f}", np.mean(ms), ""]
        )  # fmt: skip
    base = next((row[5] for row in table if row[5] != "-"), None)
    for row in table:
        row[5] = "-" if row[5] == "-" or base is None else f"{base / row[5]:.2f}x"
    tokens = sum(int(b["input_ids"].numel()) for b in batches)
    print(
        f"{args.model}, {len(batches)} packs of packing_length {args.packing_length:,} ({tokens:,} tokens), "
        f"{device.type}, {dtype}, loss {args.loss_impl}, {args.rounds} rounds (odd rounds reversed)"
    )
    print(
        markdown_table(
            [
                "gated-delta backend",
                "cold pass s",
                "ms/step by round",
                "tokens/s",
                "peak GiB",
                "speed vs first",
                "error",
            ],
            table,
        )
    )
    if args.out:
        Path(args.out).write_text(json.dumps({"rounds": rounds, "machine": machine_info(device)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
