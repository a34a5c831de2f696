"""Collation throughput: varpack's ``PaddingFreeCollator`` against transformers'
``DataCollatorWithFlattening``.

Both collators get the same best-fit-decreasing packs of samples with the real chat lengths (drawn from the
lengths of ../shared/data, :func:`benchmarks._common.real_lengths_per_file`; stand-in lengths with
``--small``), and both produce the same padding-free row with FlashAttention kwargs and ``seq_idx`` (checked
equal before timing). Samples stored as Python lists, numpy arrays, or read from a ``datasets.Dataset``
(varpack: ``PackedDataset``'s numpy views). Each batch is timed on its own, the two collators one after the
other, the best of ``--repeats`` per batch summed over the batches (a preemption on a shared machine spoils
one measurement, which the minimum discards); the garbage collector is off while timing, as ``timeit`` does.

    python benchmarks/collate.py [--packs 48] [--repeats 10] [--packing-lengths 4096 16384 65536]
    python benchmarks/collate.py --small
"""

from __future__ import annotations

import argparse
import gc
import inspect
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import torch
import transformers
from transformers import DataCollatorWithFlattening

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import lengths_for, machine_info, markdown_table, write_json  # noqa: E402
from varpack.collate import PaddingFreeCollator  # noqa: E402
from varpack.data.dataset import PackedDataset  # noqa: E402
from varpack.plan import plan_packs  # noqa: E402


def make_samples(lengths: np.ndarray, storage: str, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    samples = []
    for sid, n in enumerate(lengths.tolist()):
        ids = rng.integers(0, 151_643, n)
        labels = ids.copy()
        labels[: max(1, n // 3)] = -100  # prompt part unsupervised, first label always -100
        if storage == "lists":  # what a datasets.Dataset in python format yields
            ids, labels = ids.tolist(), labels.tolist()
        samples.append({"input_ids": ids, "labels": labels, "length": n, "sample_id": sid})
    return samples


def check_same(ours: dict, theirs: dict) -> None:
    for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"):
        if not torch.equal(ours[key], theirs[key]):
            raise AssertionError(f"collators disagree on {key}")
    if ours["max_length_q"] != theirs["max_length_q"]:
        raise AssertionError("collators disagree on max_length_q")


def best_times(fns: list, batches: list, repeats: int) -> list[float]:
    """Per collator: sum over batches of the best (min over ``repeats``) time of that batch.

    Each batch is timed on its own, the collators one after the other, so a preemption on this shared
    machine spoils one measurement of one batch, which the minimum then discards. The garbage collector is
    off while timing (as ``timeit`` does): otherwise its full passes over the millions of Python ints held
    by the sample lists land on whichever call happens to trigger them.
    """
    best = np.full((len(fns), len(batches)), np.inf)
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for b, batch in enumerate(batches):
                for k, fn in enumerate(fns):
                    t0 = time.perf_counter()
                    fn(batch)
                    best[k, b] = min(best[k, b], time.perf_counter() - t0)
    finally:
        gc.enable()
    return best.sum(axis=1).tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--packs", type=int, default=48, help="packs (batches) per configuration")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats; the best is reported")
    parser.add_argument("--packing-lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--small", action="store_true", help="stand-in lengths, 4 packs of 4096, 1 repeat")
    parser.add_argument(
        "--out", default=None, help="write the rows, the command, commit and machine as JSON here"
    )
    args = parser.parse_args(argv)
    if args.small:
        args.packs, args.repeats, args.packing_lengths = 4, 1, [4096]
    params = inspect.signature(DataCollatorWithFlattening.__init__).parameters
    hf_kwargs = {k: True for k in ("return_flash_attn_kwargs", "return_seq_idx") if k in params}
    hf, ours = DataCollatorWithFlattening(**hf_kwargs), PaddingFreeCollator()
    per_file, source = lengths_for(args.small, args.data_dir)
    pool = np.concatenate(list(per_file.values()))
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, numpy {np.__version__}; "
        f"{source}; "
        f"baseline DataCollatorWithFlattening({', '.join(f'{k}=True' for k in hf_kwargs)})"
    )
    rows = []
    for packing_length in args.packing_lengths:
        n = 2000
        while True:  # enough samples for args.packs full packs
            lengths = np.minimum(np.random.default_rng(args.seed).choice(pool[pool > 0], n), packing_length)
            plan = plan_packs(lengths, packing_length, seed=args.seed)
            if plan.num_packs > args.packs:
                break
            n *= 2
        chosen = plan.pack_order(0)[: args.packs]
        for storage in ("lists", "numpy", "datasets"):
            if storage == "datasets":  # end to end: read each pack from a datasets.Dataset, then collate
                table = datasets.Dataset.from_list(make_samples(lengths, "lists", args.seed))
                packed = PackedDataset(table, plan)
                batches = list(range(args.packs))

                def run_hf(i: int, table=table, packed=packed) -> dict:
                    cols = table[packed.pack_ids(i).tolist()]
                    return hf([dict(zip(cols, vals)) for vals in zip(*cols.values())])

                def run_ours(i: int, packed=packed) -> dict:
                    return ours(packed[i])

                ids = [packed.pack_ids(i) for i in batches]
            else:
                samples = make_samples(lengths, storage, args.seed)
                batches = [[samples[i] for i in plan.packs[p]] for p in chosen]
                run_hf, run_ours, ids = hf, ours, [plan.packs[p] for p in chosen]
            for batch in batches[:3]:
                check_same(run_ours(batch), run_hf(batch))
            best_hf, best_ours = best_times([run_hf, run_ours], batches, args.repeats)
            tokens = sum(int(lengths[np.asarray(x)].sum()) for x in ids)
            rows.append(
                {
                    "packing_length": packing_length,
                    "storage": storage,
                    "tokens_per_batch": tokens / len(batches),
                    "samples_per_batch": sum(len(x) for x in ids) / len(batches),
                    "transformers_tokens_per_s": tokens / best_hf,
                    "varpack_tokens_per_s": tokens / best_ours,
                    "ratio": best_hf / best_ours,
                }
            )
    print(f"{args.packs} packs per row, per-batch best of {args.repeats}")
    print(
        markdown_table(
            [
                "packing_length",
                "samples as",
                "tokens/batch",
                "samples/batch",
                "transformers tok/s",
                "varpack tok/s",
                "ratio",
            ],
            [
                [
                    r["packing_length"],
                    r["storage"],
                    r["tokens_per_batch"],
                    r["samples_per_batch"],
                    f"{r['transformers_tokens_per_s'] / 1e6:.2f}M",
                    f"{r['varpack_tokens_per_s'] / 1e6:.2f}M",
                    f"{r['ratio']:.1f}x",
                ]
                for r in rows
            ],
        )
    )
    write_json(args.out, {"machine": machine_info(), "args": vars(args), "lengths": source, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
