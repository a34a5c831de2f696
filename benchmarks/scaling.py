"""Data-parallel scaling of packed training (#13): tokens/s on W GPUs vs 1, DDP or FSDP2, peak memory per GPU.

Launched with ``torchrun``; every rank builds the same plan (fingerprint checked,
:func:`varpack.train.distributed.check_same_on_all_ranks`), takes its balanced column of packs
(:class:`varpack.data.sampler.BalancedPackSampler`, tokens + attention cost), and runs full optimizer steps
(forward, backward, gradient all-reduce / reduce-scatter, fused AdamW) of one packed micro-batch per rank.
The loss is the exact global token mean: each step's supervised-token count is all-reduced (a device
tensor, no host sync) and DDP's gradient average is undone by the world size, as HF Trainer does.

Steady state: the first pass over the steps is untimed (FlashAttention-4 compiles a kernel per shape key,
the allocator warms up) and reported as the cold pass; the same steps are then timed again. Global tokens/s
= real tokens of all ranks / wall seconds of the timed pass (synchronised on every rank).

    torchrun --standalone --nproc-per-node 1 benchmarks/scaling.py --samples .gpu/samples.npz --out w1.json
    torchrun --standalone --nproc-per-node 2 benchmarks/scaling.py --samples .gpu/samples.npz --out w2.json
    python benchmarks/scaling.py --compare w1.json w2.json          # the scaling table (2 GPUs vs 1)
    torchrun --standalone --nproc-per-node 2 benchmarks/scaling.py --model qwen3-1.7b-shape --engine fsdp2 \\
        --samples .gpu/samples.npz --steps 6 --out fsdp17.json   # FSDP2 peak memory
    torchrun --standalone --nproc-per-node 2 benchmarks/scaling.py --model tiny-qwen3 --packing-length 512 \\
        --steps 3                                                 # CPU / gloo smoke run (synthetic lengths)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks._common import (  # noqa: E402
    H200_BF16_DENSE_PEAK_FLOPS,
    init_distributed,
    load_samples,
    machine_info,
    markdown_table,
    sync,
    synthetic_samples,
)
from varpack.collate import PaddingFreeCollator  # noqa: E402
from varpack.data.dataset import PackedDataset  # noqa: E402
from varpack.data.sampler import BalancedPackSampler  # noqa: E402
from varpack.models import load_model  # noqa: E402
from varpack.plan import plan_packs  # noqa: E402
from varpack.plan.balance import attention_cost_weight, pack_membership_fingerprint  # noqa: E402
from varpack.train.distributed import check_same_on_all_ranks  # noqa: E402
from varpack.train.objectives import get_objective  # noqa: E402
from varpack.train.trainer import TrainCollator  # noqa: E402


def _wrap(model: torch.nn.Module, engine: str, device: torch.device) -> torch.nn.Module:
    """DDP (``torch.nn.parallel.DistributedDataParallel``) or FSDP2 (``fully_shard`` per decoder layer, then
    the root): the engines, not varpack's own."""
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _batches(samples, plan, sampler, steps: int):
    """The first ``steps`` collated micro-batches of this rank (CPU tensors) and their real token counts."""
    dataset = PackedDataset(samples, plan, shuffle=False, check=False)
    collate = TrainCollator(PaddingFreeCollator(pad_token_id=0))
    out = []
    for i, micro in enumerate(sampler):
        if i >= steps:
            break
        batch = collate([dataset[p] for p in micro])
        out.append((batch, int((batch["labels"] != -100).sum()), int(batch["input_ids"].numel())))
    return out


def _step(model, opt, batch, objective, device, world: int, linear_ce: bool) -> None:
    batch = {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }
    count = objective.count_items(batch, reduction="token").to(torch.float32)
    if world > 1:
        dist.all_reduce(count)  # the step's global supervised tokens, a device tensor (no host sync)
    loss = objective.loss(model, batch, num_items_in_batch=count, linear_ce=linear_ce).loss
    (loss * world).backward()  # DDP / FSDP2 average gradients over ranks; the loss is already a global mean
    opt.step()
    opt.zero_grad(set_to_none=True)


