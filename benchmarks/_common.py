"""The harness every benchmark here shares: data and workloads, models, timing, same-run peers, tables.

How a benchmark measures (the rules below are implemented here, once):

* **One untimed pass first.** Every configuration runs its whole workload once before anything is timed (JIT
  compiles, Triton autotuning, FlashAttention-4's kernel compiles, the allocator, caches):
  :func:`cold_then_timed` for training steps, ``warmup`` calls in :func:`time_fn` for kernels. The cold pass
  is reported apart (seconds to the first step, seconds for the pass), never mixed into the steady figure.
* **Steady state** is the median of the timed passes (steps) or calls (kernels).
* **The strongest peer in the same run.** A ratio is taken only against peers measured in the same process on
  the same inputs, and against the fastest of them (:func:`merge_rounds`); a peer that fails leaves no ratio.
* **Both orders.** With several rounds, round ``r`` runs the configurations in :func:`round_order` (the order
  rotated by ``r // 2``, reversed in odd rounds: with two rounds, given then reversed), so none always runs
  first, last or right after the same one; a ratio that lands on both sides of 1 across rounds is flagged
  ``order_dependent`` and is not a result.

The GPU machine has no ``datasets`` and cannot see ``../shared/``: encode the real chat data here once and
carry the file (``load_samples`` needs only ``json`` / ``numpy``)::

    python -m benchmarks._common encode .gpu/samples.npz
    python -m benchmarks._common fit .gpu/samples.npz         # lognormal mu / sigma of the token lengths
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = Path(os.environ.get("VARPACK_SHARED_DATA", REPO.parent / "shared" / "data"))
IGNORE = -100

#: H200 SXM dense bf16 tensor-core peak (NVIDIA H200 datasheet: 1,979 TFLOP/s with sparsity; dense is half).
#: MFU = 6 * N_params * tokens/s / this.
H200_BF16_DENSE_PEAK_FLOPS = 989e12
#: Lognormal fit (mean / std of log length) of the 20,377 conversations of ../shared/data encoded with the
#: embedded Qwen3 chat template (``python -m benchmarks._common fit``): real lengths p50 151, p90 373, p99
#: 1,117, max 2,916, mean 208 tokens. The stand-in for the real lengths where ``--small`` or a missing data
#: folder needs one.
REAL_MU, REAL_SIGMA = 5.05, 0.72


# ----------------------------------------------------------------------------------------------------------
# data: the real chat data of ../shared/data, its lengths, and stand-ins
# ----------------------------------------------------------------------------------------------------------


def chat_files(data_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The ``*.jsonl`` chat files of the data folder, sorted by name; preference pairs (rows without
    ``messages``, e.g. ``mt_bench_pairs.jsonl``) are not SFT samples and are left out.

    Raises:
        FileNotFoundError: no chat file in the folder (default ``../shared/data`` or
        ``$VARPACK_SHARED_DATA``).
    """
    d = Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR
    files = []
    for f in sorted(d.glob("*.jsonl")):
        with f.open(encoding="utf-8") as fh:
            first = fh.readline()
        if first.strip() and "messages" in json.loads(first):
            files.append(f)
    if not files:
        raise FileNotFoundError(f"no chat *.jsonl files in {d} (set VARPACK_SHARED_DATA)")
    return files


def _encode(files: Sequence[Path], tokenizer: str) -> dict[str, Any]:
    """``{file name: encoded samples (numpy format)}`` (:func:`varpack.data.load_and_encode`)."""
    from varpack.data import load_and_encode
    from varpack.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    return {
        f.name: load_and_encode([str(f)], tok, desc=f"encode {f.name}").samples.with_format("numpy")
        for f in files
    }


