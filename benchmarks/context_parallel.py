"""Context parallelism: work per rank of the row split, and activation memory per rank vs one process.

``work`` (no GPU, no process group): the real length mix of ../shared/data planned into packs
(``plan_packs``, best-fit decreasing, overflow truncate), every pack split over N ranks by the zigzag split
(the default, :func:`varpack.varlen.shard.zigzag_split`) and, as the baseline measured in the same run, by
contiguous runs of the row (:func:`varpack.varlen.shard.contiguous_split`). Per split, summed over the packs:

* ``tokens``: max / mean tokens per rank (the token-local layers: MLP, projections, the loss);
* ``attn``: max / mean causal attention work per rank (query-key pairs a rank's queries attend: ring
  attention's total per rank; Ulysses splits attention by heads, so it is balanced whatever the split);
* ``ring``: ring attention's critical path (the ranks meet at every ring step, so each step costs its slowest
  rank's block) over the ideal (total work / N); 1.00 = no rank ever waits.

Also a long-document mix (lognormal lengths, median ~2K tokens, 5% of the samples 16K-64K), where a
contiguous split leaves the ranks that hold documents' ends with most of the causal work.

``memory`` (under ``torchrun --nproc-per-node N``, CPU / gloo): one packed row of real samples through a
small Qwen3 (or Qwen3.5) model, forward + backward; the activation memory a rank holds for its backward is
measured as the bytes of the tensors autograd saves (``torch.autograd.graph.saved_tensors_hooks``, unique
storages) -- one process over the whole row vs each rank's share under context parallelism. CPU measurement
of what autograd keeps, not a GPU allocator's peak. Without ``torchrun``: one rank, the split of a group of 1.

    python benchmarks/context_parallel.py work [--packing-length 16384 65536] [--sizes 2 4 8] [--out w.json]
    torchrun --standalone --nproc-per-node 2 benchmarks/context_parallel.py memory [--tokens 8192]
        [--model tiny-qwen3] [--attention auto] [--out m.json]
    python benchmarks/context_parallel.py work --small          # stand-in lengths: no data needed
    python benchmarks/context_parallel.py memory --small        # one rank, a row of 1,024 tokens
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (  # noqa: E402
    init_distributed,
    lengths_for,
    machine_info,
    markdown_table,
    write_json,
)
from varpack.train.distributed import close_process_group  # noqa: E402
from varpack.varlen.shard import contiguous_split, zigzag_split  # noqa: E402

SPLITS = {"zigzag": zigzag_split, "contiguous": contiguous_split}


def split_stats(offsets: np.ndarray, size: int, split) -> tuple[np.ndarray, np.ndarray, float]:
    """``(tokens per rank [N], causal work per rank [N], ring critical path)`` of one pack.

    Causal work of a query = keys of its document at or before it. The ring's step ``s`` pairs the queries of
    rank ``r`` with the keys of rank ``r - s``; the step costs its slowest rank's block."""
    parts = split(offsets, size)
    total = int(offsets[-1])
    doc = np.searchsorted(offsets, np.arange(total), side="right") - 1
    start = offsets[doc]
    tokens = np.array([len(p) for p in parts], dtype=np.float64)
    work = np.array([float((p - start[p] + 1).sum()) for p in parts])
    # block work (r, s): pairs (q in rank r, k in rank s), same document, k <= q
    blocks = np.zeros((size, size))
    for r, pq in enumerate(parts):
        for s, pk in enumerate(parts):
            if not len(pq) or not len(pk):
                continue
            # per document: for each query, keys of rank s in [doc start, q]
            keys_sorted = np.sort(pk)
            upto = np.searchsorted(keys_sorted, pq, side="right")
            before_doc = np.searchsorted(keys_sorted, start[pq], side="left")
            blocks[r, s] = float((upto - before_doc).sum())
    ring = sum(max(blocks[r, (r - step) % size] for r in range(size)) for step in range(size))
    return tokens, work, ring


def work_rows(lengths: np.ndarray, packing_length: int, sizes: list[int], label: str) -> list[dict]:
    """Per (N, split): max / mean tokens and attention work per rank and the ring's critical path over the
    ideal, summed over the packs of ``lengths`` planned at ``packing_length``."""
    from varpack.plan import plan_packs

    plan = plan_packs(lengths, packing_length, overflow="truncate", seed=0)
    rows = []
    for size in sizes:
        for name, split in SPLITS.items():
            tok, att, ring = np.zeros(size), np.zeros(size), 0.0
            for p in range(plan.num_packs):
                ls = plan.item_lengths[plan.offsets[p] : plan.offsets[p + 1]]  # tokens of each sample / piece
                offsets = np.concatenate([[0], np.cumsum(ls)]).astype(np.int64)
                if offsets[-1] < size:
                    continue
                t, w, r = split_stats(offsets, size, split)
                tok, att, ring = tok + t, att + w, ring + r
            rows.append(
                {
                    "mix": label,
                    "packing_length": packing_length,
                    "packs": plan.num_packs,
                    "N": size,
                    "split": name,
                    "tokens": tok.max() / tok.mean(),
                    "attn": att.max() / att.mean(),
                    "ring": ring / (att.sum() / size),
                }
            )
    return rows