def run(args: argparse.Namespace) -> dict | None:
    rank, world, device = init_distributed()
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = load_model(args.model, dtype=dtype, attn_backend="auto")
    model.config.use_cache = False
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    vocab = int(model.config.get_text_config().vocab_size)
    if args.samples:
        samples = [s for s in load_samples(args.samples) if s["length"] <= args.packing_length]
    else:
        samples = synthetic_samples(4000, vocab=vocab, mu=5.0, sigma=1.0, hi=args.packing_length)
    lengths = np.asarray([s["length"] for s in samples], dtype=np.int64)
    plan = plan_packs(lengths, args.packing_length, strategy="bfd", seed=0)
    check_same_on_all_ranks(pack_membership_fingerprint(plan))
    sampler = BalancedPackSampler(
        plan,
        rank=rank,
        world_size=world,
        packs_per_rank=1,
        attention_weight=attention_cost_weight(model.config),
    )
    batches = _batches(samples, plan, sampler, args.steps)
    if world > 1 and args.loss_impl == "linear_ce":
        raise SystemExit(
            "--loss-impl linear_ce calls the base model and the LM head outside the wrapper's forward, which DDP "
            "and FSDP2 do not see (varpack's Trainer refuses it too): use --loss-impl logits with several ranks"
        )
    engine = args.engine if world > 1 or args.engine == "fsdp2" else "none"
    if engine != "none":  # one GPU with --engine ddp: the plain model, what a single-GPU user runs
        model = _wrap(model, engine, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=cuda, foreach=not cuda)
    objective = get_objective("sft")
    linear_ce = args.loss_impl == "linear_ce"

    def one_pass() -> tuple[float, list[float]]:
        per_step = []
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        for batch, _, _ in batches:
            s0 = time.perf_counter()
            _step(model, opt, batch, objective, device, world, linear_ce)
            sync(device)
            per_step.append(time.perf_counter() - s0)
        dist.barrier()
        sync(device)
        return time.perf_counter() - t0, per_step

    cold_s, _ = one_pass()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    warm_s, per_step = one_pass()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    tokens = sum(t for _, _, t in batches)
    mine = {"rank": rank, "tokens": tokens, "ms_per_step": 1e3 * float(np.mean(per_step)), "peak_gib": peak}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    dist.destroy_process_group()
    if rank != 0:
        return None
    all_tokens = sum(r["tokens"] for r in gathered)
    tps = all_tokens / warm_s
    ms = [r["ms_per_step"] for r in gathered]
    return {
        "model": args.model,
        "engine": engine,
        "world_size": world,
        "packing_length": args.packing_length,
        "steps": len(batches),
        "loss_impl": args.loss_impl,
        "params": n_params,
        "tokens_per_s": tps,
        "tokens_per_s_per_gpu": tps / world,
        "mfu": 6 * n_params * tps / world / H200_BF16_DENSE_PEAK_FLOPS if cuda else None,
        "cold_pass_s": cold_s,
        "steady_pass_s": warm_s,
        "ms_per_step_per_rank": ms,
        "rank_imbalance": max(ms) / float(np.mean(ms)),
        "peak_gib_per_rank": [r["peak_gib"] for r in gathered],
        "machine": machine_info(device),
    }


def _row(r: dict) -> list:
    return [
        r["model"], r["engine"], r["world_size"], r["steps"], f"{r['cold_pass_s']:.1f}",
        f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s_per_gpu']:,.0f}",
        "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
        " / ".join(f"{m:.1f}" for m in r["ms_per_step_per_rank"]), f"{r['rank_imbalance']:.3f}",
        " / ".join("-" if g != g else f"{g:.1f}" for g in r["peak_gib_per_rank"]),  # NaN on CPUs: not measured
    ]  # fmt: skip


HEADERS = [
    "model", "engine", "GPUs", "steps", "cold pass s", "tokens/s", "tokens/s/GPU", "MFU",
    "ms/step per rank", "max/mean", "peak GiB per rank",
]  # fmt: skip


def compare(paths: list[str]) -> str:
    """The table of several runs' JSON files and, against the first (the 1-GPU baseline), the scaling ratio."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    base = runs[0]
    rows = [[*_row(r), f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x"] for r in runs]
    return markdown_table([*HEADERS, f"vs {base['world_size']} GPU"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b-shape")
    ap.add_argument("--engine", choices=("ddp", "fsdp2"), default="ddp")
    ap.add_argument("--packing-length", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=16, help="optimizer steps per pass (one pack per rank each)")
    ap.add_argument("--loss-impl", choices=("logits", "linear_ce"), default="logits")
    ap.add_argument(
        "--samples", default=None, help="pre-encoded samples (.npz from benchmarks/_common.py encode)"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--compare", nargs="+", default=None, metavar="JSON", help="print the table of earlier runs"
    )
    args = ap.parse_args(argv)
    if args.compare:
        print(compare(args.compare))
        return 0
    result = run(args)
    if result is not None:
        print(markdown_table(HEADERS, [_row(result)]))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