def encode_shared_data(
    out_path: str | os.PathLike[str],
    max_samples: int | None = None,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    tokenizer: str = "qwen3",
    seed: int = 0,
) -> dict[str, Any]:
    """Encode the chat files (chat template of ``tokenizer``; labels on assistant turns only) and write
    ``max_samples`` of them, drawn uniformly at random (``seed``, so the subset keeps the files' length mix).

    Args:
        out_path: ``.npz`` (flat int32 ``input_ids`` / ``labels``, int64 ``offsets`` ``[N+1]``, ``source``
            file index per sample) or ``.jsonl`` (one ``{"input_ids", "labels"}`` per line).

    Returns:
        A summary: samples, tokens, supervised tokens, files.

    Raises:
        FileNotFoundError: no chat file. ValueError: another output suffix.
    """
    out_path = Path(out_path)
    if out_path.suffix not in (".npz", ".jsonl"):
        raise ValueError(f"out_path must end in .npz or .jsonl, got {out_path}")
    files = chat_files(data_dir)
    rows = [(fi, row) for fi, ds in enumerate(_encode(files, tokenizer).values()) for row in ds]
    order = np.random.default_rng(seed).permutation(len(rows))[:max_samples]
    ids = [np.asarray(rows[i][1]["input_ids"], np.int32) for i in order]
    labels = [np.asarray(rows[i][1]["labels"], np.int32) for i in order]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if out_path.suffix == ".npz":
        np.savez_compressed(
            out_path,
            input_ids=np.concatenate(ids),
            labels=np.concatenate(labels),
            offsets=np.concatenate([[0], np.cumsum([len(x) for x in ids])]),
            source=np.asarray([rows[i][0] for i in order], np.int16),
            files=np.asarray([f.name for f in files]),
        )
    else:
        with out_path.open("w") as fh:
            for x, y in zip(ids, labels):
                fh.write(json.dumps({"input_ids": x.tolist(), "labels": y.tolist()}) + "\n")
    return {
        "path": str(out_path), "samples": len(ids), "tokens": int(sum(len(x) for x in ids)),
        "supervised_tokens": int(sum(int((y != IGNORE).sum()) for y in labels)),
        "files": [f.name for f in files], "tokenizer": tokenizer, "seed": seed,
    }  # fmt: skip


