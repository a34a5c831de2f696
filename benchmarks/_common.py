"""Shared pieces of the GPU benchmarks: pre-encoded samples, length fits, timing, tables, machine facts.

The GPU machine has no ``datasets`` package and cannot see ``../shared/``: encode the real chat data here on
the CPU once with :func:`encode_shared_data` (:func:`varpack.data.load_and_encode`), put the file in
a folder that ``.git/info/exclude`` ignores (e.g. ``.gpu/``) and carry it; :func:`load_samples` needs only
``json`` / ``numpy``::

    python -m benchmarks._common encode .gpu/samples.npz --max-samples 20000
    python -m benchmarks._common fit .gpu/samples.npz         # lognormal mu / sigma of the token lengths
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = Path(os.environ.get("VARPACK_SHARED_DATA", REPO.parent / "shared" / "data"))

#: H200 SXM dense bf16 tensor-core peak (NVIDIA H200 datasheet: 1,979 TFLOP/s *with sparsity*; dense is half).
#: Issue 7 and every MFU figure here use it: MFU = 6 * N_params * tokens/s / 989e12.
H200_BF16_DENSE_PEAK_FLOPS = 989e12


# ----------------------------------------------------------------------------------------------------------
# pre-encoded samples
# ----------------------------------------------------------------------------------------------------------


def _is_chat_file(path: Path) -> bool:
    """True when the first row of a JSONL file is a chat (``messages``); preference pairs
    (``mt_bench_pairs.jsonl``: ``prompt`` / ``chosen`` / ``rejected``) are not SFT samples and are skipped."""
    with path.open(encoding="utf-8") as fh:
        first = fh.readline()
    is_chat = bool(first.strip()) and "messages" in json.loads(first)
    if not is_chat:
        print(f"encode: skipping {path.name} (not a chat file: no 'messages' in its first row)", file=sys.stderr)
    return is_chat


def encode_shared_data(
    out_path: str | os.PathLike[str],
    max_samples: int | None = None,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    tokenizer: str = "qwen3",
    seed: int = 0,
) -> dict[str, Any]:
    """Encode ``../shared/data/*.jsonl`` with varpack's chat encoder and write the samples for the GPU run.

    The conversations of all files are encoded (chat template of the embedded Qwen3 tokenizer; labels only on
    assistant turns, first label -100), then ``max_samples`` of them are drawn uniformly at random
    (``seed``) so the subset keeps the files' length mix, and written in their drawn order.

    Args:
        out_path: ``.npz`` (flat int32 ``input_ids`` / ``labels`` + int64 ``offsets`` ``[N+1]`` + ``source``
            file index per sample; compressed) or ``.jsonl`` (one ``{"input_ids", "labels"}`` per line).
        max_samples: how many samples to keep (None: all).
        data_dir: the chat files (default ``../shared/data`` beside the repo or ``$VARPACK_SHARED_DATA``).
        tokenizer: ``varpack.data.tokenizer.load_tokenizer`` name or directory.
        seed: the subset draw.

    Returns:
        A summary: number of samples, tokens, supervised tokens, files.

    Raises:
        FileNotFoundError: no ``*.jsonl`` in ``data_dir``.
        ValueError: an unknown output suffix.
    """
    from varpack.data import load_and_encode
    from varpack.data.tokenizer import load_tokenizer

    out_path = Path(out_path)
    if out_path.suffix not in (".npz", ".jsonl"):
        raise ValueError(f"out_path must end in .npz or .jsonl, got {out_path}")
    d = Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR
    files = sorted(f for f in d.glob("*.jsonl") if _is_chat_file(f))
    if not files:
        raise FileNotFoundError(f"no chat *.jsonl files in {d} (set VARPACK_SHARED_DATA)")
    tok = load_tokenizer(tokenizer)
    ids: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    source: list[int] = []
    for fi, f in enumerate(files):
        ds = load_and_encode([str(f)], tok, desc=f"encode {f.name}").samples.with_format("numpy")
        for row in ds:
            ids.append(np.asarray(row["input_ids"], dtype=np.int32))
            labels.append(np.asarray(row["labels"], dtype=np.int32))
            source.append(fi)
    order = np.random.default_rng(seed).permutation(len(ids))
    if max_samples is not None:
        order = order[:max_samples]
    ids = [ids[i] for i in order]
    labels = [labels[i] for i in order]
    src = np.asarray([source[i] for i in order], dtype=np.int16)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if out_path.suffix == ".npz":
        lengths = np.asarray([len(x) for x in ids], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        np.savez_compressed(
            out_path,
            input_ids=np.concatenate(ids),
            labels=np.concatenate(labels),
            offsets=offsets,
            source=src,
            files=np.asarray([f.name for f in files]),
        )
    else:
        with out_path.open("w") as fh:
            for x, y in zip(ids, labels):
                fh.write(json.dumps({"input_ids": x.tolist(), "labels": y.tolist()}) + "\n")
    summary = {
        "path": str(out_path),
        "samples": len(ids),
        "tokens": int(sum(len(x) for x in ids)),
        "supervised_tokens": int(sum(int((y != -100).sum()) for y in labels)),
        "files": [f.name for f in files],
        "tokenizer": tokenizer,
        "seed": seed,
    }
    return summary


def load_samples(path: str | os.PathLike[str], max_samples: int | None = None) -> list[dict[str, Any]]:
    """Samples written by :func:`encode_shared_data` (``.npz`` / ``.jsonl``): ``[{input_ids, labels, length}]``.

    ``input_ids`` / ``labels`` are int64 numpy arrays. Needs only ``json`` and ``numpy``.

    Raises:
        FileNotFoundError: no such file. ValueError: an unknown suffix, or a sample whose ``labels`` length
            differs from its ``input_ids`` (named by index).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"samples file {path} does not exist (write it with benchmarks/_common.py encode)"
        )
    out: list[dict[str, Any]] = []
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            ids, labels, offsets = z["input_ids"], z["labels"], z["offsets"]
        n = len(offsets) - 1 if max_samples is None else min(max_samples, len(offsets) - 1)
        for i in range(n):
            a, b = int(offsets[i]), int(offsets[i + 1])
            out.append(
                {
                    "input_ids": ids[a:b].astype(np.int64),
                    "labels": labels[a:b].astype(np.int64),
                    "length": b - a,
                }
            )
    elif path.suffix == ".jsonl":
        with path.open() as fh:
            for i, line in enumerate(fh):
                if max_samples is not None and i >= max_samples:
                    break
                row = json.loads(line)
                x = np.asarray(row["input_ids"], dtype=np.int64)
                y = np.asarray(row["labels"], dtype=np.int64)
                if x.shape != y.shape:
                    raise ValueError(f"sample {i}: labels length {len(y)} != input_ids length {len(x)}")
                out.append({"input_ids": x, "labels": y, "length": len(x)})
    else:
        raise ValueError(f"samples file must be .npz or .jsonl, got {path}")
    return out


def synthetic_samples(
    n: int, *, vocab: int, mu: float, sigma: float, lo: int = 16, hi: int = 8192, seed: int = 0
) -> list[dict[str, Any]]:
    """Random-token samples with lognormal lengths (clipped to ``[lo, hi]``), prompt = first third unsupervised.

    For smoke runs and for the GPU run when no pre-encoded file is given (then the *length mix* is the fitted
    lognormal, not the real samples).
    """
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(mu, sigma, n)), lo, hi).astype(np.int64)
    out = []
    for length in lengths:
        x = rng.integers(0, vocab, int(length), dtype=np.int64)
        y = x.copy()
        y[: max(1, int(length) // 3)] = -100
        out.append({"input_ids": x, "labels": y, "length": int(length)})
    return out


def fit_lognormal(lengths: Sequence[int] | np.ndarray) -> tuple[float, float]:
    """Maximum-likelihood lognormal fit: ``(mu, sigma)`` = mean and std of ``log(length)``.

    Raises:
        ValueError: empty input or a length < 1.
    """
    x = np.asarray(lengths, dtype=np.float64)
    if x.size == 0 or (x < 1).any():
        raise ValueError(
            f"need >= 1 length, all >= 1; got {x.size} lengths, min {x.min() if x.size else None}"
        )
    logs = np.log(x)
    return float(logs.mean()), float(logs.std())


def length_stats(lengths: Sequence[int] | np.ndarray) -> dict[str, float]:
    x = np.asarray(lengths)
    return {
        "n": int(x.size),
        "mean": float(x.mean()),
        "p50": float(np.percentile(x, 50)),
        "p90": float(np.percentile(x, 90)),
        "p99": float(np.percentile(x, 99)),
        "max": int(x.max()),
    }


# ----------------------------------------------------------------------------------------------------------
# timing, tables, machine facts
# ----------------------------------------------------------------------------------------------------------


def init_distributed() -> tuple[int, int, Any]:
    """Under ``torchrun``: open the default process group (NCCL on CUDA, else gloo), pin this rank's GPU
    (``LOCAL_RANK``); ``(rank, world_size, device)``."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(
    fn: Callable[[], Any], device: Any, *, warmup: int = 3, iters: int = 10, queued: bool = False
) -> dict[str, float]:
    """Median / min milliseconds of ``fn()`` after ``warmup`` calls: CUDA events on CUDA, perf_counter else.

    ``queued=False`` (synced): the host waits for each call before issuing the next, so a call's time includes
    the host's launch path (Python, argument binding) whenever the GPU idles behind it. ``queued=True`` (CUDA):
    every call is issued back to back between its own pair of events and the host waits once at the end, as
    ``triton.testing.do_bench`` and ``torch.utils.benchmark`` do: while the host runs ahead of the GPU, a call's
    time is its GPU time (the steady state of a training loop, whose host issues the next kernels while the GPU
    runs the last ones); a call whose host path is slower than its kernels still shows it. On the CPU both are
    the same."""
    import torch

    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    cuda = torch.device(device).type == "cuda"
    if cuda and queued:
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
        ]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
        return {"ms": statistics.median(times), "min_ms": min(times), "iters": iters}
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": statistics.median(times), "min_ms": min(times), "iters": iters}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if math.isnan(v):
                return "-"
            return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_info(device: Any = None) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    for mod in ("transformers", "triton", "liger_kernel", "flash_attn"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "installed")
        except Exception:
            info[mod] = None
    if device is not None and torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cudnn"] = torch.backends.cudnn.version()
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def write_json(path: str | os.PathLike[str] | None, obj: Any) -> None:
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=2, default=str) + "\n")


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    enc = sub.add_parser("encode", help="encode ../shared/data into a samples file for the GPU machine")
    enc.add_argument("out")
    enc.add_argument("--max-samples", type=int, default=None)
    enc.add_argument("--data-dir", default=None)
    enc.add_argument("--seed", type=int, default=0)
    fit = sub.add_parser("fit", help="lognormal fit of the token lengths of a samples file")
    fit.add_argument("path")
    args = parser.parse_args(argv)
    if args.cmd == "encode":
        print(
            json.dumps(encode_shared_data(args.out, args.max_samples, data_dir=args.data_dir, seed=args.seed))
        )
    else:
        lengths = [s["length"] for s in load_samples(args.path)]
        mu, sigma = fit_lognormal(lengths)
        print(json.dumps({"mu": mu, "sigma": sigma, **length_stats(lengths)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
