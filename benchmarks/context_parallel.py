"""Context parallelism: work per rank of the row split, and activation memory per rank vs one process.

``work`` (no GPU, no process group): the real length mix of ../shared/data planned into packs
(``plan_packs``, best-fit decreasing, overflow truncate), every pack split over N ranks by the zigzag split
(the default, :func:`varpack.varlen.shard.zigzag_split`) and, as the baseline measured in the same run, by
contiguous runs of the row (:func:`varpack.varlen.shard.contiguous_split`). Per split, summed over the packs:

* ``tokens``: max / mean tokens per rank (the token-local layers: MLP, projections, the loss);
* ``attn``: max / mean causal attention work per rank (query-key pairs a rank's queries attend: ring attention's
  total per rank; Ulysses splits attention by heads, so it is balanced whatever the split);
* ``ring``: ring attention's critical path (the ranks meet at every ring step, so each step costs its slowest
  rank's block) over the ideal (total work / N); 1.00 = no rank ever waits.

Also a long-document mix (lognormal lengths, median ~2K tokens, 5% of the samples 16K-64K), where a
contiguous split leaves the ranks that hold documents' ends with most of the causal work.

``memory`` (under ``torchrun --nproc-per-node N``, CPU / gloo): one packed row of real samples through a
small Qwen3 (or Qwen3.5) model, forward + backward; the activation memory a rank holds for its backward is
measured as the bytes of the tensors autograd saves (``torch.autograd.graph.saved_tensors_hooks``, unique
storages) -- one process over the whole row vs each rank's share under context parallelism. CPU measurement
of what autograd keeps, not a GPU allocator's peak (the GPU figures are benchmarks/RESULTS.md's, issue-free).

    python benchmarks/context_parallel.py work [--packing-length 16384 65536] [--sizes 2 4 8]
    torchrun --standalone --nproc-per-node 2 benchmarks/context_parallel.py memory [--tokens 8192]
        [--model tiny-qwen3] [--attention auto]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

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


def work_table(lengths: np.ndarray, packing_length: int, sizes: list[int], label: str) -> list[str]:
    from varpack.plan import plan_packs

    plan = plan_packs(lengths, packing_length, overflow="truncate", seed=0)
    rows = [
        f"{label}: {len(lengths):,} samples -> {plan.num_packs:,} packs of <= {packing_length:,} tokens",
        f"  {'N':>2}  {'split':<10} {'tokens max/mean':>16} {'attn max/mean':>14} {'ring path/ideal':>16}",
    ]
    for size in sizes:
        for name, split in SPLITS.items():
            tok = np.zeros(size)
            att = np.zeros(size)
            ring = 0.0
            for p in range(plan.num_packs):
                ls = plan.item_lengths[plan.offsets[p] : plan.offsets[p + 1]]  # tokens of each sample / piece
                offsets = np.concatenate([[0], np.cumsum(ls)]).astype(np.int64)
                if offsets[-1] < size:
                    continue
                t, w, r = split_stats(offsets, size, split)
                tok += t
                att += w
                ring += r
            rows.append(
                f"  {size:>2}  {name:<10} {tok.max() / tok.mean():>16.3f} {att.max() / att.mean():>14.3f} "
                f"{ring / (att.sum() / size):>16.3f}"
            )
    return rows


def run_work(args: argparse.Namespace) -> None:
    from _lengths import real_lengths_per_file

    per_file = real_lengths_per_file(args.data_dir)
    real = np.concatenate(list(per_file.values()))
    rng = np.random.default_rng(0)
    longmix = np.clip(rng.lognormal(np.log(2000), 0.8, size=3000), 16, 65536).astype(np.int64)
    longmix[rng.choice(len(longmix), size=len(longmix) // 20, replace=False)] = rng.integers(
        16384, 65537, len(longmix) // 20
    )
    print("work per rank of the context-parallel split (max over ranks / mean; 1.000 = balanced)")
    for packing_length in args.packing_length:
        print("\n".join(work_table(real, packing_length, args.sizes, f"real mix ({', '.join(per_file)})")))
        print(
            "\n".join(
                work_table(longmix, packing_length, args.sizes, "long-document mix (lognormal, 5% 16K-64K)")
            )
        )


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

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    overrides = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, head_dim=64)
    model = load_model(
        args.model, vocab_size=args.vocab, attn_backend=args.attn_backend, seed=0, config_overrides=overrides
    )
    g = torch.Generator().manual_seed(0)
    from _lengths import real_lengths_per_file

    lengths = np.concatenate(list(real_lengths_per_file(args.data_dir).values()))
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
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    w = sub.add_parser("work")
    w.add_argument("--packing-length", type=int, nargs="+", default=[16384, 65536])
    w.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    w.add_argument("--data-dir", default=None)
    m = sub.add_parser("memory")
    m.add_argument("--tokens", type=int, default=8192)
    m.add_argument("--model", default="tiny-qwen3")
    m.add_argument("--vocab", type=int, default=8192)
    m.add_argument("--attention", default="auto", choices=("auto", "ulysses", "ring"))
    m.add_argument("--attn-backend", default="auto")
    m.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)
    if args.what == "work":
        run_work(args)
    else:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
        run_memory(args)


if __name__ == "__main__":
    main()