def load_samples(path: str | os.PathLike[str], max_samples: int | None = None) -> list[dict[str, Any]]:
    """Samples written by :func:`encode_shared_data`: ``[{input_ids, labels, length}]`` (int64 numpy arrays).

    Raises:
        FileNotFoundError: no such file. ValueError: another suffix, or a sample whose ``labels`` length
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
        for a, b in list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))[:max_samples]:
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
                x, y = np.asarray(row["input_ids"], np.int64), np.asarray(row["labels"], np.int64)
                if x.shape != y.shape:
                    raise ValueError(f"sample {i}: labels length {len(y)} != input_ids length {len(x)}")
                out.append({"input_ids": x, "labels": y, "length": len(x)})
    else:
        raise ValueError(f"samples file must be .npz or .jsonl, got {path}")
    return out


def synthetic_samples(
    n: int,
    *,
    vocab: int,
    mu: float = REAL_MU,
    sigma: float = REAL_SIGMA,
    lo: int = 16,
    hi: int = 8192,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Random-token samples with lognormal lengths clipped to ``[lo, hi]``; the first third of each is
    unsupervised."""
    rng = np.random.default_rng(seed)
    out = []
    for length in np.clip(np.round(rng.lognormal(mu, sigma, n)), lo, hi).astype(np.int64).tolist():
        x = rng.integers(0, vocab, length, dtype=np.int64)
        y = x.copy()
        y[: max(1, length // 3)] = IGNORE
        out.append({"input_ids": x, "labels": y, "length": length})
    return out


def samples_for(
    path: str | None, *, vocab: int, tokens: int, hi: int, seed: int = 0
) -> tuple[list[dict], str]:
    """The samples of a training benchmark and their description: ``path`` (:func:`load_samples`), else enough
    synthetic samples (:data:`REAL_MU` / :data:`REAL_SIGMA` lengths up to ``hi``) for about ``tokens``
    tokens."""
    if path:
        return load_samples(path), path
    n = int(tokens / math.exp(REAL_MU + REAL_SIGMA**2 / 2)) + 16
    return synthetic_samples(
        n, vocab=vocab, hi=hi, seed=seed
    ), f"synthetic lognormal({REAL_MU}, {REAL_SIGMA})"


def _cache_dir() -> Path:
    root = os.environ.get("VARPACK_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "varpack") / "bench"


def real_lengths_per_file(
    data_dir: str | os.PathLike[str] | None = None, *, tokenizer: str = "qwen3"
) -> dict[str, np.ndarray]:
    """``{file name: [N_file] int64 token lengths}`` of the chat files, encoded once and cached under
    ``$VARPACK_CACHE/bench`` (keyed by the files' names, sizes, modification times and the tokenizer)."""
    files = chat_files(data_dir)
    stamp = "|".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files) + f"|{tokenizer}"
    cache = _cache_dir() / f"lengths-{hashlib.sha256(stamp.encode()).hexdigest()[:20]}.npz"
    if cache.is_file():
        with np.load(cache, allow_pickle=False) as z:
            return {name: z[name] for name in z.files}
    out = {name: np.asarray(ds["length"], np.int64) for name, ds in _encode(files, tokenizer).items()}
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache.with_suffix(".tmp.npz"), **out)
    cache.with_suffix(".tmp.npz").replace(cache)
    return out


def lengths_for(
    small: bool, data_dir: str | None = None, *, n_small: int = 4000
) -> tuple[dict[str, np.ndarray], str]:
    """Per-file sample lengths of the CPU benchmarks and their description: the real lengths of the chat files
    (:func:`real_lengths_per_file`), or with ``small`` two stand-in "files" of ``n_small`` lognormal lengths
    (:data:`REAL_MU` / :data:`REAL_SIGMA`, clipped to [8, 4096]; no data and no encoding needed)."""
    if not small:
        per_file = real_lengths_per_file(data_dir)
        return (
            per_file,
            f"real lengths of {len(per_file)} chat files ({sum(v.size for v in per_file.values()):,} "
            "samples)",
        )
    rng = np.random.default_rng(0)

    def draw(mu: float) -> np.ndarray:
        return np.clip(np.round(rng.lognormal(mu, REAL_SIGMA, n_small)), 8, 4096).astype(np.int64)

    return {
        "short.jsonl": draw(REAL_MU - 0.5),
        "long.jsonl": draw(REAL_MU + 0.5),
    }, "lognormal stand-in lengths (--small)"


def read_lengths_file(path: str | os.PathLike[str]) -> np.ndarray:
    """Token lengths from a samples ``.npz`` (its ``offsets``), any ``.npz`` of int arrays (concatenated), a
    ``.npy``, or a text file of ints.

    Raises:
        FileNotFoundError: no such file. ValueError: no lengths, or a length < 1.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"lengths file {p} does not exist")
    if p.suffix == ".npz":
        with np.load(p, allow_pickle=False) as z:
            ints = [z[k].ravel() for k in z.files if np.issubdtype(z[k].dtype, np.integer)]
            lengths = np.diff(z["offsets"]) if "offsets" in z.files else np.concatenate(ints)
    elif p.suffix == ".npy":
        lengths = np.load(p, allow_pickle=False).ravel()
    else:
        lengths = np.asarray([int(x) for x in p.read_text().split()])
    lengths = np.asarray(lengths, np.int64)
    if lengths.size == 0 or (lengths < 1).any():
        raise ValueError(
            f"{p}: need >= 1 lengths, all >= 1 (got {lengths.size}, min {lengths.min(initial=0)})"
        )
    return lengths


def fit_lognormal(lengths: Sequence[int] | np.ndarray) -> tuple[float, float]:
    """Maximum-likelihood lognormal fit ``(mu, sigma)``: mean and std of ``log(length)``.

    Raises:
        ValueError: no length, or a length < 1.
    """
    x = np.asarray(lengths, np.float64)
    if x.size == 0 or (x < 1).any():
        raise ValueError(
            f"need >= 1 length, all >= 1; got {x.size} lengths, min {x.min() if x.size else None}"
        )
    return float(np.log(x).mean()), float(np.log(x).std())


def length_stats(lengths: Sequence[int] | np.ndarray) -> dict[str, float]:
    x = np.asarray(lengths)
    pct = {f"p{q}": float(np.percentile(x, q)) for q in (50, 90, 99)}
    return {"n": int(x.size), "mean": float(x.mean()), **pct, "max": int(x.max())}


# ----------------------------------------------------------------------------------------------------------
# workloads and models of the training benchmarks
# ----------------------------------------------------------------------------------------------------------


def fullest_packs(
    samples: list[dict[str, Any]], packing_length: int, steps: int, max_sample_length: int | None = None
) -> tuple[Any, list[int], dict[str, Any]]:
    """The workload every configuration of a step benchmark trains on: best-fit-decreasing packs over a prefix
    of the samples that fit (of at most ``max_sample_length`` tokens, when given: a short-document workload of
    the same data), the ``steps`` fullest of them as the optimizer steps (one pack per step).

    Returns:
        ``(PackedDataset over the prefix in plan order, indices of the chosen packs, info for the report)``.

    Raises:
        ValueError: not enough tokens for ``steps`` packs.
    """
    from varpack.data.dataset import PackedDataset
    from varpack.plan import plan_packs

    usable = [s for s in samples if s["length"] <= packing_length]
    kept = [s for s in usable if max_sample_length is None or s["length"] <= max_sample_length]
    prefix, total = [], 0
    for s in kept:
        if total >= steps * packing_length * 1.1:
            break
        prefix.append(s)
        total += s["length"]
    if total < steps * packing_length * 0.9:
        raise ValueError(
            f"{len(kept)} samples hold {total} tokens: not enough for {steps} packs of {packing_length}"
        )
    lengths = np.asarray([s["length"] for s in prefix], np.int64)
    plan = plan_packs(lengths, packing_length, strategy="bfd")
    fill = np.asarray([int(lengths[np.asarray(p)].sum()) for p in plan.packs])
    chosen = sorted(np.argsort(-fill, kind="stable")[:steps].tolist())
    used = lengths[np.concatenate([np.asarray(plan.packs[i]) for i in chosen])]
    info = {
        "samples_considered": len(prefix),
        "samples_longer_than_packing_length_skipped": len(samples) - len(usable),
        **(
            {
                "max_sample_length": max_sample_length,
                "samples_longer_than_max_sample_length_skipped": len(usable) - len(kept),
            }
            if max_sample_length is not None
            else {}
        ),
        "sample_length_mean": float(used.mean()),
        "sample_length_max": int(used.max()),
        "packs_planned": plan.num_packs,
        "steps": len(chosen),
        "tokens_per_step_mean": float(fill[chosen].mean()),
        "fill_mean": float(fill[chosen].mean() / packing_length),
        "samples_per_step_mean": float(np.mean([len(plan.packs[i]) for i in chosen])),
    }
    return PackedDataset(prefix, plan, shuffle=False, check=False), chosen, info


def build_model(
    name: str, *, device: Any, dtype: Any, seed: int = 0, vocab_size: int | None = None,
    overrides: dict[str, Any] | None = None, hf_attn: str | None = None, backend: str | None = None,
) -> Any:  # fmt: skip
    """A random-init varpack built-in model (``name``: e.g. ``qwen3-0.6b-shape``) built on ``device`` in
    ``dtype``, the same weights for the same seed, ``use_cache`` off, in train mode; HF attention ``hf_attn``
    (``sdpa``, ``flash_attention_4`` ...) or varpack attention ``backend`` (``enable_varpack``).

    Raises:
        ValueError / ImportError: an unknown name, or transformers refuses ``hf_attn`` (e.g. FA4 not
        installed).
    """
    import torch

    from varpack.models import builtin_family, model_config

    family = builtin_family(name)
    if family is None:
        raise ValueError(f"{name!r} is not a built-in model")
    config = model_config(name, vocab_size=vocab_size, **(overrides or {}))
    config.use_cache = False
    torch.manual_seed(seed)
    with torch.device(device):
        model = family.build(config)
    model.to(dtype)
    if hf_attn is not None:
        model.set_attn_implementation(hf_attn)
    if backend is not None:
        from varpack.integrations.transformers import enable_varpack

        enable_varpack(model, backend=backend)  # the built-in text models need nothing more
    return model.train()


#: ``make_optimizer``'s implementations of the same AdamW update: ``fused`` (``torch.optim.AdamW(fused=True)``
#: on CUDA, ``foreach`` elsewhere) and ``compiled`` (its ``foreach`` step under ``torch.compile``: inductor's
#: horizontally fused kernels; PyTorch recipe "Compiling the optimizer with torch.compile").
OPTIMIZER_IMPLS = ("fused", "compiled")


class CompiledOptimizerStep:
    """``optimizer.step`` run under ``torch.compile`` (compiled on the first call, after the first backward:
    the gradients must exist); ``zero_grad`` and ``param_groups`` are the optimizer's. The learning rate is a
    constant float here, so the step compiles once (a scheduler would need a tensor ``lr``).

    Building one resets torch.compile's caches (``torch.compiler.reset()``): every optimizer's ``step`` is the
    one code object, each new optimizer a recompile of it, and past dynamo's ``recompile_limit`` (8) the step
    would run uncompiled -- from the ninth row of a benchmark process on. Build it before the row's model
    is first run (its compiled layers compile on their first call)."""

    def __init__(self, optimizer: Any) -> None:
        import torch

        torch.compiler.reset()
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self._step = torch.compile(optimizer.step, fullgraph=False)

    def step(self) -> None:
        import torch

        # the name profile_step.py files under "optimizer" (Optimizer.step's own range is not kept in the graph)
        with torch.profiler.record_function("Optimizer.step#AdamW.compiled"):
            self._step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def make_optimizer(model: Any, device: Any, lr: float = 1e-5, impl: str = "fused") -> Any:
    """AdamW, no weight decay: the optimizer of every step benchmark; ``impl`` one of :data:`OPTIMIZER_IMPLS`.

    Raises:
        ValueError: an unknown ``impl``.
    """
    import torch

    if impl not in OPTIMIZER_IMPLS:
        raise ValueError(f"optimizer implementation {impl!r}: choose one of {OPTIMIZER_IMPLS}")
    fused = impl == "fused" and torch.device(device).type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=fused, foreach=not fused)
    return CompiledOptimizerStep(opt) if impl == "compiled" else opt


def n_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight counts once


def pad_tokenizer(pad_token_id: int) -> Any:
    """A minimal HF fast tokenizer whose only job is ``tokenizer.pad`` (the GPU machine has no tokenizer
    files), for ``DataCollatorForSeq2Seq`` and TRL."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({"<pad>": pad_token_id, "<unk>": 0 if pad_token_id else 1}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


def apply_trl_liger(model: Any) -> str:
    """Liger-Kernel on an HF model as transformers' Trainer applies ``use_liger_kernel=True`` (TRL's
    ``SFTConfig(use_liger_kernel=True)``): ``_apply_liger_kernel_to_instance`` with its defaults. Use inside
    :func:`restored_module` (Liger patches the modeling module)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model)
    return "Liger defaults (RoPE, RMSNorm, SwiGLU, fused linear CE)"


@contextlib.contextmanager
def restored_module(module: Any) -> Iterator[None]:
    """Put every global of ``module`` back on exit: Liger and reference-function rows rebind a modeling
    module's functions and classes, and a configuration run after them must not inherit that."""
    saved = dict(vars(module))
    try:
        yield
    finally:
        for name, value in saved.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)


