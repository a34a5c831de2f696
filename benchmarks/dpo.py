"""DPO step throughput: varpack packed pairs vs TRL-style padded pairs, steady state.

Workload: preference pairs of real lengths (``--data``, default ../shared/data/mt_bench_pairs.jsonl: 1,920
MT-bench answer pairs) encoded with the embedded Qwen3 chat template (:mod:`varpack.data.preference`),
planned with best-fit decreasing keeping each pair in one pack (``plan_packs(..., groups=pair_groups(n))``,
overlong pairs dropped); the ``--steps`` fullest packs are the optimizer steps (one pack = one step), and both
configurations train on exactly those pairs.

* ``padded``: TRL's ``DPOTrainer`` layout: per micro-batch of ``--pad-batch`` pairs, the chosen and rejected
  sequences right-padded into one ``[2B, S]`` batch with an attention mask, transformers' ``sdpa`` attention;
  per-sequence log-probs = masked sum of the completion's token log-probs; reference forward under
  ``no_grad``; sigmoid loss summed over pairs / pairs of the step (gradient accumulation over micro-batches).
* ``varpack``: the pack collated into one row (``PaddingFreeCollator``), ``DPOObjective.loss`` (one segment
  reduction over ``seq_idx``, reference alongside on the same row), varpack attention (``backend="auto"``).

Both: same init (policy and reference, same seed), AdamW (lr 1e-6), bf16 weights on CUDA. Measurement, per
configuration in the same run (the ``padded`` baseline included): one untimed cold pass over all steps
(compiles, autotuning, allocator warm-up; its time is reported separately as ``cold pass s``), then up to
``--timed-passes`` timed passes (steady state), stopped early so that the cold and timed passes of all
configurations stay within ``--time-budget`` seconds (at least one timed pass runs); the median is reported.
Reported: real tokens/s (tokens of the pairs, no padding; reference forward included), padded tokens
processed, peak memory, the first step's loss (equal up to rounding: same computation), ratio to ``padded``.

Run::

    python benchmarks/dpo.py --steps 16 --out runs/dpo.json           # H200: qwen3-0.6b-shape, bf16 (budget 80 s)
    python benchmarks/dpo.py --small                                   # CPU smoke: tiny-qwen3, 2 steps

On the dev CPU (2 shared cores, tiny-qwen3, float32) ``--small`` takes ~4 min: the 151,936-token vocabulary
makes every logits tensor ~1.2 GB per 2,048 tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from varpack.collate import PaddingFreeCollator  # noqa: E402
from varpack.data.preference import encode_pairs, load_pairs, pair_groups  # noqa: E402
from varpack.data.tokenizer import load_tokenizer  # noqa: E402
from varpack.models import load_model  # noqa: E402
from varpack.plan import plan_packs  # noqa: E402
from varpack.train.objectives.dpo import DPOObjective  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "mt_bench_pairs.jsonl"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _padded_logps(model: Any, samples: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
    """TRL layout: right-padded ``[2B, S]`` batch with attention mask; summed completion log-probs ``[2B]``."""
    s = max(len(x["input_ids"]) for x in samples)
    ids = torch.zeros(len(samples), s, dtype=torch.long)
    labels = torch.full((len(samples), s), -100, dtype=torch.long)
    mask = torch.zeros(len(samples), s, dtype=torch.long)
    for i, x in enumerate(samples):
        n = len(x["input_ids"])
        ids[i, :n] = torch.tensor(x["input_ids"])
        labels[i, :n] = torch.tensor(x["labels"])
        mask[i, :n] = 1
    ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    target = labels[:, 1:]
    valid = target != -100
    tok = -F.cross_entropy(logits.transpose(1, 2), target.masked_fill(~valid, 0), reduction="none")
    return (tok * valid).sum(1)


def _padded_step(policy, ref, step_samples, pad_batch, beta, device) -> tuple[torch.Tensor, int]:
    pairs = len(step_samples) // 2
    total = torch.zeros((), device=device)
    padded_tokens = 0
    for a in range(0, pairs, pad_batch):
        chunk = step_samples[2 * a : 2 * min(pairs, a + pad_batch)]
        ordered = chunk[0::2] + chunk[1::2]  # TRL: [chosen..., rejected...]
        padded_tokens += len(ordered) * max(len(x["input_ids"]) for x in ordered)
        logps = _padded_logps(policy, ordered, device)
        with torch.no_grad():
            ref_logps = _padded_logps(ref, ordered, device)
        b = len(chunk) // 2
        delta = (logps[:b] - ref_logps[:b]) - (logps[b:] - ref_logps[b:])
        loss = -F.logsigmoid(beta * delta).sum() / pairs
        loss.backward()
        total = total + loss.detach()
    return total, padded_tokens


def _packed_step(policy, objective, batch, device) -> tuple[torch.Tensor, int]:
    batch = {
        k: v.to(device) if isinstance(v, torch.Tensor) and not k.startswith("cu_seq_lens") else v
        for k, v in batch.items()
    }
    loss = objective.loss(policy, batch).loss
    loss.backward()
    return loss.detach(), int(batch["input_ids"].shape[1])


def _one_pass(name, policy, ref, objective, opt, steps, packed_batches, args, device):  # noqa: ANN001
    """One pass over the steps: ``(seconds, losses, tokens processed)``."""
    losses, processed = [], 0
    _sync(device)
    t0 = time.perf_counter()
    for step, batch in zip(steps, packed_batches):
        if name == "padded":
            loss, n = _padded_step(policy, ref, step, args.pad_batch, args.beta, device)
        else:
            loss, n = _packed_step(policy, objective, batch, device)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
        processed += n
    _sync(device)
    return time.perf_counter() - t0, [float(x) for x in losses], processed


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    tok = load_tokenizer("qwen3")
    enc = encode_pairs(load_pairs(str(args.data)), tok)
    lengths = np.array([s["length"] for s in enc], dtype=np.int64)
    plan = plan_packs(lengths, args.packing_length, groups=pair_groups(len(enc)), overflow="drop")
    fullest = np.argsort(-plan.pack_lengths, kind="stable")[: args.steps]
    steps = [[enc[i] | {"sample_id": int(i)} for i in plan.pack(p)] for p in fullest]
    real_tokens = sum(s["length"] for step in steps for s in step)
    collate = PaddingFreeCollator()
    packed_batches = [collate([step]) for step in steps]
    results: dict[str, Any] = {
        "model": args.model,
        "device": str(device),
        "dtype": args.dtype,
        "packing_length": args.packing_length,
        "steps": len(steps),
        "pairs": sum(len(s) // 2 for s in steps),
        "real_tokens_per_pass": real_tokens,
        "dropped_pairs": len(plan.overflow["overlong_group_ids"]),
        "configs": {},
    }
    configs = args.configs.split(",")
    share = args.time_budget / len(configs)  # seconds of cold + timed passes per configuration
    for name in configs:
        backend = "auto" if name == "varpack" else None
        policy = load_model(args.model, dtype=dtype, seed=0, attn_backend=backend, device=device)
        ref = load_model(args.model, dtype=dtype, seed=0, attn_backend=backend, device=device)
        for m in (policy, ref):
            m.config.use_cache = False
            if name == "padded":
                m.set_attn_implementation("sdpa")
        ref.eval().requires_grad_(False)
        policy.train()
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
        objective = DPOObjective(beta=args.beta, ref_model=ref)

        ctx = (name, policy, ref, objective, opt, steps, packed_batches, args, device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t_cfg = time.perf_counter()
        cold_s, cold_losses, processed = _one_pass(*ctx)  # untimed: compiles, autotuning, allocator
        times: list[float] = []
        while len(times) < args.timed_passes:  # at least one; stop before the next would pass the share
            times.append(_one_pass(*ctx)[0])
            if time.perf_counter() - t_cfg + times[-1] > share:
                break
        steady = statistics.median(times)
        results["configs"][name] = {
            "tokens_per_s": real_tokens / steady,
            "seconds_per_pass": steady,
            "cold_pass_s": cold_s,
            "timed_passes": len(times),
            "timed_pass_s": times,
            "tokens_processed_per_pass": processed,
            "first_step_loss": cold_losses[0],
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30
            if device.type == "cuda"
            else None,
        }
        del policy, ref, opt, objective, ctx
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = results["configs"].get("padded", {}).get("tokens_per_s")
    for cfg in results["configs"].values():
        cfg["ratio_to_padded"] = cfg["tokens_per_s"] / base if base else None
    return results


def _table(results: dict[str, Any]) -> str:
    rows = [
        "| config | real tokens/s | tokens processed/pass | s/pass (median) | timed passes | cold pass s | "
        "first loss | peak GiB | vs padded |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c in results["configs"].items():
        mem = f"{c['peak_memory_gib']:.1f}" if c["peak_memory_gib"] is not None else "-"
        ratio = f"{c['ratio_to_padded']:.2f}x" if c["ratio_to_padded"] else "-"
        rows.append(
            f"| {name} | {c['tokens_per_s']:,.0f} | {c['tokens_processed_per_pass']:,} | {c['seconds_per_pass']:.3f} "
            f"| {c['timed_passes']} | {c['cold_pass_s']:.2f} | {c['first_step_loss']:.6f} | {mem} | {ratio} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--model", default="qwen3-0.6b-shape")
    p.add_argument("--packing-length", type=int, default=16384)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--pad-batch", type=int, default=4, help="pairs per padded micro-batch")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--timed-passes", type=int, default=3, help="at most this many timed passes per config")
    p.add_argument(
        "--time-budget",
        type=float,
        default=80.0,
        help="seconds of cold + timed passes for all configs together, split evenly: a config's timed passes "
        "stop when the next one would pass its share (at least one timed pass runs)",
    )
    p.add_argument("--configs", default="padded,varpack")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    p.add_argument(
        "--small", action="store_true", help="CPU smoke: tiny-qwen3, 2 steps of 2048 tokens, one timed pass"
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.small:
        args.model, args.steps, args.packing_length, args.timed_passes = "tiny-qwen3", 2, 2048, 1
        args.device = "cpu"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    results = run(args)
    print(
        f"DPO step, {results['model']} on {results['device']} ({results['dtype']}): {results['steps']} steps, "
        f"{results['pairs']} pairs, {results['real_tokens_per_pass']:,} real tokens per pass, "
        f"packing_length {results['packing_length']:,} ({results['dropped_pairs']} overlong pairs dropped)"
    )
    print(_table(results))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
