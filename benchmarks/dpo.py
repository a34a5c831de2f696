"""The DPO step: varpack's packed pairs against TRL's padded pairs, steady state, same run.

Workload: preference pairs (``--data``, default ../shared/data/mt_bench_pairs.jsonl: MT-bench answer pairs;
the built-in pairs with ``--small``) encoded with the embedded Qwen3 chat template
(:mod:`varpack.data.preference`), planned with best-fit decreasing keeping each pair in one pack
(``plan_packs(..., groups=pair_groups(n))``, overlong pairs dropped); the ``--steps`` fullest packs are the
optimizer steps, and both configurations train on exactly those pairs:

* ``padded`` (the peer): TRL ``DPOTrainer``'s layout -- per micro-batch of ``--pad-batch`` pairs, chosen and
  rejected right-padded into one ``[2B, S]`` batch with an attention mask, ``sdpa``; per-sequence log-probs =
  masked sum of the completion's token log-probs; the reference forward under ``no_grad``; sigmoid loss summed
  over pairs / pairs;
* ``varpack``: the pack as one row (``PaddingFreeCollator``), ``DPOObjective.loss`` (one segment reduction
  over ``seq_idx``, the reference alongside on the same row), varpack attention ``auto``.

Same init for policy and reference (same seed), AdamW (lr 1e-6), bf16 weights on CUDA. Each configuration: one
untimed cold pass (reported), then up to ``--timed-passes`` timed passes, stopped early so that all
configurations stay within ``--time-budget`` seconds (at least one timed pass); the median is reported. Real
tokens/s counts the pairs' tokens (no padding; the reference forward included).

    python benchmarks/dpo.py --data .gpu/mt_bench_pairs.jsonl --steps 8 --out dpo.json   # H200
    python benchmarks/dpo.py --small                                                    # CPU smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    DEFAULT_DATA_DIR,
    add_common_args,
    build_model,
    checked_device,
    cold_then_timed,
    machine_info,
    markdown_table,
    write_json,
)
from varpack.collate import PaddingFreeCollator  # noqa: E402
from varpack.data.preference import encode_pairs, load_pairs, pair_groups  # noqa: E402
from varpack.data.tokenizer import load_tokenizer  # noqa: E402
from varpack.plan import plan_packs  # noqa: E402
from varpack.train.objectives.dpo import DPOObjective  # noqa: E402


def padded_logps(model: Any, samples: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
    """TRL layout: a right-padded ``[2B, S]`` batch with attention mask; summed completion log-probs
    ``[2B]``."""
    s = max(len(x["input_ids"]) for x in samples)
    ids, labels, mask = (torch.full((len(samples), s), fill, dtype=torch.long) for fill in (0, -100, 0))
    for i, x in enumerate(samples):
        n = len(x["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = (
            torch.as_tensor(x["input_ids"]),
            torch.as_tensor(x["labels"]),
            1,
        )
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, :-1].float()
    target = labels[:, 1:].to(device)
    valid = target != -100
    return (
        -F.cross_entropy(logits.transpose(1, 2), target.masked_fill(~valid, 0), reduction="none") * valid
    ).sum(1)


def padded_step(policy, ref, step_samples, pad_batch, beta, device) -> torch.Tensor:
    """Forward + backward of one step in TRL's padded layout; the step's loss (detached)."""
    pairs, total = len(step_samples) // 2, torch.zeros((), device=device)
    for a in range(0, pairs, pad_batch):
        chunk = step_samples[2 * a : 2 * min(pairs, a + pad_batch)]
        ordered, b = chunk[0::2] + chunk[1::2], len(chunk) // 2  # TRL: [chosen..., rejected...]
        logps = padded_logps(policy, ordered, device)
        with torch.no_grad():
            ref_logps = padded_logps(ref, ordered, device)
        delta = (logps[:b] - ref_logps[:b]) - (logps[b:] - ref_logps[b:])
        loss = -F.logsigmoid(beta * delta).sum() / pairs
        loss.backward()
        total += loss.detach()
    return total


def run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    enc = encode_pairs(load_pairs(None if args.small else str(args.data)), load_tokenizer("qwen3"))
    if args.small:  # a small vocabulary keeps the CPU run fast: token ids folded into it
        fold = lambda ids: [t if t < 0 else t % args.vocab_size for t in ids]  # noqa: E731 (-100 stays)
        enc = [s | {"input_ids": fold(s["input_ids"]), "labels": fold(s["labels"])} for s in enc]
    lengths = np.array([s["length"] for s in enc], dtype=np.int64)
    plan = plan_packs(lengths, args.packing_length, groups=pair_groups(len(enc)), overflow="drop")
    steps = [[enc[i] | {"sample_id": int(i)} for i in plan.pack(p)]
             for p in np.argsort(-plan.pack_lengths, kind="stable")[: args.steps]]  # fmt: skip
    collate = PaddingFreeCollator()
    packed = [collate([step]) for step in steps]
    real = sum(s["length"] for step in steps for s in step)
    padded_tokens = sum(len(ch) * max(len(x["input_ids"]) for x in ch)
                        for step in steps for a in range(0, len(step) // 2, args.pad_batch)
                        for ch in [step[2 * a : 2 * min(len(step) // 2, a + args.pad_batch)]])  # fmt: skip
    out: dict[str, Any] = {
        "model": args.model,
        "steps": len(steps),
        "pairs": sum(len(s) // 2 for s in steps),
        "real_tokens_per_pass": real,
        "dropped_pairs": len(plan.overflow["overlong_group_ids"]),
        "configs": {},
    }
    configs = args.configs.split(",")
    for name in configs:
        models = [
            build_model(
                args.model,
                device=device,
                dtype=dtype,
                vocab_size=args.vocab_size,
                hf_attn="sdpa",
                backend=None if name == "padded" else "auto",
            )
            for _ in range(2)
        ]
        policy, ref = models
        ref.eval().requires_grad_(False)
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-6)
        objective = DPOObjective(beta=args.beta, ref_model=ref)

        def step(i: int, name=name, policy=policy, ref=ref, opt=opt, objective=objective) -> torch.Tensor:
            if name == "padded":
                loss = padded_step(policy, ref, steps[i], args.pad_batch, args.beta, device)
            else:
                batch = {
                    k: v.to(device) if isinstance(v, torch.Tensor) and not k.startswith("cu_seq_lens") else v
                    for k, v in packed[i].items()
                }
                loss = objective.loss(policy, batch).loss
                loss.backward()
                loss = loss.detach()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t = cold_then_timed(
            step, len(steps), device, args.timed_passes, seconds=args.time_budget / len(configs)
        )
        out["configs"][name] = {
            **t,
            "tokens_per_s": real / t["seconds"],
            "timed_passes": len(t["timed_pass_s"]),
            "tokens_processed_per_pass": padded_tokens if name == "padded" else real,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30
            if device.type == "cuda"
            else None,
        }
        del models, policy, ref, opt, objective
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = out["configs"].get("padded", {}).get("tokens_per_s")
    for c in out["configs"].values():
        c["ratio_to_padded"] = c["tokens_per_s"] / base if base else None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(
        p,
        device="cuda" if torch.cuda.is_available() else "cpu",
        small="CPU smoke run: tiny-qwen3 (vocabulary 1,024), the built-in pairs, 2 steps of 512",
    )
    p.add_argument("--data", default=str(DEFAULT_DATA_DIR / "mt_bench_pairs.jsonl"))
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
        help="seconds of cold + timed passes for all configs together, split evenly (a config's timed "
        "passes stop when the next would pass its share; at least one runs)",
    )
    p.add_argument("--configs", default="padded,varpack")
    args = p.parse_args(argv)
    args.vocab_size = None
    if args.small:
        args.model, args.vocab_size, args.steps, args.packing_length, args.timed_passes = (
            "tiny-qwen3",
            1024,
            2,
            512,
            1,
        )
        args.device = "cpu"
    device = checked_device(p, args)
    results = run(args, device)
    print(
        f"DPO step, {results['model']} on {device} ({args.dtype}): {results['steps']} steps, "
        f"{results['pairs']} "
        f"pairs, {results['real_tokens_per_pass']:,} real tokens per pass, packing_length "
        f"{args.packing_length:,} "
        f"({results['dropped_pairs']} overlong pairs dropped)"
    )
    headers = [
        "config",
        "real tokens/s",
        "tokens processed/pass",
        "s/pass (median)",
        "timed passes",
        "cold pass s",
        "first loss",
        "peak GiB",
        "vs padded",
    ]
    print(markdown_table(headers, [[n, c["tokens_per_s"], c["tokens_processed_per_pass"], c["seconds"],
                                    c["timed_passes"], c["cold_pass_s"], f"{c['loss_first']:.6f}",
                                    c["peak_memory_gib"], c["ratio_to_padded"]]
                                   for n, c in results["configs"].items()]))  # fmt: skip
    write_json(args.out, {"machine": machine_info(device), "args": vars(args), **results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