def cold_then_timed(
    step: Callable[[int], Any], n_steps: int, device: Any, passes: int, *, per_step: bool = False,
    seconds: float | None = None, wait: Callable[[], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One untimed cold pass over ``n_steps`` optimizer steps, then up to ``passes`` timed passes over the
    same steps.

    ``step(i)`` runs optimizer step ``i`` (forward, backward, optimizer) and returns its loss as a detached
    tensor (read once, after the first step: the only host sync inside a pass). ``per_step``: also wait after
    every step and report the steps' seconds (``step_s``, of the last timed pass). ``seconds``: stop timing
    once the next pass would end past this many seconds since the cold pass began (at least one timed pass
    runs). ``wait``: how a pass start / end waits for the device (default :func:`sync`; a multi-rank run adds
    a barrier).

    Returns:
        ``cold_first_step_s``, ``cold_pass_s``, ``loss_first``, ``timed_pass_s`` (each timed pass) and
        ``seconds`` (their median: the steady figure), and ``step_s`` with ``per_step``.
    """
    wait = wait or (lambda: sync(device))

    def one_pass() -> tuple[float, float, float, list[float]]:
        wait()
        t0 = time.perf_counter()
        first_s, first_loss, steps_s = 0.0, float("nan"), []
        for i in range(n_steps):
            s0 = time.perf_counter()
            loss = step(i)
            if i == 0:
                first_loss, first_s = float(loss), time.perf_counter() - t0
            if per_step:
                sync(device)
                steps_s.append(time.perf_counter() - s0)
        wait()
        return first_s, time.perf_counter() - t0, first_loss, steps_s

    start = time.perf_counter()
    cold_first, cold_s, loss, _ = one_pass()
    timed, steps_s = [], []
    while len(timed) < passes:
        _, secs, _, steps_s = one_pass()
        timed.append(secs)
        if seconds is not None and time.perf_counter() - start + secs > seconds:
            break
    out = {"cold_first_step_s": cold_first, "cold_pass_s": cold_s, "loss_first": loss, "timed_pass_s": timed,
           "seconds": statistics.median(timed)}  # fmt: skip
    return out | ({"step_s": steps_s} if per_step else {})


def init_distributed() -> tuple[int, int, Any]:
    """``(rank, world_size, device)`` of this process: under ``torchrun`` its process group (NCCL on CUDA,
    else gloo) and ``LOCAL_RANK``'s GPU; without ``torchrun``, a one-rank group of this process."""
    import socket

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    kw: dict[str, Any] = {}
    if "RANK" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            kw = {"init_method": f"tcp://127.0.0.1:{sock.getsockname()[1]}", "rank": 0, "world_size": 1}
    dist.init_process_group("nccl" if cuda else "gloo", **kw)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


# ----------------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------------


def sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(
    fn: Callable[[], Any], device: Any, *, warmup: int = 3, iters: int = 10, queued: bool = False
) -> dict[str, float]:
    """Median / min milliseconds of ``fn()`` after ``warmup`` untimed calls: CUDA events on CUDA, perf_counter
    else.

    ``queued=False`` (synced): the host waits for each call before issuing the next, so a call's time includes
    the host's launch path whenever the GPU idles behind it. ``queued=True`` (CUDA): the calls are issued back
    to back, each between its own pair of events, and the host waits once at the end
    (``triton.testing.do_bench``'s method): while the host runs ahead of the GPU, a call's time is its GPU
    time -- the steady state of a training loop; a call whose host path is slower than its kernels still shows
    it. On the CPU both are the same."""
    import torch

    for _ in range(warmup):
        fn()
    sync(device)
    cuda = torch.device(device).type == "cuda"
    times = []
    if cuda:
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
        ]
        for start, end in events:
            start.record()
            fn()
            end.record()
            if not queued:
                end.synchronize()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"ms": statistics.median(times), "min_ms": min(times), "iters": iters}


