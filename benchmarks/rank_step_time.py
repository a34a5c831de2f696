"""Measured per-rank step-time imbalance of the pack layout: balanced (``rank_balance``) vs round-robin.

Every rank runs forward + backward of its own micro-batches of the epoch layout
(:class:`varpack.data.sampler.BalancedPackSampler`) with no gradient communication, so each rank's time is its
own compute (no waiting at an all-reduce), synchronised and timed per micro-batch slot after ``--warmup``
untimed slots. Per layout: each rank's mean slot time, the measured imbalance (sum over slots of the slowest
rank's time / sum of the mean rank's: the time a synchronous data-parallel step loses to waiting, 1.0 = none)
and the cost model's prediction for the same slots (:func:`varpack.plan.balance.layout_imbalance`). Real
lengths (random token ids: the compute depends on the lengths and shapes only); the round-robin layout is the
baseline, measured in the same run.

    torchrun --nproc-per-node 2 benchmarks/rank_step_time.py --model qwen3-0.6b-shape --packing-length 8192
    torchrun --standalone --nproc-per-node 2 benchmarks/rank_step_time.py --small   # CPU / gloo smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import build_model, init_distributed, lengths_for, sync, write_json  # noqa: E402
from varpack.collate import PaddingFreeCollator  # noqa: E402
from varpack.data.dataset import PackedDataset  # noqa: E402
from varpack.data.sampler import BalancedPackSampler  # noqa: E402
from varpack.plan import plan_packs  # noqa: E402
from varpack.plan.balance import attention_cost_weight, layout_imbalance  # noqa: E402
from varpack.train.distributed import close_process_group  # noqa: E402
from varpack.train.objectives import get_objective  # noqa: E402
from varpack.train.trainer import TrainCollator  # noqa: E402


def _samples(lengths: np.ndarray, vocab: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths.tolist():
        ids = rng.integers(0, vocab, n).tolist()
        out.append({"input_ids": ids, "labels": [-100] + ids[1:], "length": n})
    return out


def _time_layout(model, sampler, dataset, collate, device, *, slots: int, warmup: int, linear_ce: bool):
    """Seconds of each of this rank's first ``warmup + slots`` micro-batches (forward + backward)."""
    objective = get_objective("sft")
    times = []
    for i, micro in enumerate(sampler):
        if i >= warmup + slots:
            break
        batch = collate([dataset[p] for p in micro])
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        sync(device)
        t0 = time.perf_counter()
        loss = objective.loss(model, batch, linear_ce=linear_ce).loss
        loss.backward()
        sync(device)
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return times[warmup:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b-shape")
    ap.add_argument("--packing-length", type=int, default=8192)
    ap.add_argument("--packs-per-step", type=int, default=1)
    ap.add_argument("--slots", type=int, default=30, help="micro-batch slots timed per layout")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--loss-impl", choices=("logits", "linear_ce"), default="linear_ce")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument(
        "--small",
        action="store_true",
        help="smoke run: tiny-qwen3, vocabulary 1,024, stand-in lengths, packing_length 1024, 4 slots",
    )
    ap.add_argument("--out", default=None, help="rank 0 writes the rows as JSON here")
    args = ap.parse_args(argv)
    vocab = None
    if args.small:
        args.model, vocab, args.packing_length, args.slots, args.warmup = "tiny-qwen3", 1024, 1024, 4, 1

    rank, world, device = init_distributed()
    cuda = device.type == "cuda"
    model = build_model(
        args.model,
        device=device,
        dtype=torch.bfloat16 if cuda else torch.float32,
        vocab_size=vocab,
        backend="auto",
    )
    weight = attention_cost_weight(model.config)
    per_file, _ = lengths_for(args.small, args.data_dir, n_small=400)
    lengths = np.minimum(np.concatenate(list(per_file.values())), args.packing_length)
    plan = plan_packs(lengths, args.packing_length, seed=0)
    samples = _samples(lengths, int(model.config.get_text_config().vocab_size))
    dataset = PackedDataset(samples, plan, shuffle=False, check=False)
    collate = TrainCollator(PaddingFreeCollator(pad_token_id=0))
    rows = []
    for balance in (False, True):
        sampler = BalancedPackSampler(
            plan, rank=rank, world_size=world, packs_per_rank=args.packs_per_step, attention_weight=weight,
            balance=balance,
        )  # fmt: skip
        mine = _time_layout(
            model, sampler, dataset, collate, device, slots=args.slots, warmup=args.warmup,
            linear_ce=args.loss_impl == "linear_ce",
        )  # fmt: skip
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        t = np.asarray(gathered)  # [W, slots]
        layout = sampler.layout()[args.warmup : args.warmup + t.shape[1]]
        predicted = layout_imbalance(layout, sampler.costs)["imbalance"]
        measured = float(t.max(axis=0).sum() / t.mean(axis=0).sum())
        per_rank = " ".join(f"{x * 1e3:8.1f}" for x in t.mean(axis=1))
        rows.append((("balanced" if balance else "round-robin"), per_rank, measured, predicted, t.shape[1]))
    if rank == 0:
        print(
            f"{args.model}, packing_length {args.packing_length:,}, {world} ranks x {args.packs_per_step} "
            f"pack(s), {plan.num_packs:,} packs of {lengths.size:,} real samples, {device.type}, "
            f"attention_weight {weight:.3e}, loss {args.loss_impl}"
        )
        print(f"{'layout':<12} {'slots':>5} {'ms per slot, rank 0..W-1':>26} {'measured':>9} {'model':>7}")
        for name, per_rank, measured, predicted, n in rows:
            print(f"{name:<12} {n:>5} {per_rank:>26} {measured:>9.4f} {predicted:>7.4f}")
        base, bal = rows[0][2], rows[1][2]
        print(
            f"waiting removed by balancing: {base:.4f} -> {bal:.4f} ({(base - bal) / base:.1%} of the step "
            "time)"
        )
        write_json(args.out, {"args": vars(args), "world_size": world, "rows": [
            {"layout": name, "ms_per_slot_per_rank": per_rank, "measured": m, "model": pred, "slots": n}
            for name, per_rank, m, pred, n in rows]})  # fmt: skip
    close_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
