"""Real sample lengths for benchmarks: ../shared/data/*.jsonl encoded once with the embedded tokenizer.

The lengths (chat-templated tokens per conversation, exactly what ``varpack plan`` plans with) are cached as
an ``.npz`` (one int64 array per file) under ``$VARPACK_CACHE/bench`` (default ``~/.cache/varpack/bench``),
keyed by the files' names, sizes and modification times and the tokenizer name.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = Path(os.environ.get("VARPACK_SHARED_DATA", REPO.parent / "shared" / "data"))


def _cache_dir() -> Path:
    root = os.environ.get("VARPACK_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "varpack") / "bench"


def _is_sft_file(path: Path) -> bool:
    """False for preference pairs (``mt_bench_pairs.jsonl``: ``prompt`` / ``chosen`` / ``rejected``), which
    are not SFT samples (the same rule as ``_common.encode_shared_data``)."""
    with path.open(encoding="utf-8") as fh:
        first = json.loads(fh.readline() or "{}")
    return not ("chosen" in first and "rejected" in first)


def data_files(data_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The ``*.jsonl`` chat files of the shared data folder (preference pairs left out), sorted by name.

    Raises:
        FileNotFoundError: the folder does not exist or holds no ``.jsonl`` file.
    """
    d = Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR
    files = sorted(f for f in d.glob("*.jsonl") if _is_sft_file(f))
    if not files:
        raise FileNotFoundError(
            f"no *.jsonl files in {d} (set VARPACK_SHARED_DATA to the shared data folder)"
        )
    return files


def real_lengths_per_file(
    data_dir: str | os.PathLike[str] | None = None, *, tokenizer: str = "qwen3", refresh: bool = False
) -> dict[str, np.ndarray]:
    """``{file name: [N_file] int64 token lengths}``, encoded once with
    :func:`varpack.data.load_and_encode` and cached.

    Args:
        data_dir: folder with the ``*.jsonl`` chat files (default ``../shared/data`` next to the repo, or
            ``$VARPACK_SHARED_DATA``).
        tokenizer: ``varpack.data.tokenizer.load_tokenizer`` argument (default the embedded ``qwen3``).
        refresh: re-encode even if a cache file exists.
    """
    files = data_files(data_dir)
    key = hashlib.sha256(
        (
            "|".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files) + f"|{tokenizer}"
        ).encode()
    ).hexdigest()[:20]
    cache = _cache_dir() / f"lengths-{key}.npz"
    if cache.is_file() and not refresh:
        with np.load(cache, allow_pickle=False) as z:
            return {name: z[name] for name in z.files}

    from varpack.data import load_and_encode
    from varpack.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    out: dict[str, np.ndarray] = {}
    for f in files:
        ds = load_and_encode([str(f)], tok, desc=f"encode {f.name}").samples
        out[f.name] = np.asarray(ds.with_format("numpy")["length"], dtype=np.int64)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp.npz")
    np.savez(tmp, **out)
    tmp.replace(cache)
    return out


def real_lengths(data_dir: str | os.PathLike[str] | None = None, **kw) -> np.ndarray:
    """All files' lengths concatenated (file order), ``[N]`` int64."""
    return np.concatenate(list(real_lengths_per_file(data_dir, **kw).values()))