def best_cpu_time(fn: Callable[[], Any], repeat: int) -> tuple[float, float, Any]:
    """``(best wall s, best CPU s of this process, result)`` over ``repeat`` runs. On a shared machine the CPU
    time is the fair one-core figure; wall time includes waiting for a core."""
    wall = cpu = math.inf
    out = None
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        wall, cpu = min(wall, time.perf_counter() - w), min(cpu, time.process_time() - c)
    return wall, cpu, out


class Budget:
    """Wall-clock budget of a run (``--time-budget``): :meth:`spent` once ``seconds`` have passed since it was
    made (never for ``None``), :meth:`left` the seconds remaining."""

    def __init__(self, seconds: float | None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds, self.clock, self.start = seconds, clock, clock()

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - (self.clock() - self.start)

    def spent(self) -> bool:
        return self.left() <= 0

    def reason(self) -> str:
        return f"skipped: --time-budget {self.seconds:g} s spent before it started"


def round_order(n: int, r: int) -> list[int]:
    """Order of ``n`` configurations in round ``r``: the given order rotated by ``r // 2``, reversed in odd
    rounds, so no configuration is always first or last, nor always right after the same one (a configuration
    that heats the GPU slows the next). Two configurations: 01, 10, 10, 01, ..."""
    order = [(r // 2 + j) % n for j in range(n)]
    return order[::-1] if r % 2 else order


def run_rounds(
    names: Sequence[str], run_one: Callable[[str], dict[str, Any]], rounds: int, *,
    budget: Budget | None = None, after_each: Callable[[list[list[dict]]], None] | None = None,
) -> list[list[dict[str, Any]]]:  # fmt: skip
    """Every configuration ``rounds`` times, round ``r`` in :func:`round_order`; ``run_one(name)`` returns the
    row (a dict; ``"error"`` when it could not run). A configuration not started within ``budget`` gets an
    error row saying so. ``after_each(rounds so far)`` runs after every row (e.g. to save partial results).
    Returns the rows of each round in run order, each with ``"config"`` set."""
    out: list[list[dict[str, Any]]] = []
    for r in range(rounds):
        rows: list[dict[str, Any]] = []
        out.append(rows)
        for i in round_order(len(names), r):
            name = names[i]
            if budget is not None and budget.spent():
                rows.append({"config": name, "error": budget.reason()})
            else:
                print(f"  round {r + 1}: {name} ...", file=sys.stderr, flush=True)
                try:
                    rows.append({**run_one(name), "config": name})
                except Exception as exc:  # a configuration that cannot run here: reported, never fatal
                    rows.append({"config": name, "error": row_error(exc)})
            if "error" in rows[-1]:
                print(f"  {name}: {rows[-1]['error']}", file=sys.stderr, flush=True)
            if after_each is not None:
                after_each(out)
    return out


def merge_rounds(
    rounds: list[list[dict[str, Any]]], key: str, peers: Sequence[str], *, baseline: str | None = None
) -> list[dict[str, Any]]:
    """One row per configuration (first-seen order) from the rows of each round: the first measured round's
    fields, ``key`` (higher is better, e.g. tokens/s) and every other float the rounds share averaged over the
    rounds that measured (peaks: their maximum), ``rounds`` (each round's row), and per round the ratio to
    that round's strongest peer (``vs_best_peer_rounds``, ``best_peer_rounds``; their mean ``vs_best_peer``;
    ``order_dependent`` when they fall on both sides of 1) and to ``baseline`` (``vs_<baseline>``). A round
    whose peers all failed has no ratio."""
    merged: dict[str, dict[str, Any]] = {}
    for rows in rounds:
        ok = {r["config"]: r for r in rows if key in r}
        measured = [ok[p] for p in peers if p in ok]
        best = max(measured, key=lambda r: r[key]) if measured else None
        for r in rows:
            m = merged.setdefault(r["config"], {"config": r["config"], "rounds": []})
            m["rounds"].append(r)
            if key not in r:
                continue
            if best is not None:
                m.setdefault("vs_best_peer_rounds", []).append(r[key] / best[key])
                m.setdefault("best_peer_rounds", []).append(best["config"])
            if baseline in ok:
                m.setdefault(f"vs_{baseline}_rounds", []).append(r[key] / ok[baseline][key])
    out = []
    for m in merged.values():
        good = [r for r in m["rounds"] if key in r]
        row = {**(good or m["rounds"])[0], **m}
        if good:
            row.pop("error", None)
            for k, v in good[0].items():
                if isinstance(v, float) and all(isinstance(g.get(k), float) for g in good):
                    row[k] = float((np.max if k.startswith("peak") else np.mean)([g[k] for g in good]))
            for k in ("cold_first_step_s", "cold_pass_s"):  # the first round's: nothing compiled before it
                if k in good[0]:
                    row[k] = good[0][k]
        for k in [k for k in row if k.startswith("vs_") and k.endswith("_rounds")]:
            row[k.removesuffix("_rounds")] = float(np.mean(row[k]))
        if "vs_best_peer_rounds" in row:
            row["order_dependent"] = min(row["vs_best_peer_rounds"]) < 1.0 < max(row["vs_best_peer_rounds"])
        out.append(row)
    return out


def missing_rounds(row: dict[str, Any]) -> list[str]:
    """``"round k not measured (reason)"`` for each round of a merged row without a measurement."""
    return [
        f"round {i + 1} not measured ({r.get('error', 'no result')})"
        for i, r in enumerate(row.get("rounds", []))
        if "error" in r
    ]


# ----------------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------------


def error_text(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters) for a row that could not run."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"


def row_error(exc: BaseException) -> str:
    """:func:`error_text` of a row that failed, its whole traceback printed to stderr (the log) first."""
    traceback.print_exception(exc, file=sys.stderr)
    return error_text(exc)


def fmt_value(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10_000:
        return f"{v:,}"
    return "-" if v is None else str(v)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; floats to 3 significant digits (thousands separated from 100 on), NaN / None as
    ``-``."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(fmt_value(v) for v in row) + " |" for row in rows])


def _commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        return done.stdout.strip() + ("+dirty" if dirty else "") if done.returncode == 0 else None
    except OSError:
        return None


def machine_info(device: Any = None) -> dict[str, Any]:
    """What a result row needs beside its figures: date, command, commit, versions, the device."""
    import torch

    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "commit": _commit(),
        "python": platform.python_version(), "torch": torch.__version__,
    }  # fmt: skip
    for mod in ("transformers", "triton", "liger_kernel", "flash_attn", "fla", "trl"):
        try:
            info[mod] = getattr(__import__(mod), "__version__", "installed")
        except Exception:  # not installed, or fails to import on this machine
            info[mod] = None
    if device is not None and torch.device(device).type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), cudnn=torch.backends.cudnn.version())
    else:
        info.update(
            cpu=platform.processor() or platform.machine(),
            cpus=os.cpu_count(),
            threads=torch.get_num_threads(),
        )
    return info


def write_json(path: str | os.PathLike[str] | None, obj: Any) -> None:
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(obj, indent=1, default=str) + "\n")


def add_common_args(
    p: argparse.ArgumentParser, *, device: str = "cuda", small: str = "smoke run on the CPU"
) -> None:
    """``--device``, ``--dtype`` (default: bfloat16 on CUDA, float32 elsewhere), ``--small``, ``--seed``,
    ``--out``."""
    p.add_argument("--device", default=device)
    p.add_argument("--dtype", default=None, help="bfloat16 (CUDA default) / float32 (CPU default)")
    p.add_argument("--small", action="store_true", help=small)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default=None, help="write the rows, the command, commit, versions and machine as JSON here"
    )


def checked_device(p: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """``args.device`` as a torch device (a usage error when it is CUDA and there is none); fills
    ``args.dtype``."""
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available; use --device cpu --small for a smoke run")
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    return device


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
        lengths = read_lengths_file(args.path)
        mu, sigma = fit_lognormal(lengths)
        print(json.dumps({"mu": mu, "sigma": sigma, **length_stats(lengths)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