def run_work(args: argparse.Namespace) -> None:
    per_file, source = lengths_for(args.small, args.data_dir)
    real = np.concatenate(list(per_file.values()))
    rng = np.random.default_rng(0)
    n_long = 300 if args.small else 3000
    longmix = np.clip(rng.lognormal(np.log(2000), 0.8, size=n_long), 16, 65536).astype(np.int64)
    longmix[rng.choice(n_long, size=n_long // 20, replace=False)] = rng.integers(16384, 65537, n_long // 20)
    rows = []
    for packing_length in args.packing_length:
        rows += work_rows(real, packing_length, args.sizes, source)
        rows += work_rows(longmix, packing_length, args.sizes, "long-document mix (lognormal, 5% 16K-64K)")
    print("work per rank of the context-parallel split (max over ranks / mean; 1.000 = balanced)")
    print(
        markdown_table(
            [
                "mix",
                "packing_length",
                "packs",
                "N",
                "split",
                "tokens max/mean",
                "attn max/mean",
                "ring path/ideal",
            ],
            [
                [
                    r["mix"],
                    r["packing_length"],
                    r["packs"],
                    r["N"],
                    r["split"],
                    f"{r['tokens']:.3f}",
                    f"{r['attn']:.3f}",
                    f"{r['ring']:.3f}",
                ]
                for r in rows
            ],
        )
    )
    write_json(args.out, {"machine": machine_info(), "args": vars(args), "rows": rows})


# -----------------------------------------------------------------------------------------------------------
# memory
# -----------------------------------------------------------------------------------------------------------
def saved_bytes(step) -> int:
    """Bytes of the unique storages autograd saves for the backward during ``step()`` (the forward)."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        try:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # pragma: no cover - tensors without storage
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return sum(seen.values())


def run_memory(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from varpack.collate import PaddingFreeCollator, shard_batch
    from varpack.integrations.context_parallel import enable_context_parallel
    from varpack.loss import causal_lm_loss, shifted_lm_loss
    from varpack.models import load_model
    from varpack.schema import NOT_MODEL_INPUTS, SHIFT_LABELS

    rank, world, _ = init_distributed()  # gloo: CUDA is hidden for this CPU measurement
    overrides = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, head_dim=64)
    model = load_model(
        args.model, vocab_size=args.vocab, attn_backend=args.attn_backend, seed=0, config_overrides=overrides
    )
    g = torch.Generator().manual_seed(0)
    lengths = np.concatenate(list(lengths_for(args.small, args.data_dir)[0].values()))
    rng = np.random.default_rng(0)
    pack, total = [], 0
    for n in rng.permutation(lengths):
        n = int(min(n, args.tokens - total))
        if n <= 0:
            break
        ids = torch.randint(0, args.vocab, (n,), generator=g).tolist()
        pack.append({"input_ids": ids, "labels": [-100] + ids[1:]})
        total += n
    batch = PaddingFreeCollator()([pack])
    inputs = {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}
    one = saved_bytes(
        lambda: causal_lm_loss(model(**inputs).logits, batch["labels"], seq_idx=batch["seq_idx"])
    )
    model.zero_grad(set_to_none=True)
    enable_context_parallel(model, None, attention=args.attention)
    shard = shard_batch(batch, rank, world)
    sh_inputs = {k: v for k, v in shard.items() if k not in NOT_MODEL_INPUTS}
    count = (shard[SHIFT_LABELS] != -100).sum()
    dist.all_reduce(count)
    per_rank = saved_bytes(
        lambda: shifted_lm_loss(model(**sh_inputs).logits, shard[SHIFT_LABELS], num_items_in_batch=count)
    )
    got = [None] * world
    dist.all_gather_object(got, (per_rank, shard["cp_shard"].num_local))
    if rank == 0:
        plan = model._varpack_context_parallel.plan
        print(
            f"activation memory (bytes autograd saves for the backward, unique storages), {args.model} "
            f"(hidden 256, 4 layers, vocab {args.vocab}), one packed row of {total:,} tokens "
            f"({len(pack)} real-length samples); {'; '.join(f'{k}: {v}' for k, v in plan.items())}"
        )
        print(f"  cp=1 (one process, whole row): {one / 2**20:9.1f} MiB")
        for r, (b, n) in enumerate(got):
            print(f"  cp={world} rank {r} ({n:,} tokens):    {b / 2**20:9.1f} MiB  ({b / one:.3f} of cp=1)")
        write_json(
            args.out,
            {
                "machine": machine_info(),
                "args": vars(args),
                "tokens": total,
                "plan": plan,
                "cp1_bytes": one,
                "per_rank": [{"bytes": b, "tokens": n} for b, n in got],
            },
        )
    close_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    w = sub.add_parser("work")
    w.add_argument("--packing-length", type=int, nargs="+", default=[16384, 65536])
    w.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    w.add_argument("--data-dir", default=None)
    for q in (w, m := sub.add_parser("memory")):
        q.add_argument(
            "--small",
            action="store_true",
            help="stand-in lengths (work: packs of 4,096, N = 2; memory: a row of 1,024 tokens)",
        )
        q.add_argument(
            "--out", default=None, help="write the rows, the command, commit and machine as JSON here"
        )
    m.add_argument("--tokens", type=int, default=8192)
    m.add_argument("--model", default="tiny-qwen3")
    m.add_argument("--vocab", type=int, default=8192)
    m.add_argument("--attention", default="auto", choices=("auto", "ulysses", "ring"))
    m.add_argument("--attn-backend", default="auto")
    m.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)
    if args.what == "work":
        if args.small:
            args.packing_length, args.sizes = [4096], [2]
        run_work(args)
    else:
        args.tokens = min(args.tokens, 1024) if args.small else args.tokens
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
        run_memory(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
