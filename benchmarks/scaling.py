"""Data-parallel scaling of packed training: tokens/s on W GPUs vs 1, DDP or FSDP2, peak memory per GPU.

Launched with ``torchrun``; every rank builds the same plan (fingerprint checked,
:func:`varpack.train.distributed.check_same_on_all_ranks`), takes its balanced column of packs
(:class:`varpack.data.sampler.BalancedPackSampler`, tokens + attention cost), and runs full optimizer steps
(forward, backward, gradient all-reduce / reduce-scatter, fused AdamW) of one pack per rank. The loss is the
exact global token mean: each step's supervised-token count is all-reduced (a device tensor, no host sync) and
the engine's gradient average is undone by the world size, as HF Trainer does. One untimed pass over the steps
first (FA4's compiles, the allocator; reported as the cold pass), then the same steps timed; tokens/s = real
tokens of all ranks / wall seconds of the timed pass (every rank synchronised).

    torchrun --standalone --nproc-per-node 1 benchmarks/scaling.py --samples .gpu/samples.npz --out w1.json
    torchrun --standalone --nproc-per-node 2 benchmarks/scaling.py --samples .gpu/samples.npz --out w2.json
    python benchmarks/scaling.py --compare w1.json w2.json          # the table: 2 GPUs vs 1
    torchrun --standalone --nproc-per-node 2 benchmarks/scaling.py --model qwen3-1.7b-shape --engine fsdp2 \\
        --samples .gpu/samples.npz --steps 6 --out fsdp17.json
    torchrun --standalone --nproc-per-node 2 benchmarks/scaling.py --small   # CPU / gloo smoke run

``--torch-compile`` compiles every decoder layer first (:func:`varpack.integrations.kernels.compile_layers`,
inductor, then DDP / FSDP2 wraps the model: what ``varpack sft`` runs by default on CUDA); the cold pass then
holds the compiles. Compiled DDP on 2 GPUs vs compiled on one:

    torchrun --standalone --nproc-per-node 1 benchmarks/scaling.py --torch-compile --samples .gpu/samples.npz \\
        --out w1c.json
    torchrun --standalone --nproc-per-node 2 benchmarks/scaling.py --torch-compile --samples .gpu/samples.npz \\
        --out w2c.json
    python benchmarks/scaling.py --compare w1.json w1c.json w2.json w2c.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    H200_BF16_DENSE_PEAK_FLOPS,
    build_model,
    cold_then_timed,
    init_distributed,
    load_samples,
    machine_info,
    make_optimizer,
    markdown_table,
    n_params,
    sync,
    synthetic_samples,
    write_json,
)
from varpack.collate import PaddingFreeCollator  # noqa: E402
from varpack.data.dataset import PackedDataset  # noqa: E402
from varpack.data.sampler import BalancedPackSampler  # noqa: E402
from varpack.plan import plan_packs  # noqa: E402
from varpack.plan.balance import attention_cost_weight, pack_membership_fingerprint  # noqa: E402
from varpack.train.distributed import check_same_on_all_ranks, close_process_group  # noqa: E402
from varpack.train.objectives import get_objective  # noqa: E402
from varpack.train.trainer import TrainCollator  # noqa: E402

HEADERS = [
    "model",
    "engine",
    "GPUs",
    "steps",
    "cold pass s",
    "tokens/s",
    "tokens/s/GPU",
    "MFU",
    "ms/step per rank",
    "max/mean",
    "peak GiB per rank",
]


def wrap(model: torch.nn.Module, engine: str, device: torch.device) -> torch.nn.Module:
    """DDP (``DistributedDataParallel``) or FSDP2 (``fully_shard`` per decoder layer, then the root)."""
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _timed_steps(model: Any, engine: str, batches: list, device: Any, world: int, *, linear_ce: bool) -> dict:
    """One cold pass, then the timed steps (``cold_then_timed``) of ``model`` under ``engine``. The DDP / FSDP2
    wrapper lives in this frame only: it is gone before the caller closes the process group."""
    if engine != "none":
        model = wrap(model, engine, device)
    opt, objective = make_optimizer(model, device), get_objective("sft")

    def step(i: int) -> torch.Tensor:
        batch = {
            k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in batches[i].items()
        }
        count = objective.count_items(batch, reduction="token").to(torch.float32)
        if world > 1:
            dist.all_reduce(count)  # the step's global supervised tokens, a device tensor (no host sync)
        loss = objective.loss(model, batch, num_items_in_batch=count, linear_ce=linear_ce).loss
        (
            loss * world
        ).backward()  # DDP / FSDP2 average gradients over ranks; the loss is already a global mean
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def wait() -> None:
        dist.barrier()
        sync(device)

    return cold_then_timed(step, len(batches), device, 1, per_step=True, wait=wait)


def run(args: argparse.Namespace) -> dict | None:
    rank, world, device = init_distributed()
    cuda = device.type == "cuda"
    model = build_model(args.model, device=device, dtype=torch.bfloat16 if cuda else torch.float32,
                        vocab_size=args.vocab_size, backend="auto")  # fmt: skip
    params, vocab = n_params(model), int(model.config.get_text_config().vocab_size)
    if args.torch_compile:  # before the engine wraps the model, as varpack sft prepares it
        from varpack.integrations.kernels import compile_layers

        compile_layers(model)
    if args.samples:
        samples = [s for s in load_samples(args.samples) if s["length"] <= args.packing_length]
    else:
        samples = synthetic_samples(
            4000 if not args.small else 200, vocab=vocab, mu=5.0, sigma=1.0, hi=args.packing_length
        )
    plan = plan_packs(
        np.asarray([s["length"] for s in samples], np.int64), args.packing_length, strategy="bfd", seed=0
    )
    check_same_on_all_ranks(pack_membership_fingerprint(plan))
    sampler = BalancedPackSampler(plan, rank=rank, world_size=world, packs_per_rank=1,
                                  attention_weight=attention_cost_weight(model.config))  # fmt: skip
    dataset = PackedDataset(samples, plan, shuffle=False, check=False)
    collate = TrainCollator(PaddingFreeCollator(pad_token_id=0))
    batches = [collate([dataset[p] for p in micro]) for micro, _ in zip(sampler, range(args.steps))]
    if world > 1 and args.loss_impl == "linear_ce":
        raise SystemExit(
            "--loss-impl linear_ce calls the base model and the LM head outside the wrapper's forward, "
            "which DDP and FSDP2 do not see: use --loss-impl logits with several ranks"
        )
    engine = (
        args.engine if world > 1 or args.engine == "fsdp2" else "none"
    )  # one GPU: what a single-GPU user runs
    t = _timed_steps(model, engine, batches, device, world, linear_ce=args.loss_impl == "linear_ce")
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan")
    mine = {
        "tokens": sum(int(b["input_ids"].numel()) for b in batches),
        "ms_per_step": 1e3 * float(np.mean(t["step_s"])),
        "peak_gib": peak,
    }
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    close_process_group()  # every rank leaves together; the wrapped model went with _timed_steps
    if rank != 0:
        return None
    tps, ms = sum(r["tokens"] for r in gathered) / t["seconds"], [r["ms_per_step"] for r in gathered]
    return {
        "model": args.model,
        "engine": engine,
        "torch_compile": bool(args.torch_compile),
        "world_size": world,
        "packing_length": args.packing_length,
        "steps": len(batches),
        "loss_impl": args.loss_impl,
        "params": params,
        "tokens_per_s": tps,
        "tokens_per_s_per_gpu": tps / world,
        "mfu": 6 * params * tps / world / H200_BF16_DENSE_PEAK_FLOPS if cuda else None,
        "cold_pass_s": t["cold_pass_s"],
        "steady_pass_s": t["seconds"],
        "ms_per_step_per_rank": ms,
        "rank_imbalance": max(ms) / float(np.mean(ms)),
        "peak_gib_per_rank": [r["peak_gib"] for r in gathered],
        "machine": machine_info(device),
    }


def row(r: dict) -> list:
    engine = r["engine"] + (" + compile" if r.get("torch_compile") else "")
    return [r["model"], engine, r["world_size"], r["steps"], r["cold_pass_s"], r["tokens_per_s"],
            r["tokens_per_s_per_gpu"], "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
            " / ".join(f"{m:.1f}" for m in r["ms_per_step_per_rank"]), f"{r['rank_imbalance']:.3f}",
            " / ".join("-" if g != g else f"{g:.1f}" for g in r["peak_gib_per_rank"])]  # fmt: skip


def compare(paths: list[str]) -> str:
    """The table of several runs' JSON files, with the scaling ratio against the first (the 1-GPU
    baseline)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    rows = [[*row(r), f"{r['tokens_per_s'] / runs[0]['tokens_per_s']:.2f}x"] for r in runs]
    return markdown_table([*HEADERS, f"vs {runs[0]['world_size']} GPU"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b-shape")
    ap.add_argument("--engine", choices=("ddp", "fsdp2"), default="ddp")
    ap.add_argument("--packing-length", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=16, help="optimizer steps per pass (one pack per rank each)")
    ap.add_argument("--loss-impl", choices=("logits", "linear_ce"), default="logits")
    ap.add_argument(
        "--torch-compile", action="store_true",
        help="compile each decoder layer (varpack.integrations.kernels.compile_layers) before DDP / FSDP2",
    )  # fmt: skip
    ap.add_argument(
        "--samples", default=None, help="pre-encoded samples (.npz from benchmarks/_common.py encode)"
    )
    ap.add_argument(
        "--small", action="store_true", help="smoke run: tiny-qwen3, vocabulary 1,024, 3 steps of 512"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--compare", nargs="+", default=None, metavar="JSON", help="print the table of earlier runs"
    )
    args = ap.parse_args(argv)
    if args.compare:
        print(compare(args.compare))
        return 0
    args.vocab_size = None
    if args.small:
        args.model, args.vocab_size, args.packing_length, args.steps = "tiny-qwen3", 1024, 512, 3
    result = run(args)
    if result is not None:
        print(markdown_table(HEADERS, [row(result)]))
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
